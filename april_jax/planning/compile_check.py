"""Every program a run uses, compiled at a config's real shapes, with no weights.

  python -m april_jax.plan --config=configs/qwen3_8b.py --compile --devices=8 \
      --device_memory_gb=80

Params, optimizer state and the slot state are abstract (`jax.eval_shape`, with the
shardings the run gives them); each program is lowered and compiled for the config's
mesh on fake CPU devices, and XLA reports, per device, its argument, output, temporary
and aliased (donated) bytes. The HLO names its collectives and their result sizes.

A run keeps some state on the devices for its whole life (the resident set: float32
masters, AdamW moments, the sampler's decode copy of the params, the slot state with
its KV cache, reference params when a KL term needs them). With LoRA (train.lora.rank >
0) the masters and moments are the adapters' and the base is held once, frozen in the
compute dtype in the learner's layout: the learner's programs take it beside the
adapters, the decode copy is the adapters merged into it, and the reference policy (a
KL term) is the base itself, its logprobs computed with no adapters. A program's peak is
the resident set plus what the program adds: its non-resident arguments, its outputs
that are not written in place, and its temporaries. The run fits when the largest peak
fits the device. CPU compiles blockwise attention where NVIDIA GPUs run cuDNN's flash
kernel, which needs less, and computes 16-bit floats in float32 a layer at a time
(`GPU_LIKE`), so the CPU numbers bound what a GPU holds.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from april_jax import buckets, sharding
from april_jax.models import lora as lora_lib
from april_jax.models import qwen3
from april_jax.rl import advantages
from april_jax.rl import batch as batch_lib
from april_jax.rl import critic as critic_lib
from april_jax.rl import layout
from april_jax.rl import step as step_lib
from april_jax.rl import update as update_lib
from april_jax.sampler.speculation.drafts import DraftInputs
from april_jax.sampler.engine_config import EngineConfig
from april_jax.sampler import rows as rows_lib
from april_jax.sampler import slot_ops
from april_jax.planning.memory import optimizer_state_name

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
# XLA's CPU compiler computes 16-bit floats in float32 and hoists the upcasts of
# loop-invariant weights out of the layer loop: a float32 copy of every 16-bit weight
# (twice the decode copy, or a LoRA run's frozen base) in every program that reads them. A
# GPU computes in bfloat16 and makes no such copy, so a program with 16-bit float inputs
# is compiled without that hoisting (a layer's upcast, inside the loop, remains); one of
# float32 weights (a full fine-tune's learner) as XLA compiles it.
GPU_LIKE = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
# The numbers are those of XLA's default CPU compiler whatever XLA_FLAGS asks of it (tests
# turn its fusion emitters off to compile faster, which changes the temporaries).
_DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_OP = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")


@dataclasses.dataclass
class Program:
  """One compiled program's per-device memory (bytes) and collectives."""

  name: str
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  resident_argument_bytes: int  # arguments that belong to the resident set
  collectives: list[tuple[str, int]]  # (kind, result bytes) per op in the HLO

  @property
  def added_bytes(self) -> int:
    """What the program holds beyond the resident set while it runs."""
    return (
        self.argument_bytes
        - self.resident_argument_bytes
        + self.output_bytes
        - self.alias_bytes
        + self.temp_bytes
    )

  def largest_collective(self) -> int:
    return max((b for _, b in self.collectives), default=0)


