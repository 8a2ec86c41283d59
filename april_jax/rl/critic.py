"""PPO's learned critic: a Qwen3 backbone with a scalar value head, GAE over the response
tokens, the clipped value loss, and the critic's own optimizer (train.advantage "gae").

The value model is the policy's architecture without its output head: the final-normed
hidden state h_t gives V_t = h_t . w + b (float32). It starts from the policy's weights,
or from train.critic_path (a Hugging Face Qwen3 folder), with w = 0 and b = 0, so its
first values are 0 and its first gradients reach the head only (weight decay, if set,
shrinks the backbone from the first update). Values are indexed like the
policy's batch arrays: V[t] is the value of the state that has read tokens[:t+1], from
which targets[t] (a drawn response token where mask[t] = 1) is drawn.

GAE runs over each sample's drawn tokens k = 1..K in order (a multi-turn episode's
observation tokens are skipped: the environment wrote them, they are not actions):
  delta_k = r_k + gamma V_{k+1} - V_k     (r_K the sample's reward, r_k = 0 before it;
                                           V_{K+1} = 0: the episode ends)
  A_k = delta_k + gamma lambda A_{k+1}    R_k = A_k + V_k, the value target.
With gamma = lambda = 1, A_k = r - V_k. The advantages the policy loss uses are whitened
over the batch's trained tokens when train.gae_whiten: the drawn tokens, less the stale
ones when train.mask_stale_tokens (a mask-mode importance weight drops its tokens later,
as a rejection). train.whitening picks the scale (rl/advantages.py `whiten`): "bessel",
the unbiased variance with 1e-8 inside the root, as verl and slime (the default), or
"population", the population std with eps outside it.

Value loss, a token mean over the trained tokens (c = train.value_clip, 0 = no clip):
  0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)
critic/value_clipfrac counts the tokens where the second term is the larger, as verl's
vf_clipfrac: clip(V, V_old - c, V_old + c) is V itself inside the window, so float
rounding is never counted as clipping (V_old + (V - V_old) need not be V).

Values are computed by the current critic, for the whole batch the step trains, at the
start of the update (V_old above). A partial sample's values from the step that began it
are not kept, for three reasons: the sampler never runs the critic (decode pays for the
policy only, and the slot state holds no values); GAE telescopes only if every V_k comes
from one critic, and the critic has been updated since those tokens were drawn; and the
value clip is a trust region around the critic being trained, which an older critic's
values are not. The price is one forward pass of the critic per trained sample and
step, the same as the policy's old-logprob pass.

The critic trains as the learner does, by rl/step.py's step (the same layout of samples in
the calls, gradient accumulation and optimizer), on the value loss, at train.critic_lr.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from april_jax import sharding
from april_jax.runtime.distributed import to_host
from april_jax.errors import InputError
from april_jax.models import hf_io, qwen3
from april_jax.models import lora as lora_lib
from april_jax.rl import step
from april_jax.rl import update as update_lib

HEAD = "value_head"


def critic_params(policy_params, cfg: qwen3.Qwen3Config):
  """A critic from a policy's params: its backbone (no output head), a zero value head."""
  params = {k: v for k, v in policy_params.items() if k != "lm_head"}
  dtype = params["final_norm"].dtype
  params[HEAD] = {"w": jnp.zeros((cfg.hidden_size,), dtype), "b": jnp.zeros((), dtype)}
  return params


def load_backbone(
    path: str, cfg: qwen3.Qwen3Config, mesh=None, rules=sharding.TRAIN_RULES, dtype="float32"
):
  """The params of a Hugging Face Qwen3 folder (train.critic_path) to start a critic from;
  an InputError unless it has the policy's architecture and vocabulary (its output head,
  tied or not, is dropped)."""
  found = hf_io.load_config(path)
  shape = lambda c: [getattr(c, f) for f in hf_io.SHAPE_FIELDS]
  if shape(found) != shape(cfg):
    raise InputError(
        f"train.critic_path {path!r} holds a model of another shape than the policy's "
        f"({found} against {cfg}): the critic shares the policy's architecture and vocabulary"
    )
  return hf_io.load_pretrained(path, dtype, mesh, rules)[1]


def logical_axes(cfg: qwen3.Qwen3Config):
  axes = {k: v for k, v in qwen3.param_logical_axes(cfg).items() if k != "lm_head"}
  axes[HEAD] = {"w": ("norm",), "b": ()}
  return axes


def param_shardings(cfg: qwen3.Qwen3Config, mesh, rules=sharding.TRAIN_RULES):
  shapes = jax.eval_shape(lambda: critic_params(qwen3.init_params(cfg, jax.random.key(0)), cfg))
  return sharding.named_shardings(logical_axes(cfg), shapes, mesh, rules)


