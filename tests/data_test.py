"""Tests for april_jax.data: dataset files to records, records to a prompt stream.

The format tests read the real math sets shipped in tests/data/math; the iterator tests
use small in-memory records and the CharTokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
import tracemalloc

import numpy as np
import pytest

from april_jax.data import DataError, PromptIterator, load_records
from april_jax.tasks.longtail import LongTailSource
from april_jax.data import line_budget, make_prompt_source
from april_jax.tasks.longtail import LongTailTask, tokenizer as longtail_tokenizer
from april_jax.settings.data import DataSettings
from april_jax.settings.run import RunSettings
from april_jax.tokenizer import CharTokenizer

from conftest import MATH_DIR

# file -> number of records
FORMATS = {
    "gsm8k_test.jsonl": 1319,
    "aime24.jsonl": 30,
    "amc23.jsonl": 40,
    "math500.json": 500,
    "dapo_format_aime24.parquet": 960,
}
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False


def _char_tokenizer() -> CharTokenizer:
  return CharTokenizer("abcdefghijklmnopqrstuvwxyz0123456789 ?")


def _records(n: int, lengths: dict[int, int] | None = None) -> list[dict]:
  """n records "q<i>" (padded with "x" to lengths[i] characters where given)."""
  records = []
  for i in range(n):
    text = f"q{i}".ljust((lengths or {}).get(i, 0), "x")
    records.append({"id": i, "messages": [{"role": "user", "content": text}], "answer": str(i)})
  return records


def _ids(source, count: int) -> list:
  return [source().prompt_id for _ in range(count)]


def _write_jsonl(path: Path, lines: list[str]) -> Path:
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return path


# ---------------------------------------------------------------------- file formats
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_loads_every_row_with_messages_and_string_answer(name):
  records, skipped = load_records(MATH_DIR / name)
  assert len(records) == FORMATS[name]
  assert not skipped
  for record in records:
    assert set(record) == {"id", "messages", "answer", "row"}
    assert isinstance(record["answer"], str) and record["answer"]
    assert record["messages"][-1]["role"] == "user"
    assert all(isinstance(m["content"], str) for m in record["messages"])


def test_dapo_record_messages_are_the_parquet_chat_and_answer_its_ground_truth():
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  rows = pq.read_table(MATH_DIR / "dapo_format_aime24.parquet").to_pylist()
  records, _ = load_records(MATH_DIR / "dapo_format_aime24.parquet")
  for i in (0, 1, len(rows) - 1):
    assert records[i]["messages"] == [
        {"role": m["role"], "content": m["content"]} for m in rows[i]["prompt"]
    ]
    assert records[i]["answer"] == rows[i]["reward_model"]["ground_truth"]
    assert records[i]["id"] == f"dapo_format_aime24:{i}"  # no id field: file stem and row


def test_gsm8k_keeps_the_full_solution_ending_with_hash_answer():
  records, _ = load_records(MATH_DIR / "gsm8k_test.jsonl")
  first = json.loads((MATH_DIR / "gsm8k_test.jsonl").open(encoding="utf-8").readline())
  assert records[0]["messages"] == [{"role": "user", "content": first["question"]}]
  assert records[0]["answer"] == first["answer"]
  assert all(r["answer"].rsplit("\n", 1)[-1].startswith("#### ") for r in records)


def test_numeric_answers_become_strings_and_id_fields_are_kept():
  amc, _ = load_records(MATH_DIR / "amc23.jsonl")
  assert amc[0]["answer"] == "27.0" and amc[0]["id"] == 0
  math500, _ = load_records(MATH_DIR / "math500.json")
  assert math500[0]["id"] == "test/precalculus/807.json"
  aime, _ = load_records(MATH_DIR / "aime24.jsonl")
  assert len({r["id"] for r in aime}) == 30


def test_keys_given_explicitly_with_a_dot_path():
  records, _ = load_records(
      MATH_DIR / "dapo_format_aime24.parquet",
      prompt_key="prompt",
      answer_key="reward_model.ground_truth",
  )
  assert len(records) == 960 and records[0]["answer"] == "540"
  records, _ = load_records(MATH_DIR / "aime24.jsonl", prompt_key="solution")
  first = json.loads((MATH_DIR / "aime24.jsonl").open(encoding="utf-8").readline())
  assert records[0]["messages"][0]["content"] == first["solution"]


# ---------------------------------------------------------------------- chat template
def test_prompt_tokens_equal_the_qwen3_chat_template_and_end_with_generation_prompt(
    qwen3_tokenizer,
):
  records, _ = load_records(MATH_DIR / "gsm8k_test.jsonl")
  it = PromptIterator(records, qwen3_tokenizer, max_prompt_len=4096, shuffle=False)
  tail = qwen3_tokenizer.encode(GENERATION_PROMPT)
  for record in records:
    item = it()
    expected = qwen3_tokenizer.apply_chat_template(
        record["messages"], add_generation_prompt=True, enable_thinking=False, tokenize=True
    )
    assert item.tokens.dtype == np.int32 and item.prompt_id == record["id"]
    assert item.tokens.tolist() == expected
    assert item.tokens[-len(tail) :].tolist() == tail
    assert item.answer == record["answer"]


def test_system_prompt_comes_first_and_thinking_switch_is_passed(qwen3_tokenizer):
  records, _ = load_records(MATH_DIR / "dapo_format_aime24.parquet")
  it = PromptIterator(
      records[:3],
      qwen3_tokenizer,
      4096,
      shuffle=False,
      system_prompt="Be brief.",
      enable_thinking=True,
  )
  item = it()
  messages = [{"role": "system", "content": "Be brief."}] + records[0]["messages"]
  expected = qwen3_tokenizer.apply_chat_template(
      messages, add_generation_prompt=True, enable_thinking=True, tokenize=True
  )
  assert item.tokens.tolist() == expected
  assert qwen3_tokenizer.decode(item.tokens).startswith("<|im_start|>system\nBe brief.<|im_end|>")
  assert qwen3_tokenizer.decode(item.tokens).endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------- malformed rows
def test_malformed_rows_are_skipped_and_counted_per_reason(tmp_path):
  path = _write_jsonl(
      tmp_path / "mixed.jsonl",
      [
          json.dumps({"question": "good one", "answer": "1"}),
          json.dumps(["not", "an", "object"]),
          json.dumps({"answer": "2"}),
          json.dumps({"problem": "no answer here"}),
          '{"question": "broken", ',
          json.dumps({"prompt": [{"role": "user"}], "answer": "3"}),
          "",
          json.dumps(
              {
                  "prompt": [{"role": "user", "content": "good two"}],
                  "reward_model": {"ground_truth": 4},
                  "idx": 7,
              }
          ),
      ],
  )
  records, skipped = load_records(path)
  assert [r["messages"][0]["content"] for r in records] == ["good one", "good two"]
  assert [r["id"] for r in records] == ["mixed:0", 7]
  assert [r["answer"] for r in records] == ["1", "4"]
  assert skipped == {
      "not_an_object": 1,
      "missing_prompt": 1,
      "missing_answer": 1,
      "bad_json": 1,
      "bad_messages": 1,
  }


def test_empty_prompts_and_answers_count_as_missing(tmp_path):
  path = _write_jsonl(
      tmp_path / "empty.jsonl",
      [
          json.dumps({"question": "ok", "answer": "1"}),
          json.dumps({"question": "  ", "answer": "1"}),
          json.dumps({"question": "ok", "answer": ""}),
          json.dumps({"question": 5, "answer": "1"}),
      ],
  )
  records, skipped = load_records(path)
  assert len(records) == 1
  assert skipped == {"missing_prompt": 1, "missing_answer": 1, "bad_prompt": 1}


# ---------------------------------------------------------------------- file errors
def test_missing_file_error_names_the_path(tmp_path):
  with pytest.raises(DataError, match="nowhere.jsonl"):
    load_records(tmp_path / "nowhere.jsonl")


def test_unsupported_extension_error_names_it(tmp_path):
  path = tmp_path / "data.csv"
  path.write_text("question,answer\n", encoding="utf-8")
  with pytest.raises(ValueError, match=r"\.csv"):
    load_records(path)


def test_file_without_usable_rows_error_says_how_many_and_why(tmp_path):
  path = _write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"answer": "1"}), "[1]", "{"])
  with pytest.raises(ValueError, match=r"3 skipped.*bad_json: 1.*missing_prompt: 1"):
    load_records(path)


def test_json_file_that_is_not_a_list_is_rejected(tmp_path):
  path = tmp_path / "obj.json"
  path.write_text(json.dumps({"question": "q", "answer": "a"}), encoding="utf-8")
  with pytest.raises(ValueError, match="JSON list"):
    load_records(path)


def test_a_non_utf8_line_is_skipped_and_counted_with_its_neighbours_kept(tmp_path):
  path = tmp_path / "mixed.jsonl"
  path.write_bytes(
      b'{"problem": "1+1", "answer": "2"}\n{"problem": "caf\xe9", "answer": "3"}\n'
      b'{"problem": "2+2", "answer": "4"}\n'
  )
  records, skipped = load_records(path)
  assert [r["answer"] for r in records] == ["2", "4"] and skipped == {"bad_utf8": 1}


def test_text_utf8_cannot_write_is_skipped_as_bad_utf8(tmp_path):
  """A lone surrogate (scraped data has them) parses as JSON but fails the tokenizer mid-run."""
  path = tmp_path / "surrogates.jsonl"
  path.write_text(
      '{"problem": "1+1", "answer": "2"}\n{"problem": "hi \\ud83d", "answer": "3"}\n'
      '{"prompt": [{"role": "user", "content": "x \\udc00"}], "answer": "5"}\n'
      '{"problem": "3+3", "answer": "6 \\ud800"}\n{"problem": "2+2", "answer": "4"}\n'
  )
  records, skipped = load_records(path)
  assert [r["answer"] for r in records] == ["2", "4"] and skipped == {"bad_utf8": 3}


def test_a_line_nested_past_the_parsers_depth_is_skipped_as_bad_json(tmp_path):
  path = tmp_path / "deep.jsonl"
  path.write_text('{"problem": "1+1", "answer": "2"}\n' + "[" * 100_000 + "\n")
  records, skipped = load_records(path)
  assert [r["answer"] for r in records] == ["2"] and skipped == {"bad_json": 1}


def test_an_id_of_any_type_becomes_an_int_or_a_string_that_json_writes(tmp_path):
  """A list or dict id was unhashable for the skip count; a parquet scalar that JSON cannot
  write ended the run at its first checkpoint."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  path = tmp_path / "ids.jsonl"
  rows = [{"id": [1, 2]}, {"id": {"b": 1, "a": 2}}, {"id": True}, {"id": 7}, {"id": "q"}, {}]
  path.write_text("".join(json.dumps({**r, "problem": "p", "answer": "1"}) + "\n" for r in rows))
  records, _ = load_records(path)
  ids = [r["id"] for r in records]
  assert ids == ["[1, 2]", '{"a": 2, "b": 1}', "True", 7, "q", ids[-1]]
  assert isinstance(ids[-1], str)
  table = pa.table({
      "id": pa.array([b"\x00\x01", b"ab"], pa.binary()),
      "problem": ["p", "q"], "answer": ["1", "2"],
  })  # fmt: skip
  pq.write_table(table, tmp_path / "ids.parquet")
  records, _ = load_records(tmp_path / "ids.parquet")
  assert all(isinstance(r["id"], str) for r in records)
  json.dumps([r["id"] for r in records])


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("garbage.parquet", b"PAR1 not really", "cannot be read as parquet"),
        ("latin1.json", b'[{"problem": "caf\xe9", "answer": "1"}]', "is not valid JSON"),
        ("empty.jsonl", b"", "No usable rows"),
        ("schema.jsonl", b'{"foo": 1}\n{"foo": 2}\n', "2 skipped \\(missing_prompt: 2\\)"),
    ],
)
def test_an_unusable_data_file_is_a_data_error_that_names_it(tmp_path, name, content, message):
  path = tmp_path / name
  path.write_bytes(content)
  with pytest.raises(DataError, match=message) as error:
    load_records(path)
  assert str(path) in str(error.value)