@dataclasses.dataclass
class Report:
  resident: dict[str, int]  # bytes per device of each resident item
  programs: list[Program]
  device_bytes: float  # 0 = unknown

  @property
  def resident_bytes(self) -> int:
    return sum(self.resident.values())

  def peak(self, program: Program) -> int:
    return self.resident_bytes + program.added_bytes

  @property
  def peak_bytes(self) -> int:
    return max(self.peak(p) for p in self.programs)

  @property
  def fits(self) -> bool:
    return self.device_bytes <= 0 or self.peak_bytes <= self.device_bytes

  def table(self) -> str:
    gb = lambda b: f"{b / 1e9:9.2f}"
    lines = ["resident per device (GB)"]
    lines += [f"  {name:<32}{gb(b)}" for name, b in self.resident.items()]
    lines.append(f"  {'total':<32}{gb(self.resident_bytes)}")
    lines.append(
        f"{'program (GB per device)':<28}{'args':>9}{'outputs':>9}{'temps':>9}"
        f"{'aliased':>9}{'peak':>9}  collectives (count, largest GB)"
    )
    for p in self.programs:
      kinds = {}
      for kind, b in p.collectives:
        count, largest = kinds.get(kind, (0, 0))
        kinds[kind] = (count + 1, max(largest, b))
      coll = ", ".join(f"{k} {n} x <= {b / 1e9:.3f}" for k, (n, b) in sorted(kinds.items()))
      lines.append(
          f"{p.name:<28}{gb(p.argument_bytes)}{gb(p.output_bytes)}"
          f"{gb(p.temp_bytes)}{gb(p.alias_bytes)}{gb(self.peak(p))}  {coll or '-'}"
      )
    verdict = "fits" if self.fits else "DOES NOT FIT"
    capacity = f" of {self.device_bytes / 1e9:.1f} GB" if self.device_bytes > 0 else ""
    lines.append(f"peak {self.peak_bytes / 1e9:.2f} GB per device{capacity}: {verdict}")
    return "\n".join(lines)

  def to_json(self) -> dict:
    return {
        "fits": self.fits,
        "peak_bytes_per_device": self.peak_bytes,
        "device_bytes": self.device_bytes,
        "resident_bytes": self.resident,
        "programs": {
            p.name: {
                "peak_bytes": self.peak(p),
                "argument_bytes": p.argument_bytes,
                "output_bytes": p.output_bytes,
                "temp_bytes": p.temp_bytes,
                "alias_bytes": p.alias_bytes,
                "largest_collective_bytes": p.largest_collective(),
            }
            for p in self.programs
        },
    }


# ------------------------------------------------------------------------- helpers


def device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize  # typed keys too
  return total


def collectives(hlo_text: str) -> list[tuple[str, int]]:
  """(kind, result bytes) of every collective op in an HLO module's text."""
  out = []
  for types, kind, _ in _OP.findall(hlo_text):
    size = sum(
        int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _DTYPE_BYTES[dt]
        for dt, dims in _SHAPE.findall(types)
    )
    out.append((kind, size))
  return out


def _abstract(shapes, shardings):
  return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )


def _replicated(mesh, shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def compile_program(
    name: str, fn, args: tuple, resident: tuple[bool, ...], static_args: tuple = ()
) -> Program:
  """Lowers and compiles fn(*static_args, *args); `resident` marks the resident args."""
  dtypes = [jnp.dtype(x.dtype) for x in jax.tree.leaves(args) if hasattr(x, "dtype")]
  sixteen = any(jnp.issubdtype(d, jnp.floating) and d.itemsize == 2 for d in dtypes)
  options = dict(_DEFAULT_EMITTERS, **(GPU_LIKE if sixteen else {}))
  compiled = fn.lower(*static_args, *args).compile(options)
  memory = compiled.memory_analysis()
  return Program(
      name=name,
      argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes),
      temp_bytes=int(memory.temp_size_in_bytes),
      alias_bytes=int(memory.alias_size_in_bytes),
      resident_argument_bytes=sum(device_bytes(a) for a, r in zip(args, resident) if r),
      collectives=collectives(compiled.as_text()),
  )


# ------------------------------------------------------------------------ programs


def _sampler_fns(config, cfg: qwen3.Qwen3Config, mesh):
  """The run's engine settings, its device programs and its slot state (abstract)."""
  econf = EngineConfig.from_run_config(config)
  decode_rules = tuple(tuple(x) for x in config.mesh.decode_rules)
  fns = slot_ops.device_fns(cfg, econf.device_settings(), mesh, decode_rules)
  return econf, fns, _abstract(jax.eval_shape(fns.init), fns.state_sharding)


def _prefill_programs(fns, mesh, decode_params, T: int, B: int, prompt: int) -> list:
  """prefill: one sequence of the longest length T, and B prompts together at the
  longest prompt bucket."""
  tokens = lambda *shape: _replicated(mesh, shape, jnp.int32)
  return [
      compile_program("prefill", fns.prefill_kv, (decode_params, tokens(1, T)), (True, False)),
      compile_program(
          "prefill (prompts together)",
          fns.prefill_kv,
          (decode_params, tokens(B, prompt)),
          (True, False),
      ),
  ]


