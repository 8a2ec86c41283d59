"""Mode `async`: rollout and learner on their own devices, overlapped, against the
colocated run that takes turns on all of them.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python -m april_jax.bench --mode=async --config=configs/tiny.py --steps=12

Both sides run the config for the same number of steps (the same number of trained
groups) on the same devices: colocated (mesh.rollout_devices = 0) and split
(--rollout_devices k, by default half). Per side, over the steps after the first
(compiling): seconds per trained batch (the learner's loop period: rollout + learn
colocated; the wait for a batch + learn split), each phase's seconds, and split, each
mesh's busy fraction (its phase's seconds over the period), the publish time beside its floor (the bytes over
the device-to-device copy rate measured on the same meshes), the lag of every trained
token (histogram). Both sides' held-out pass@1 after the last step is printed beside the
times: an overlap that did not teach would not be a win.

The projection: a colocated step's rollout and learner seconds on the devices measured
(one GPU, say: then only the colocated side runs), and what each split of a node of
--node_devices would take per batch (plan.choose_split, each phase scaled to its devices,
the rollout as (n / k)^a for a = 1 and 0.5): what a node would gain, from one device's
numbers.
"""

from __future__ import annotations

import json
import os
import tempfile

import jax
import numpy as np

from april_jax.planning import split as split_lib
from april_jax.benchmarks import common
from april_jax.models import hf_io
from april_jax.run.trainer import Trainer
from april_jax.settings.run import RunSettings

SCALINGS = (1.0, 0.5)  # the rollout's time on k of n devices: (n / k)^a


def _side(config, workdir: str, steps: int, rollout_devices: int) -> tuple[list[dict], dict]:
  """(metrics lines of steps 1.., what the run's own objects say: the copy rate)."""
  c = RunSettings.from_config(config).overridden(
      {
          "num_steps": steps,
          "checkpoint_every": 0,
          "eval_every": steps,
          "train.warm_up": True,  # the learner compiled before the first step
          "mesh.rollout_devices": rollout_devices,
      }
  )
  trainer = Trainer(c, workdir)
  extra = {}
  publisher = getattr(trainer.rollout, "publisher", None)  # split meshes: the weights' copier
  if publisher is not None:
    extra["copy_bytes_per_s"] = publisher.copy_rate()
  trainer.run()
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    lines = [json.loads(line) for line in f if line.strip()]
  with open(os.path.join(workdir, "rollouts.jsonl"), encoding="utf-8") as f:
    groups = [json.loads(line) for line in f if line.strip()]
  lags = [g["step"] - 1 - v[0] for g in groups for v in g["versions"] if v]
  extra["lag_histogram"] = np.bincount(lags).tolist() if lags else []
  return [m for m in lines if m["step"] >= 1], extra


def _summary(lines: list[dict], extra: dict) -> dict:
  steady = lines[1:] or lines  # the first step's rollout compiles the sampler's programs
  mean = lambda k: float(np.mean([m.get(k, 0.0) for m in steady]))
  period = mean("time/step_s")
  out = {
      "s_per_batch": period,
      "rollout_s": mean("time/rollout_s"),
      "train_s": mean("time/train_s"),
      "lag_token_mean": mean("rollout/lag_token_mean"),
      "lag_token_max": max(m["rollout/lag_token_max"] for m in lines),
      "eval_pass@1": float(lines[-1].get("eval/pass@1", float("nan"))),
      "lag_histogram": extra["lag_histogram"],
  }
  if "async/publish_s" in steady[0]:
    publish_bytes = mean("async/publish_bytes")
    out.update(
        learner_busy=out["train_s"] / period,
        rollout_busy=out["rollout_s"] / period,
        rollout_wait_s=mean("async/rollout_wait_s"),
        learner_wait_s=mean("async/learner_wait_s"),
        publish_s=mean("async/publish_s"),
        publish_bytes=publish_bytes,
        publish_floor_s=publish_bytes / extra["copy_bytes_per_s"],
    )
  return out


