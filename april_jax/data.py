"""Prompt data: dataset files (or the built-in task) turned into a stream of PromptItems.

The scheduler pulls fresh prompts by calling a prompt source with no arguments
(`AprilScheduler(prompt_source=...)`); this module builds that source from the `data`
config section (`make_prompt_source`):

  * `load_records` reads a `.jsonl`, `.json` (a list of objects) or `.parquet` file
    (GSM8K, MATH, AIME, or the DAPO/verl schema with chat-message prompts and
    `reward_model.ground_truth`) into records {"id", "messages", "answer", "row"} (row: the
    whole row as JSON, for a reward that asks for it). A bad row is
    skipped and counted under a reason, never silently dropped and never fatal.
  * `PromptIterator` applies the tokenizer's chat template and yields PromptItems
    forever, epoch after epoch, each epoch in its own seeded order. Prompts longer than
    max_prompt_len are skipped and counted. `state()` / `restore()` make it resume
    exactly where a checkpoint left it.
  * `LongTailSource` gives the built-in synthetic task the same interface.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any, Sequence

import dataclasses

import numpy as np
from absl import logging

from april_jax.errors import InputError
from april_jax.settings.data import DataSettings

SUFFIXES = (".jsonl", ".json", ".parquet")
# A jsonl line longer than this many bytes per prompt token (plus LINE_SLACK_BYTES for the
# answer and other columns) could not hold a prompt that fits: it is skipped, unread.
BYTES_PER_TOKEN_BOUND = 64
LINE_SLACK_BYTES = 1 << 20


def line_budget(max_prompt_len: int) -> int:
  """The longest jsonl line worth parsing for prompts of at most max_prompt_len tokens."""
  return int(max_prompt_len) * BYTES_PER_TOKEN_BOUND + LINE_SLACK_BYTES


PROMPT_KEYS = ("question", "problem", "prompt")
ANSWER_KEYS = ("answer", "reward_model.ground_truth")
ID_KEYS = ("id", "unique_id", "idx")


@dataclasses.dataclass
class PromptItem:
  """One prompt as the scheduler admits it."""

  prompt_id: Any
  tokens: np.ndarray  # int32 [P]
  answer: str
  budgets: list[int] | None = None  # per-sample response budgets (default: config)
  row: dict | None = None  # the dataset row's other columns (JSON values), for the reward


class DataError(InputError, ValueError):
  """A data file that cannot be used as a whole; the message names the file."""


class _BadRow(Exception):
  """A row that cannot become a record; `reason` is its key in the skip counter."""

  def __init__(self, reason: str) -> None:
    super().__init__(reason)
    self.reason = reason


# ------------------------------------------------------------------------ reading files
def _lines(f, max_bytes: int | None):
  """(line, whole) for each line of binary file f: a line longer than max_bytes is read
  past in chunks, never held whole, and comes back as (b"", False)."""
  while True:
    raw = f.readline() if max_bytes is None else f.readline(max_bytes + 1)
    if not raw:
      return
    if max_bytes is None or len(raw) <= max_bytes or raw.endswith(b"\n"):
      yield raw, True
      continue
    while raw and not raw.endswith(b"\n"):  # the rest of the long line, a chunk at a time
      raw = f.readline(1 << 20)
    yield b"", False


def _read_jsonl(path: Path, skipped: collections.Counter, max_line_bytes=None) -> list[Any]:
  """Rows of a JSON-lines file; blank lines are not rows, invalid lines are counted, and
  so are lines longer than max_line_bytes (skipped without being read whole)."""
  rows = []
  with path.open("rb") as f:
    for line_number, (raw, whole) in enumerate(_lines(f, max_line_bytes), 1):
      if not whole:
        _skip(skipped, "line_too_long", f"{path} line {line_number}: over {max_line_bytes} bytes")
        continue
      try:
        line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")  # a BOM is no row
      except UnicodeDecodeError as e:
        _skip(skipped, "bad_utf8", f"{path} line {line_number}: not UTF-8 ({e})")
        continue
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except (json.JSONDecodeError, RecursionError) as e:  # nested past Python's stack too
        _skip(skipped, "bad_json", f"{path} line {line_number}: invalid JSON ({e})")
  return rows


def _skip(skipped: collections.Counter, reason: str, message: str) -> None:
  """Counts a skipped line; the first of each reason is logged."""
  skipped[reason] += 1
  if skipped[reason] == 1:
    logging.warning("%s; skipped", message)


def _read_json(path: Path) -> list[Any]:
  """Rows of a file holding one JSON list."""
  try:
    rows = json.loads(path.read_text(encoding="utf-8-sig"))
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    raise DataError(f"{path} is not valid JSON: {e}") from None
  if not isinstance(rows, list):
    raise DataError(f"{path} should hold a JSON list of objects, got a {type(rows).__name__}")
  return rows


def _read_parquet(path: Path) -> list[Any]:
  """Rows of a parquet file; nested columns come back as Python lists and dicts."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  try:
    return pq.read_table(path).to_pylist()
  except Exception as e:  # pylint: disable=broad-except  # pyarrow's ArrowInvalid, OSError
    raise DataError(f"{path} cannot be read as parquet: {e}") from None


