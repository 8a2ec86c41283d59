"""The training step the learner (rl/update.py) and PPO's critic (rl/critic.py) share.

Each trains float32 master params on a loss of its own, beside frozen weights it only
reads (a LoRA run's base model; None in a full fine-tune); the rest is this module's:

  optimizer  clipped AdamW that skips (and counts) an update whose gradient is not
             finite, its learning-rate schedule, its state sharded like the params.
  programs   `build_programs`, from shapes alone: a forward pass over microbatches
             [M, b, T] one at a time (lax.map); the gradients of microbatches added to a
             running sum (lax.scan, one buffer carried through every call), with the
             whole minibatch's totals so the sum equals one big batch's; the optimizer
             update from the summed gradients. Params and optimizer state are donated
             and come back in the shardings they went in.
  host       `TrainedModel`: a batch laid out in pieces (rl/layout.py), each placed on the
             mesh; a forward pass over them gathered back to [B, T]; ppo_epochs x
             num_minibatches optimizer updates of a `ModelState`, each one gradient call
             per piece into one buffer, then the update.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from april_jax import sharding
from april_jax.runtime.distributed import to_host
from april_jax.rl import layout

# ------------------------------------------------------------------------ optimizer


def make_schedule(train, total_updates: int) -> optax.Schedule:
  warmup = int(train.warmup_steps)
  if train.lr_schedule == "constant":
    main = optax.constant_schedule(train.lr)
  elif train.lr_schedule == "cosine":
    main = optax.cosine_decay_schedule(
        train.lr, max(total_updates - warmup, 1), alpha=train.min_lr_ratio
    )
  else:
    raise ValueError(
        f"train.lr_schedule must be 'constant' or 'cosine', got " f"{train.lr_schedule!r}"
    )
  if warmup <= 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, train.lr, warmup), main], [warmup])


def make_optimizer(
    train, total_updates: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Clipped AdamW that skips (and counts) every update whose gradient is not finite."""
  schedule = make_schedule(train, total_updates)
  chain = []
  if train.max_grad_norm > 0:
    chain.append(optax.clip_by_global_norm(train.max_grad_norm))
  if train.moments_dtype == "float32":
    chain.append(
        optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=1e-8, weight_decay=train.weight_decay)
    )
  else:
    chain += [
        scale_by_adam_stored_in(train.moments_dtype, train.b1, train.b2, 1e-8),
        optax.add_decayed_weights(train.weight_decay),
        optax.scale_by_learning_rate(schedule),
    ]
  # Never give up skipping: a run of non-finite steps must not be applied after N of them.
  return optax.apply_if_finite(optax.chain(*chain), max_consecutive_errors=2**30), schedule


def scale_by_adam_stored_in(dtype, b1: float, b2: float, eps: float):
  """Adam's scaling (optax.scale_by_adam's numbers) with both moments stored in `dtype`
  (train.moments_dtype): each update computes in float32 and rounds the new moments to
  `dtype` to keep. bfloat16 halves the moments' memory, the largest of a learner's arrays
  (twice the float32 masters)."""
  dtype = jnp.dtype(dtype)

  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, dtype)
    return optax.ScaleByAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(zeros, params),
        nu=jax.tree.map(zeros, params),
    )

  def update(updates, state, params=None):
    del params
    f32 = lambda x: x.astype(jnp.float32)
    mu = jax.tree.map(lambda m, g: b1 * f32(m) + (1 - b1) * f32(g), state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * f32(v) + (1 - b2) * jnp.square(f32(g)), state.nu, updates)
    count = optax.safe_increment(state.count)
    c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
    out = jax.tree.map(
        lambda m, v, g: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype), mu, nu, updates
    )
    keep = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
    return out, optax.ScaleByAdamState(count=count, mu=keep(mu), nu=keep(nu))

  return optax.GradientTransformation(init, update)


def optimizer_shardings(optimizer: optax.GradientTransformation, params, param_sh, mesh):
  """The optimizer state's shardings: each moment like its param, scalars replicated."""
  shapes = jax.eval_shape(optimizer.init, params)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return optax.tree_map_params(
      optimizer, lambda _, sh: sh, shapes, param_sh, transform_non_params=lambda _: replicated
  )


def cast(params, dtype):
  """params in dtype (floating leaves only)."""
  return jax.tree.map(lambda x: x.astype(dtype), params)


# ------------------------------------------------------------------------- programs


