"""The learner: jitted policy-gradient updates of the very params the sampler decodes with.

One RL step's batch (rl/batch.py) goes through these, as rl/learn.py calls them
(`passes`, then `optimize` with the advantages it derives):
  1. old logprobs: the learner's logprobs under the params before this step's updates
     (the proximal policy), in chunks over the sequence (never [B, T, vocab]) and in
     microbatches; from them and the sampler's logprobs, on the host, the importance
     weights of rl/corrections.py (with ratio_anchor "behavior" this pass is skipped and
     the sampler's logprobs anchor the ratio);
  2. ppo_epochs x num_minibatches optimizer updates, each the sum of its microbatches'
     gradient evaluations, aggregated with the whole minibatch's token and sequence
     counts so accumulation equals one big batch. How samples are laid out in the calls
     is rl/layout.py's: with `train.packing` (the default) a minibatch's samples are
     packed end to end into microbatches of B / (num_minibatches x num_microbatches)
     rows of `pack_len` tokens (one call each, as many as the tokens need); unpacked,
     a row per sample, sorted by length and cut per microbatch
     (`train.microbatch_by_length`) or all at the batch's length in one lax.scan;
     one path either way: gradient calls into one buffer, then one optimizer update
     (rl/step.py's, which PPO's critic trains by too);
  3. a guard: a non-finite gradient skips the update (params and moments kept), counted
     in the optimizer state (optax.apply_if_finite), so checkpoints carry the count.
Metrics and the learning rate stay on device and are read once per RL step.
Precision: the learner owns float32 master weights and float32 AdamW moments, sharded
FSDP x tensor (sharding.TRAIN_RULES); the forward and backward run in the compute dtype
(`model.dtype`, cast inside the jitted step, so gradients flow back into float32).
An update of 1e-6 on a weight of 0.02 is not lost, as it would be in bfloat16.
The sampler decodes with `decode_params()`: the masters cast to the compute dtype in the
sampler's layout (sharding.DECODE_RULES), made once per update.
With LoRA (train.lora.rank > 0, models/lora.py) the trained params are the adapters
(float32 masters and moments, sharded like the weights they adapt) and the base model
is frozen in the compute dtype, held once: the learner's passes apply the adapters
unmerged (no weight-sized array per layer, no gradient of a base weight), the
reference policy is the base itself (no copy), and `decode_params()` merges the adapters
into a decode copy once per update, so the sampler's step costs what it costs without
LoRA; or, with train.lora.decode "unmerged" (one device), hands the sampler the base
itself with the adapters beside it, applied in every step: no second copy of the base.
Params and optimizer state are donated and come back in the shardings they went in;
optimizer state is created in the params' shardings (never whole on one device).
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
from april_jax.runtime.distributed import to_host
from april_jax.errors import InputError
from april_jax.models import lora as lora_lib
from april_jax.models import moe, qwen3
from april_jax.rl import advantages as advantages_lib
from april_jax.rl import batch as batch_lib
from april_jax.rl import corrections
from april_jax.rl import cov_tokens
from april_jax.rl import layout
from april_jax.rl import losses
from april_jax.rl import step
from april_jax.rl.policy_terms import COVARIANCE_TERMS


@dataclasses.dataclass(frozen=True)
class _Static:
  model: qwen3.Qwen3Config
  loss: losses.LossConfig
  chunk: int
  temperature: float
  remat: bool
  compute_dtype: str = "float32"
  lora: lora_lib.LoraSpec | None = None
  router_aux_coef: float = 0.0  # a mixture-of-experts model's load-balancing loss weight
  replay: bool = True  # replay a batch's recorded routes (model.routing_replay)


def _token_logprobs(
    static: _Static, params, frozen, micro: dict[str, Any], remat: bool = False, moe_out=False
):
  """Logprobs and entropy [b, T] of one microbatch's targets (packed rows: with their
  positions and segments; a Qwen3-MoE model's recorded routes replayed where the
  microbatch has them). Cast layer by layer inside the model, so a gradient flows back
  to the float32 masters. With LoRA, params are the adapters (None: the base model
  alone, the reference policy) over the frozen base. moe_out: the sparse layers'
  MoeOut too."""
  model, adapters = (params, None) if static.lora is None else (frozen, params)
  out = qwen3.token_logprobs(
      static.model,
      model,
      micro["tokens"],
      micro["targets"],
      compute_dtype=static.compute_dtype,
      chunk_size=static.chunk,
      temperature=static.temperature,
      remat=remat,
      positions_BxT=micro.get("positions"),
      segments_BxT=micro.get("segments"),
      adapters=adapters,
      adapter_scale=1.0 if static.lora is None else static.lora.scale,
      routes=micro.get("routes") if static.replay else None,
      token_mask_BxT=micro.get("mask"),
      moe_out=moe_out,
  )
  return out if moe_out else out[:2]


def _micro_loss(static: _Static, params, frozen, micro: dict[str, Any], totals):
  """One microbatch's policy loss and metrics; totals: the whole minibatch's
  (total_tokens, total_seqs) (losses.batch_totals), so sums over microbatches, and over
  several calls, equal one big batch's values. A mixture-of-experts model adds its
  router's terms (_router_terms)."""
  logp, entropy, seen = _token_logprobs(static, params, frozen, micro, static.remat, True)
  total_tokens, total_seqs = totals
  loss, metrics = losses.policy_loss(
      static.loss,
      logp,
      micro["old_logp"],
      micro["advantages"],
      micro["mask"],
      is_weight_BxT=micro["is_weight"],
      ref_logp_BxT=micro.get("ref_logp"),
      entropy_BxT=entropy,
      stale_BxT=micro["stale"],
      total_tokens=total_tokens,
      total_seqs=total_seqs,
      segments_BxT=micro.get("segments"),
      selected_BxT=micro.get("selected"),
  )
  if seen is None:
    return loss, metrics
  aux, agreement = _router_terms(static, seen, micro, total_tokens)
  return loss + aux, dict(metrics, router_aux_loss=aux, router_agreement=agreement)