# ---------------------------------------------------------------------- iterator
def test_each_epoch_covers_every_record_once_in_a_different_order():
  n = 20
  it = PromptIterator(_records(n), _char_tokenizer(), max_prompt_len=64, seed=3)
  epochs = [_ids(it, n) for _ in range(3)]
  for epoch, ids in enumerate(epochs):
    assert sorted(ids) == list(range(n))
    assert ids == np.random.default_rng([3, epoch]).permutation(n).tolist()
  assert len({tuple(ids) for ids in epochs}) == 3


def test_without_shuffle_every_epoch_is_in_file_order():
  it = PromptIterator(_records(5), _char_tokenizer(), 64, shuffle=False)
  assert _ids(it, 12) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]


def test_seed_changes_the_order():
  a = _ids(PromptIterator(_records(20), _char_tokenizer(), 64, seed=0), 20)
  b = _ids(PromptIterator(_records(20), _char_tokenizer(), 64, seed=1), 20)
  assert a != b and sorted(a) == sorted(b)


@pytest.mark.parametrize("consumed", [0, 7, 10, 23])
def test_restore_mid_epoch_continues_identically_across_json(consumed):
  records, tok = _records(10, {4: 30}), _char_tokenizer()
  reference = PromptIterator(records, tok, 16, seed=5)
  expected = _ids(reference, consumed + 25)

  it = PromptIterator(records, tok, 16, seed=5)
  assert _ids(it, consumed) == expected[:consumed]
  state = json.loads(json.dumps(it.state()))
  resumed = PromptIterator(records, tok, 16, seed=99)
  resumed.restore(state)
  assert _ids(resumed, 25) == expected[consumed:]
  assert resumed.state() == reference.state()


