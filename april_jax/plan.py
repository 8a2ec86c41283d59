"""What fits: bytes per device for a config, by arithmetic or by compiling every program.

  python -m april_jax.plan --config=configs/qwen3_8b.py --devices=8 --device_memory_gb=80
  python -m april_jax.plan --config=configs/qwen3_8b.py --compile --devices=8 \
      --device_memory_gb=80        # compile at the real shapes on fake CPU devices
  python -m april_jax.plan --config=configs/qwen3_8b.py --devices=8 \
      --rollout_s=R --learn_s=L     # the split of rollout and learner devices to choose

The arithmetic plan is planning/memory.py's, the compiled one planning/compile_check.py's,
the split planning/split.py's. Exit status 2: a config refused; 3: it does not fit.
"""

from __future__ import annotations

import json
import math
import os
import sys

from april_jax import cli, sharding
from april_jax.models import hf_io
from april_jax.planning import compile_check
from april_jax.planning.memory import GB, compiled_pages_that_fit, make_plan, pool_sentence, what_fits
from april_jax.planning.split import choose_split, describe_split
from april_jax.validation.checks import PLAN_CHECKS, ConfigError, validate, validate_for_devices


def _compiled(settings, f, cfg, devices: int, capacity: float) -> bool:
  """--compile: every program compiled on fake CPU devices (each on its mesh when split);
  prints the report; whether it fits."""
  import jax  # pylint: disable=g-import-not-at-top

  k = settings.mesh.rollout_devices
  if k:
    rollout_mesh = sharding.make_mesh(
        tuple(settings.mesh.rollout_shape), jax.devices()[devices - k : devices]
    )
    mesh = sharding.make_mesh(tuple(settings.mesh.shape), jax.devices()[: devices - k])
    report = compile_check.check_split(settings, cfg, rollout_mesh, mesh, capacity)
    print(report.table())
  else:
    mesh = sharding.make_mesh(tuple(settings.mesh.shape), jax.devices()[:devices])
    report = compile_check.check(settings, cfg, mesh, capacity)
    print(report.table())
    if not report.fits:  # the compiled peak, less the pages it exceeds by
      excess = report.peak_bytes - capacity
      print(pool_sentence(settings, compiled_pages_that_fit(settings, cfg, mesh, excess)))
  print(json.dumps(report.to_json(), sort_keys=True))
  return report.fits


def _arithmetic(settings, f, cfg, devices: int, capacity: float) -> bool:
  """The arithmetic plan (and, given a colocated step's phase times, the split to
  choose); prints it; whether it fits."""
  plan = make_plan(settings, cfg, devices, capacity)
  print(plan.table())
  if f.rollout_s > 0 and f.learn_s > 0:  # the split these phase costs call for
    chosen = choose_split(
        settings, cfg, devices, f.rollout_s, f.learn_s, capacity, f.rollout_scaling
    )
    print(describe_split(chosen))
    print(json.dumps({"split": chosen}, sort_keys=True))
  if capacity <= 0:
    print("not checked against a device: give --device_memory_gb (and --devices)")
  else:
    print("fits" if plan.fits else "DOES NOT FIT: " + what_fits(settings, cfg, devices, capacity))
  print(json.dumps(plan.to_json(), sort_keys=True))
  return plan.fits


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  if f.compile:  # fake CPU devices, before JAX starts its backends
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={f.devices or 8}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top

  devices = f.devices or len(jax.devices())
  try:
    settings = validate(f.config, PLAN_CHECKS)  # what main refuses of the shapes, its words
    cfg = hf_io.model_config(settings, f.model_config)
    validate_for_devices(settings, devices, cfg)
  except ConfigError as e:  # as main words it: every problem, one a line
    print(f"april_jax.plan: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  except (ValueError, OSError) as e:
    cli.fail("april_jax.plan", str(e))
  capacity = f.device_memory_gb * GB
  k = settings.mesh.rollout_devices
  learner_shape = sharding.resolve_mesh_shape(tuple(settings.mesh.shape), devices - k)
  print(f"{cfg.num_params() / 1e9:.2f}B params on {devices} devices, mesh {learner_shape}")
  if k:
    rollout_shape = sharding.resolve_mesh_shape(tuple(settings.mesh.rollout_shape), k)
    print(f"  split: the rollout on {k} devices, mesh {rollout_shape}; the learner on the rest")
  fits = (_compiled if f.compile else _arithmetic)(settings, f, cfg, devices, capacity)
  if not fits:
    raise SystemExit(3)


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
  flags.DEFINE_string("model_config", "", "HF config.json giving the model shape.")
  flags.DEFINE_integer(
      "devices", 0, "Devices to plan for (0 = those JAX sees; " "8 with --compile)."
  )
  flags.DEFINE_float("device_memory_gb", 0.0, "Memory per device in GB (0 = do not check).")
  flags.DEFINE_float(
      "rollout_s",
      0.0,
      "A colocated step's rollout seconds on these devices: with "
      "--learn_s, the split of rollout and learner devices to choose.",
  )
  flags.DEFINE_float("learn_s", 0.0, "A colocated step's learner seconds (see --rollout_s).")
  flags.DEFINE_float(
      "rollout_scaling",
      1.0,
      "How the rollout's time scales with its devices: "
      "(n / k)^a on k of n (1: in proportion; below 1: less, as a decode bound by memory).",
  )
  flags.DEFINE_bool(
      "compile",
      False,
      "Compile every program at the config's shapes on "
      "fake CPU devices and report XLA's memory and collectives.",
  )
  flags.mark_flags_as_required(["config"])
  flags.register_validator(
      "device_memory_gb",
      lambda gb: math.isfinite(gb) and gb >= 0,
      "--device_memory_gb takes a number of GB > 0 (0 or left out: do not check)",
  )
  flags.register_validator(
      "devices",
      lambda n: n >= 1 or (n == 0 and not flags.FLAGS["devices"].present),
      "--devices takes a count >= 1 (left out: the devices JAX sees, 8 with --compile)",
  )
  app.run(main, flags_parser=cli.flags_parser("april_jax.plan", "april_jax.plan"))
