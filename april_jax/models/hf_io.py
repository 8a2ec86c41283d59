"""Hugging Face checkpoints in and out: config.json + safetensors <-> Qwen3 params.

`load_pretrained` reads tensors one at a time from memory-mapped safetensors (one file,
or shards listed in `model.safetensors.index.json`), converts each to the layout of
`qwen3.py` and puts it straight into its sharding, so host memory peaks near one
(layer-stacked) tensor rather than at a copy of the model. `save_pretrained` writes
config.json and size-capped safetensors shards that transformers loads as
`Qwen3ForCausalLM` (or `Qwen3MoeForCausalLM`: experts under their per-expert names, as
the released checkpoints have them). Weights are never read from pickles.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from april_jax import sharding
from april_jax.runtime.distributed import to_host
from april_jax.errors import InputError, InputFileMissing
from april_jax.models import layer_runs
from april_jax.models import qwen3

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


# ------------------------------------------------------------------------------ config


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> qwen3.Qwen3Config:
  """A Qwen3Config from a transformers config dict; rejects what the model cannot run."""
  if not isinstance(hf, dict):
    raise ValueError(f"{source}: a JSON object was expected, got {type(hf).__name__}")
  model_type = hf.get("model_type")
  if model_type not in ("qwen3", "qwen3_moe"):
    raise ValueError(
        f"{source}: unsupported model_type {model_type!r}; "
        "april_jax runs Qwen3 models (model_type 'qwen3' or 'qwen3_moe')"
    )
  if "num_experts" not in hf and "num_local_experts" in hf:  # transformers 5's name for it
    hf = {**hf, "num_experts": hf["num_local_experts"]}
  required = _REQUIRED_KEYS + (_MOE_REQUIRED if model_type == "qwen3_moe" else ())
  missing = [k for k in required if k not in hf]
  if missing:
    raise ValueError(f"{source}: missing required field(s) {missing}")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
  if hf.get("attention_bias", False):
    raise ValueError(f"{source}: attention_bias=true is not supported by Qwen3")
  if hf.get("use_sliding_window", False):
    raise ValueError(f"{source}: use_sliding_window=true is not supported")
  rope_params = hf.get("rope_parameters") or {}
  rope_scaling = hf.get("rope_scaling") or {}
  for name, rope in (("rope_parameters", rope_params), ("rope_scaling", rope_scaling)):
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise ValueError(
          f"{source}: {name} type {rope_type!r} is not supported " "(only default RoPE)"
      )
  for key in required + ("num_key_value_heads", "head_dim", "decoder_sparse_step"):
    value = hf.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
  rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10_000.0))
  num_heads = hf["num_attention_heads"]
  return qwen3.Qwen3Config(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      rope_theta=float(rope_theta),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
      **(_moe_fields(hf, source) if model_type == "qwen3_moe" else {}),
  )


_MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def _moe_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """Qwen3Config's mixture-of-experts fields from a qwen3_moe config.json (transformers'
  defaults where a field is absent)."""
  only = hf.get("mlp_only_layers") or []
  if not isinstance(only, list) or not all(
      isinstance(i, int) and 0 <= i < hf["num_hidden_layers"] for i in only
  ):
    raise ValueError(f"{source}: mlp_only_layers must list layer indices, got {only!r}")
  if hf.get("shared_expert_intermediate_size"):
    raise ValueError(f"{source}: shared experts (Qwen2-MoE's) are not supported by Qwen3-MoE")
  return dict(
      num_experts=hf["num_experts"],
      num_experts_per_tok=hf["num_experts_per_tok"],
      moe_intermediate_size=hf["moe_intermediate_size"],
      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
      decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
      mlp_only_layers=tuple(only),
  )


def config_to_hf(
    cfg: qwen3.Qwen3Config, dtype: str = "float32", extra: dict[str, Any] | None = None
) -> dict[str, Any]:
  """The transformers config.json for `cfg` (extra keys, e.g. token ids, merged in)."""
  hf = {
      "architectures": ["Qwen3ForCausalLM"],
      "model_type": "qwen3",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None,
      "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "max_position_embeddings": cfg.max_position_embeddings,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "use_sliding_window": False,
      "torch_dtype": dtype,
  }
  if cfg.num_experts:
    hf.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
        output_router_logits=False,
        router_aux_loss_coef=0.0,
    )
  hf.update(extra or {})
  return hf


def load_config(path: str | os.PathLike) -> qwen3.Qwen3Config:
  config_path = Path(path) / CONFIG_NAME
  if not config_path.is_file():
    raise InputFileMissing(
        f"no {CONFIG_NAME} in model folder {path} (looked for " f"{config_path})"
    )
  try:
    with open(config_path, encoding="utf-8") as f:
      hf = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
    raise ModelError(f"{config_path} is not valid JSON: {e}") from None
  try:
    return config_from_hf(hf, source=str(config_path))
  except (ValueError, KeyError, TypeError) as e:
    said = str(e)  # config_from_hf's own messages start with the file
    raise ModelError(said if said.startswith(str(config_path)) else f"{config_path}: {e}") from None


RUN_CHOICES = ("attention", "attention_chunk", "experts_impl")  # how the run computes


# What a second model (a critic, a LoRA base) must share with the policy to stand in for
# its backbone: everything but the output head (tied or not) and the run's attention choice.
SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
    "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers",
)  # fmt: skip


def architecture(cfg: qwen3.Qwen3Config) -> dict[str, Any]:
  """The model's own fields (shapes, rope, norm, experts), as JSON: what a checkpoint was
  trained as."""
  fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUN_CHOICES}
  return {**fields, "mlp_only_layers": list(cfg.mlp_only_layers)}


def from_architecture(fields: dict[str, Any]) -> qwen3.Qwen3Config:
  """The model an `architecture` record describes (a checkpoint's)."""
  return qwen3.Qwen3Config(
      **{**fields, "mlp_only_layers": tuple(fields.get("mlp_only_layers", ()))}
  )


def model_config(config, hf_config_json: str = "") -> qwen3.Qwen3Config:
  """The run's model: from an HF config.json if given, else model.path's, else the
  config's model.init; with the config's attention settings."""
  if hf_config_json:
    with open(hf_config_json, encoding="utf-8") as f:
      cfg = config_from_hf(json.load(f), source=hf_config_json)
  elif config.model.path:
    cfg = load_config(config.model.path)
  else:
    init = config.model.init
    if min(init.vocab_size, init.hidden_size, init.num_layers, init.num_heads) < 1:
      raise ValueError(
          "the config has no model shape: set config.model.path to an HF "
          "folder, pass --model_config=<config.json>, or fill config.model.init"
      )
    cfg = qwen3.Qwen3Config.from_init(init)
  return dataclasses.replace(
      cfg,
      attention=config.model.attention,
      attention_chunk=config.model.attention_chunk,
      experts_impl=config.model.experts_impl,
  )


# ------------------------------------------------------------------------- name mapping


# Our layer param -> (HF name template, HF shape, HF->ours fn, ours->HF fn). Attention and
# norms are in every layer; the dense feed-forward in dense layers; the router and the
# experts ("{e}" in the name: one tensor an expert) in sparse layers.
def _layer_table(cfg: qwen3.Qwen3Config):
  D, H = cfg.hidden_size, cfg.head_dim
  N, K = cfg.num_heads, cfg.num_kv_heads
  p = "model.layers.{i}."
  ident = lambda w: w
  qkv_in = lambda n: (lambda w: w.reshape(n, H, D).transpose(2, 0, 1))  # [n*H, D] -> [D, n, H]
  qkv_out = lambda w: w.transpose(1, 2, 0).reshape(-1, D)  # [D, n, H] -> [n*H, D]
  return {
      "attn_norm": (p + "input_layernorm.weight", (D,), ident, ident),
      "q": (p + "self_attn.q_proj.weight", (N * H, D), qkv_in(N), qkv_out),
      "k": (p + "self_attn.k_proj.weight", (K * H, D), qkv_in(K), qkv_out),
      "v": (p + "self_attn.v_proj.weight", (K * H, D), qkv_in(K), qkv_out),
      "o": (
          p + "self_attn.o_proj.weight",
          (D, N * H),
          lambda w: w.reshape(D, N, H).transpose(1, 2, 0),
          lambda w: w.transpose(2, 0, 1).reshape(D, N * H),
      ),
      "q_norm": (p + "self_attn.q_norm.weight", (H,), ident, ident),
      "k_norm": (p + "self_attn.k_norm.weight", (H,), ident, ident),
      "mlp_norm": (p + "post_attention_layernorm.weight", (D,), ident, ident),
  }


def _mlp_table(cfg: qwen3.Qwen3Config, sparse: bool):
  D, F, E, Fe = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.moe_intermediate_size
  p = "model.layers.{i}.mlp."
  t = np.transpose
  if not sparse:
    return {
        "gate": (p + "gate_proj.weight", (F, D), t, t),
        "up": (p + "up_proj.weight", (F, D), t, t),
        "down": (p + "down_proj.weight", (D, F), t, t),
    }
  return {
      "router": (p + "gate.weight", (E, D), t, t),
      "experts_gate": (p + "experts.{e}.gate_proj.weight", (Fe, D), t, t),
      "experts_up": (p + "experts.{e}.up_proj.weight", (Fe, D), t, t),
      "experts_down": (p + "experts.{e}.down_proj.weight", (D, Fe), t, t),
  }


def _stacks(cfg: qwen3.Qwen3Config):
  """(our name, (template, shape, to ours, to HF), the layers it is stacked over)."""
  every = list(range(cfg.num_layers))
  sparse = [i for i in every if layer_runs.is_sparse(cfg, i)]
  dense = [i for i in every if i not in sparse]
  for layers, table in (
      (every, _layer_table(cfg)),
      (dense, _mlp_table(cfg, False)),
      (sparse, _mlp_table(cfg, True)),
  ):
    if layers:
      for ours, entry in table.items():
        yield ours, entry, layers


def _top_table(cfg: qwen3.Qwen3Config):
  D, V = cfg.hidden_size, cfg.vocab_size
  ident = lambda w: w
  table = {
      "embed": ("model.embed_tokens.weight", (V, D), ident, ident),
      "final_norm": ("model.norm.weight", (D,), ident, ident),
  }
  if not cfg.tie_word_embeddings:
    table["lm_head"] = ("lm_head.weight", (V, D), np.transpose, np.transpose)
  return table


# ---------------------------------------------------------------------------- reading


class ModelError(InputError, ValueError):
  """A model folder whose files are not a Qwen3 checkpoint; the message names the file."""


class _TensorReader:
  """Looks tensors up by name across the safetensors files of one folder."""

  def __init__(self, path: Path):
    index = path / INDEX_NAME
    if index.is_file():
      try:
        with open(index, encoding="utf-8") as f:
          weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
          raise TypeError("weight_map must map tensor names to file names")
      except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ModelError(f"{index} is not a safetensors index: {type(e).__name__}: {e}") from None
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(p.name for p in path.glob("*.safetensors"))
      if not files:
        raise InputFileMissing(
            f"no *.safetensors files (nor {INDEX_NAME}) in model " f"folder {path}"
        )
      weight_map = {}
    self._handles = {}
    for name in files:
      file = path / name
      if not file.is_file():
        raise InputFileMissing(f"{INDEX_NAME} lists {name}, which is missing from {path}")
      try:
        self._handles[name] = safe_open(str(file), framework="numpy")
      except Exception as e:  # pylint: disable=broad-except  # SafetensorError, OSError
        raise ModelError(f"{file} is not a readable safetensors file: {e}") from None
      if not index.is_file():
        weight_map.update({key: name for key in self._handles[name].keys()})
    self._weight_map = weight_map
    self._path = path

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self._weight_map:
      raise ModelError(f"tensor {name!r} is missing from the checkpoint in {self._path}")
    file = self._path / self._weight_map[name]
    try:
      tensor = self._handles[self._weight_map[name]].get_tensor(name)
    except Exception as e:  # pylint: disable=broad-except  # a truncated or corrupt file
      raise ModelError(f"{file}: tensor {name!r} cannot be read: {e}") from None
    if tuple(tensor.shape) != tuple(shape):
      raise ModelError(
          f"tensor {name!r} has shape {tuple(tensor.shape)}, the config " f"implies {tuple(shape)}"
      )
    return tensor


def _np_dtype(dtype) -> np.dtype:
  return (
      np.dtype(ml_dtypes.bfloat16)
      if str(jnp.dtype(dtype)) == "bfloat16"
      else np.dtype(jnp.dtype(dtype))
  )


def load_pretrained(
    path: str | os.PathLike, dtype: Any = "float32", mesh=None, rules=None
) -> tuple[qwen3.Qwen3Config, qwen3.Params]:
  """Reads an HF Qwen3 folder into params of `dtype`, sharded over `mesh` if given."""
  path = Path(path)
  if not path.is_dir():
    raise InputFileMissing(f"model folder {path} does not exist")
  cfg = load_config(path)
  reader = _TensorReader(path)
  np_dtype = _np_dtype(dtype)
  if mesh is not None:
    shardings = qwen3.param_shardings(cfg, mesh, rules or sharding.DEFAULT_RULES, dtype)
  else:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(
        lambda _: device, qwen3.param_logical_axes(cfg), is_leaf=lambda x: isinstance(x, tuple)
    )

  def place(host: np.ndarray, target) -> jax.Array:
    return jax.make_array_from_callback(host.shape, target, lambda idx: host[idx])

  params: dict[str, Any] = {"layers": {}}
  for ours, (name, shape, to_ours, _) in _top_table(cfg).items():
    params[ours] = place(to_ours(reader.get(name, shape)).astype(np_dtype), shardings[ours])
  for ours, (template, shape, to_ours, _), layers in _stacks(cfg):
    experts = range(cfg.num_experts) if "{e}" in template else [None]
    stacked = None
    for j, i in enumerate(layers):
      for e in experts:
        one = to_ours(reader.get(template.format(i=i, e=e), shape)).astype(np_dtype)
        if stacked is None:
          stacked = np.empty(
              (len(layers),) + ((len(experts),) if e is not None else ()) + one.shape, np_dtype
          )
        stacked[j if e is None else (j, e)] = one
    params["layers"][ours] = place(stacked, shardings["layers"][ours])
    del stacked
  return cfg, params


# ---------------------------------------------------------------------------- writing


def _hf_tensors(cfg: qwen3.Qwen3Config, params: qwen3.Params):
  """Yields (HF name, numpy array) one tensor at a time."""
  for ours, (name, _, _, to_hf) in _top_table(cfg).items():
    if ours == "final_norm":
      continue
    yield name, np.ascontiguousarray(to_hf(to_host(params[ours])))
  for ours, (template, _, _, to_hf), layers in _stacks(cfg):
    for j, i in enumerate(layers):
      layer = to_host(params["layers"][ours][j])
      if "{e}" not in template:
        yield template.format(i=i), np.ascontiguousarray(to_hf(layer))
        continue
      for e in range(cfg.num_experts):
        yield template.format(i=i, e=e), np.ascontiguousarray(to_hf(layer[e]))
  yield "model.norm.weight", to_host(params["final_norm"])


def save_pretrained(
    path: str | os.PathLike,
    cfg: qwen3.Qwen3Config,
    params: qwen3.Params,
    max_shard_bytes: int = 2 << 30,
    extra_config: dict[str, Any] | None = None,
) -> None:
  """Writes config.json and safetensors (sharded past `max_shard_bytes`) for transformers.

  In a multi-host run every process calls it (params are gathered tensor by tensor, a
  collective) and process 0 alone writes.
  """
  if jax.process_index() != 0:
    for _ in _hf_tensors(cfg, params):
      pass
    return
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  dtype = str(params["embed"].dtype)
  umask = os.umask(0)
  os.umask(umask)
  mode = 0o666 & ~umask  # what a plain open() gives (0644 under the usual umask 022)
  with open(path / CONFIG_NAME, "w", encoding="utf-8") as f:
    json.dump(config_to_hf(cfg, dtype, extra_config), f, indent=2)

  shards: list[tuple[str, list[str]]] = []
  pending: dict[str, np.ndarray] = {}
  pending_bytes = total_bytes = 0

  def flush():
    nonlocal pending, pending_bytes
    tmp_name = f"shard-{len(shards):05d}.tmp"
    save_file(pending, str(path / tmp_name), metadata={"format": "pt"})
    os.chmod(path / tmp_name, mode)  # safetensors writes 0600; a model folder is shared
    shards.append((tmp_name, list(pending)))
    pending, pending_bytes = {}, 0

  for name, tensor in _hf_tensors(cfg, params):
    if pending and pending_bytes + tensor.nbytes > max_shard_bytes:
      flush()
    pending[name] = tensor
    pending_bytes += tensor.nbytes
    total_bytes += tensor.nbytes
  flush()

  for stale in [*path.glob("*.safetensors"), path / INDEX_NAME]:
    stale.unlink(missing_ok=True)
  if len(shards) == 1:
    os.replace(path / shards[0][0], path / SINGLE_NAME)
    return
  weight_map = {}
  for i, (tmp_name, names) in enumerate(shards):
    final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    os.replace(path / tmp_name, path / final)
    weight_map.update({n: final for n in names})
  with open(path / INDEX_NAME, "w", encoding="utf-8") as f:
    json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
