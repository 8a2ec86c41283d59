"""The learner: jitted policy-gradient updates of the very params the sampler decodes with.

One RL step's batch (rl/batch.py) goes through:
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
     one path either way: gradient calls into one buffer, then one optimizer update;
  3. a guard: a non-finite gradient skips the update (params and moments kept), counted
     in the optimizer state (optax.apply_if_finite), so checkpoints carry the count.
Metrics and the learning rate stay on device and are read once per RL step.
Precision: the learner owns float32 master weights and float32 AdamW moments, sharded
FSDP x tensor (sharding.TRAIN_RULES); the forward and backward run in the compute dtype
(`model.dtype`, cast inside the jitted step, so gradients flow back into float32).
An update of 1e-6 on a weight of 0.02 is not lost, as it would be in bfloat16.
The sampler decodes with `decode_params()`: the masters cast to the compute dtype in the
sampler's layout (sharding.DECODE_RULES), made once per update.
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
from april_jax.distributed import to_host
from april_jax.models import qwen3
from april_jax.rl import advantages as advantages_lib
from april_jax.rl import batch as batch_lib
from april_jax.rl import corrections
from april_jax.rl import layout
from april_jax.rl import losses


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
  chain.append(
      optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=1e-8, weight_decay=train.weight_decay)
  )
  # Never give up skipping: a run of non-finite steps must not be applied after N of them.
  return optax.apply_if_finite(optax.chain(*chain), max_consecutive_errors=2**30), schedule


@dataclasses.dataclass(frozen=True)
class _Static:
  model: qwen3.Qwen3Config
  loss: losses.LossConfig
  chunk: int
  temperature: float
  remat: bool
  compute_dtype: str = "float32"


def cast(params, dtype):
  """params in dtype (floating leaves only)."""
  return jax.tree.map(lambda x: x.astype(dtype), params)


def _logprobs(static: _Static, params, tokens_MxbxT, targets_MxbxT, positions=None, segments=None):
  """Logprobs and entropy for microbatches [M, b, T], one microbatch at a time (packed
  rows: with their positions and segments [M, b, T])."""
  fn = lambda xs: qwen3.token_logprobs(
      static.model,
      params,
      xs[0],
      xs[1],
      compute_dtype=static.compute_dtype,
      chunk_size=static.chunk,
      temperature=static.temperature,
      positions_BxT=xs[2],
      segments_BxT=xs[3],
  )
  return jax.lax.map(fn, (tokens_MxbxT, targets_MxbxT, positions, segments))


def _grads(static: _Static, params, mb: dict[str, Any], total_tokens, total_seqs, grads):
  """grads plus the gradients of microbatches [M, b, T] (lax.scan); their loss and metrics.

  total_tokens / total_seqs are the whole minibatch's (losses.batch_totals), so sums over
  microbatches, and over several calls, equal one big batch's values. `grads` is the
  running sum (zeros at first): one gradient buffer is carried through every call.
  """

  def micro_loss(p, micro):
    # Cast layer by layer inside the model; the gradient flows back to the float32 masters.
    logp, entropy = qwen3.token_logprobs(
        static.model,
        p,
        micro["tokens"],
        micro["targets"],
        compute_dtype=static.compute_dtype,
        chunk_size=static.chunk,
        temperature=static.temperature,
        remat=static.remat,
        positions_BxT=micro.get("positions"),
        segments_BxT=micro.get("segments"),
    )
    return losses.policy_loss(
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
    )

  return accumulate_grads(micro_loss, params, mb, grads)


def accumulate_grads(micro_loss, params, mb: dict[str, Any], grads):
  """grads plus the gradients of micro_loss(params, micro) -> (loss, metrics) over the
  microbatches [M, ...] of mb (lax.scan); the summed loss and metrics. Each microbatch's
  metrics are its share of the minibatch's: they add up."""
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def accumulate(carry, micro):
    grads, loss_sum = carry
    (loss, metrics), g = grad_fn(params, micro)
    return (jax.tree.map(jnp.add, grads, g), loss_sum + loss), metrics

  (grads, loss), metrics = jax.lax.scan(accumulate, (grads, jnp.zeros(())), mb)
  return grads, loss, {k: jnp.sum(v) for k, v in metrics.items()}


