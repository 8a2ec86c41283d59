"""The `model` section: an HF folder or a random init, its dtypes and attention."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class InitSettings:
  """model.init: the shapes of a random init (no model.path), by config.json's names."""

  vocab_size: int = 0  # Qwen3's shape; 0 = unset (a random init needs it: tiny.py)
  hidden_size: int = 0  # Qwen3's shape
  intermediate_size: int = 0  # Qwen3's shape
  num_layers: int = 0  # Qwen3's shape
  num_heads: int = 0  # Qwen3's shape
  num_kv_heads: int = 0  # Qwen3's shape
  head_dim: int = 0  # Qwen3's shape
  rope_theta: float = 1e6  # as config.json's
  rms_norm_eps: float = 1e-6  # as config.json's
  tie_word_embeddings: bool = True  # as config.json's
  std: float = 0.02  # the normal init's standard deviation


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  path: str = ""  # HF folder (config.json + safetensors); "" = random init
  tokenizer_path: str = ""  # default: model.path
  # Compute dtype: float32 | bfloat16 (master weights and AdamW moments are float32 always).
  dtype: str = "float32"
  kv_dtype: str = "float32"  # the sampler's KV cache: float32 | bfloat16
  remat: bool = False  # rematerialise layers in the update
  attention: str = "auto"  # auto | dense | blockwise | cudnn (models/attention.py)
  attention_chunk: int = 512  # keys per block of blockwise attention
  init: InitSettings = dataclasses.field(default_factory=InitSettings)
