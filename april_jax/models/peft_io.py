"""LoRA adapters in and out as a PEFT folder: adapter_config.json + adapter_model.safetensors.

`peft.PeftModel.from_pretrained(base, folder)` loads what `save_peft` writes onto the
base model that transformers saved (hf_io.save_pretrained), and gives the logits of the
merged model (lora.merge). `load_peft` reads such a folder back, checking that it fits
the base: LoRA, its target modules, and every tensor's shape.

PEFT keeps, per layer and module, lora_A.weight [rank, in] and lora_B.weight [out, rank]
over the module's torch weight [out, in]; the update is (alpha / rank) * B @ A. Ours are
A [in, rank] and B [rank, out] over flattened in and out dims, in the same order as
hf_io maps each weight, so each is a transpose.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from april_jax.errors import InputError
from april_jax.models import lora, qwen3

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
TARGETS_OF = {module.split(".")[1]: target for target, module in MODULES.items()}


class AdapterError(InputError, ValueError):
  """A PEFT folder that is not LoRA for this base model; the message says what differs."""


def _key(i: int, target: str, side: str) -> str:
  return f"base_model.model.model.layers.{i}.{MODULES[target]}.lora_{side}.weight"


def save_peft(path, spec: lora.LoraSpec, adapters: dict, base_model: str = "") -> None:
  """Writes the adapters as a PEFT LoRA folder (float32 tensors)."""
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for target, ad in adapters["layers"].items():
    a, b = np.asarray(ad["a"], np.float32), np.asarray(ad["b"], np.float32)
    for i in range(a.shape[0]):
      tensors[_key(i, target, "A")] = np.ascontiguousarray(a[i].reshape(-1, spec.rank).T)
      tensors[_key(i, target, "B")] = np.ascontiguousarray(b[i].reshape(spec.rank, -1).T)
  save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
  config = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model,
      "r": spec.rank,
      "lora_alpha": spec.alpha,
      "lora_dropout": 0.0,
      "bias": "none",
      "target_modules": sorted(MODULES[t].split(".")[1] for t in spec.targets),
      "fan_in_fan_out": False,
      "use_rslora": False,
      "inference_mode": True,
  }
  (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def spec_of(config: dict, where: str) -> lora.LoraSpec:
  """The LoraSpec of a PEFT adapter_config.json, or AdapterError naming what it lacks."""
  if config.get("peft_type") != "LORA":
    raise AdapterError(f"{where}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
  modules = config.get("target_modules") or []
  if isinstance(modules, str):
    raise AdapterError(f"{where}: target_modules is a pattern ({modules!r}); list the modules")
  unknown = [m for m in modules if m not in TARGETS_OF]
  if unknown:
    raise AdapterError(f"{where}: target_modules {unknown} are not Qwen3 projections")
  for field in ("use_rslora", "fan_in_fan_out"):
    if config.get(field):
      raise AdapterError(f"{where}: {field}=true is not supported")
  targets = tuple(t for t in lora.TARGETS if MODULES[t].split(".")[1] in modules)
  if "r" not in config or "lora_alpha" not in config:
    raise AdapterError(f"{where}: no 'r' or 'lora_alpha'")
  return lora.LoraSpec(rank=int(config["r"]), alpha=float(config["lora_alpha"]), targets=targets)


def load_peft(path, cfg: qwen3.Qwen3Config) -> tuple[lora.LoraSpec, dict]:
  """The spec and float32 adapters of a PEFT LoRA folder made for this base model."""
  path = Path(path)
  where = str(path / CONFIG_NAME)
  try:
    config = json.loads((path / CONFIG_NAME).read_text())
  except (OSError, ValueError) as e:
    raise AdapterError(f"{where} cannot be read: {type(e).__name__}: {e}") from None
  spec = spec_of(config, where)
  found = lora.problems(cfg, spec, "the adapter's ")
  if found:
    raise AdapterError(f"{where}: " + "; ".join(found))
  shapes = jax_shapes(cfg, spec)
  try:
    return spec, _read_adapters(path / WEIGHTS_NAME, spec, shapes, cfg)
  except AdapterError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # missing, unreadable, damaged
    why = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise AdapterError(
        f"{path / WEIGHTS_NAME} cannot be read as safetensors: {type(e).__name__}: {why}"
    ) from None


def _read_adapters(weights: Path, spec: lora.LoraSpec, shapes: dict, cfg) -> dict:
  """The adapters in the safetensors file `weights`, in our layout (float32)."""
  path = weights.parent
  out = {}
  with safe_open(str(weights), "numpy") as f:
    names = set(f.keys())
    for target in spec.targets:
      sides = {}
      for side, shape in zip(("a", "b"), shapes[target]):
        rows = []
        for i in range(cfg.num_layers):
          key = _key(i, target, side.upper())
          if key not in names:
            raise AdapterError(f"{path / WEIGHTS_NAME} has no {key}")
          rows.append(_ours(f.get_tensor(key), side, shape[1:], key))
        sides[side] = np.stack(rows)
      out[target] = sides
  return {"layers": out}


def _ours(tensor: np.ndarray, side: str, shape: tuple[int, ...], key: str) -> np.ndarray:
  """A PEFT tensor ([rank, in] for A, [out, rank] for B) in our layout `shape`."""
  want = (shape[-1], math.prod(shape[:-1])) if side == "a" else (math.prod(shape[1:]), shape[0])
  if tensor.shape != want:
    raise AdapterError(f"{key} has shape {tensor.shape}; this base model needs {want}")
  return np.asarray(tensor, np.float32).T.reshape(shape)


def jax_shapes(cfg: qwen3.Qwen3Config, spec: lora.LoraSpec) -> dict:
  """Each target's (A, B) shapes, as lora.init makes them."""
  L = cfg.num_layers
  out = {}
  for target in spec.targets:
    ins, outs = lora.weight_dims(cfg, target)
    out[target] = ((L, *ins, spec.rank), (L, spec.rank, *outs))
  return out