def _add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _zeros_like(tree):
  return jax.tree.map(jnp.zeros_like, tree)


def _apply(optimizer, schedule, params, opt_state, grads, loss, metrics, attempted):
  """The optimizer update from summed gradients (skipped if they are not finite); its
  metrics, the learning rate it used among them. `attempted`: updates tried before."""
  applied = attempted - opt_state.total_notfinite  # the schedule's step for this update
  updates, opt_state = optimizer.update(grads, opt_state, params)
  out = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), lr=schedule(applied))
  return optax.apply_updates(params, updates), opt_state, out


def trained_mask(train, mask_BxT: np.ndarray, stale_BxT=None) -> np.ndarray:
  """The tokens the policy loss trains on (before a mask-mode weight rejects any): the
  drawn ones, less the stale ones when train.mask_stale_tokens (losses.effective_mask on
  the host, as bools: no device op, so nothing compiles). train: the config's train
  section or a LossConfig."""
  mask_BxT = np.asarray(mask_BxT) > 0
  if train.mask_stale_tokens and stale_BxT is not None:
    mask_BxT = mask_BxT & ~np.asarray(stale_BxT, bool)
  return mask_BxT


def _totals(loss_cfg: losses.LossConfig, mask_BxT: np.ndarray, stale_BxT: np.ndarray):
  """A minibatch's (total_tokens, total_seqs), counted on the host as losses.batch_totals
  counts them on losses.effective_mask."""
  mask_BxT = trained_mask(loss_cfg, mask_BxT, stale_BxT)
  return np.float32(mask_BxT.sum()), np.float32((mask_BxT.sum(-1) > 0).sum())


def optimizer_shardings(optimizer: optax.GradientTransformation, params, param_sh, mesh):
  """The optimizer state's shardings: each moment like its param, scalars replicated."""
  shapes = jax.eval_shape(optimizer.init, params)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return optax.tree_map_params(
      optimizer, lambda _, sh: sh, shapes, param_sh, transform_non_params=lambda _: replicated
  )


@dataclasses.dataclass(frozen=True)
class Programs:
  """The learner's jitted programs and the shardings they pin (None without a mesh).
  Built from shapes alone, so they can be compiled at real shapes with no weights
  (april_jax/compile_check.py)."""

  param_sh: Any
  opt_sh: Any
  decode_sh: Any
  to_masters: Any  # params -> float32 masters in the learner's layout
  init_opt: Any  # masters -> optimizer state, sharded like them
  to_reference: Any  # masters -> reference params in the compute dtype
  decode_params: Any  # masters -> compute-dtype copy in the sampler's layout
  logprobs: Any  # (params, tokens [M, b, T], targets) -> logprobs, entropy
  zeros: Any
  grads: Any  # gradients of microbatches of one length, added to a running sum
  add: Any
  apply: Any  # the optimizer update from summed gradients


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
  if mesh is None:
    param_sh = opt_sh = decode_sh = None
    pin = lambda sh: {}
  else:
    param_sh = qwen3.param_shardings(static.model, mesh, rules)
    opt_sh = optimizer_shardings(optimizer, params_shape, param_sh, mesh)
    decode_sh = qwen3.param_shardings(static.model, mesh, decode_rules)
    pin = lambda sh: {"out_shardings": sh}
  to_compute = functools.partial(cast, dtype=static.compute_dtype)
  traced = lambda fn: sharding.traced_under(fn, mesh, rules)

  def to_decode(p):  # cast where the masters lie, then move the 16-bit copy
    p = to_compute(p)
    return p if param_sh is None else jax.lax.with_sharding_constraint(p, param_sh)

  return Programs(
      param_sh=param_sh,
      opt_sh=opt_sh,
      decode_sh=decode_sh,
      to_masters=jax.jit(lambda p: cast(p, jnp.float32), **pin(param_sh)),
      init_opt=jax.jit(optimizer.init, **pin(opt_sh)),
      to_reference=jax.jit(to_compute, **pin(param_sh)),
      decode_params=jax.jit(to_decode, **pin(decode_sh)),
      logprobs=jax.jit(traced(functools.partial(_logprobs, static))),
      zeros=jax.jit(_zeros_like, **pin(param_sh)),
      grads=jax.jit(
          traced(functools.partial(_grads, static)), donate_argnums=4, **pin((param_sh, None, None))
      ),
      add=jax.jit(_add),  # losses and metrics of several calls
      apply=jax.jit(
          functools.partial(_apply, optimizer, schedule),
          donate_argnums=(0, 1),
          **pin((param_sh, opt_sh, None)),
      ),
  )