def _insert_programs(cfg: qwen3.Qwen3Config, econf, fns, state, mesh, B, prompt) -> list:
  """insert: one sequence's KV at the longest length, B prompts' at the longest prompt
  bucket, and a snapshot's rows restored."""
  L, K, H, T = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, econf.max_len
  kv_dtype = jnp.dtype(econf.kv_dtype)
  rep = functools.partial(_replicated, mesh)
  routes = lambda r, t: (
      rep((r, t) + cfg.route_shape, jnp.uint8) if cfg.num_experts else None
  )  # a Qwen3-MoE model's KV carries each position's experts
  kv = lambda r, t: qwen3.KVCache(
      *(
          jax.ShapeDtypeStruct((L, r, t, K, H), kv_dtype, sharding=fns.kv_sharding)
          for _ in range(2)
      ),
      routes(r, t),
  )
  rows = lambda w: jax.tree.map(
      lambda x: rep(x.shape, x.dtype), rows_lib.rows_from_records([], w, T, [])
  )
  i32 = jnp.int32
  args = lambda r, w, t=T: (state, kv(r, t), rows(w), rep((w,), i32), rep((w,), i32))
  W, Wr = econf.insert_width, econf.snapshot_width
  resident = (True, False, False, False, False, False)
  insert = lambda name, *a: compile_program(name, fns.insert, a + (state.page_table,), resident)
  return [
      insert("insert", *args(1, W)),
      insert("insert (prompts together)", *args(B, W, prompt)),
      insert("insert_rows (restore)", *args(Wr, Wr)),
  ]


def _decode_programs(econf, fns, state, mesh, decode_params) -> list:
  """decode (one call of sync_every steps; the speculative one too, with speculation)
  and a snapshot's KV copy at the longest length."""
  rep = functools.partial(_replicated, mesh)
  i32, Wr = jnp.int32, econf.snapshot_width
  args = (decode_params, state, rep((), i32), rep((1,), i32), rep((), i32), state.page_table)
  resident = (True, True, False, False, False, False)
  speculate = []
  if fns.speculate is not None:
    S, M, H = econf.num_slots, econf.max_len, econf.speculative_history
    inputs = DraftInputs(rep((S, M), i32), rep((S, H, M), i32), rep((S, H), i32))
    slots = rep((S,), i32)  # the widest verify pass: every slot
    speculate.append(
        compile_program(
            "decode (speculative)", fns.speculate, args + (inputs, slots), resident + (False,) * 2
        )
    )
  return [
      compile_program("decode", fns.decode, args, resident),
      *speculate,
      compile_program(
          "extract_kv (snapshot)",
          fns.extract_kv,
          (state, rep((Wr,), i32), econf.max_len, state.page_table),
          (True, False, False, False),
      ),
  ]


def _sampler_programs(config, cfg: qwen3.Qwen3Config, mesh, decode_params) -> tuple:
  """The sampler's programs at their largest shapes; the slot state's bytes and those of
  the KV kept from the prefill call that held a group's prompt (per device)."""
  econf, fns, state = _sampler_fns(config, cfg, mesh)
  # Prompts that start together: prefill_rows of them at the longest prompt bucket.
  prompt = buckets.bucket(config.data.max_prompt_len, econf.min_bucket, econf.max_len)
  B = econf.prefill_rows(prompt)
  programs = _prefill_programs(fns, mesh, decode_params, econf.max_len, B, prompt)
  programs += _insert_programs(cfg, econf, fns, state, mesh, B, prompt)
  programs += _decode_programs(econf, fns, state, mesh, decode_params)
  if econf.hold_stopped and econf.feed_given == "prefill":  # an environment's observations
    rep, W = functools.partial(_replicated, mesh), econf.insert_width
    T = buckets.bucket(min(econf.feed_len, econf.max_len), econf.min_bucket, econf.max_len)
    args = (decode_params, state, rep((W,), jnp.int32), rep((W,), jnp.int32), T, state.page_table)
    programs.append(
        compile_program("feed (observations)", fns.feed, args, (True, True) + (False,) * 4)
    )
  # The KV of the prefill call that held the last prompt, kept for the rest of its group
  # (sampler/prefill_cache.py).
  kept = jax.eval_shape(fns.prefill_kv, decode_params, _replicated(mesh, (B, prompt), jnp.int32))
  kv_sh = slot_ops.kv_shardings(cfg, fns.kv_sharding)
  return programs, device_bytes(state), device_bytes(_abstract(kept, kv_sh))


def lora_spec(config) -> lora_lib.LoraSpec | None:
  """The run's LoRA spec (train.lora), or None when every weight trains."""
  return lora_lib.LoraSpec.from_config(config.train.lora)


def unmerged(config) -> bool:
  """Whether a LoRA run's sampler decodes the frozen base with the adapters beside it."""
  return lora_spec(config) is not None and config.train.lora.decode == "unmerged"


