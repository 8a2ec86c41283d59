"""Lower bounds on the phases of an RL step: this machine's ceilings, measured, and the
work each phase must do (bytes moved, FLOPs), counted from the model's shape.

Ceilings (measured in the run that uses them):
  copy        device copy bandwidth, bytes read + written per second (common.copy_gbps)
  matmul      FLOP/s of one jitted square matmul in the compute dtype (4096^3 on an
              accelerator, 512^3 on a CPU), best of a few rounds of several calls
  disk        bytes per second of a file of random bytes written and fsync'd
  host copy   numpy's copy of a 64 MiB array, bytes read + written per second

Work:
  FLOPs of a forward pass over sequences of lengths n:
    2 x body params x tokens            the matmuls of every layer (body params: all
                                        but the embedding and the logits head, of a
                                        mixture of experts a token's own k; the norms,
                                        a rounding error, are counted in)
    + 2 x layers x heads x head_dim x n(n+1) for each sequence
                                        causal attention, QK^T and PV: query i reads i+1
                                        keys, 2 FLOPs a multiply-add, twice
    + 2 x hidden x vocab x tokens       the logits head (not in a prefill, which only
                                        writes KV)
  The learner's passes: each logprob pass (the old policy, the reference) is one forward;
  each PPO epoch's gradients are 3 forwards (forward + backward), plus one more forward of
  the body and attention when layers are rematerialised; 2 with LoRA's frozen base.
  KV bytes a position holds: 2 (keys and values) x layers x KV heads x head_dim x bytes.
  A decode step reads the weights once (of a mixture of experts, the experts its tokens
  touch: decode_params_read) and each live sequence's KV.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.benchmarks import common
from april_jax.models import qwen3


def matmul_flops_per_s(dtype: str, size: int | None = None, rounds: int = 3, calls: int = 10):
  """FLOP/s of a jitted size^3 matmul in `dtype`: `calls` back-to-back calls timed
  together (so dispatch overlaps the work), best of `rounds`."""
  if size is None:
    size = 512 if jax.default_backend() == "cpu" else 4096
  a, b = (jax.random.normal(jax.random.key(i), (size, size), jnp.dtype(dtype)) for i in range(2))
  matmul = jax.jit(jnp.matmul)
  jax.block_until_ready(matmul(a, b))
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    jax.block_until_ready([matmul(a, b) for _ in range(calls)])
    best = min(best, (time.perf_counter() - start) / calls)
  return 2 * size**3 / best


def disk_bytes_per_s(directory: str, nbytes: int | None = None) -> float:
  """Bytes per second of `nbytes` random bytes written to a file in `directory` and
  fsync'd (256 MiB on an accelerator's host, 32 MiB on a CPU); the file is removed."""
  if nbytes is None:
    nbytes = (32 if jax.default_backend() == "cpu" else 256) << 20
  data = np.random.default_rng(0).bytes(nbytes)
  path = os.path.join(directory, "disk_rate.bin")
  try:
    start = time.perf_counter()
    with open(path, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    return nbytes / (time.perf_counter() - start)
  finally:
    if os.path.exists(path):
      os.remove(path)


def host_copy_bytes_per_s(nbytes: int = 1 << 26, rounds: int = 3) -> float:
  """numpy's copy of an `nbytes` array on the host: bytes read + written per second."""
  src = np.ones(nbytes, np.uint8)
  dst = np.empty_like(src)
  seconds, _ = common.best_of(rounds, lambda: np.copyto(dst, src))
  return 2 * nbytes / seconds


def measure_ceilings(directory: str, dtype: str) -> dict[str, float]:
  """This machine's ceilings, in bytes/s and FLOP/s."""
  return {
      "copy_bytes_per_s": common.copy_gbps() * 1e9,
      "matmul_flops_per_s": matmul_flops_per_s(dtype),
      "disk_bytes_per_s": disk_bytes_per_s(directory),
      "host_copy_bytes_per_s": host_copy_bytes_per_s(),
  }


def body_params(cfg: qwen3.Qwen3Config) -> int:
  """Params every token's matmuls use: all but the embedding and the logits head (of a
  mixture-of-experts model's experts, a token's own k)."""
  vocab_d = cfg.vocab_size * cfg.hidden_size
  return cfg.num_params(active=True) - vocab_d * (1 if cfg.tie_word_embeddings else 2)


def decode_params_read(cfg: qwen3.Qwen3Config, batch: int) -> float:
  """Params one decode step of `batch` tokens reads: all of a dense model's; of a
  mixture-of-experts model's experts, those its tokens touch, E (1 - (1 - k/E)^batch) a
  sparse layer in expectation when tokens route uniformly."""
  if not cfg.num_experts:
    return float(cfg.num_params())
  E, k = cfg.num_experts, cfg.num_experts_per_tok
  touched = E * (1.0 - (1.0 - k / E) ** batch)
  one_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
  return cfg.num_params() - cfg.sparse_layers * (E - touched) * one_expert


def head_flops(cfg: qwen3.Qwen3Config, tokens: float) -> float:
  """The logits head's FLOPs over `tokens` tokens, forward."""
  return 2.0 * cfg.hidden_size * cfg.vocab_size * tokens


def body_flops(cfg: qwen3.Qwen3Config, lengths) -> float:
  """Forward FLOPs of the layers (matmuls and causal attention) over sequences of
  `lengths` tokens; no logits head."""
  n = np.asarray(lengths, np.float64)
  attention = 2.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * float((n * (n + 1)).sum())
  return 2.0 * body_params(cfg) * float(n.sum()) + attention


def learner_flops(
    cfg: qwen3.Qwen3Config,
    lengths,
    logprob_passes: int,
    epochs: int,
    remat: bool,
    frozen_base: bool = False,
) -> float:
  """FLOPs of one update over sequences of `lengths` tokens: `logprob_passes` forwards,
  then `epochs` gradient passes (3 forwards; the body once more when rematerialised).
  With a frozen base (LoRA) a gradient pass is 2 forwards: no weight gradients, only the
  activations' (the adapters' own FLOPs, rank / width of the body's, are left out)."""
  body = body_flops(cfg, lengths)
  head = head_flops(cfg, float(np.sum(lengths)))
  passes = 2 if frozen_base else 3
  return logprob_passes * (body + head) + epochs * ((passes + int(remat)) * body + passes * head)


def kv_bytes_per_position(cfg: qwen3.Qwen3Config, kv_dtype: str) -> int:
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(kv_dtype).itemsize


def tree_bytes(tree) -> int:
  return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def folder_bytes(path: str) -> int:
  """Bytes of the files under `path`."""
  return sum(
      os.path.getsize(os.path.join(root, name))
      for root, _, files in os.walk(path)
      for name in files
  )
