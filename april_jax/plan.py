"""What fits: bytes per device for a config, before anything is allocated.

  python -m april_jax.plan --config=configs/qwen3_8b.py --devices=8 --device_gb=80

Per device: params, optimizer state (AdamW: two moments in the params' dtype), gradients
(one transient copy), reference params when a KL term needs them, the slots' KV cache,
training activations for one microbatch (with and without rematerialisation), and the
logits chunk; on the host: the partial buffer's KV per snapshot, worst case (every slot
parked at full length in mode kv; partials not resumed in a step keep theirs longer). Sharding follows the default rules: weights over
fsdp x tensor, slots over data x fsdp, KV heads over tensor, batch over data x fsdp.
The activation figure is an estimate (the largest tensors a layer keeps for its backward
pass); everything else is exact arithmetic.
"""

from __future__ import annotations

import dataclasses
import math

from april_jax import sharding
from april_jax.models import qwen3

GB = 1e9


def dtype_bytes(name: str) -> int:
  return {"float32": 4, "bfloat16": 2}[name]


@dataclasses.dataclass
class Plan:
  device: dict[str, float]      # bytes per device, by item
  host_buffer_bytes: float      # worst case held by the partial buffer on the host
  device_total: float
  device_capacity: float

  @property
  def fits(self) -> bool:
    return self.device_capacity <= 0 or self.device_total <= self.device_capacity

  def table(self) -> str:
    lines = [f"{'item':<34}{'GB per device':>14}"]
    lines += [f"{name:<34}{value / GB:>14.2f}" for name, value in self.device.items()]
    lines.append(f"{'total (with remat if enabled)':<34}{self.device_total / GB:>14.2f}")
    if self.device_capacity > 0:
      lines.append(f"{'capacity':<34}{self.device_capacity / GB:>14.2f}")
    lines.append(f"{'host: buffer KV per snapshot (max)':<34}"
                 f"{self.host_buffer_bytes / GB:>14.2f}")
    return "\n".join(lines)


def kv_bytes_per_token(cfg: qwen3.Qwen3Config, kv_dtype: str) -> int:
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(kv_dtype)


def make_plan(config, cfg: qwen3.Qwen3Config, num_devices: int,
              device_bytes: float = 0.0) -> Plan:
  data, fsdp, tensor = sharding.resolve_mesh_shape(tuple(config.mesh.shape), num_devices)
  r, t, m = config.rollout, config.train, config.model
  p_bytes = dtype_bytes(m.dtype)
  weight_shards = fsdp * tensor
  params = cfg.num_params() * p_bytes / weight_shards
  kv_heads_split = tensor if cfg.num_kv_heads % tensor == 0 else 1
  max_len = config.data.max_prompt_len + r.max_response_len
  slots_per_device = math.ceil(r.num_slots / (data * fsdp))
  kv = slots_per_device * max_len * kv_bytes_per_token(cfg, m.kv_dtype) / kv_heads_split

  batch = r.batch_size * r.n_samples_per_prompt
  micro = math.ceil(batch / (t.num_minibatches * t.num_microbatches) / (data * fsdp))
  D, F, N, H = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
  # Per layer and token: the residual input, q/k/v/attention output, the MLP's gate, up
  # and hidden (F-wide) tensors; attention scores are per head, T x T.
  per_token_layer = (4 * D + 3 * N * H / tensor + 3 * F / tensor) * p_bytes
  scores = micro * (N / tensor) * max_len * max_len * 4
  no_remat = cfg.num_layers * (micro * max_len * per_token_layer + scores)
  remat = cfg.num_layers * micro * max_len * D * p_bytes + micro * max_len * per_token_layer + scores
  logits_chunk = micro * t.logprob_chunk * cfg.vocab_size * 4 * 3 / tensor  # logits, softmax, grad

  device = {
      "params": params,
      "optimizer state (AdamW)": 2 * params,
      "gradients (transient)": params,
      "reference params (KL)": params if t.kl_coef > 0 else 0.0,
      "KV cache (slots)": kv,
      "activations, no remat": no_remat,
      "activations, remat": remat,
      "logits chunk": logits_chunk,
  }
  activations = remat if m.remat else no_remat
  total = (params * 4 + device["reference params (KL)"] + kv + activations + logits_chunk)
  # A sample carries KV only if it was in a slot at a snapshot: at most num_slots of them
  # per step, each at most max_len tokens.
  host = (r.num_slots * max_len * kv_bytes_per_token(cfg, m.kv_dtype)
          if r.resume_mode == "kv" else 0.0)
  return Plan(device=device, host_buffer_bytes=host, device_total=total,
              device_capacity=device_bytes)


def check_fits(plan: Plan) -> None:
  if not plan.fits:
    raise MemoryError(
        f"the config needs {plan.device_total / GB:.1f} GB per device but a device holds "
        f"{plan.device_capacity / GB:.1f} GB:\n{plan.table()}\nLower rollout.num_slots or "
        "max_response_len, enable model.remat, add microbatches, or shard over more devices.")


def model_config(config, hf_config_json: str = "") -> qwen3.Qwen3Config:
  """From an HF config.json if given, else model.path's, else model.init."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from april_jax.models import hf_io  # pylint: disable=g-import-not-at-top
  path = hf_config_json or (os.path.join(config.model.path, "config.json")
                            if config.model.path else "")
  if path:
    with open(path, encoding="utf-8") as f:
      return hf_io.config_from_hf(json.load(f), source=path)
  from april_jax.trainer import model_config_from_init  # pylint: disable=g-import-not-at-top
  return model_config_from_init(config.model.init)


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  cfg = model_config(f.config, f.model_config)
  devices = f.devices or len(jax.devices())
  plan = make_plan(f.config, cfg, devices, f.device_gb * GB)
  print(f"{cfg.num_params() / 1e9:.2f}B params on {devices} devices, mesh "
        f"{sharding.resolve_mesh_shape(tuple(f.config.mesh.shape), devices)}")
  print(plan.table())
  print("fits" if plan.fits else "DOES NOT FIT")
  if not plan.fits:
    raise SystemExit(3)


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
  flags.DEFINE_string("model_config", "", "HF config.json giving the model shape.")
  flags.DEFINE_integer("devices", 0, "Devices to plan for (0 = those JAX sees).")
  flags.DEFINE_float("device_gb", 0.0, "Memory per device in GB (0 = do not check).")
  flags.mark_flags_as_required(["config"])
  app.run(main)