def _router_terms(static: _Static, seen: qwen3.MoeOut, micro: dict[str, Any], total_tokens):
  """A mixture-of-experts microbatch's (weighted load-balancing loss, router agreement),
  each its share of the minibatch's (sums over microbatches are the minibatch's values),
  over the tokens its mask trains. Agreement: the fraction of token-layers whose own
  top-k set equals the rollout's recorded one (a layer not recorded counts as equal)."""
  mask = (micro["mask"] > 0).astype(jnp.float32)
  share = jnp.sum(mask) / jnp.maximum(total_tokens, 1.0)
  aux = static.router_aux_coef * moe.balance_loss(seen.fraction, seen.mean_prob) * share
  recorded = micro.get("routes")
  if recorded is None:
    return aux, share
  own = jnp.sort(seen.experts, axis=-1)
  theirs = jnp.sort(recorded.astype(jnp.int32), axis=-1)
  missing = jnp.any(recorded == moe.UNRECORDED, axis=-1)
  same = jnp.where(missing, True, jnp.all(own == theirs, axis=-1))  # [b, T, Ls]
  per_token = jnp.mean(same.astype(jnp.float32), axis=-1)
  return aux, jnp.sum(per_token * mask) / jnp.maximum(total_tokens, 1.0)


def trained_mask(train, mask_BxT: np.ndarray, stale_BxT=None) -> np.ndarray:
  """The tokens the policy loss trains on (before a mask-mode weight rejects any): the
  drawn ones, less the stale ones when train.mask_stale_tokens (losses.effective_mask on
  the host, as bools: no device op, so nothing compiles). train: the config's train
  section or a LossConfig."""
  mask_BxT = np.asarray(mask_BxT) > 0
  if train.mask_stale_tokens and stale_BxT is not None:
    mask_BxT = mask_BxT & ~np.asarray(stale_BxT, bool)
  return mask_BxT


def selects_tokens(train) -> bool:
  """Whether the policy term treats tokens selected by covariance apart (clip_cov,
  kl_cov): the updates then read a `selected` array [B, T] (rl/cov_tokens.py)."""
  return train.policy_loss in COVARIANCE_TERMS