def accumulate_grads(micro_loss, params, mb: dict[str, Any], grads):
  """grads plus the gradients in params of micro_loss(params, micro) -> (loss, metrics) over the
  microbatches [M, ...] of mb (lax.scan); the summed loss and metrics. Each microbatch's
  metrics are its share of the minibatch's: they add up."""
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def accumulate(carry, micro):
    grads, loss_sum = carry
    (loss, metrics), g = grad_fn(params, micro)
    return (jax.tree.map(jnp.add, grads, g), loss_sum + loss), metrics

  (grads, loss), metrics = jax.lax.scan(accumulate, (grads, jnp.zeros(())), mb)
  return grads, loss, {k: jnp.sum(v) for k, v in metrics.items()}


def add(a, b):
  return jax.tree.map(jnp.add, a, b)


def zeros_like(tree):
  return jax.tree.map(jnp.zeros_like, tree)


def apply_update(optimizer, schedule, params, opt_state, grads, loss, metrics, attempted):
  """The optimizer update from summed gradients (skipped if they are not finite); its
  metrics, the learning rate it used among them. `attempted`: updates tried before."""
  applied = attempted - opt_state.total_notfinite  # the schedule's step for this update
  updates, opt_state = optimizer.update(grads, opt_state, params)
  out = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), lr=schedule(applied))
  return optax.apply_updates(params, updates), opt_state, out


@dataclasses.dataclass(frozen=True)
class Programs:
  """A trained model's jitted programs and the shardings they pin (None without a mesh).
  A microbatch is a dict of a piece's arrays (layout.Piece.device_arrays), [M, b, T]."""

  param_sh: Any
  opt_sh: Any
  init_opt: Any  # masters -> optimizer state, sharded like them
  forward: Any  # (params, frozen, microbatches) -> the model's outputs, [M, b, T] each
  zeros: Any  # params -> a zero gradient sum, sharded like them
  grads: Any  # (params, frozen, microbatches, totals, grads) -> (grads + theirs, loss, metrics)
  add: Any  # losses and metrics of several calls
  apply: Any  # (params, opt_state, grads, loss, metrics, attempted) -> the update


def build_programs(
    forward: Callable,
    micro_loss: Callable,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    params_shape,
    param_sh,
    mesh=None,
    rules=sharding.TRAIN_RULES,
) -> Programs:
  """The programs of a model whose forward(params, frozen, micro) gives one microbatch's
  outputs [b, T] and whose micro_loss(params, frozen, micro, totals) gives one
  microbatch's (loss, metrics), with `totals` the whole minibatch's (a tuple of scalars,
  as the loss needs). Gradients are taken in params alone; frozen weights are read.
  params_shape: the masters' shapes; param_sh: their shardings (None off a mesh)."""
  if mesh is None:
    opt_sh = None
    pin = lambda sh: {}
  else:
    opt_sh = optimizer_shardings(optimizer, params_shape, param_sh, mesh)
    pin = lambda sh: {"out_shardings": sh}
  traced = lambda fn: sharding.traced_under(fn, mesh, rules)

  def forward_all(params, frozen, mb):
    return jax.lax.map(lambda micro: forward(params, frozen, micro), mb)

  def grads(params, frozen, mb, totals, grads):
    loss = lambda p, micro: micro_loss(p, frozen, micro, totals)
    return accumulate_grads(loss, params, mb, grads)

  def apply(params, opt_state, grads, loss, metrics, attempted):
    return apply_update(optimizer, schedule, params, opt_state, grads, loss, metrics, attempted)

  return Programs(
      param_sh=param_sh,
      opt_sh=opt_sh,
      init_opt=jax.jit(optimizer.init, **pin(opt_sh)),
      forward=jax.jit(traced(forward_all)),
      zeros=jax.jit(zeros_like, **pin(param_sh)),
      grads=jax.jit(traced(grads), donate_argnums=4, **pin((param_sh, None, None))),
      add=jax.jit(add),
      apply=jax.jit(apply, donate_argnums=(0, 1), **pin((param_sh, opt_sh, None))),
  )


# ----------------------------------------------------------------------------- host


def microbatch_sharding(shape, mesh, rules=sharding.TRAIN_RULES):
  """Where microbatch arrays [M, b, ...] live: rows b over the batch axes of the mesh."""
  axes = (None, "batch") + ("seq",) * (len(shape) - 2)
  return jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(axes, shape, mesh, rules))


def place(x: np.ndarray, mesh, rules=sharding.TRAIN_RULES):
  """Places [M, b, ...] arrays with b over the batch axes of the mesh."""
  if mesh is None:
    return jnp.asarray(x)
  return jax.device_put(x, microbatch_sharding(x.shape, mesh, rules))