def project(config, rollout_s: float, learn_s: float, measured: int, node: int) -> dict:
  """Each split of a node of `node` devices, from a colocated step's phase times on the
  `measured` devices: each phase scaled to the node's devices (the learner in proportion,
  the rollout as (measured / node)^a), then split as plan.choose_split does (no memory
  check here: the shapes are the config's)."""
  config = RunSettings.from_config(config)
  cfg = hf_io.model_config(config)
  out = {}
  for a in SCALINGS:
    r, l = rollout_s * (measured / node) ** a, learn_s * measured / node
    out[f"scaling_{a}"] = split_lib.choose_split(config, cfg, node, r, l, rollout_scaling=a)
  return out


def run(config, steps: int = 12, rollout_devices: int = 0, node_devices: int = 8, **unused):
  """Both sides on these devices (the colocated side alone on one device), then the
  projection to a node of node_devices."""
  del unused
  n = len(jax.devices())
  k = rollout_devices or n // 2
  if n > 1 and not 0 < k < n:
    raise ValueError(f"--rollout_devices={k}: the split needs 1 to {n - 1} of the {n} devices")
  with tempfile.TemporaryDirectory(prefix="april_async_") as tmp:
    colocated, c_extra = _side(config, os.path.join(tmp, "colocated"), steps, 0)
    split = None
    if n > 1:  # one device: the projection from its phase times alone
      split, s_extra = _side(config, os.path.join(tmp, "split"), steps, k)
  out = {
      "mode": "async",
      "steps": steps,
      "devices": n,
      "rollout_devices": k if split else 0,
      "machine": common.machine(),
      "colocated": _summary(colocated, c_extra),
  }
  if split is not None:
    out["split"] = _summary(split, s_extra)
    out["speedup"] = out["colocated"]["s_per_batch"] / out["split"]["s_per_batch"]
  c = out["colocated"]
  out["projection"] = {
      "from_devices": n,
      "node_devices": node_devices,
      **project(config, c["rollout_s"], c["train_s"], n, node_devices),
  }
  _print(out)
  return out


def _print(out: dict) -> None:
  c = out["colocated"]
  s = out.get("split")
  if s is None:
    print(f"{out['devices']} device: the colocated side alone (a split needs two or more)")
    print(f"s per trained batch {c['s_per_batch']:.3f} (rollout {c['rollout_s']:.3f}, "
          f"learn {c['train_s']:.3f}); eval pass@1 after {c['eval_pass@1']:.3f}")  # fmt: skip
  else:
    print(f"{out['devices']} devices; split: {out['rollout_devices']} rollout + the rest learner")
    print(f"{'':<28}{'colocated':>12}{'split':>12}")
    print(f"{'s per trained batch':<28}{c['s_per_batch']:>12.3f}{s['s_per_batch']:>12.3f}")
    print(f"{'  rollout s':<28}{c['rollout_s']:>12.3f}{s['rollout_s']:>12.3f}")
    print(f"{'  learn s':<28}{c['train_s']:>12.3f}{s['train_s']:>12.3f}")
    print(f"{'token lag mean / max':<28}{c['lag_token_mean']:>8.2f}/{c['lag_token_max']:<3.0f}"
          f"{s['lag_token_mean']:>8.2f}/{s['lag_token_max']:<3.0f}")  # fmt: skip
    print(f"{'eval pass@1 after':<28}{c['eval_pass@1']:>12.3f}{s['eval_pass@1']:>12.3f}")
    print(f"split vs colocated: {out['speedup']:.2f}x per trained batch")
    print(
        f"split: learner busy {s['learner_busy']:.0%}, rollout busy {s['rollout_busy']:.0%}; "
        f"publish {s['publish_s'] * 1e3:.2f} ms for {s['publish_bytes'] / 1e6:.2f} MB "
        f"(floor {s['publish_floor_s'] * 1e3:.2f} ms)"
    )
    print(f"lag histogram (samples by oldest token's lag): split {s['lag_histogram']}")
  p = out["projection"]
  for key, chosen in p.items():
    if not key.startswith("scaling_"):
      continue
    best = chosen["chosen"]
    rows = {r["rollout_devices"]: r for r in chosen["splits"]}
    gain = f"{rows[best]['speedup']:.2f}x at k={best}" if best else "no split"
    print(f"projection to {p['node_devices']} devices, rollout scaling {key[8:]}: {gain}")