def _totals(loss_cfg: losses.LossConfig, mask_BxT: np.ndarray, stale_BxT: np.ndarray):
  """A minibatch's (total_tokens, total_seqs), counted on the host as losses.batch_totals
  counts them on losses.effective_mask."""
  mask_BxT = trained_mask(loss_cfg, mask_BxT, stale_BxT)
  return np.float32(mask_BxT.sum()), np.float32((mask_BxT.sum(-1) > 0).sum())


@dataclasses.dataclass(frozen=True)
class Programs(step.Programs):
  """The learner's jitted programs: the training step's (rl/step.py; `forward` gives the
  logprobs and entropy of microbatches' targets), and the casts of its weights. Built
  from shapes alone, so they can be compiled at real shapes with no weights
  (april_jax/planning/compile_check.py)."""

  decode_sh: Any
  frozen_sh: Any  # the frozen base's shardings (LoRA; None without a mesh or LoRA)
  to_masters: Any  # params -> float32 masters in the learner's layout
  # params -> the compute dtype in the learner's layout: the reference params of a KL
  # term, or LoRA's frozen base
  to_compute: Any
  decode_params: Any  # (masters, frozen) -> compute-dtype params in the sampler's layout
  decode_adapters: Any  # LoRA adapters -> as the sampler applies them unmerged (or None)


@dataclasses.dataclass(frozen=True)
class Passes:
  """What a step's updates read besides its rows, from the passes before them (host
  arrays [B, T]): the proximal policy's logprobs (the sampler's with ratio_anchor
  "behavior"), the importance weights, the trained mask (a mask-mode weight drops
  tokens), the reference's logprobs (None without a KL term), and their metrics."""

  old_logp: np.ndarray
  is_weight: np.ndarray
  mask: np.ndarray
  ref_logp: np.ndarray | None
  metrics: dict


def build_programs(
    static: _Static,
    optimizer,
    params_shape,
    mesh=None,
    rules=sharding.TRAIN_RULES,
    decode_rules=sharding.DECODE_RULES,
    *,
    schedule: optax.Schedule,
) -> Programs:
  """params_shape: the trained params' shapes (the model's, or with LoRA the adapters')."""
  if mesh is None:
    model_sh = decode_sh = param_sh = None
    pin = lambda sh: {}
  else:
    model_sh = qwen3.param_shardings(static.model, mesh, rules)
    decode_sh = qwen3.param_shardings(static.model, mesh, decode_rules)
    param_sh = (
        model_sh
        if static.lora is None
        else lora_lib.shardings(static.model, static.lora, mesh, rules)
    )
    pin = lambda sh: {"out_shardings": sh}
  to_compute = functools.partial(step.cast, dtype=static.compute_dtype)

  def to_decode(params, frozen):  # cast (merge) where the weights lie, then move the copy
    model = params if static.lora is None else lora_lib.merge(frozen, params, static.lora)
    model = to_compute(model)
    return model if model_sh is None else jax.lax.with_sharding_constraint(model, model_sh)

  shared = step.build_programs(
      functools.partial(_token_logprobs, static),
      functools.partial(_micro_loss, static),
      optimizer,
      schedule,
      params_shape,
      param_sh,
      mesh,
      rules,
  )
  return Programs(
      **vars(shared),
      decode_sh=decode_sh,
      frozen_sh=None if static.lora is None else model_sh,
      to_masters=jax.jit(lambda p: step.cast(p, jnp.float32), **pin(param_sh)),
      to_compute=jax.jit(to_compute, **pin(model_sh)),
      decode_params=jax.jit(to_decode, **pin(decode_sh)),
      decode_adapters=None
      if static.lora is None
      else jax.jit(
          functools.partial(lora_lib.decode_adapters, spec=static.lora, dtype=static.compute_dtype),
          **pin(param_sh),
      ),
  )