def values(
    cfg: qwen3.Qwen3Config,
    params,
    tokens_BxT,
    *,
    compute_dtype=None,
    remat=False,
    positions_BxT=None,
    segments_BxT=None,
    lora=None,
):
  """V [B, T], float32 (see the module docstring for what V[t] values); packed rows with
  their positions and segments (rl/layout.py). lora: (spec, trained) where params is a
  frozen base and trained holds the adapters and the head."""
  head = params[HEAD] if lora is None else lora[1][HEAD]
  h = qwen3.hidden_states(
      cfg,
      params,
      tokens_BxT,
      remat=remat,
      compute_dtype=compute_dtype,
      positions_BxT=positions_BxT,
      segments_BxT=segments_BxT,
      adapters=None if lora is None else lora[1]["adapters"],
      adapter_scale=1.0 if lora is None else lora[0].scale,
  )
  return jnp.einsum(
      "btd,d->bt", h, head["w"].astype(h.dtype), preferred_element_type=jnp.float32
  ) + head["b"].astype(jnp.float32)


# ------------------------------------------------------------------------- GAE, loss


def gae(rewards_B, values_BxT, mask_BxT, gamma: float, lam: float):
  """(advantages, returns) [B, T] float32 by GAE over each row's masked tokens (0 off
  them); the reward is received at a row's last masked token."""
  mask = np.asarray(mask_BxT) > 0
  V = np.where(mask, np.asarray(values_BxT, np.float64), 0.0)
  B, T = mask.shape
  last = T - 1 - np.argmax(mask[:, ::-1], axis=1)
  reward = np.zeros((B, T))
  rows = np.flatnonzero(mask.any(axis=1))
  reward[rows, last[rows]] = np.asarray(rewards_B, np.float64)[rows]
  adv = np.zeros((B, T))
  next_value, next_adv = np.zeros(B), np.zeros(B)
  for t in range(T - 1, -1, -1):
    m = mask[:, t]
    a = reward[:, t] + gamma * next_value - V[:, t] + gamma * lam * next_adv
    adv[:, t] = np.where(m, a, 0.0)
    next_value = np.where(m, V[:, t], next_value)
    next_adv = np.where(m, a, next_adv)
  returns = np.where(mask, adv + V, 0.0)
  return adv.astype(np.float32), returns.astype(np.float32)


def value_loss(values_BxT, old_values_BxT, returns_BxT, mask_BxT, clip: float, total_tokens):
  """The clipped value loss (token mean over total_tokens) and its metrics (additive over
  microbatches, as the policy loss's are)."""
  mask = jnp.asarray(mask_BxT, jnp.float32)
  err = jnp.square(values_BxT - returns_BxT)
  if clip > 0:
    clipped_v = jnp.clip(values_BxT, old_values_BxT - clip, old_values_BxT + clip)
    err_clipped = jnp.square(clipped_v - returns_BxT)
    loss_BxT, clipped = jnp.maximum(err, err_clipped), err_clipped > err
  else:
    loss_BxT, clipped = err, jnp.zeros_like(err, bool)
  n = jnp.maximum(total_tokens, 1.0)
  mean = lambda x: jnp.sum(jnp.where(mask > 0, x, 0.0)) / n
  loss = 0.5 * mean(loss_BxT)
  return loss, {"value_loss": loss, "value_clipfrac": mean(clipped.astype(jnp.float32))}


# ---------------------------------------------------------------------------- programs


@dataclasses.dataclass(frozen=True)
class _Static:
  model: qwen3.Qwen3Config
  value_clip: float
  remat: bool
  compute_dtype: str
  lora: lora_lib.LoraSpec | None = None


def _values(static: _Static, params, frozen, micro: dict[str, Any], remat: bool = False):
  """V [b, T] of one microbatch (packed rows: with their positions and segments). With
  LoRA, params are the adapters and the head over the frozen base."""
  lora = None if static.lora is None else (static.lora, params)
  return values(
      static.model,
      params if lora is None else frozen,
      micro["tokens"],
      compute_dtype=static.compute_dtype,
      remat=remat,
      positions_BxT=micro.get("positions"),
      segments_BxT=micro.get("segments"),
      lora=lora,
  )


def _micro_loss(static: _Static, params, frozen, micro: dict[str, Any], totals):
  """One microbatch's value loss and metrics; totals: the minibatch's (total_tokens,)."""
  v = _values(static, params, frozen, micro, static.remat)
  (total_tokens,) = totals
  return value_loss(
      v, micro["old_values"], micro["returns"], micro["mask"], static.value_clip, total_tokens
  )


def critic_train(train):
  """The train section the critic's optimizer reads: the policy's, at train.critic_lr."""
  return dataclasses.replace(train, lr=float(train.critic_lr))


def build_programs(
    static: _Static, optimizer, schedule, params_shape, mesh=None, rules=sharding.TRAIN_RULES
) -> step.Programs:
  """The critic's programs: the training step's (rl/step.py), `forward` giving V."""
  if mesh is None:
    param_sh = None
  elif static.lora is None:
    param_sh = param_shardings(static.model, mesh, rules)
  else:
    param_sh = lora_param_shardings(static.model, static.lora, mesh, rules)
  return step.build_programs(
      functools.partial(_values, static),
      functools.partial(_micro_loss, static),
      optimizer,
      schedule,
      params_shape,
      param_sh,
      mesh,
      rules,
  )


