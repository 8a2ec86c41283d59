"""The `data` section: the prompt source and its format, and the built-in task's shape."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TaskSettings:
  """data.task: the built-in task (data.source = "longtail", tasks/longtail.py)."""

  ring_size: int = 64  # symbols on the ring; walks are at most this long
  median: float = 8.0  # answer lengths: log-normal with this median ...
  sigma: float = 0.9  # ... and this sigma of the log (the tail's weight)
  demo_overshoot: float = 0.0  # warm-start demonstrations that walk one symbol too far
  hide_target: bool = False  # multi-turn: the target told only by env "lookup"


@dataclasses.dataclass(frozen=True)
class DataSettings:
  source: str = "longtail"  # "longtail" (built-in task) or a .jsonl/.json/.parquet path
  prompt_key: str = ""  # "" = first of question/problem/prompt
  answer_key: str = ""  # "" = answer, or reward_model.ground_truth
  max_prompt_len: int = 512  # tokens; longer prompts are skipped and counted
  shuffle: bool = True  # a seeded order, the same on every host
  system_prompt: str = ""  # a system message before each prompt's; "" = none
  enable_thinking: bool = False  # Qwen3's chat template: thinking on
  task: TaskSettings = dataclasses.field(default_factory=TaskSettings)