def test_state_names_epoch_offset_seed_and_skips():
  it = PromptIterator(_records(4), _char_tokenizer(), 64, seed=2)
  _ids(it, 6)
  state = it.state()
  assert (state["epoch"], state["offset"], state["seed"], state["skipped_too_long"]) == (1, 2, 2, 0)


def test_restore_refuses_a_state_over_other_data():
  it = PromptIterator(_records(4), _char_tokenizer(), 64)
  with pytest.raises(ValueError, match="4 records"):
    PromptIterator(_records(5), _char_tokenizer(), 64).restore(it.state())


def test_too_long_prompts_are_skipped_and_counted():
  records = _records(6, {1: 20, 4: 11})  # CharTokenizer: one token per character
  it = PromptIterator(records, _char_tokenizer(), max_prompt_len=10, shuffle=False)
  assert _ids(it, 8) == [0, 2, 3, 5, 0, 2, 3, 5]
  assert it.state()["skipped_too_long"] == 4
  item = PromptIterator(records, _char_tokenizer(), 10, shuffle=False)()
  assert item.tokens.tolist() == _char_tokenizer().encode("q0") and item.answer == "0"


def test_an_epoch_with_no_prompt_that_fits_raises():
  it = PromptIterator(_records(3, {0: 9, 1: 9, 2: 9}), _char_tokenizer(), max_prompt_len=5)
  with pytest.raises(ValueError, match="max_prompt_len 5"):
    it()


