"""The plan of a run whose rollout and learner have their own devices: each mesh sized for
what it holds, the 8B async config fitting 8 x 80 GB, and the split the planner chooses
from two phase times (none beats colocated when the rollout scales with its devices)."""

import pytest

from april_jax.planning import memory
from april_jax.planning import split as split_lib
from april_jax.models import hf_io
import cli
from conftest import load_settings


def _async_8b():
  config = load_settings("qwen3_8b", "async")
  return config, hf_io.model_config(config)


def test_the_8b_async_config_fits_each_mesh_of_8_x_80gb_with_what_it_holds():
  config, cfg = _async_8b()
  p = memory.make_plan(config, cfg, 8, 80e9)
  assert isinstance(p, memory.SplitPlan) and p.fits
  assert (p.rollout_devices, p.learner_devices) == (4, 4)
  assert config.rollout.num_slots >= 128
  assert set(p.rollout.resident) == {
      "decode params",
      "slot state (KV cache)",
      "the last prefill's KV (kept)",
  }
  assert "master params (float32)" in p.learner.resident
  assert "slot state (KV cache)" not in p.learner.resident
  assert "decode" in p.rollout.programs and "gradients" not in p.rollout.programs
  assert "decode_params (cast)" in p.learner.programs  # the learner casts ...
  assert "decode_params (cast)" not in p.rollout.programs  # ... the rollout takes a weight
  bf16_params = cfg.num_params() * 2
  # Tensor parallel over the 4 rollout devices; float32 masters FSDP over the other 4.
  assert p.rollout.resident["decode params"] == pytest.approx(bf16_params / 4, rel=0.01)
  assert p.learner.resident["master params (float32)"] == pytest.approx(
      2 * bf16_params / 4, rel=0.01
  )
  colocated = memory.make_plan(load_settings("qwen3_8b"), cfg, 8, 80e9)
  # The rollout mesh holds no learner: a pool larger than the colocated one fits there.
  assert config.rollout.kv_pages > load_settings("qwen3_8b").rollout.kv_pages
  assert p.device_total <= 80e9 and colocated.fits


def test_no_split_beats_colocated_when_the_rollout_scales_with_its_devices():
  config, cfg = _async_8b()
  chosen = split_lib.choose_split(config, cfg, 8, rollout_s=100.0, learn_s=40.0, device_bytes=80e9)
  rows = {r["rollout_devices"]: r for r in chosen["splits"]}
  assert "refused" in rows[3] and "32 attention heads 3 ways" in rows[3]["refused"]
  assert "GB per device" in rows[1]["refused"]  # the whole pool on one device
  assert chosen["chosen"] == 4 and rows[4]["num_microbatches"] == 64
  assert rows[4]["seconds_per_batch"] == pytest.approx(max(100 * 2, 40 * 2))
  assert all(r["speedup"] < 1 for r in rows.values() if "speedup" in r)
  slow = split_lib.choose_split(config, cfg, 8, 100.0, 40.0, 80e9, rollout_scaling=0.25)
  best = {r["rollout_devices"]: r for r in slow["splits"]}[slow["chosen"]]
  assert best["speedup"] == pytest.approx(140 / max(100 * 2**0.25, 80))


def test_the_planner_cli_prints_both_meshes_and_the_chosen_split():
  proc = cli.run(
      "--config=configs/qwen3_8b.py:async", "--devices=8", "--device_memory_gb=80",
      "--rollout_s=100", "--learn_s=40", "--rollout_scaling=0.5", module="april_jax.plan",
      devices=8,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "rollout mesh (4 devices)" in proc.stdout and "learner mesh (4 devices)" in proc.stdout
  assert "chosen: mesh.rollout_devices=4 (train.num_microbatches=64)" in proc.stdout


def test_the_planner_refuses_a_split_that_leaves_the_learner_no_device():
  proc = cli.run(
      "--config=configs/qwen3_8b.py", "--devices=8", "--config.mesh.rollout_devices=8",
      module="april_jax.plan", devices=8,
  )  # fmt: skip
  assert proc.returncode == 2
  assert "mesh.rollout_devices=8 leaves no device for the learner" in proc.stderr