def base_name(config, critic: bool = False) -> str:
  """The resident item of a LoRA run's frozen base (the policy's, or the critic's own)."""
  return f"{'critic ' if critic else ''}base params (frozen, {config.model.dtype})"


def _frozen_base(config, cfg: qwen3.Qwen3Config, shardings):
  """A frozen base in the compute dtype, abstract, in `shardings` (the learner's layout)."""
  dtype = jnp.dtype(config.model.dtype)
  return _abstract(
      jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0), dtype)), shardings
  )


def _learner_arrays(config, cfg: qwen3.Qwen3Config, mesh):
  """The learner's programs, its trained params and frozen base (None without LoRA), and
  its resident arrays as sharded shapes: masters and optimizer state (with LoRA: the
  frozen base, the adapters and their optimizer state), decode params and (with KL,
  without LoRA) reference params."""
  r, t, m = config.rollout, config.train, config.model
  rules = tuple(tuple(x) for x in config.mesh.rules)
  decode_rules = tuple(tuple(x) for x in config.mesh.decode_rules)
  spec = lora_spec(config)
  static = update_lib.make_static(
      cfg, t, r.temperature, m.remat, m.dtype, lora=spec, routing_replay=m.routing_replay
  )
  optimizer, schedule = step_lib.make_optimizer(
      t if spec is None else update_lib.lora_train(t), max(config.num_steps, 1) * t.num_minibatches
  )
  if spec is None:
    shapes = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0), jnp.float32))
  else:
    shapes = jax.eval_shape(lambda: lora_lib.init(cfg, spec, jax.random.key(0)))
  progs = update_lib.build_programs(
      static, optimizer, shapes, mesh, rules, decode_rules, schedule=schedule
  )
  params = _abstract(shapes, progs.param_sh)
  opt_state = _abstract(jax.eval_shape(optimizer.init, shapes), progs.opt_sh)
  if spec is None:
    frozen = None
    arrays = {"master params (float32)": params, optimizer_state_name(config): opt_state}
  else:
    frozen = _frozen_base(config, cfg, progs.frozen_sh)
    arrays = {
        base_name(config): frozen,
        "LoRA adapters (float32)": params,
        "adapter optimizer state (float32)": opt_state,
    }
  if unmerged(config):  # the sampler reads the frozen base: only the adapters are its own
    decode = jax.eval_shape(progs.decode_adapters, params)
    arrays["decode params"] = _abstract(decode, progs.param_sh)
  else:
    decode = jax.eval_shape(progs.decode_params, params, frozen)
    arrays["decode params"] = _abstract(decode, progs.decode_sh)
  if update_lib.needs_reference(t) and spec is None:  # with LoRA the base is the reference
    arrays["reference params"] = _abstract(jax.eval_shape(progs.to_compute, shapes), progs.param_sh)
  return progs, arrays, params, frozen


def _longest_microbatch(config, cfg: qwen3.Qwen3Config, mesh, with_ref: bool) -> dict:
  """One gradient call's arrays [M, rows, T] at the longest training row, as placed:
  packed (train.packing), one call of rows x pack_len with its positions, segments and
  per-token advantages; else rows at the longest bucket (all microbatches in one call
  unless cut by length)."""
  r = config.rollout
  t = layout.train_section(config)
  max_len = config.data.max_prompt_len + r.max_response_len
  T = batch_lib.bucket_len(max_len, max_len=max_len)
  rows = r.batch_size * r.n_samples_per_prompt // (t.num_minibatches * t.num_microbatches)
  M = 1 if bool(t.microbatch_by_length) and t.num_microbatches > 1 else t.num_microbatches
  packed = layout.pack_len(t, T)
  if packed is not None:
    M, T = 1, packed
  rules = tuple(tuple(x) for x in config.mesh.rules)
  place = lambda dtype, *shape: jax.ShapeDtypeStruct(
      shape, dtype, sharding=step_lib.microbatch_sharding(shape, mesh, rules)
  )
  f32 = jnp.float32
  mb = dict(tokens=place(jnp.int32, M, rows, T), mask=place(f32, M, rows, T))
  mb.update(targets=mb["tokens"], is_weight=mb["mask"], old_logp=mb["mask"])
  per_token = update_lib.token_advantages(config.train) or packed is not None
  mb.update(
      stale=place(bool, M, rows, T), advantages=mb["mask"] if per_token else place(f32, M, rows)
  )
  if packed is not None:
    mb.update(positions=mb["tokens"], segments=mb["tokens"])
  if update_lib.selects_tokens(config.train):
    mb.update(selected=mb["mask"])
  if cfg.num_experts:  # the rollout's recorded routes
    mb.update(routes=place(jnp.uint8, M, rows, T, *cfg.route_shape))
  return dict(mb, ref_logp=mb["mask"]) if with_ref else mb