def _read_rows(path: Path, skipped: collections.Counter, max_line_bytes=None) -> list[Any]:
  if path.suffix == ".jsonl":
    return _read_jsonl(path, skipped, max_line_bytes)
  if path.suffix == ".json":
    return _read_json(path)
  return _read_parquet(path)


# ------------------------------------------------------------------------ rows to records
def _lookup(row: dict, key: str) -> Any:
  """row[key], or the value at a dot path ("reward_model.ground_truth"); None if absent."""
  if key in row:
    return row[key]
  value: Any = row
  for part in key.split("."):
    if not isinstance(value, dict) or part not in value:
      return None
    value = value[part]
  return value


def _first_present(row: dict, keys: Sequence[str]) -> Any:
  for key in keys:
    value = _lookup(row, key)
    if value is not None:
      return value
  return None


def _utf8(text: str) -> str:
  """`text`, if UTF-8 can write it (a lone surrogate, e.g. "\\ud83d" in JSON, cannot: the
  tokenizer would fail on it mid-run)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError:
    raise _BadRow("bad_utf8") from None
  return text


def _messages(prompt: Any) -> list[dict[str, str]]:
  """Chat messages from a prompt field: a string (one user turn) or a list of messages."""
  if isinstance(prompt, str):
    if not prompt.strip():
      raise _BadRow("missing_prompt")
    return [{"role": "user", "content": _utf8(prompt)}]
  if not isinstance(prompt, list):
    raise _BadRow("bad_prompt")
  messages = []
  for message in prompt:
    if not isinstance(message, dict):
      raise _BadRow("bad_messages")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role or not isinstance(content, str):
      raise _BadRow("bad_messages")
    messages.append({"role": _utf8(role), "content": _utf8(content)})
  if not any(m["content"].strip() for m in messages):
    raise _BadRow("missing_prompt")
  return messages


def _answer(value: Any) -> str:
  """The raw answer as a string; numbers are written as Python writes them (27.0 -> "27.0")."""
  if value is None:
    raise _BadRow("missing_answer")
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise _BadRow("bad_answer")
  answer = value if isinstance(value, str) else str(value)
  if not answer.strip():
    raise _BadRow("missing_answer")
  return _utf8(answer)


def _record_id(value: Any, default: str) -> int | str:
  """A row's id as an int or a string: it keys the skip count, rides in checkpoints and
  rollouts.jsonl (JSON), so a parquet scalar becomes its Python value and anything else
  (a list, a dict, bytes, a timestamp) its JSON or string form."""
  if value is None:
    return default
  value = _jsonable(value)
  if isinstance(value, bool) or not isinstance(value, (int, str)):
    value = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
  return value


def _record(row: Any, default_id: str, prompt_key: str, answer_key: str) -> dict[str, Any]:
  if not isinstance(row, dict):
    raise _BadRow("not_an_object")
  prompt = _lookup(row, prompt_key) if prompt_key else _first_present(row, PROMPT_KEYS)
  if prompt is None:
    raise _BadRow("missing_prompt")
  messages = _messages(prompt)
  answer = _answer(_lookup(row, answer_key) if answer_key else _first_present(row, ANSWER_KEYS))
  return {
      "id": _record_id(_first_present(row, ID_KEYS), default_id),
      "messages": messages,
      "answer": answer,
      "row": {str(k): _jsonable(v) for k, v in row.items()},
  }


def record_from_row(row: Any, prompt_key: str = "", answer_key: str = "") -> dict[str, Any]:
  """One dataset row as a record {"id", "messages", "answer", "row"}, as load_records
  reads each; DataError naming why a row is refused (missing_prompt, ...)."""
  try:
    return _record(row, "0", prompt_key, answer_key)
  except _BadRow as bad:
    raise DataError(f"the row is refused: {bad.reason}") from None


def _jsonable(value: Any) -> Any:
  """A row's value as plain JSON (numpy arrays and scalars from parquet included), so it
  can ride in the partial buffer's checkpoint and to a reward server."""
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return [_jsonable(v) for v in value.tolist()]
  if isinstance(value, np.generic):
    return value.item()
  if value is None or isinstance(value, (str, int, float, bool)):
    return value
  return str(value)


