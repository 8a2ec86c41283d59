"""The built-in task: long-tailed answer lengths, an exact reward, supervised batches."""

import numpy as np

from april_jax.rewards import get_reward
from april_jax.tasks.longtail import RING, LongTailTask, ring, sft_batch, targets, tokenizer


def test_answer_lengths_have_a_long_tail():
  task = LongTailTask(max_answer_len=64, median=8, sigma=0.9)
  lengths = np.array([len(task.item(i)["answer"]) for i in range(4000)])
  assert np.median(lengths) == 8
  assert np.percentile(lengths, 90) < 32  # most answers are short ...
  assert 0.002 < np.mean(lengths == 64) < 0.03  # ... and a few run to the maximum


def test_items_are_deterministic_and_tokenizable():
  task, tok = LongTailTask(), tokenizer()
  assert task.item(5, seed=1) == task.item(5, seed=1) != task.item(5, seed=2)
  item = task.item(7)
  assert tok.decode(tok.encode(item["prompt"])) == item["prompt"]
  assert len(tok.encode(item["prompt"])) <= task.prompt_len()


def test_the_prompt_names_the_first_symbol_and_the_last_in_the_target_alphabet():
  task, tok = LongTailTask(), tokenizer()
  for i in range(50):
    item = task.item(i)
    answer, prompt = item["answer"], item["prompt"]
    assert prompt == f"c:{answer[0]}{targets()[RING.index(answer[-1])]}="
    assert prompt[3] not in RING  # the target never appears in a response
  assert tok.vocab_size == 3 + 64 + 2 + 64


def test_copy_reward_is_one_only_for_an_exact_copy():
  reward = get_reward("longtail")
  assert reward("abcd", "abcd") == 1.0
  assert reward("abcx", "abcd") == 0.75
  assert reward("abcdab", "abcd") == 4 / 6  # too long is penalised
  assert reward("", "abcd") == 0.0


def test_sft_batch_masks_exactly_the_answer_and_stop_targets():
  task, tok = LongTailTask(), tokenizer()
  tokens, targets, mask = sft_batch(task, tok, [0, 1], seed=0, seq_len=80)
  item = task.item(0)
  A = len(item["answer"])
  assert mask[0].sum() == A + 1
  np.testing.assert_array_equal(targets[0][mask[0] > 0], tok.encode(item["answer"]) + [tok.eos_id])


def test_a_sloppy_demonstrator_walks_one_symbol_past_the_target_at_its_rate():
  task, tok = LongTailTask(), tokenizer()
  indices = range(2000)
  tokens, _, mask = sft_batch(task, tok, indices, seed=3, seq_len=80, overshoot=0.85)
  past = 0
  for b, i in enumerate(indices):
    answer = task.item(i, seed=3)["answer"]
    shown = tok.decode(tokens[b][5 : 5 + int(mask[b].sum()) - 1].tolist())
    nxt = RING[(RING.index(answer[-1]) + 1) % 64]
    assert shown in (answer, answer + nxt)
    past += shown == answer + nxt
  assert 0.83 < past / 2000 < 0.87
  assert mask.sum() - past == sum(len(task.item(i, seed=3)["answer"]) + 1 for i in indices)


def test_a_larger_ring_walks_its_own_symbols_and_wraps_around():
  symbols = ring(100)
  assert symbols[:64] == RING and len(set(symbols)) == 100
  tok = tokenizer(100)
  assert tok.vocab_size == 3 + 100 + 2 + 100
  task = LongTailTask(max_answer_len=100, median=40, sigma=0.5, ring_size=100)
  for i in range(200):
    answer = task.item(i)["answer"]
    start = symbols.index(answer[0])
    assert answer == "".join(symbols[(start + j) % 100] for j in range(len(answer)))
    assert tok.decode(tok.encode(answer)) == answer
  lengths = [len(task.item(i)["answer"]) for i in range(500)]
  assert max(lengths) > 64  # walks longer than the default ring