def test_all_too_long_detected_when_starting_mid_epoch():
  records = _records(3, {1: 9, 2: 9})
  it = PromptIterator(records, _char_tokenizer(), max_prompt_len=5, shuffle=False)
  assert it().prompt_id == 0
  records[0]["messages"] = [{"role": "user", "content": "x" * 9}]  # now none fits
  with pytest.raises(ValueError, match="No prompt"):
    it()


# ---------------------------------------------------------------------- longtail source
def test_longtail_source_yields_the_task_items_and_restores():
  task, tok = LongTailTask(max_answer_len=16), longtail_tokenizer()
  source = LongTailSource(task, tok, seed=4)
  items = [source() for _ in range(5)]
  for index, item in enumerate(items):
    expected = task.item(index, 4)
    assert item.prompt_id == expected["id"] and item.answer == expected["answer"]
    assert item.tokens.dtype == np.int32
    assert item.tokens.tolist() == tok.encode(expected["prompt"])

  state = json.loads(json.dumps(source.state()))
  following = [source().answer for _ in range(3)]
  resumed = LongTailSource(task, tok, seed=0)
  resumed.restore(state)
  assert [resumed().answer for _ in range(3)] == following


# ---------------------------------------------------------------------- config
def test_make_prompt_source_from_the_data_config(tmp_path):
  data = DataSettings()  # data.source "longtail": the built-in task's stream, no file
  with pytest.raises(ValueError, match="longtail"):
    make_prompt_source(data, longtail_tokenizer(), 0)

  rows = [json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(4)] + ["{"]
  data = DataSettings(source=str(_write_jsonl(tmp_path / "d.jsonl", rows)), shuffle=False)
  source = make_prompt_source(data, _char_tokenizer(), 0)
  assert isinstance(source, PromptIterator)
  assert [source().answer for _ in range(5)] == ["0", "1", "2", "3", "0"]