def load_records(
    path: str | Path, prompt_key: str = "", answer_key: str = "", max_line_bytes: int | None = None
) -> tuple[list[dict], collections.Counter]:
  """Reads a dataset file into records {"id", "messages", "answer", "row"}.

  Args:
    path: A `.jsonl`, `.json` (a JSON list of objects) or `.parquet` file.
    prompt_key: Field (dot path allowed) holding the prompt, a string or a list of chat
      messages; "" takes the first present of question, problem, prompt.
    answer_key: Field (dot path allowed) holding the answer; "" takes `answer`, else
      `reward_model.ground_truth`.
    max_line_bytes: A jsonl line longer than this is skipped, unread (`line_budget`);
      None reads every line.

  Returns:
    The records, in file order, and a Counter of skipped rows by reason (not_an_object,
    bad_utf8, bad_json, line_too_long, missing_prompt, bad_prompt, bad_messages,
    missing_answer, bad_answer).

  Raises:
    DataError: If the file does not exist, its extension is not supported, it cannot be read as a whole, or
      not one row is usable.
  """
  path = Path(path)
  if path.suffix not in SUFFIXES:
    raise DataError(
        f"Unsupported data file extension {path.suffix!r} of {path}; " f"expected one of {SUFFIXES}"
    )
  if not path.is_file():
    raise DataError(f"Data file not found: {path}")
  skipped: collections.Counter = collections.Counter()
  rows = _read_rows(path, skipped, max_line_bytes)
  records = []
  for index, row in enumerate(rows):
    try:
      records.append(_record(row, f"{path.stem}:{index}", prompt_key, answer_key))
    except _BadRow as e:
      skipped[e.reason] += 1
      if skipped[e.reason] == 1:
        logging.warning("%s row %d skipped: %s", path, index, e.reason)
  if not records:
    raise DataError(
        f"No usable rows in {path}: {sum(skipped.values())} skipped "
        f"({_describe(skipped) or 'the file is empty'})"
    )
  return records, skipped


def _describe(counts: collections.Counter) -> str:
  return ", ".join(f"{reason}: {n}" for reason, n in sorted(counts.items()))