def make_static(model_cfg, train, remat: bool, compute_dtype: str, lora=None) -> _Static:
  return _Static(model_cfg, float(train.value_clip), bool(remat), str(compute_dtype), lora)


def lora_params(cfg: qwen3.Qwen3Config, spec: lora_lib.LoraSpec, key) -> dict:
  """A LoRA critic's trained params: fresh adapters (B = 0) and a zero float32 head."""
  head = {"w": jnp.zeros((cfg.hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  return {"adapters": lora_lib.init(cfg, spec, key), HEAD: head}


def lora_param_shardings(cfg: qwen3.Qwen3Config, spec: lora_lib.LoraSpec, mesh, rules):
  head = {"w": ("norm",), "b": ()}
  head_sh = sharding.named_shardings(
      head, jax.eval_shape(lambda: lora_params(cfg, spec, jax.random.key(0)))[HEAD], mesh, rules
  )
  return {"adapters": lora_lib.shardings(cfg, spec, mesh, rules), HEAD: head_sh}


class Critic(step.TrainedModel):
  """Holds the critic's float32 masters and optimizer state; gives the values of a step's
  tokens (`values`, which rl/learn.py turns into GAE's advantages and returns) and
  regresses them on the returns (`optimize`).
  Made from a policy's params (or a critic folder's): their backbone, a new zero head.
  With `lora`, `params` is a frozen base in the compute dtype (the policy's own, shared,
  or a critic folder's) and the critic trains adapters over it and its head."""

  def __init__(
      self,
      model_cfg: qwen3.Qwen3Config,
      params,
      train,
      total_updates: int,
      mesh=None,
      rules=sharding.TRAIN_RULES,
      remat: bool = False,
      compute_dtype: str = "float32",
      lora: lora_lib.LoraSpec | None = None,
      seed: int = 0,
  ):
    self.static = make_static(model_cfg, train, remat, compute_dtype, lora)
    self.lora = lora
    self.optimizer, self.schedule = step.make_optimizer(critic_train(train), total_updates)
    if lora is None:
      make = lambda p: critic_params(step.cast(p, jnp.float32), model_cfg)
      frozen, source = None, params
    else:  # the base's output head is not read: not held (the policy's is its own)
      make = lambda key: lora_params(model_cfg, lora, key)
      frozen = {k: v for k, v in params.items() if k != "lm_head"}
      source = jax.random.key(seed)
    shapes = jax.eval_shape(make, source)
    p = build_programs(self.static, self.optimizer, self.schedule, shapes, mesh, rules)
    # The head is made inside the program, in its sharding (on every host of a run).
    pin = {} if mesh is None else {"out_shardings": p.param_sh}
    super().__init__(p, jax.jit(make, **pin)(source), train, mesh, rules, frozen=frozen)
    self.base_fingerprint = None if lora is None else lora_lib.fingerprint(frozen)

  def state(self) -> tuple[dict[str, Any], dict]:
    arrays, host = super().state()
    if self.lora is not None:
      host["lora"] = dict(self.lora.describe(), base_fingerprint=self.base_fingerprint)
    return arrays, host

  def restore(self, arrays: dict[str, Any], host: dict) -> None:
    if self.lora is not None:
      update_lib.check_same_base(host.get("lora"), self.lora, self.base_fingerprint)
    super().restore(arrays, host)

  def values(self, batch: dict[str, np.ndarray], plan=None, params=None) -> np.ndarray:
    """V [B, T] under params (default: the held critic's) (0 past a microbatch's cut,
    and packed, past each sample's last needed token)."""
    pieces = [p for mb in (plan or self.plan(batch)) for p in mb]
    params = self.params if params is None else params
    return self.forward_pass(params, {"tokens": batch["tokens"]}, pieces)

  def optimize(
      self, state: step.ModelState, batch: dict[str, np.ndarray], old_values, returns, plan=None
  ) -> tuple[step.ModelState, dict[str, float]]:
    """ppo_epochs x num_minibatches optimizer updates from `state` of the value loss on
    `returns`, clipped around `old_values` ([B, T] each, from rl/learn.py's GAE); the
    new state and critic/* metrics (one host read)."""
    arrays = {
        "tokens": batch["tokens"],
        "mask": batch["mask"],
        "old_values": old_values,
        "returns": returns,
    }
    totals = lambda rows: (np.float32((arrays["mask"][rows] > 0).sum()),)
    state, metrics = self.epochs(state, arrays, plan or self.plan(batch), totals)
    metrics = to_host(metrics)
    mean = lambda k: float(np.mean([m[k] for m in metrics]))
    return state, {
        "critic/value_loss": mean("value_loss"),
        "critic/value_clipfrac": mean("value_clipfrac"),
        "critic/grad_norm": mean("grad_norm"),
        "critic/lr": mean("lr"),
    }

  def update(self, batch: dict[str, np.ndarray], old_values, returns, plan=None) -> dict:
    """`optimize` on the held state (which it replaces); critic/* metrics."""
    state, metrics = self.optimize(self.model_state(), batch, old_values, returns, plan)
    self.set_model_state(state)
    return metrics
