"""Which decoder layers are sparse (mixture of experts) and how the layer stacks are cut
into runs of one kind, each scanned.

Every layer has attention and two norms, stacked over all L layers. A dense layer's
feed-forward (gate, up, down) is stacked over the dense layers only, a sparse layer's
(router, experts_gate, experts_up, experts_down) over the sparse layers only, so a model
keeps no weight it does not use. A run is a stretch of consecutive layers of one kind:
the model scans each run over its slice of the stacks. A dense model, or a Qwen3-MoE model
whose layers are all sparse (30B-A3B, 235B-A22B), is one run and slices nothing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

DENSE_MLP = ("gate", "up", "down")
EXPERTS = ("router", "experts_gate", "experts_up", "experts_down")


def is_sparse(cfg, layer: int) -> bool:
  """transformers' rule: a layer has experts unless listed in mlp_only_layers, and only
  every decoder_sparse_step-th layer (counting from 1) does."""
  return (
      cfg.num_experts > 0
      and layer not in cfg.mlp_only_layers
      and (layer + 1) % cfg.decoder_sparse_step == 0
  )


class Run(NamedTuple):
  """Layers [start, stop), all sparse or all dense; `first` is the first one's index in
  the stack of its kind (its feed-forward's index)."""

  start: int
  stop: int
  sparse: bool
  first: int


def runs(cfg) -> tuple[Run, ...]:
  """The runs of the model's layers, in order."""
  out: list[Run] = []
  counts = {True: 0, False: 0}
  for layer in range(cfg.num_layers):
    sparse = is_sparse(cfg, layer)
    if out and out[-1].sparse == sparse and out[-1].stop == layer:
      out[-1] = out[-1]._replace(stop=layer + 1)
    else:
      out.append(Run(layer, layer + 1, sparse, counts[sparse]))
    counts[sparse] += 1
  return tuple(out)


def counts(cfg) -> tuple[int, int]:
  """(dense layers, sparse layers)."""
  sparse = sum(is_sparse(cfg, i) for i in range(cfg.num_layers))
  return cfg.num_layers - sparse, sparse


def of_run(cfg, layers: dict[str, Any] | None, run: Run) -> dict[str, Any] | None:
  """The run's slice of a layers tree (the params' or the adapters'): the attention and
  norm stacks at [start, stop), the run's kind of feed-forward at its own indices; the
  other kind left out. Whole arrays where the run spans the stack."""
  if layers is None:
    return None
  n = run.stop - run.start
  dense, sparse = counts(cfg)
  out = {}
  for name, value in layers.items():
    if name in DENSE_MLP or name in EXPERTS:
      if (name in EXPERTS) != run.sparse:
        continue
      whole = (sparse if run.sparse else dense) == n
      out[name] = value if whole else _slice(value, run.first, n)
    else:
      out[name] = value if n == cfg.num_layers else _slice(value, run.start, n)
  return out


def _slice(tree, start: int, n: int):
  return jax.tree.map(lambda a: a[start : start + n], tree)
