"""Qwen3-4B on GSM8K with a calculator tool: multi-turn episodes on one H200.

  python -m april_jax.main --config=configs/gsm8k_tool.py --workdir=runs/gsm8k_tool \
      --config.model.path=/models/Qwen3-4B \
      --config.data.source=/data/gsm8k_train.jsonl \
      --config.eval.path=/data/gsm8k_test.jsonl

The model calls the calculator in Qwen3's tool-call format,
<tool_call>{"name": "calculator", "arguments": {"expression": "48 / 2"}}</tool_call>,
read as the hermes parser reads it; at the end of its turn each result comes back as the
chat template renders a tool message, and the model goes on in the same slot. A turn
without a call is the final answer (envs/calculator.py: expressions are parsed, never
evaluated as code). The math reward scores the final answer after the thinking. Otherwise configs/qwen3_4b.py
on one GPU.
"""

from april_jax.settings import base

SYSTEM_PROMPT = """You can use a calculator. To call it, write
<tool_call>{"name": "calculator", "arguments": {"expression": "<arithmetic>"}}</tool_call>
and end your turn to get its result. Finish with the final answer as \\boxed{N}."""


def get_config(arg=None):
  c = base.sibling(__file__, "qwen3_4b.py").get_config(arg)
  c.data.source = ""  # required: GSM8K train (jsonl, "question" / "answer ... #### N")
  c.data.max_prompt_len = 512
  c.data.system_prompt = SYSTEM_PROMPT
  c.rollout.reward = "math"
  c.rollout.max_response_len = 2048  # every turn and every observation
  c.rollout.dynamic_sampling = True
  c.env.name = "calculator"
  base.qwen3_tool_turns(c)  # turns end at <|im_end|>; results as the template's tool messages
  c.env.max_turns = 8
  c.env.max_observation_tokens = 64
  c.env.timeout_s = 5.0
  c.eval.num_prompts = 256  # the first of GSM8K test
  c.eval.k = 0
  c.eval.temperature = 0.0
  return c
