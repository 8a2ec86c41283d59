"""Side-by-side benchmarks: `python -m april_jax.bench --mode=sampler [...]`.

Each mode measures both sides in one run and prints a readable table, then, as its last
stdout line, one JSON object with every number.

  sampler    april_jax decode vs transformers' generate; snapshot/restore kv vs recompute
  scheduler  APRIL vs the synchronous baseline on long-tailed response lengths
  resume     continuing partial samples: KV kept vs recomputed (per step, per token, bytes)
  e2e        the RL loop on the built-in task, APRIL vs baseline, over seeds
  roofline   bytes one decode step reads at a config's shapes: paged vs live bound vs dense
  step       whole RL steps, APRIL vs baseline: rollout, batch, learner, cast, checkpoint,
             each phase's seconds beside its floor on this machine
  layout     the learner's padded tokens per real token, packed rows vs a row per sample
  lora_decode  a LoRA policy's decode step, adapters merged into a decode copy vs applied
             unmerged: compiled at the 8B shape (FLOPs, bytes, memory), timed small here
  multiturn  3-turn episodes with a slow tool vs single-turn samples of the same tokens:
             observations prefilled and calls off the decode path, beside feeding them
             token by token with every call waited for
  rewards    the math rewards' calls per second over (response, gold) pairs, and how many
             reach math-verify
  python_tool  the Python tool's calls per second, in the kernel's sandbox vs under the
             audit hook alone
  moe_layer  the mixture-of-experts layer (each grouping) vs a dense feed-forward of the
             same active width at equal tokens: timed small, compiled at 30B-A3B's widths
  async      rollout and learner on their own devices, overlapped, vs colocated: time
             per trained batch, busy fractions, publish vs its floor, token lag; and the
             split a node would gain, projected from these devices' phase times

  python -m april_jax.bench --mode=scheduler --config=configs/tiny.py [--dist=deepmath]
  python -m april_jax.bench --mode=step --config=configs/tiny.py [--steps=3 --dist=dapo_math]
  python -m april_jax.bench --mode=lora_decode --repeats=9
  python -m april_jax.bench --mode=multiturn
  python -m april_jax.bench --mode=rewards [--corpus=tests/data/dapo_corpus.jsonl]
  python -m april_jax.bench --mode=python_tool [--repeats=3]
  python -m april_jax.bench --mode=moe_layer
  python -m april_jax.bench --mode=speculative --config=configs/tiny.py [--spec_tokens=4]
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python -m april_jax.bench --mode=async --config=configs/tiny.py --steps=12
"""

if __name__ == "__main__":  # before jax loads: Ctrl-C is one line and exit 130
  from april_jax.runtime import interrupt  # pylint: disable=g-import-not-at-top

  interrupt.install("the benchmark stopped; its report was not written")

import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from april_jax.benchmarks import (
    async_bench,
    common,
    e2e_bench,
    layout_bench,
    lora_decode,
    moe_layer,
    multiturn_bench,
    resume_bench,
    reward_bench,
    roofline,
    sampler_bench,
    scheduler_bench,
    speculative_bench,
    step_bench,
    tool_bench,
)
from april_jax.benchmarks.length_dists import SHAPES
from april_jax.benchmarks.report import Report
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES
from april_jax.validation.checks import ConfigError, settings_of

