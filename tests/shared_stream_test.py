"""The multi-host prompt stream: shards interleave to the one-process stream, and the
exchange, state and restore work; processes are simulated by threads sharing a gather."""

import threading

import numpy as np
import pytest

from april_jax.data import LongTailSource, PromptIterator
from april_jax.rewards.longtail_task import LongTailTask, tokenizer as longtail_tokenizer
from april_jax.rollout.scheduler import PromptItem
from april_jax.shared_stream import SharedPromptStream, decode_item, encode_item
from april_jax.tokenizer import CharTokenizer


def _records(n):
  return [{"id": i, "messages": [{"role": "user", "content": f"q{i}"}], "answer": str(i)}
          for i in range(n)]


def _iterator(shard=(0, 1)):
  return PromptIterator(_records(10), CharTokenizer("q0123456789 "), max_prompt_len=64,
                        seed=3, shard=shard)


class ThreadGather:
  """An all-gather among `count` threads (each thread plays one process)."""

  def __init__(self, count):
    self.slots = [None] * count
    self.barrier = threading.Barrier(count)

  def for_process(self, index):
    def gather(data):
      self.slots[index] = data
      self.barrier.wait()
      out = list(self.slots)
      self.barrier.wait()
      return out
    return gather


def _run_processes(count, make_local, body):
  """Runs body(stream) on `count` simulated processes; returns their results."""
  gather = ThreadGather(count)
  results, errors = [None] * count, []

  def run(i):
    try:
      results[i] = body(SharedPromptStream(make_local((i, count)), i, count,
                                           gather.for_process(i)))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)
      gather.barrier.abort()
  threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  if errors:
    raise errors[0]
  return results


@pytest.mark.parametrize("count", [2, 3])
def test_dataset_shards_partition_each_epoch_and_interleave_to_the_full_order(count):
  one = _iterator()
  full = [one().prompt_id for _ in range(10)]  # one (shuffled) epoch
  per_shard = [[shard().prompt_id for _ in range(len(range(i, 10, count)))]
               for i, shard in enumerate(_iterator((i, count)) for i in range(count))]
  assert sorted(sum(per_shard, [])) == list(range(10))  # every record once, no overlap
  assert [per_shard[j % count][j // count] for j in range(10)] == full


@pytest.mark.parametrize("count", [2, 3])
def test_shared_stream_equals_the_one_process_stream_on_every_process(count):
  task, tok = LongTailTask(), longtail_tokenizer()
  expected = LongTailSource(task, tok, seed=5)
  expected = [expected() for _ in range(11)]
  results = _run_processes(count, lambda shard: LongTailSource(task, tok, seed=5, shard=shard),
                           lambda stream: [stream() for _ in range(11)])
  for items in results:
    assert [x.prompt_id for x in items] == [x.prompt_id for x in expected]
    for got, want in zip(items, expected):
      np.testing.assert_array_equal(got.tokens, want.tokens)
      assert got.answer == want.answer


def test_state_restores_every_process_position_and_the_queue():
  task, tok = LongTailTask(), longtail_tokenizer()
  make = lambda shard: LongTailSource(task, tok, seed=1, shard=shard)

  def save_then_continue(stream):
    first = [stream().prompt_id for _ in range(5)]  # 5 of 6 fetched: one still queued
    state = stream.state()
    return first, state, [stream().prompt_id for _ in range(6)]

  results = _run_processes(3, make, save_then_continue)
  state = results[0][1]
  assert [r[1] for r in results] == [state] * 3  # every process saves the same state
  assert len(state["processes"]) == 3 and len(state["queue"]) == 1

  def restore_and_continue(stream):
    stream.restore(state)
    return [stream().prompt_id for _ in range(6)]

  for resumed in _run_processes(3, make, restore_and_continue):
    assert resumed == results[0][2]

  with pytest.raises(ValueError, match="saved by 3 processes; resume with that many, not 2"):
    _run_processes(2, make, lambda stream: stream.restore(state))
  with pytest.raises(ValueError, match="saved by 3 processes; resume with that many"):
    LongTailSource(task, tok).restore(state)


def test_a_process_with_no_prompt_that_fits_contributes_none():
  def make(shard):  # process 1's only record is too long
    records = _records(2)
    records[1]["messages"][0]["content"] = "q" * 80
    return PromptIterator(records, CharTokenizer("q0123456789 "), max_prompt_len=64,
                          shuffle=False, shard=shard)
  results = _run_processes(2, make, lambda stream: [stream().prompt_id for _ in range(3)])
  assert results == [[0, 0, 0]] * 2


def test_items_survive_encoding_with_any_id_and_unicode_answers():
  item = PromptItem(prompt_id="aime-7", tokens=np.array([5, 0, 151643], np.int32),
                    answer="\\frac{π}{2}")
  back = decode_item(encode_item(item))
  assert back.prompt_id == "aime-7" and back.answer == item.answer
  np.testing.assert_array_equal(back.tokens, item.tokens)
  assert back.tokens.dtype == np.int32
  assert decode_item(encode_item(None)) is None