# ------------------------------------------------------------------------ prompt sources
class PromptIterator:
  """Dataset records as an endless stream of tokenized PromptItems, checkpointable.

  Epoch e visits every record once, in the order
  `np.random.default_rng([seed, e]).permutation(n)` (file order without shuffle). In a
  multi-host run every process reads the whole file and walks the same order, so all
  see one stream with no exchange (an RL prompt set is small: DAPO-Math-17k is 17k rows).
  """

  def __init__(
      self,
      records: Sequence[dict],
      tokenizer: Any,
      max_prompt_len: int,
      seed: int = 0,
      shuffle: bool = True,
      system_prompt: str = "",
      enable_thinking: bool = False,
  ) -> None:
    if not records:
      raise ValueError("PromptIterator needs at least one record")
    if max_prompt_len < 1:
      raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    self.records = list(records)
    self.tokenizer = tokenizer
    self.max_prompt_len = int(max_prompt_len)
    self.shuffle = shuffle
    self.system_prompt = system_prompt
    self.enable_thinking = enable_thinking
    self.seed = int(seed)
    self.epoch = 0
    self.offset = 0  # position within the epoch's order
    self.skipped_too_long = 0  # skips so far, each time a long prompt comes up
    self._order_epoch, self._order = -1, np.arange(0)
    self._logged_too_long: set[Any] = set()

  def _epoch_order(self) -> np.ndarray:
    if self._order_epoch != self.epoch:
      n = len(self.records)
      self._order = (
          np.random.default_rng([self.seed, self.epoch]).permutation(n)
          if self.shuffle
          else np.arange(n)
      )
      self._order_epoch = self.epoch
    return self._order

  def tokens(self, record: dict) -> np.ndarray:
    """The record's prompt: its messages (after the system prompt) in the chat template."""
    messages = list(record["messages"])
    if self.system_prompt:
      messages = [{"role": "system", "content": self.system_prompt}] + messages
    ids = self.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=self.enable_thinking, tokenize=True
    )
    return np.asarray(ids, np.int32)

  def check_one_fits(self, where: str) -> None:
    """Raises DataError now, at load time, if no record's prompt fits max_prompt_len
    (naming the shortest). Prompts are tokenized in file order until one fits: one, in
    the usual case."""
    shortest = None
    for record in self.records:
      length = len(self.tokens(record))
      if length <= self.max_prompt_len:
        return
      shortest = length if shortest is None else min(shortest, length)
    raise DataError(
        f"no prompt of the {len(self.records)} records in {where} fits "
        f"data.max_prompt_len={self.max_prompt_len}: the shortest is {shortest} tokens "
        "(chat template included); raise data.max_prompt_len to at least that"
    )

  def _skip_too_long(self, record: dict, length: int) -> None:
    self.skipped_too_long += 1
    if record["id"] not in self._logged_too_long:
      self._logged_too_long.add(record["id"])
      logging.warning(
          "prompt %r skipped: %d tokens > max_prompt_len %d",
          record["id"],
          length,
          self.max_prompt_len,
      )

  def __call__(self) -> PromptItem:
    """The next prompt that fits max_prompt_len.

    Raises:
      ValueError: If a whole epoch holds no prompt that fits.
    """
    whole_epoch_seen = self.offset == 0
    while True:
      order = self._epoch_order()
      if self.offset >= len(order):
        if whole_epoch_seen:
          raise ValueError(
              f"No prompt of the {len(order)} records fits max_prompt_len "
              f"{self.max_prompt_len} ({self.skipped_too_long} skipped)"
          )
        self.epoch, self.offset, whole_epoch_seen = self.epoch + 1, 0, True
        continue
      record = self.records[order[self.offset]]
      self.offset += 1
      tokens = self.tokens(record)
      if len(tokens) > self.max_prompt_len:
        self._skip_too_long(record, len(tokens))
        continue
      return PromptItem(
          prompt_id=record["id"], tokens=tokens, answer=record["answer"], row=record.get("row")
      )

  def state(self) -> dict[str, int]:
    """Where the stream stands; JSON-serialisable."""
    return {
        "epoch": self.epoch,
        "offset": self.offset,
        "seed": self.seed,
        "skipped_too_long": self.skipped_too_long,
        "num_records": len(self.records),
    }

  def restore(self, state: dict[str, Any]) -> None:
    """Continues from `state()`: the items that follow are those the saved stream had next.

    Raises:
      ValueError: If the state was saved over a different number of records.
    """
    num_records = int(state.get("num_records", len(self.records)))
    if num_records != len(self.records):
      raise ValueError(
          f"Prompt state saved over {num_records} records, but the data now "
          f"has {len(self.records)}"
      )
    self.seed = int(state["seed"])
    self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
    self.skipped_too_long = int(state["skipped_too_long"])
    self._order_epoch = -1


def make_prompt_source(data_config: DataSettings, tokenizer: Any, seed: int) -> PromptIterator:
  """The prompt source of a data file the `data` config section names (the built-in
  task's is tasks/longtail.py's LongTailSource).

  Args:
    data_config: The `data` section (source, prompt_key, answer_key, max_prompt_len,
      shuffle, system_prompt, enable_thinking).
    tokenizer: Tokenizer for the prompts.
    seed: Seed of the shuffle.

  Returns:
    A PromptIterator over the file's records.
  """
  c = data_config
  if c.source == "longtail":
    raise ValueError(
        'data.source "longtail" is the built-in task\'s prompt stream '
        "(tasks/longtail.py LongTailSource, made by tasks/task.py), not a data file"
    )
  records, skipped = load_records(
      c.source, c.prompt_key, c.answer_key, line_budget(c.max_prompt_len)
  )
  logging.info(
      "loaded %d prompts from %s; skipped %d rows%s",
      len(records),
      c.source,
      sum(skipped.values()),
      f" ({_describe(skipped)})" if skipped else "",
  )
  source = PromptIterator(
      records,
      tokenizer,
      c.max_prompt_len,
      seed=seed,
      shuffle=c.shuffle,
      system_prompt=c.system_prompt,
      enable_thinking=c.enable_thinking,
  )
  source.check_one_fits(c.source)
  return source
