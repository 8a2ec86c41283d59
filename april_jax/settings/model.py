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
  # Qwen3-MoE (models/moe.py, docs/moe.md), by config.json's names:
  num_experts: int = 0  # experts in each sparse layer; 0 = a dense model
  num_experts_per_tok: int = 0  # experts a token is routed to (top k)
  moe_intermediate_size: int = 0  # an expert's feed-forward width
  norm_topk_prob: bool = True  # the top k's gates renormalised to sum to one
  decoder_sparse_step: int = 1  # every n-th layer is sparse (counting from 1)
  mlp_only_layers: tuple = ()  # layers kept dense whatever decoder_sparse_step says


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
  # A mixture-of-experts model's experts group their tokens as blocks | ragged (moe.IMPLS).
  experts_impl: str = "blocks"
  # The learner computes each token's experts as the rollout chose them (docs/moe.md).
  routing_replay: bool = True
  init: InitSettings = dataclasses.field(default_factory=InitSettings)