def piece(batch: dict[str, np.ndarray], p: layout.Piece, mesh, rules) -> dict:
  """A piece's arrays of `batch` (layout.Piece.device_arrays), on the mesh."""
  return {k: place(v, mesh, rules) for k, v in p.device_arrays(batch).items()}


class ModelState(NamedTuple):
  """What one optimizer update changes: float32 master params, their optimizer state and
  the count of updates tried (the skipped ones are counted in the optimizer state). A
  state given to an update is consumed: its arrays are donated."""

  params: Any
  opt_state: Any
  attempted: int


class TrainedModel:
  """A model trained by `programs` beside `frozen` weights it only reads (None if none):
  the learner and the critic are each one. Its updates are functions of a ModelState
  (`minibatch`, `epochs`); the object holds the current one (`model_state()`), which
  checkpoints save. Rows of a call split over min_rows devices."""

  def __init__(
      self, programs: Programs, params, train, mesh=None, rules=sharding.TRAIN_RULES, frozen=None
  ):
    self.programs, self.train, self.mesh, self.rules = programs, train, mesh, rules
    self.min_rows = sharding.shards("batch", mesh, rules)
    self.params, self.frozen = params, frozen
    self.opt_state = programs.init_opt(params)
    self.attempted = 0

  def model_state(self) -> ModelState:
    return ModelState(self.params, self.opt_state, self.attempted)

  def set_model_state(self, state: ModelState) -> None:
    self.params, self.opt_state, self.attempted = state

  def state(self) -> tuple[dict[str, Any], dict]:
    """What a checkpoint keeps: the device arrays (masters, optimizer state with its
    skip count) and the host counter (JSON)."""
    return {"params": self.params, "opt_state": self.opt_state}, {"attempted": self.attempted}

  def restore(self, arrays: dict[str, Any], host: dict) -> None:
    """Back to a `state()` (arrays restored in the shardings of this model's own)."""
    self.params, self.opt_state = arrays["params"], arrays["opt_state"]
    self.attempted = host["attempted"]

  def plan(self, batch: dict[str, np.ndarray]) -> list[list[layout.Piece]]:
    """The batch's layout: per minibatch, its pieces (decided by its mask)."""
    return layout.plan(batch["mask"], self.train, self.min_rows)

  def piece(self, batch: dict[str, np.ndarray], p: layout.Piece) -> dict:
    return piece(batch, p, self.mesh, self.rules)

  def forward_pass(self, params, inputs: dict[str, np.ndarray], pieces, pick=None) -> np.ndarray:
    """The forward program's outputs under params (pick(outputs) of each call, if given)
    over the pieces of `inputs` (its [B, T] arrays the forward reads), gathered back
    into [B, T] float32: 0 where no piece computes a token."""
    outs = []
    for p in pieces:
      out = self.programs.forward(params, self.frozen, self.piece(inputs, p))
      outs.append(out if pick is None else pick(out))
    gathered = np.zeros(inputs["tokens"].shape, np.float32)
    for p, x in zip(pieces, to_host(outs)):
      p.scatter(gathered, x)
    return gathered

  def minibatch(
      self, state: ModelState, batch: dict[str, np.ndarray], pieces, totals: tuple
  ) -> tuple[ModelState, dict]:
    """One optimizer update over one minibatch: its microbatches' gradients summed into
    one buffer (one call per piece), then the update. The new state and its metrics, on
    device."""
    p = self.programs
    grads, acc = p.zeros(state.params), None
    for piece_ in pieces:
      grads, loss, metrics = p.grads(
          state.params, self.frozen, self.piece(batch, piece_), totals, grads
      )
      acc = (loss, metrics) if acc is None else p.add(acc, (loss, metrics))
    params, opt_state, m = p.apply(
        state.params, state.opt_state, grads, *acc, np.int32(state.attempted)
    )
    return ModelState(params, opt_state, state.attempted + 1), m

  def epochs(
      self, state: ModelState, batch: dict[str, np.ndarray], plan, totals: Callable
  ) -> tuple[ModelState, list[dict]]:
    """train.ppo_epochs passes over the plan's minibatches, an optimizer update each;
    totals(rows) gives the loss's totals over a minibatch's batch rows. The new state
    and the updates' metrics, on device."""
    metrics = []
    for _ in range(self.train.ppo_epochs):
      for pieces in plan:
        rows = np.concatenate([p.batch_rows for p in pieces])
        state, m = self.minibatch(state, batch, pieces, totals(rows))
        metrics.append(m)
    return state, metrics