def make_static(
    model_cfg: qwen3.Qwen3Config, train, temperature: float, remat: bool, compute_dtype: str
) -> _Static:
  return _Static(
      model_cfg,
      losses.LossConfig.from_config(train),
      int(train.logprob_chunk),
      float(temperature) if temperature > 0 else 1.0,
      bool(remat),
      str(compute_dtype),
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


# The arrays a gradient call reads (advantages [B], or [B, T] from a critic's GAE).
UPDATE_KEYS = (
    "tokens",
    "targets",
    "mask",
    "is_weight",
    "old_logp",
    "stale",
    "advantages",
    "ref_logp",
)


def _dummy_batch(B: int, T: int, with_ref: bool, token_advantages: bool) -> dict[str, np.ndarray]:
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
  return dict(batch, ref_logp=mask) if with_ref else batch


def _logprob_args(piece: dict) -> tuple:
  """A piece's arguments of the logprob program: tokens, targets, positions, segments
  (the last two None unless packed)."""
  return piece["tokens"], piece["targets"], piece.get("positions"), piece.get("segments")


def microbatch_sharding(shape, mesh, rules=sharding.TRAIN_RULES):
  """Where microbatch arrays [M, b, ...] live: rows b over the batch axes of the mesh."""
  axes = (None, "batch") + ("seq",) * (len(shape) - 2)
  return jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(axes, shape, mesh, rules))


def place(x: np.ndarray, mesh, rules=sharding.TRAIN_RULES):
  """Places [M, b, ...] arrays with b over the batch axes of the mesh."""
  if mesh is None:
    return jnp.asarray(x)
  return jax.device_put(x, microbatch_sharding(x.shape, mesh, rules))


def pack_len(train, T: int) -> int | None:
  """The packed rows' token budget for a batch of padded length T: train.pack_len, or
  T when it is 0 (a run sets it: `train_section`); None when train.packing is off."""
  if not train.get("packing", False):
    return None
  return int(train.pack_len) or int(T)


def train_section(config):
  """The train section the learner and critic read: config.train with pack_len 0
  resolved to the run's longest row (data.max_prompt_len + rollout.max_response_len,
  rounded up as rl/batch.py pads), so every step packs into rows of one length."""
  t = config.train.copy_and_resolve_references()
  if t.packing and not t.pack_len:
    max_len = config.data.max_prompt_len + config.rollout.max_response_len
    t.pack_len = batch_lib.bucket_len(max_len, max_len=max_len)
  return t