_MODE = flags.DEFINE_enum(
    "mode",
    "sampler",
    [
        "sampler",
        "scheduler",
        "resume",
        "e2e",
        "roofline",
        "step",
        "layout",
        "lora_decode",
        "async",
        "multiturn",
        "rewards",
        "python_tool",
        "speculative",
        "moe_layer",
    ],
    "What to measure.",
)
_CORPUS = flags.DEFINE_string(
    "corpus", None, "rewards: JSON lines of {response, gold} (default: the test corpus)."
)
_SEEDS = flags.DEFINE_list(
    "seeds", ["0", "1"], "e2e: seeds (one pair of runs each); layout: batches drawn."
)
_DEVICES = flags.DEFINE_integer(
    "devices", 1, "layout: devices a learner call's rows are split over (8 for the 8B config)."
)
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (every mode but sampler).", lock_config=True
)
_DIST = flags.DEFINE_enum(
    "dist",
    "deepmath",
    sorted(SHAPES),
    "scheduler, resume, roofline, step, layout: response lengths.",
)
_STEPS = flags.DEFINE_integer("steps", 8, "scheduler, resume, step, async: RL steps per side.")
_ROLLOUT_DEVICES = flags.DEFINE_integer(
    "rollout_devices", 0, "async: the split side's rollout devices (0: half of them)."
)
_NODE_DEVICES = flags.DEFINE_integer(
    "node_devices", 8, "async: the node the measured phase times are projected to."
)
_RATIO = flags.DEFINE_float("ratio", 2.0, "scheduler, resume, step: N'/N for APRIL.")
_RATIOS = flags.DEFINE_list(
    "ratios",
    [],
    "scheduler: sweep these N'/N values instead "
    "(e.g. 1,1.5,2,3), each against its own baseline run.",
)
_RESPONSE_LEN = flags.DEFINE_integer(
    "max_response_len",
    512,
    "scheduler, resume, step: the length cap the distribution is scaled to "
    "(0 = the config's). Longer than the tiny task's 64 so that decoding, not Python "
    "bookkeeping, dominates a step on a CPU, as it does on a GPU at real lengths.",
)
_MODELS = flags.DEFINE_list("models", ["tiny", "small"], "sampler: model sizes to run.")
_HF = flags.DEFINE_bool("hf", True, "sampler: also time transformers' generate (CPU torch).")
_MOE_TOKENS = flags.DEFINE_integer("moe_tokens", 1024, "moe_layer: tokens through the layer.")
_MOE_WIDTHS = flags.DEFINE_enum(
    "moe_widths", "scaled", ["scaled", "real"],
    "moe_layer: time at a quarter of Qwen3-30B-A3B's widths (a CPU) or at its own (a GPU).",
)  # fmt: skip
_DTYPE = flags.DEFINE_enum(
    "dtype",
    "float32",
    ["float32", "bfloat16"],
    "sampler, speculative (controlled part), moe_layer: params.",
)
_HBM = flags.DEFINE_float(
    "hbm_gbps",
    0.0,
    "sampler: memory bandwidth (GB/s) for the decode "
    "roofline; 0 = guess from the device kind, or skip.",
)
_TAIL_MODEL = flags.DEFINE_string(
    "tail_model", "wide", "sampler: model of the long-tail vs uniform decode step ('' = skip)."
)
_TAIL_ROUNDS = flags.DEFINE_integer(
    "tail_rounds", 5, "sampler: rounds of the long-tail vs uniform step (median of their ratios)."
)
_COPY = flags.DEFINE_bool(
    "copy_bandwidth", True, "sampler: measure the copy bandwidth, report each step's share."
)
_BATCH = flags.DEFINE_integer("batch", 16, "sampler: sequences decoded together.")
_DECODE_ATTENTION = flags.DEFINE_enum(
    "decode_attention",
    "auto",
    ["auto", "xla", "pallas"],
    "sampler: how the engine's decode step reads the pool (rollout.decode_attention; auto: "
    "pallas on NVIDIA GPUs, else xla); pallas is interpreted, slowly, on a CPU.",
)
_DECODE_BLOCK = flags.DEFINE_integer(
    "decode_block",
    1024,
    "multiturn: pooled positions each chunk of the XLA path's decode attention reads "
    "(rollout.decode_block), on every side.",
    lower_bound=1,
)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "sampler: prompt tokens.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "sampler: tokens generated each.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Timed repetitions (best is reported; lora_decode: the median)."
)
_LORA_SHAPE = flags.DEFINE_enum(
    "lora_shape", "qwen3_8b", sorted(QWEN3_SHAPES), "lora_decode: the compiled side's model."
)
_LORA_ROWS = flags.DEFINE_integer("lora_rows", 64, "lora_decode: rows decoded together.")
_SPEC_TOKENS = flags.DEFINE_integer(
    "spec_tokens",
    4,
    "speculative: tokens drafted per slot and pass.",
    lower_bound=1,
    upper_bound=32,
)
_SPEC_MODEL = flags.DEFINE_string(
    "spec_model", "", "speculative: the controlled part's model shape ('' = the config's)."
)
_SPEC_LIVE = flags.DEFINE_list(
    "spec_live", ["1", "4", "16"], "speculative: live slot counts of the controlled part."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weights and prompts.")
_OUT_DIR = flags.DEFINE_string(
    "out_dir", "bench_out", "Markdown report and PNG plots go " "here ('' = none)."
)


def _numbers(name: str, kind: type, low: float):
  """A validator: every item of list flag `name` is a `kind` of at least `low`."""

  def check(values) -> bool:
    try:
      ok = all(kind(v) >= low for v in values)
    except ValueError:
      ok = False
    if not ok:
      raise flags.ValidationError(f"--{name} takes {kind.__name__}s >= {low}, comma-separated")
    return True

  return check


flags.register_validator("seeds", _numbers("seeds", int, 0))
flags.register_validator("spec_live", _numbers("spec_live", int, 1))
flags.register_validator("ratios", _numbers("ratios", float, 1))
flags.register_validator(
    "out_dir",
    lambda d: not d or not os.path.exists(d) or os.path.isdir(d),
    "--out_dir names a file; the reports go into a folder",
)


def _sampler(report) -> dict:
  """Mode sampler, with its flags."""
  if _NEW_TOKENS.value <= sampler_bench.SYNC_EVERY:
    raise app.UsageError(
        f"--new_tokens={_NEW_TOKENS.value} must exceed {sampler_bench.SYNC_EVERY}, the "
        "decode steps of the engine's first (untimed) call, to time a steady-state step"
    )
  return sampler_bench.run(
      models=_MODELS.value,
      batch=_BATCH.value,
      prompt_len=_PROMPT_LEN.value,
      new_tokens=_NEW_TOKENS.value,
      repeats=_REPEATS.value,
      seed=_SEED.value,
      report=report,
      hf=_HF.value,
      dtype=_DTYPE.value,
      hbm_gbps=_HBM.value or common.hbm_gbps(),
      tail_model=_TAIL_MODEL.value or None,
      tail_rounds=_TAIL_ROUNDS.value,
      copy_gbps=common.copy_gbps() if _COPY.value else 0.0,
      decode_attention=_DECODE_ATTENTION.value,
  )


def _settings():
  """--config's settings, for the modes that take one; a usage error naming what is wrong."""
  if _CONFIG.value is None:
    raise app.UsageError(f"--mode={_MODE.value} needs --config (e.g. configs/tiny.py)")
  try:
    return settings_of(_CONFIG.value)
  except ConfigError as e:  # a field the settings do not have, a value of the wrong type
    raise app.UsageError(str(e)) from None


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # tables on stdout; libraries stay quiet
  report = Report(_OUT_DIR.value, _MODE.value) if _OUT_DIR.value else None
  if _MODE.value == "sampler":
    result = _sampler(report)
  elif _MODE.value == "multiturn":
    result = multiturn_bench.run(
        seed=_SEED.value, repeats=_REPEATS.value, report=report, decode_block=_DECODE_BLOCK.value
    )
  elif _MODE.value == "rewards":
    result = reward_bench.run(_CORPUS.value, repeats=_REPEATS.value)
  elif _MODE.value == "python_tool":
    result = tool_bench.run(repeats=_REPEATS.value)
  elif _MODE.value == "moe_layer":
    result = moe_layer.run(
        _MOE_TOKENS.value, repeats=_REPEATS.value, timed_at=_MOE_WIDTHS.value, dtype=_DTYPE.value
    )
  elif _MODE.value == "lora_decode":
    result = lora_decode.run(
        _LORA_SHAPE.value, _LORA_ROWS.value, repeats=_REPEATS.value, report=report
    )
  else:
    config = _settings()
    if _RESPONSE_LEN.value and _MODE.value not in ("e2e", "roofline", "layout", "speculative"):
      config = config.overridden({"rollout.max_response_len": _RESPONSE_LEN.value})
    common_args = dict(shape=_DIST.value, steps=_STEPS.value, seed=_SEED.value, report=report)
    if _MODE.value == "roofline":
      result = roofline.run(config, shape=_DIST.value)
    elif _MODE.value == "layout":
      seeds = [int(x) for x in _SEEDS.value]
      result = layout_bench.run(config, _DIST.value, seeds, _DEVICES.value)
    elif _MODE.value == "e2e":
      result = e2e_bench.run(config, seeds=[int(x) for x in _SEEDS.value], report=report)
    elif _MODE.value == "resume":
      result = resume_bench.run(config, ratio=_RATIO.value, **common_args)
    elif _MODE.value == "async":
      result = async_bench.run(
          config, steps=_STEPS.value, rollout_devices=_ROLLOUT_DEVICES.value,
          node_devices=_NODE_DEVICES.value,
      )  # fmt: skip
    elif _MODE.value == "step":
      result = step_bench.run(config, ratio=_RATIO.value, **common_args)
    elif _MODE.value == "speculative":
      live = [int(x) for x in _SPEC_LIVE.value]
      result = speculative_bench.run(
          config, K=_SPEC_TOKENS.value, model=_SPEC_MODEL.value, live=live, seed=_SEED.value,
          dtype=_DTYPE.value, repeats=_REPEATS.value,
      )  # fmt: skip
    elif _RATIOS.value:
      result = scheduler_bench.sweep(
          config, ratios=[float(r) for r in _RATIOS.value], **common_args
      )
    else:
      result = scheduler_bench.run(config, ratio=_RATIO.value, **common_args)
  if report is not None:
    print(f"report: {report.write('python -m april_jax.bench ' + ' '.join(sys.argv[1:]), result)}")
  common.emit(result)


if __name__ == "__main__":
  app.run(main)