def make_static(
    model_cfg: qwen3.Qwen3Config,
    train,
    temperature: float,
    remat: bool,
    compute_dtype: str,
    lora: lora_lib.LoraSpec | None = None,
    routing_replay: bool = True,
) -> _Static:
  return _Static(
      model_cfg,
      losses.LossConfig.from_config(train),
      int(train.logprob_chunk),
      float(temperature) if temperature > 0 else 1.0,
      bool(remat),
      str(compute_dtype),
      lora,
      float(train.router_aux_loss_coef),
      bool(routing_replay),
  )


def _abstract(tree, on_mesh: bool):
  """Shapes, dtypes and (on a mesh) shardings of arrays: what `lower` needs, no data.
  Off a mesh arrays are uncommitted, and so are their stand-ins."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if on_mesh else None),
      tree,
  )


def needs_reference(train) -> bool:
  """Whether reference params are held: a KL term in the loss or in the reward."""
  return train.kl_coef > 0 or train.reward_kl_coef > 0


def token_advantages(train) -> bool:
  """Whether advantages are per token [B, T] (a critic's GAE, REINFORCE++'s reward KL)."""
  return train.advantage in advantages_lib.CRITIC_ADVANTAGES or train.reward_kl_coef > 0


# The arrays the logprob pass reads, and those a gradient call reads (advantages [B], or
# [B, T] from a critic's GAE).
FORWARD_KEYS = ("tokens", "targets", "routes")  # routes: a Qwen3-MoE batch's, replayed
UPDATE_KEYS = (
    "tokens",
    "targets",
    "routes",
    "mask",
    "is_weight",
    "old_logp",
    "stale",
    "advantages",
    "ref_logp",
    "selected",
)


def _dummy_batch(
    B: int,
    T: int,
    with_ref: bool,
    token_advantages: bool,
    with_selected: bool = False,
    route_shape: tuple[int, int] | None = None,
) -> dict[str, np.ndarray]:
  """A batch [B, T] of the update's arrays whose rows are all full length, so every
  microbatch is cut at T."""
  mask = np.zeros((B, T), np.float32)
  mask[:, T - 2] = 1.0
  tokens = np.zeros((B, T), np.int32)
  batch = {
      "tokens": tokens,
      "targets": tokens,
      "mask": mask,
      "is_weight": mask,
      "old_logp": mask,
      "stale": np.zeros((B, T), bool),
      "advantages": mask if token_advantages else np.zeros((B,), np.float32),
  }
  if with_selected:
    batch["selected"] = mask
  if route_shape is not None:  # a Qwen3-MoE batch's recorded routes
    batch["routes"] = np.zeros((B, T) + tuple(route_shape), np.uint8)
  return dict(batch, ref_logp=mask) if with_ref else batch


def lora_train(train):
  """The train section the adapters' optimizer reads: the policy's, at train.lora.lr."""
  return dataclasses.replace(train, lr=float(train.lora.lr))


def _in_dtype(params, dtype) -> bool:
  return all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(params))


def _adapters(cfg, spec: lora_lib.LoraSpec, adapters, seed: int, shardings):
  """The adapters' float32 masters, placed (in `shardings`, None off a mesh): the given
  ones (as read from a PEFT folder) or a fresh init (B = 0) from `seed`."""
  if adapters is None:
    init = lambda key: lora_lib.init(cfg, spec, key)
    pin = {} if shardings is None else {"out_shardings": shardings}
    return jax.jit(init, **pin)(jax.random.key(seed))
  adapters = jax.tree.map(lambda x: np.asarray(x, np.float32), adapters)
  return (
      jax.tree.map(jnp.asarray, adapters)
      if shardings is None
      else jax.device_put(adapters, shardings)
  )


def check_same_base(saved: dict | None, spec: lora_lib.LoraSpec, fingerprint: str) -> None:
  """An InputError unless a checkpoint's LoRA record (Learner.state) is this run's: the
  same adapters over the same base weights."""
  if saved is None:
    raise InputError(
        "the checkpoint holds a full fine-tune's params, and this run trains LoRA adapters "
        "(train.lora.rank > 0): resume it with train.lora.rank=0, or start a new workdir"
    )
  if saved["base_fingerprint"] != fingerprint:
    raise InputError(
        f"the checkpoint's LoRA adapters were trained over other base weights (fingerprint "
        f"{saved['base_fingerprint']}, this run's base gives {fingerprint}): resume with the "
        "base model the run started from (model.path, or the run's lora_base folder)"
    )
  wanted = spec.describe()
  differ = [f"{k} {saved[k]!r} (now {wanted[k]!r})" for k in wanted if saved[k] != wanted[k]]
  if differ:
    raise InputError(f"the checkpoint's LoRA adapters differ from train.lora: {', '.join(differ)}")


class Learner(step.TrainedModel):
  """Holds float32 master params, optimizer state and the (optional) reference params
  (in the compute dtype); updates them. With `lora`, the trained params are adapters
  (given, as from a PEFT folder, or initialised from `seed`) and `params` is the frozen
  base model, kept in the compute dtype."""

  def __init__(
      self,
      model_cfg: qwen3.Qwen3Config,
      params,
      train,
      temperature: float,
      total_updates: int,
      mesh=None,
      rules=sharding.TRAIN_RULES,
      remat: bool = False,
      compute_dtype: str = "float32",
      decode_rules=sharding.DECODE_RULES,
      lora: lora_lib.LoraSpec | None = None,
      adapters=None,
      seed: int = 0,
      lora_decode: str = "merged",
      routing_replay: bool = True,
  ):
    self.static = make_static(
        model_cfg, train, temperature, remat, compute_dtype, lora, routing_replay
    )
    self.loss_cfg, self.lora, self.lora_decode = self.static.loss, lora, lora_decode
    self.optimizer, self.schedule = step.make_optimizer(
        train if lora is None else lora_train(train), total_updates
    )
    if lora is None:
      shapes = jax.eval_shape(lambda p: step.cast(p, jnp.float32), params)
    else:
      shapes = jax.eval_shape(lambda: lora_lib.init(model_cfg, lora, jax.random.key(0)))
    p = build_programs(
        self.static, self.optimizer, shapes, mesh, rules, decode_rules, schedule=self.schedule
    )
    if lora is None:
      super().__init__(p, p.to_masters(params), train, mesh, rules)
    else:
      base = params if _in_dtype(params, compute_dtype) else p.to_compute(params)
      masters = _adapters(model_cfg, lora, adapters, seed, p.param_sh)
      super().__init__(p, masters, train, mesh, rules, frozen=base)
      self.base_fingerprint = lora_lib.fingerprint(base)
    self.has_reference = needs_reference(train)
    # No reference params are held unless a KL term needs them; with LoRA the frozen
    # base is the reference (the trained params None).
    self.ref_params = p.to_compute(self.params) if self.has_reference and lora is None else None
    self.token_advantages = token_advantages(train)
    self.selects_tokens = selects_tokens(train)
    self.seed = int(seed)

  def state(self) -> tuple[dict[str, Any], dict]:
    """What a checkpoint keeps: the device arrays (masters, optimizer state with its
    skip count, reference params if held) and the host counter (JSON); with LoRA the
    adapters, their optimizer and the spec and fingerprint of the base (never the base)."""
    arrays, host = super().state()
    if self.ref_params is not None:
      arrays["ref_params"] = self.ref_params
    if self.lora is not None:
      host["lora"] = dict(self.lora.describe(), base_fingerprint=self.base_fingerprint)
    return arrays, host

  def restore(self, arrays: dict[str, Any], host: dict) -> None:
    """Back to a `state()` (arrays restored in the shardings of this learner's own). A
    LoRA checkpoint of another base model is refused, naming what differs."""
    if self.lora is not None:
      check_same_base(host.get("lora"), self.lora, self.base_fingerprint)
    super().restore(arrays, host)
    self.ref_params = arrays.get("ref_params")

  def decode_params(self):
    """The current params for the sampler: compute dtype, the sampler's layout. With
    LoRA, the adapters merged into a copy of the base; with lora_decode "unmerged", the
    frozen base itself (no copy, the learner's layout) carrying the adapters."""
    if self.lora is not None and self.lora_decode == "unmerged":
      return lora_lib.decode_view(self.frozen, self.programs.decode_adapters(self.params))
    return self.programs.decode_params(self.params, self.frozen)

  def warm_up(self, batch_size: int, lengths) -> int:
    """Compiles, ahead of time, every program an update at these padded lengths calls.

    Nothing runs: each program is lowered on the abstract shapes and shardings of the
    arrays it will be given (the next program's inputs are the last one's `out_info`), so
    params and optimizer state are untouched and no second copy is held. The compiled
    executables fill the jit caches that a step's passes and updates then hit. Returns how many microbatch
    shapes were compiled.
    """
    on_mesh, p = self.mesh is not None, self.programs
    compile_ = lambda fn, *args: _abstract(fn.lower(*args).compile().out_info, on_mesh)
    params, opt_state = _abstract((self.params, self.opt_state), on_mesh)
    frozen = _abstract(self.frozen, on_mesh)
    logprob_params = [params] + (
        [_abstract(self.ref_params, on_mesh)] if self.has_reference else []
    )
    grads0, seen = compile_(p.zeros, params), set()
    totals = (np.float32(1), np.float32(1))
    budget = layout.pack_len(self.train, max(lengths))
    if budget is not None:  # packed rows: one budget, its few row lengths
      lengths = [max(budget, max(lengths))]
    for T in lengths:
      routes = self.static.model.route_shape if self.static.model.num_experts else None
      batch = _dummy_batch(
          batch_size, T, self.has_reference, self.token_advantages, self.selects_tokens, routes
      )
      inputs = {k: batch[k] for k in FORWARD_KEYS if k in batch}
      for pieces in layout.every_shape_plan(batch["mask"], self.train, self.min_rows):
        acc = None
        for piece in pieces:
          seen.add((piece.packed, piece.gather(batch["mask"]).shape))
          for params_ in logprob_params:
            compile_(p.forward, params_, frozen, self.piece(inputs, piece))
          grads, loss, metrics = compile_(
              p.grads, params, frozen, self.piece(batch, piece), totals, grads0
          )
          out = (loss, metrics)  # as TrainedModel.minibatch sums them
          acc = out if acc is None else compile_(p.add, acc, out)
        if acc is not None:
          compile_(p.apply, params, opt_state, grads, *acc, np.int32(0))
    return len(seen)

  def logprobs(self, params, batch: dict[str, np.ndarray], plan=None) -> np.ndarray:
    """Logprobs [B, T] of the targets under params (0 past a microbatch's cut and on
    tokens no sample needs). Needs the batch's tokens, targets and mask (the mask decides
    the layout), or a plan from `plan`."""
    pieces = [p for mb in (plan or self.plan(batch)) for p in mb]
    inputs = {k: batch[k] for k in FORWARD_KEYS if k in batch}
    return self.forward_pass(params, inputs, pieces, pick=lambda out: out[0])

  def passes(self, state: step.ModelState, batch: dict[str, np.ndarray], plan) -> Passes:
    """The passes over a step's batch before its first update, under `state`'s params
    (the proximal policy) and the reference's: old logprobs and importance weights
    (rl/corrections.py), reference logprobs where a KL term needs them."""
    cfg = self.loss_cfg
    behavior = batch["behavior"]  # on the host only: the device needs the weights
    if cfg.ratio_anchor == "behavior":  # coupled PPO: no old-logprob pass, no weight
      return Passes(
          behavior, np.ones_like(batch["mask"]), batch["mask"], self._reference(batch, plan), {}
      )
    old_logp = self.logprobs(state.params, batch, plan)
    same_version = (batch["mask"] > 0) & ~batch["stale"]
    diff = np.abs(behavior - old_logp)[same_version]
    metrics = {"train/logprob_diff_mean": float(diff.mean()) if diff.size else 0.0}
    trained = trained_mask(cfg, batch["mask"], batch["stale"])
    weights = corrections.importance_weights(
        cfg.is_level, cfg.is_mode, cfg.is_low, cfg.tis_cap, old_logp, behavior, trained
    )
    metrics.update({f"train/{k}": v for k, v in weights.metrics.items()})
    mask = batch["mask"] * weights.keep_BxT
    return Passes(old_logp, weights.weight_BxT, mask, self._reference(batch, plan), metrics)

  def _reference(self, batch: dict[str, np.ndarray], plan) -> np.ndarray | None:
    return self.logprobs(self.ref_params, batch, plan) if self.has_reference else None

  def optimize(
      self, state: step.ModelState, batch: dict[str, np.ndarray], passes: Passes, advantages, plan
  ) -> tuple[step.ModelState, dict[str, float]]:
    """All of one RL step's optimizer updates from `state`, on the batch's rows with the
    passes' weights and these advantages ([B], or [B, T] per token); the new state and
    train/* metrics (one host read)."""
    cfg = self.loss_cfg
    pieces = [p for mb in plan for p in mb]
    counts = layout.token_counts(pieces, batch_lib.row_lengths(batch["mask"]))
    arrays = {
        "tokens": batch["tokens"],
        "targets": batch["targets"],
        "mask": passes.mask,
        "is_weight": passes.is_weight,
        "old_logp": passes.old_logp,
        "stale": batch["stale"],
        "advantages": np.asarray(advantages, np.float32),
    }
    if "routes" in batch:
      arrays["routes"] = batch["routes"]
    if passes.ref_logp is not None:
      arrays["ref_logp"] = passes.ref_logp
    selection = {}
    if self.selects_tokens:
      arrays["selected"], selection = self._selected(state, arrays)
    totals = lambda rows: _totals(cfg, arrays["mask"][rows], arrays["stale"][rows])
    state, metrics = self.epochs(state, arrays, plan, totals)
    metrics, skipped = to_host((metrics, state.opt_state.total_notfinite))
    mean = lambda k: float(np.mean([m[k] for m in metrics]))
    return state, {
        "train/loss": mean("loss"),
        "train/pg_loss": mean("pg_loss"),
        "train/pg_clipfrac": mean("pg_clipfrac"),
        "train/pg_clipfrac_lower": mean("pg_clipfrac_lower"),
        "train/log_ratio_clamped_frac": mean("log_ratio_clamped_frac"),
        "train/kl": mean("kl"),
        "train/entropy": mean("entropy"),
        "train/grad_norm": mean("grad_norm"),
        "train/lr": mean("lr"),
        "train/ratio_mean": mean("ratio_mean"),
        **self._router_metrics(metrics, mean),
        **passes.metrics,
        **selection,
        "train/padded_per_real": counts["padded_per_real"],  # positions computed / tokens
        "train/skipped_updates": float(skipped),
        "train/updates": float(state.attempted - int(skipped)),
    }

  def _router_metrics(self, metrics, mean) -> dict[str, float]:
    """A mixture-of-experts model's train/router_agreement and train/router_aux_loss."""
    if not self.static.model.num_experts:
      return {}
    return {
        "train/router_agreement": mean("router_agreement"),
        "train/router_aux_loss": mean("router_aux_loss"),
    }

  def _selected(self, state: step.ModelState, arrays: dict[str, np.ndarray]):
    """clip_cov's or kl_cov's tokens [B, T] over the step's trained tokens, on the
    proximal logprobs (rl/cov_tokens.py), drawn from (seed, updates tried) so a resumed
    run draws the same; and train/cov_selected_frac."""
    trained = trained_mask(self.loss_cfg, arrays["mask"], arrays["stale"])
    rng = np.random.default_rng([self.seed, state.attempted])
    selected = cov_tokens.select(
        self.loss_cfg, arrays["advantages"], arrays["old_logp"], trained, rng
    )
    frac = float(selected.sum() / max(int(trained.sum()), 1))
    return selected, {"train/cov_selected_frac": frac}

  def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """One RL step's updates of the held state on rows whose advantages are given
    (batch["advantages"]); train/* metrics. A run's step goes through rl/learn.py, which
    derives the advantages; this is the policy's part alone (warm start, tests)."""
    plan = self.plan(batch)
    passes = self.passes(self.model_state(), batch, plan)
    state, metrics = self.optimize(self.model_state(), batch, passes, batch["advantages"], plan)
    self.set_model_state(state)
    return metrics
