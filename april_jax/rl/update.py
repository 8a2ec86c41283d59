"""The learner: jitted policy-gradient updates of the very params the sampler decodes with.

One RL step's batch (rl/batch.py) goes through:
  1. old logprobs: the learner's logprobs under the params before this step's updates,
     in chunks over the sequence (never [B, T, vocab]) and in microbatches;
  2. ppo_epochs x num_minibatches optimizer updates, each the sum of num_microbatches
     gradient evaluations (lax.scan), aggregated with the whole minibatch's token and
     sequence counts so accumulation equals one big batch;
  3. a guard: a non-finite loss or gradient skips the update (params and optimizer state
     kept) and is counted.
Params and optimizer state are donated and come back in the shardings they went in: the
sampler keeps decoding with the same arrays, nothing is resharded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from april_jax import sharding
from april_jax.distributed import to_host
from april_jax.models import qwen3
from april_jax.rl import losses


def loss_config(train) -> losses.LossConfig:
  """LossConfig from the config's train section (0 means off for optional knobs)."""
  return losses.LossConfig(
      policy_loss=train.policy_loss, eps_clip=train.eps_clip,
      eps_clip_high=train.eps_clip_high or None, dual_clip_c=train.dual_clip_c or None,
      aggregation=train.aggregation, norm_len=int(train.norm_len),
      kl_coef=train.kl_coef, kl_type=train.kl_type, entropy_coef=train.entropy_coef,
      tis_cap=train.tis_cap or None, mask_stale_tokens=train.mask_stale_tokens)


def make_schedule(train, total_updates: int) -> optax.Schedule:
  warmup = int(train.warmup_steps)
  if train.lr_schedule == "constant":
    main = optax.constant_schedule(train.lr)
  elif train.lr_schedule == "cosine":
    main = optax.cosine_decay_schedule(train.lr, max(total_updates - warmup, 1),
                                       alpha=train.min_lr_ratio)
  else:
    raise ValueError(f"train.lr_schedule must be 'constant' or 'cosine', got "
                     f"{train.lr_schedule!r}")
  if warmup <= 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, train.lr, warmup), main], [warmup])


def make_optimizer(train, total_updates: int) -> tuple[optax.GradientTransformation,
                                                       optax.Schedule]:
  schedule = make_schedule(train, total_updates)
  chain = []
  if train.max_grad_norm > 0:
    chain.append(optax.clip_by_global_norm(train.max_grad_norm))
  chain.append(optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=1e-8,
                           weight_decay=train.weight_decay))
  return optax.chain(*chain), schedule