def plan(mask_BxT: np.ndarray, train, min_rows: int = 1) -> list[list[layout.Piece]]:
  """Per minibatch, its microbatches as layout.Pieces (packed when train.packing; a last
  packed microbatch keeps at least min_rows rows: the devices rows are split over)."""
  t = train
  B, T = mask_BxT.shape
  if B % (t.num_minibatches * t.num_microbatches):
    raise ValueError(
        f"batch of {B} samples does not split into train.num_minibatches="
        f"{t.num_minibatches} x train.num_microbatches={t.num_microbatches}"
    )
  minibatches = np.arange(B).reshape(t.num_minibatches, -1)
  budget = pack_len(t, T)
  if budget is not None:
    rows_per_call = B // (t.num_minibatches * t.num_microbatches)
    lengths = batch_lib.row_lengths(mask_BxT)
    return [
        layout.packed_pieces(lengths[rows], rows_per_call, budget, rows, min_rows)
        for rows in minibatches
    ]
  by_length = bool(t.microbatch_by_length)
  return [
      [
          layout.Piece(T=T, rows=rows[local])
          for local, T in batch_lib.microbatches(mask_BxT[rows], t.num_microbatches, by_length)
      ]
      for rows in minibatches
  ]


def layout_stats(mask_BxT: np.ndarray, train, min_rows: int = 1) -> dict[str, float]:
  """What the learner's calls compute for a batch: padded token positions against the
  real tokens (prompt + response) they hold, and the calls per update."""
  pieces = [p for mb in plan(mask_BxT, train, min_rows) for p in mb]
  stats = layout.token_counts(pieces, batch_lib.row_lengths(mask_BxT))
  return dict(stats, calls=len(pieces) / train.num_minibatches)


def piece(batch: dict[str, np.ndarray], p: layout.Piece, mesh, rules) -> dict:
  """A piece's arrays of `batch` (layout.Piece.device_arrays), on the mesh."""
  return {k: place(v, mesh, rules) for k, v in p.device_arrays(batch).items()}


def minibatch_update(programs, params, opt_state, batch, pieces, totals, attempted, mesh, rules):
  """One optimizer update over one minibatch with a learner's `programs` (zeros, grads,
  add, apply): its microbatches' gradients summed into one buffer (one call per piece),
  then the update. (params, opt_state, metrics on device)."""
  grads, acc = programs.zeros(params), None
  for p in pieces:
    grads, loss, metrics = programs.grads(params, piece(batch, p, mesh, rules), *totals, grads)
    acc = (loss, metrics) if acc is None else programs.add(acc, (loss, metrics))
  return programs.apply(params, opt_state, grads, *acc, np.int32(attempted))


