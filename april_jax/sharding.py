"""One device mesh and the rules that place every array on it.

The mesh has three axes, `data`, `fsdp` and `tensor` (sizes from the config; -1 takes
the devices left). Arrays name their dimensions with logical axes (`embed`, `heads`,
`batch`, ...); an ordered list of rules maps each logical axis to mesh axes:

    ("embed", "fsdp")            # shard the hidden dim of weights over fsdp
    ("heads", "tensor")          # attention heads over tensor (Megatron style)
    ("batch", ("data", "fsdp"))  # batch-like dims over data and fsdp

A mesh axis is used once per array (later dims skip axes already taken), and a dim
whose size does not divide by its mesh axes stays replicated (logged once), so one
rule set serves every model size.

Two rule sets, one mesh:
  TRAIN_RULES   (the default) the learner's float32 master weights, FSDP x tensor:
                weights' hidden dim over fsdp, heads / MLP / vocab over tensor;
                activations' batch over data x fsdp.
  DECODE_RULES  the sampler's 16-bit copy of the same weights, cast once per update:
                tensor parallel over fsdp x tensor (heads, KV heads, MLP, vocab), hidden
                dim whole, slots over data. A decode step then moves activations
                (all-reduces of [slots, hidden]) instead of all-gathering the weights
                as FSDP would at every token, and each device keeps the KV of its heads.
Inside the model, `constrain(x, logical_axes)` pins activations to the rules of the
program being traced (`activation_rules`), so XLA never guesses their layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from typing import Any, Sequence

from absl import logging
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", None),
    ("layers", None),
    ("head_dim", None),
    ("norm", None),
    ("cache_seq", None),
    ("seq", None),
)

TRAIN_RULES = DEFAULT_RULES

DECODE_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", "data"),
    ("vocab", ("fsdp", "tensor")),
    ("heads", ("fsdp", "tensor")),
    ("kv_heads", ("fsdp", "tensor")),
    ("mlp", ("fsdp", "tensor")),
    ("experts", None),
    ("embed", None),
    ("layers", None),
    ("head_dim", None),
    ("norm", None),
    ("cache_seq", None),
    ("seq", None),
)

_warned: set[tuple] = set()
_active = threading.local()  # (mesh, rules) of the program being traced, or None


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Replaces a single -1 by the devices left; checks the product."""
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(MESH_AXES):
    raise ValueError(f"mesh shape {shape} must have {len(MESH_AXES)} entries {MESH_AXES}")
  if shape.count(-1) > 1:
    raise ValueError(f"mesh shape {shape}: at most one entry may be -1")
  if any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh shape {shape}: entries must be positive or -1")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"mesh shape {shape} does not divide {num_devices} devices")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(f"mesh shape {shape} uses {math.prod(shape)} devices but {num_devices} exist")
  return shape


def make_mesh(shape: Sequence[int] = (1, -1, 1), devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all devices)."""
  devices = jax.devices() if devices is None else list(devices)
  shape = resolve_mesh_shape(shape, len(devices))
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # sharding by annotation, as XLA's
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
  except (AssertionError, NotImplementedError, ValueError):  # a topology it cannot lay out
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def logical_to_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules=DEFAULT_RULES
) -> PartitionSpec:
  """The PartitionSpec for an array with these logical axes and this shape."""
  rule_map = dict(rules)
  used: set[str] = set()
  spec = []
  for name, size in zip(logical_axes, shape):
    target = rule_map.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    span = math.prod(mesh.shape[a] for a in axes)
    if axes and size % span:
      key = (name, size, axes)
      if key not in _warned:
        _warned.add(key)
        logging.warning(
            "logical axis %r of size %d does not divide mesh axes %s (%d); " "replicating it",
            name,
            size,
            axes,
            span,
        )
      axes = ()
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


def shards(logical: str, mesh: Mesh | None, rules=DEFAULT_RULES) -> int:
  """How many ways the rules split a logical axis on the mesh (1 without a mesh)."""
  if mesh is None:
    return 1
  target = dict(rules).get(logical)
  axes = (target,) if isinstance(target, str) else tuple(target or ())
  return math.prod(mesh.shape[a] for a in axes)


def named_shardings(logical_tree, shape_tree, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedShardings for a pytree of arrays (or ShapeDtypeStructs) given logical axes."""
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
  return jax.tree.map(
      lambda axes, leaf: NamedSharding(mesh, logical_to_spec(axes, leaf.shape, mesh, rules)),
      logical_tree,
      shape_tree,
      is_leaf=is_axes,
  )


# ------------------------------------------------------------ activation constraints


@contextlib.contextmanager
def activation_rules(mesh: Mesh | None, rules=DEFAULT_RULES):
  """Within this block, `constrain` pins activations to `rules` on `mesh`."""
  previous = getattr(_active, "value", None)
  _active.value = None if mesh is None else (mesh, tuple(rules))
  try:
    yield
  finally:
    _active.value = previous


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """x with a sharding constraint from the active rules; x itself when none is active."""
  active = getattr(_active, "value", None)
  if active is None:
    return x
  mesh, rules = active
  spec = logical_to_spec(logical_axes, x.shape, mesh, rules)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def active_shards(logical: str) -> int:
  """How many ways the active rules split a logical axis (1 outside activation_rules)."""
  active = getattr(_active, "value", None)
  return 1 if active is None else shards(logical, *active)


def traced_under(fn, mesh: Mesh | None, rules=DEFAULT_RULES):
  """fn, traced (by jit) with `activation_rules(mesh, rules)` active."""
  if mesh is None:
    return fn

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with activation_rules(mesh, rules):
      return fn(*args, **kwargs)

  return wrapped


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a run's arrays live: the learner's mesh and axis rules, the rollout's mesh and
  the sampler's rules. Colocated (mesh.rollout_devices = 0) the two meshes are one; split,
  the rollout has the last rollout_devices devices (its shape mesh.rollout_shape) and
  the learner the rest (its shape mesh.shape): process 0, which writes the run's files,
  is a learner wherever the sides are on different processes."""

  mesh: Any
  rules: tuple
  decode_rules: tuple
  rollout_mesh: Any = None  # None: the learner's mesh

  @property
  def split(self) -> bool:
    return self.rollout_mesh is not None

  @property
  def decode_mesh(self):
    return self.mesh if self.rollout_mesh is None else self.rollout_mesh

  @classmethod
  def from_config(cls, config) -> "Placement":
    k = int(config.mesh.rollout_devices)
    devices = jax.devices()
    rollout_mesh = None
    if k:
      rollout_mesh = make_mesh(tuple(config.mesh.rollout_shape), devices[-k:])
      devices = devices[:-k]
    return cls(
        make_mesh(tuple(config.mesh.shape), devices),
        tuple(tuple(r) for r in config.mesh.rules),
        tuple(tuple(r) for r in config.mesh.decode_rules),
        rollout_mesh,
    )