def _split(x: np.ndarray, parts: int) -> np.ndarray:
  """[B, ...] -> [parts, B // parts, ...]."""
  return x.reshape((parts, x.shape[0] // parts) + x.shape[1:])


@dataclasses.dataclass(frozen=True)
class _Static:
  model: qwen3.Qwen3Config
  loss: losses.LossConfig
  chunk: int
  temperature: float
  remat: bool


def _logprobs(static: _Static, params, tokens_MxbxT, targets_MxbxT):
  """Logprobs and entropy for microbatches [M, b, T], one microbatch at a time."""
  fn = lambda xs: qwen3.token_logprobs(static.model, params, xs[0], xs[1],
                                       chunk_size=static.chunk,
                                       temperature=static.temperature)
  return jax.lax.map(fn, (tokens_MxbxT, targets_MxbxT))


def _minibatch_update(static: _Static, optimizer, params, opt_state, mb: dict[str, Any]):
  """One optimizer update from microbatches [M, b, T]; skipped if anything is non-finite."""
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  total_tokens, total_seqs = losses.batch_totals(
      losses.effective_mask(static.loss, flat(mb["mask"]), flat(mb["stale"])))

  def micro_loss(p, micro):
    logp, entropy = qwen3.token_logprobs(static.model, p, micro["tokens"], micro["targets"],
                                         chunk_size=static.chunk,
                                         temperature=static.temperature, remat=static.remat)
    return losses.policy_loss(
        static.loss, logp, micro["old_logp"], micro["advantages"], micro["mask"],
        behavior_logp_BxT=micro["behavior"], ref_logp_BxT=micro.get("ref_logp"),
        entropy_BxT=entropy, stale_BxT=micro["stale"], total_tokens=total_tokens,
        total_seqs=total_seqs)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def accumulate(carry, micro):
    grads, loss_sum = carry
    (loss, metrics), g = grad_fn(params, micro)
    return (jax.tree.map(jnp.add, grads, g), loss_sum + loss), metrics

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grads, loss), metrics = jax.lax.scan(accumulate, (zeros, jnp.zeros(())), mb)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  # Each microbatch's metrics are its share of the minibatch's: they add up.
  out = {k: jnp.sum(v) for k, v in metrics.items()}
  out.update(loss=loss, grad_norm=grad_norm, finite=finite)
  return keep(new_params, params), keep(new_opt_state, opt_state), out


class Learner:
  """Holds params, optimizer state and the (optional) reference params; updates them."""

  def __init__(self, model_cfg: qwen3.Qwen3Config, params, train, temperature: float,
               total_updates: int, mesh=None, rules=sharding.DEFAULT_RULES,
               remat: bool = False):
    self.train = train
    self.loss_cfg = loss_config(train)
    self.static = _Static(model_cfg, self.loss_cfg, int(train.logprob_chunk),
                          float(temperature) if temperature > 0 else 1.0, remat)
    self.optimizer, self.schedule = make_optimizer(train, total_updates)
    self.mesh, self.rules = mesh, rules
    self.params = params
    self.opt_state = jax.jit(self.optimizer.init)(params)
    if mesh is not None:  # scalars (step counts) come back on one device: replicate them
      replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      self.opt_state = jax.tree.map(
          lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
          else jax.device_put(x, replicated), self.opt_state)
    # No reference params are held unless a KL term needs them.
    self.ref_params = (jax.tree.map(jnp.copy, params) if train.kl_coef > 0 else None)
    self.updates = 0
    self.skipped_updates = 0
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_sh = jax.tree.map(lambda x: x.sharding, self.opt_state)
    self._logprobs = jax.jit(functools.partial(_logprobs, self.static))
    self._update = jax.jit(
        functools.partial(_minibatch_update, self.static, self.optimizer),
        donate_argnums=(0, 1), out_shardings=(param_sh, opt_sh, None))

  def _put(self, x: np.ndarray):
    """Places [M, b, ...] arrays with b over the batch axes of the mesh."""
    if self.mesh is None:
      return jnp.asarray(x)
    axes = (None, "batch") + ("seq",) * (x.ndim - 2)
    spec = sharding.logical_to_spec(axes, x.shape, self.mesh, self.rules)
    return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, spec))

  def warm_up(self, batch_size: int, lengths) -> None:
    """Compiles the update for each padded length, on copies (params are untouched).

    Needs memory for a second copy of params and optimizer state while it runs.
    """
    for T in lengths:
      zeros_i = np.zeros((batch_size, T), np.int32)
      zeros_f = np.zeros((batch_size, T), np.float32)
      batch = {"tokens": zeros_i, "targets": zeros_i, "mask": zeros_f, "behavior": zeros_f,
               "stale": np.zeros((batch_size, T), bool),
               "advantages": np.zeros((batch_size,), np.float32)}
      saved = self.params, self.opt_state, self.updates, self.skipped_updates
      self.params = jax.tree.map(jnp.copy, saved[0])
      self.opt_state = jax.tree.map(jnp.copy, saved[1])
      try:
        self.update(batch)
      finally:
        self.params, self.opt_state, self.updates, self.skipped_updates = saved

  def logprobs(self, params, batch: dict[str, np.ndarray]) -> np.ndarray:
    M = self.train.num_microbatches * self.train.num_minibatches
    logp, _ = self._logprobs(params, self._put(_split(batch["tokens"], M)),
                             self._put(_split(batch["targets"], M)))
    return to_host(logp).reshape(batch["tokens"].shape)

  def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """All of one RL step's optimizer updates; returns train/* metrics."""
    t = self.train
    B = batch["tokens"].shape[0]
    if B % (t.num_minibatches * t.num_microbatches):
      raise ValueError(f"batch of {B} samples does not split into train.num_minibatches="
                       f"{t.num_minibatches} x train.num_microbatches={t.num_microbatches}")
    old_logp = self.logprobs(self.params, batch)
    batch = dict(batch, old_logp=old_logp)
    if self.ref_params is not None:
      batch["ref_logp"] = self.logprobs(self.ref_params, batch)
    same_version = (batch["mask"] > 0) & ~batch["stale"]
    diff = np.abs(batch["behavior"] - old_logp)[same_version]
    metrics: list[dict] = []
    for _ in range(t.ppo_epochs):
      for mb_index in range(t.num_minibatches):
        mb = {k: _split(v, t.num_minibatches)[mb_index] for k, v in batch.items()}
        mb = {k: self._put(_split(v, t.num_microbatches)) for k, v in mb.items()}
        lr = float(self.schedule(self.updates))
        self.params, self.opt_state, m = self._update(self.params, self.opt_state, mb)
        m = to_host(m)
        if bool(m["finite"]):
          self.updates += 1
        else:
          self.skipped_updates += 1
        m["lr"] = lr
        metrics.append(m)
    mean = lambda k: float(np.mean([m[k] for m in metrics]))
    return {
        "train/loss": mean("loss"), "train/pg_loss": mean("pg_loss"),
        "train/pg_clipfrac": mean("pg_clipfrac"), "train/kl": mean("kl"),
        "train/entropy": mean("entropy"), "train/grad_norm": mean("grad_norm"),
        "train/lr": mean("lr"), "train/ratio_mean": mean("ratio_mean"),
        "train/tis_mean": mean("tis_mean"),
        "train/logprob_diff_mean": float(diff.mean()) if diff.size else 0.0,
        "train/skipped_updates": float(self.skipped_updates),
        "train/updates": float(self.updates),
    }
