"""The memory planner's exact items against the arithmetic, and its refusal."""

import importlib.util
import json
from pathlib import Path

import pytest

from april_jax import plan
from april_jax.models import hf_io

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "model_configs"


def _config(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _qwen3_8b():
  path = SHARED / "qwen3-8b.config.json"
  if not path.is_file():
    pytest.skip("shared model configs are absent")
  return hf_io.config_from_hf(json.loads(path.read_text()))


def test_param_and_kv_bytes_match_the_arithmetic():
  cfg, config = _qwen3_8b(), _config("qwen3_8b")
  p = plan.make_plan(config, cfg, num_devices=8, device_bytes=80e9)
  # bf16 params, fully sharded over 8 devices (mesh (1, 8, 1)).
  assert p.device["params"] == cfg.num_params() * 2 / 8
  assert p.device["optimizer state (AdamW)"] == 2 * p.device["params"]
  # KV: 128 slots over 8 devices, 1024 + 8192 tokens, 2 x 36 layers x 8 heads x 128 x 2 B.
  assert p.device["KV cache (slots)"] == 16 * 9216 * (2 * 36 * 8 * 128 * 2)
  assert p.device["reference params (KL)"] == 0.0  # kl_coef is 0
  assert p.host_buffer_bytes == 128 * 9216 * 147456
  assert p.fits


def test_remat_shrinks_activations_and_a_config_that_cannot_fit_is_refused():
  cfg, config = _qwen3_8b(), _config("qwen3_8b")
  p = plan.make_plan(config, cfg, num_devices=8, device_bytes=80e9)
  assert p.device["activations, remat"] < p.device["activations, no remat"] / 10
  config.rollout.num_slots = 4096
  too_big = plan.make_plan(config, cfg, num_devices=8, device_bytes=80e9)
  assert not too_big.fits
  with pytest.raises(MemoryError, match="needs .* GB per device but a device holds 80.0 GB"):
    plan.check_fits(too_big)