def test_a_utf8_bom_is_not_part_of_the_first_row(tmp_path):
  path = tmp_path / "bom.jsonl"
  path.write_bytes(
      b'\xef\xbb\xbf{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": "4"}\n'
  )
  records, skipped = load_records(path)
  assert [r["answer"] for r in records] == ["2", "4"] and not skipped
  as_list = tmp_path / "bom.json"
  as_list.write_bytes(b'\xef\xbb\xbf[{"problem": "1+1", "answer": "2"}]')
  assert [r["answer"] for r in load_records(as_list)[0]] == ["2"]


def test_no_prompt_that_fits_is_found_when_the_data_loads_with_the_shortest_length(tmp_path):
  rows = [json.dumps({"question": "x" * n, "answer": "1"}) for n in (30, 12, 50)]
  data = DataSettings(source=str(_write_jsonl(tmp_path / "long.jsonl", rows)), max_prompt_len=8)
  tok, shortest = _char_tokenizer(), 12  # CharTokenizer: one token per character
  with pytest.raises(DataError) as error:
    make_prompt_source(data, tok, 0)
  message = str(error.value)
  assert f"no prompt of the 3 records in {data.source} fits data.max_prompt_len=8" in message
  assert f"the shortest is {shortest} tokens" in message
  data = dataclasses.replace(data, max_prompt_len=shortest)
  assert make_prompt_source(data, tok, 0)().tokens.size == shortest


def test_records_keep_the_rows_columns_as_json_for_the_reward():
  records, _ = load_records(MATH_DIR / "dapo_format_aime24.parquet")
  row = records[0]["row"]
  assert json.loads(json.dumps(row)) == row  # plain JSON: it rides in checkpoints
  assert row["reward_model"]["ground_truth"] == records[0]["answer"]


def test_eval_prompts_are_the_first_that_fit_each_once(qwen3_tokenizer, tmp_path):
  """A file with fewer prompts that fit than eval.num_prompts wrapped around: a prompt was
  scored twice and the evaluation's mean weighted it double."""
  from april_jax.tasks import task as task_lib  # pylint: disable=g-import-not-at-top

  path = tmp_path / "eval.jsonl"
  rows = [("a", "1"), ("b " * 400, "2"), ("c", "3"), ("d", "4")]
  path.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in rows))
  config = RunSettings().overridden({"eval.path": str(path), "data.max_prompt_len": 64})
  for num_prompts, answers in ((2, ["1", "3"]), (3, ["1", "3", "4"]), (10, ["1", "3", "4"])):
    config = config.overridden({"eval.num_prompts": num_prompts})
    items = task_lib._file_items(config, qwen3_tokenizer)  # pylint: disable=protected-access
    assert [item.answer for item in items] == answers


def test_a_line_too_long_for_any_prompt_is_skipped_unread(tmp_path):
  """A first line of 24 MB where prompts fit 64 tokens: skipped and counted, never held
  whole (the run's source reads with the budget of data.max_prompt_len)."""
  path = tmp_path / "huge_first.jsonl"
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps({"problem": "x" * (24 << 20), "answer": "1"}) + "\n")
    f.write(json.dumps({"problem": "two and two", "answer": "4"}) + "\n")
    f.write(json.dumps({"problem": "y" * 600, "answer": "5"}))  # within budget, no newline
  tracemalloc.start()
  try:
    records, skipped = load_records(path, max_line_bytes=line_budget(64))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert [r["answer"] for r in records] == ["4", "5"] and skipped == {"line_too_long": 1}
  assert peak < 8 << 20, peak  # the line's 24 MB never were in memory at once
  source = make_prompt_source(
      DataSettings(source=str(path), max_prompt_len=64, shuffle=False), _char_tokenizer(), 0
  )
  assert [r["answer"] for r in source.records] == ["4", "5"]