def _forward_inputs(mb: dict, keys) -> dict:
  """The arrays of microbatch `mb` a forward program reads: `keys`, and packed, the rows'
  positions and segments."""
  return {k: v for k, v in mb.items() if k in keys or k in ("positions", "segments")}


def _learner_programs(config, cfg: qwen3.Qwen3Config, mesh):
  progs, arrays, params, frozen = _learner_arrays(config, cfg, mesh)
  lora = frozen is not None
  opt_state = arrays["adapter optimizer state (float32)" if lora else optimizer_state_name(config)]
  with_ref = update_lib.needs_reference(config.train)
  mb = _longest_microbatch(config, cfg, mesh, with_ref=with_ref)
  inputs = _forward_inputs(mb, update_lib.FORWARD_KEYS)
  if unmerged(config):
    decode = compile_program("decode_adapters (cast)", progs.decode_adapters, (params,), (True,))
  else:
    decode_name = "decode_params (merge)" if lora else "decode_params (cast)"
    decode = compile_program(decode_name, progs.decode_params, (params, frozen), (True, True))
  programs = [
      decode,
      compile_program("old logprobs", progs.forward, (params, frozen, inputs), (True, True, False)),
  ]
  if with_ref:  # with LoRA: the base alone (params None), no copy held
    reference = None if lora else arrays["reference params"]
    args = (reference, frozen, inputs)
    programs.append(compile_program("reference logprobs", progs.forward, args, (True, True, False)))
  scalar = _replicated(mesh, (), jnp.float32)
  args = (params, frozen, mb, (scalar, scalar), params)  # the gradient sum: like the params
  programs.append(compile_program("gradients", progs.grads, args, (True, True) + (False,) * 3))
  _, loss, metrics = jax.eval_shape(progs.grads, *args)
  rep_like = lambda x: _replicated(mesh, x.shape, x.dtype)
  acc = (rep_like(loss), jax.tree.map(rep_like, metrics))
  args = (params, opt_state, params, *acc, _replicated(mesh, (), jnp.int32))
  resident = (True, True) + (False,) * 4
  programs.append(compile_program("optimizer update", progs.apply, args, resident))
  if config.train.advantage in advantages.CRITIC_ADVANTAGES:
    programs += _critic_programs(config, cfg, mesh, mb, arrays)
  decode_params = arrays["decode params"]
  if unmerged(config):  # what the sampler's programs take: the base, the adapters beside it
    decode_params = lora_lib.decode_view(frozen, decode_params)
  return programs, {k: device_bytes(v) for k, v in arrays.items()}, decode_params


def _critic_params(config, cfg: qwen3.Qwen3Config, mesh, rules, arrays: dict):
  """The critic's trained params' shapes and its frozen base (None without LoRA: with
  LoRA the policy's, from `arrays`, or with train.critic_path its own, added to them)."""
  spec = lora_spec(config)
  if spec is None:
    shapes = jax.eval_shape(
        lambda: critic_lib.critic_params(qwen3.init_params(cfg, jax.random.key(0)), cfg)
    )
    return shapes, None
  shapes = jax.eval_shape(lambda: critic_lib.lora_params(cfg, spec, jax.random.key(0)))
  if not config.train.critic_path:
    return shapes, arrays[base_name(config)]  # shared: no bytes of its own
  frozen = _frozen_base(config, cfg, qwen3.param_shardings(cfg, mesh, rules))
  arrays[base_name(config, critic=True)] = frozen
  return shapes, frozen