class Learner:
  """Holds float32 master params, optimizer state and the (optional) reference params
  (in the compute dtype); updates them."""

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
  ):
    self.train = train
    self.static = make_static(model_cfg, train, temperature, remat, compute_dtype)
    self.loss_cfg = self.static.loss
    self.optimizer, self.schedule = make_optimizer(train, total_updates)
    self.mesh, self.rules = mesh, rules
    self.min_rows = sharding.shards("batch", mesh, rules)  # a call's rows split this way
    shapes = jax.eval_shape(lambda p: cast(p, jnp.float32), params)
    self.programs = p = build_programs(
        self.static, self.optimizer, shapes, mesh, rules, decode_rules, schedule=self.schedule
    )
    self.params = p.to_masters(params)
    self.opt_state = p.init_opt(self.params)
    # No reference params are held unless a KL term needs them.
    self.ref_params = p.to_reference(self.params) if needs_reference(train) else None
    self.attempted = 0  # optimizer updates tried; the skipped ones are in opt_state
    self.token_advantages = token_advantages(train)
    self._logprobs, self._zeros = p.logprobs, p.zeros
    self._grads, self._add, self._apply = p.grads, p.add, p.apply

  def state(self) -> tuple[dict[str, Any], dict]:
    """What a checkpoint keeps: the device arrays (masters, optimizer state with its
    skip count, reference params if held) and the host counter (JSON)."""
    arrays = {"params": self.params, "opt_state": self.opt_state}
    if self.ref_params is not None:
      arrays["ref_params"] = self.ref_params
    return arrays, {"attempted": self.attempted}

  def restore(self, arrays: dict[str, Any], host: dict) -> None:
    """Back to a `state()` (arrays restored in the shardings of this learner's own)."""
    self.params, self.opt_state = arrays["params"], arrays["opt_state"]
    self.ref_params = arrays.get("ref_params")
    self.attempted = host["attempted"]

  def decode_params(self):
    """The current params for the sampler: compute dtype, the sampler's layout."""
    return self.programs.decode_params(self.params)

  def _put(self, x: np.ndarray):
    return place(x, self.mesh, self.rules)

  def _plan(self, batch: dict[str, np.ndarray]) -> list[list[layout.Piece]]:
    return plan(batch["mask"], self.train, self.min_rows)

  def _piece(self, batch: dict[str, np.ndarray], p: layout.Piece) -> dict:
    return piece(batch, p, self.mesh, self.rules)

  def _warm_up_pieces(self, batch: dict[str, np.ndarray]) -> list[list[layout.Piece]]:
    """The pieces of every shape a batch of this padded length can produce: unpacked,
    its plan (every row full length); packed, one of rows x each possible row length."""
    budget = pack_len(self.train, batch["mask"].shape[1])
    if budget is None:
      return self._plan(batch)
    t = self.train
    rows = batch["mask"].shape[0] // (t.num_minibatches * t.num_microbatches)
    full = lambda r, T: layout.Piece(
        T=T,
        sample=np.broadcast_to(np.arange(r)[None, :, None], (1, r, T)).astype(np.int32),
        pos=np.broadcast_to(np.arange(T)[None, None], (1, r, T)).astype(np.int32),
    )
    shapes = layout.last_shapes(rows, budget, self.min_rows)
    return [[full(r, T) for r, T in shapes]]  # one minibatch, so `add` compiles too

  def warm_up(self, batch_size: int, lengths) -> int:
    """Compiles, ahead of time, every program an update at these padded lengths calls.

    Nothing runs: each program is lowered on the abstract shapes and shardings of the
    arrays it will be given (the next program's inputs are the last one's `out_info`), so
    params and optimizer state are untouched and no second copy is held. The compiled
    executables fill the jit caches that `update` then hits. Returns how many microbatch
    shapes were compiled.
    """
    on_mesh = self.mesh is not None
    compile_ = lambda fn, *args: _abstract(fn.lower(*args).compile().out_info, on_mesh)
    params, opt_state = _abstract((self.params, self.opt_state), on_mesh)
    logprob_params = [params] + (
        [_abstract(self.ref_params, on_mesh)] if self.ref_params is not None else []
    )
    grads0, seen = compile_(self._zeros, params), set()
    totals = (np.float32(1), np.float32(1))
    budget = pack_len(self.train, max(lengths))
    if budget is not None:  # packed rows: one budget, its few row lengths
      lengths = [max(budget, max(lengths))]
    for T in lengths:
      batch = _dummy_batch(batch_size, T, self.ref_params is not None, self.token_advantages)
      for pieces in self._warm_up_pieces(batch):
        acc = None
        for p in pieces:
          seen.add((p.packed, p.gather(batch["mask"]).shape))
          piece = self._piece(batch, p)
          for params_ in logprob_params:
            compile_(self._logprobs, params_, *_logprob_args(piece))
          grads, loss, metrics = compile_(self._grads, params, piece, *totals, grads0)
          out = (loss, metrics)  # as _minibatch sums them
          acc = out if acc is None else compile_(self._add, acc, out)
        if acc is not None:
          compile_(self._apply, params, opt_state, grads, *acc, np.int32(0))
    return len(seen)

  def logprobs(self, params, batch: dict[str, np.ndarray], plan=None) -> np.ndarray:
    """Logprobs [B, T] of the targets under params (0 past a microbatch's cut and on
    tokens no sample needs). Needs the batch's tokens, targets and mask (the mask decides
    the layout), or a plan from _plan."""
    pieces = [p for mb in (plan or self._plan(batch)) for p in mb]
    inputs = {k: batch[k] for k in ("tokens", "targets")}
    logps = [self._logprobs(params, *_logprob_args(self._piece(inputs, p)))[0] for p in pieces]
    out = np.zeros(batch["tokens"].shape, np.float32)
    for p, logp in zip(pieces, to_host(logps)):
      p.scatter(out, logp)
    return out

  def _minibatch(self, batch: dict[str, np.ndarray], pieces) -> dict:
    """One optimizer update over one minibatch: its microbatches' gradients summed into
    one buffer (one call per piece), then the update. Its metrics, on device."""
    rows = np.concatenate([p.batch_rows for p in pieces])
    totals = _totals(self.loss_cfg, batch["mask"][rows], batch["stale"][rows])
    self.params, self.opt_state, m = minibatch_update(
        self.programs, self.params, self.opt_state, batch, pieces, totals, self.attempted,
        self.mesh, self.rules,
    )  # fmt: skip
    self.attempted += 1
    return m

  def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """All of one RL step's optimizer updates; returns train/* metrics (one host read)."""
    t, cfg = self.train, self.loss_cfg
    plan = self._plan(batch)
    pieces = [p for mb in plan for p in mb]
    counts = layout.token_counts(pieces, batch_lib.row_lengths(batch["mask"]))
    behavior = batch["behavior"]  # on the host only: the device needs the weights
    original_mask = batch["mask"]  # the drawn tokens (a mask-mode weight may drop some)
    extra = {}
    if cfg.ratio_anchor == "behavior":  # coupled PPO: no old-logprob pass, no weight
      old_logp = behavior
    else:
      old_logp = self.logprobs(self.params, batch, plan)
      same_version = (batch["mask"] > 0) & ~batch["stale"]
      diff = np.abs(behavior - old_logp)[same_version]
      extra["train/logprob_diff_mean"] = float(diff.mean()) if diff.size else 0.0
      trained = trained_mask(cfg, batch["mask"], batch["stale"])
      weights = corrections.importance_weights(
          cfg.is_level, cfg.is_mode, cfg.is_low, cfg.tis_cap, old_logp, behavior, trained
      )
      extra.update({f"train/{k}": v for k, v in weights.metrics.items()})
      batch = dict(batch, is_weight=weights.weight_BxT, mask=batch["mask"] * weights.keep_BxT)
    batch = dict(batch, old_logp=old_logp)
    batch.setdefault("is_weight", np.ones_like(batch["mask"]))
    if self.ref_params is not None:
      batch["ref_logp"] = self.logprobs(self.ref_params, batch, plan)
    if t.reward_kl_coef > 0:  # REINFORCE++ with the KL in the reward: per token
      drawn = original_mask > 0
      batch["advantages"] = advantages_lib.reinforce_pp_kl_advantages(
          batch["rewards"],
          old_logp,
          batch["ref_logp"],
          drawn,
          t.reward_kl_coef,
          whiten_mask=trained_mask(t, drawn, batch["stale"]),
      )
    batch = {k: v for k, v in batch.items() if k in UPDATE_KEYS}  # what goes to the devices
    metrics = [self._minibatch(batch, pieces) for _ in range(t.ppo_epochs) for pieces in plan]
    metrics, skipped = to_host((metrics, self.opt_state.total_notfinite))
    mean = lambda k: float(np.mean([m[k] for m in metrics]))
    return {
        "train/loss": mean("loss"),
        "train/pg_loss": mean("pg_loss"),
        "train/pg_clipfrac": mean("pg_clipfrac"),
        "train/kl": mean("kl"),
        "train/entropy": mean("entropy"),
        "train/grad_norm": mean("grad_norm"),
        "train/lr": mean("lr"),
        "train/ratio_mean": mean("ratio_mean"),
        **extra,
        "train/padded_per_real": counts["padded_per_real"],  # positions computed / tokens
        "train/skipped_updates": float(skipped),
        "train/updates": float(self.attempted - int(skipped)),
    }
