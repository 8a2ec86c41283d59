"""The `eval` section: pass@1 and avg@k on held-out prompts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  path: str = ""  # "" = held-out built-in task prompts
  num_prompts: int = 32  # held-out prompts evaluated
  k: int = 4  # avg@k samples per prompt; 0 = greedy only
  temperature: float = 0.6  # of the avg@k samples (pass@1 is greedy)
  top_p: float = 1.0  # nucleus of the avg@k samples
  before_training: bool = True  # also evaluate before step 1 (the line of step 0)