def _critic_programs(config, cfg: qwen3.Qwen3Config, mesh, mb: dict, arrays: dict) -> list:
  """PPO's critic: its values, gradients and update at the longest microbatch; adds its
  params and optimizer state (with LoRA its adapters and head, and a base of its own
  when train.critic_path gives one) to `arrays` (the resident set)."""
  t, m = config.train, config.model
  rules = tuple(tuple(x) for x in config.mesh.rules)
  static = critic_lib.make_static(cfg, t, m.remat, m.dtype, lora_spec(config))
  optimizer, schedule = step_lib.make_optimizer(
      critic_lib.critic_train(t), max(config.num_steps, 1) * t.num_minibatches * t.ppo_epochs
  )
  shapes, frozen = _critic_params(config, cfg, mesh, rules, arrays)
  progs = critic_lib.build_programs(static, optimizer, schedule, shapes, mesh, rules)
  name = "critic params (float32)" if frozen is None else "critic adapters and head (float32)"
  params = arrays[name] = _abstract(shapes, progs.param_sh)
  opt_state = _abstract(jax.eval_shape(optimizer.init, shapes), progs.opt_sh)
  arrays["critic optimizer state (float32)"] = opt_state
  inputs = _forward_inputs(mb, ("tokens",))
  cmb = dict(inputs, mask=mb["mask"], old_values=mb["mask"], returns=mb["mask"])
  totals = (_replicated(mesh, (), jnp.float32),)
  args = (params, frozen, cmb, totals, params)
  programs = [
      compile_program(
          "critic values", progs.forward, (params, frozen, inputs), (True, True, False)
      ),
      compile_program("critic gradients", progs.grads, args, (True, True) + (False,) * 3),
  ]
  _, loss, metrics = jax.eval_shape(progs.grads, *args)
  rep_like = lambda x: _replicated(mesh, x.shape, x.dtype)
  args = (params, opt_state, params, rep_like(loss), jax.tree.map(rep_like, metrics))
  args += (_replicated(mesh, (), jnp.int32),)
  programs.append(compile_program("critic update", progs.apply, args, (True, True) + (False,) * 4))
  return programs


def check(config, cfg: qwen3.Qwen3Config, mesh, device_bytes_limit: float = 0.0) -> Report:
  """Compiles every program of a run of `config` on `mesh`; the per-device report."""
  learner, resident, decode_params = _learner_programs(config, cfg, mesh)
  sampler, state_bytes, prompt_bytes = _sampler_programs(config, cfg, mesh, decode_params)
  resident["slot state (KV cache)"] = state_bytes
  resident["the last prefill's KV (kept)"] = prompt_bytes
  return Report(resident=resident, programs=sampler + learner, device_bytes=device_bytes_limit)


@dataclasses.dataclass
class SplitReport:
  """A split run's two reports: the rollout mesh's programs and the learner mesh's."""

  rollout: Report
  learner: Report
  rollout_shape: tuple = ()  # the meshes' (axis, size) pairs
  learner_shape: tuple = ()

  @property
  def peak_bytes(self) -> int:
    return max(self.rollout.peak_bytes, self.learner.peak_bytes)

  @property
  def fits(self) -> bool:
    return self.rollout.fits and self.learner.fits

  def table(self) -> str:
    return (
        f"rollout mesh {dict(self.rollout_shape)}\n{self.rollout.table()}\n"
        f"learner mesh {dict(self.learner_shape)}\n{self.learner.table()}"
    )

  def to_json(self) -> dict:
    return {
        "rollout": self.rollout.to_json(),
        "learner": self.learner.to_json(),
        "peak_bytes_per_device": int(self.peak_bytes),
        "fits": self.fits,
    }


def check_split(config, cfg: qwen3.Qwen3Config, rollout_mesh, learner_mesh, limit: float = 0.0):
  """Compiles a split run's programs, each on its mesh (mesh.rollout_devices > 0): the
  learner's with the decode copies it casts and holds until published (two at most), the
  sampler's over decode weights in the rollout mesh's layout."""
  learner, resident, decode_params = _learner_programs(config, cfg, learner_mesh)
  waiting = resident.pop("decode params")
  resident["decode copies waiting to publish (2)"] = 2 * waiting
  decode_rules = tuple(tuple(x) for x in config.mesh.decode_rules)
  target = qwen3.param_shardings(cfg, rollout_mesh, decode_rules)
  on_rollout = _abstract(decode_params, target)
  sampler, state_bytes, prompt_bytes = _sampler_programs(config, cfg, rollout_mesh, on_rollout)
  rollout_resident = {
      "decode params": device_bytes(on_rollout),
      "slot state (KV cache)": state_bytes,
      "the last prefill's KV (kept)": prompt_bytes,
  }
  return SplitReport(
      rollout=Report(resident=rollout_resident, programs=sampler, device_bytes=limit),
      learner=Report(resident=resident, programs=learner, device_bytes=limit),
      rollout_shape=tuple(rollout_mesh.shape.items()),
      learner_shape=tuple(learner_mesh.shape.items()),
  )
