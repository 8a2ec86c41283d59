"""Qwen3-4B on math with a Python interpreter tool: multi-turn episodes on one H200.

  python -m april_jax.main --config=configs/math_python_tool.py --workdir=runs/math_python \
      --config.model.path=/models/Qwen3-4B \
      --config.data.source=/data/dapo_math_17k.parquet \
      --config.eval.path=/data/math500.jsonl

Each episode opens with the environment's instructions, the tool's schema (written by
the chat template) and the row's problem (its "question" / "problem" column, DAPO's raw
problem, or the last user message of its prompt). The model calls the tool in Qwen3's
tool-call format,
<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>,
read as the hermes parser reads it (every call of the turn runs; a malformed one runs
nothing and says why); at the end of its turn the outputs (or tracebacks) come back as the
chat template renders tool messages, and the model goes on in the same slot. A turn
without a call is the final answer; the math reward scores the final answer after the
thinking ("\\boxed{}" or DAPO's "Answer:"). Check an episode first with
`python -m april_jax.replay --config=configs/math_python_tool.py --transcript=...`.

The model's code runs in a separate, limited process, never in the trainer
(envs/python_tool.py): a fresh `python -I` per call in a folder of its own, killed past
5 s of wall time (below env.timeout_s), with 1 GB of address space, no network, no new
processes and no files written outside its folder. It is not a container: see the
module's docstring for what it does not isolate. Otherwise configs/qwen3_4b.py on one GPU.
"""

from april_jax.settings import base
from april_jax.envs.python_tool import SYSTEM_PROMPT


def get_config(arg=None):
  c = base.sibling(__file__, "qwen3_4b.py").get_config(arg)
  c.data.source = ""  # required: DAPO-Math-17k (parquet) or MATH-style rows with "problem"
  c.data.max_prompt_len = 1024  # the tool schema's system prompt and the problem
  c.data.system_prompt = SYSTEM_PROMPT  # for a row whose problem the env cannot find
  c.rollout.reward = "math"
  c.rollout.max_response_len = 8192  # every turn and every observation
  c.rollout.dynamic_sampling = True
  c.env.name = "python_tool"
  base.qwen3_tool_turns(c)  # turns end at <|im_end|>; results as the template's tool messages
  c.env.max_turns = 6
  c.env.max_observation_tokens = 512
  c.env.timeout_s = 10.0  # per call; the tool's own limit is 5 s
  c.env.workers = 8  # calls at once, each in its own child process
  c.eval.num_prompts = 500  # MATH-500
  c.eval.k = 0
  c.eval.temperature = 0.0
  return c
