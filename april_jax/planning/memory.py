"""What fits: bytes per device for a config, by arithmetic (the command is
`python -m april_jax.plan`; planning/compile_check.py compiles every program instead).

The arithmetic plan (instant; a run makes it before allocating anything) follows the
compiled programs' structure (planning/compile_check.py): a resident set held for the
whole run, exact from the shardings (float32 masters and AdamW moments under the
learner's rules, or with LoRA the frozen base in the compute dtype and the float32
adapters and their moments; the 16-bit decode copy and the slot state under the
sampler's), plus, per program, what it adds while it runs (its inputs that are not
resident, outputs not written in place, the largest temporaries; with LoRA gradients
and updates of the adapters' size). The peak over programs must fit a device. The
temporaries are estimates; a test keeps each program's peak within 15% of what XLA
compiles for the Qwen3-8B, 4B and 8B LoRA configs (compiled as a GPU runs 16-bit
programs: compile_check.GPU_LIKE). `native_16bit=False` adds what a backend without
16-bit float arithmetic (XLA's CPU, running) holds: 16-bit weights upcast to float32
inside a program. On the host: the partial buffer's KV per snapshot, worst case (every
slot parked at full length in mode kv).

Split meshes (mesh.rollout_devices > 0, docs/async.md): each mesh is sized for what it
holds (plan_part): the rollout mesh its decode weights, the KV pool and the sampler's
programs, plus one weight arriving at a publish; the learner mesh the float32 masters and
optimizer state (or LoRA's frozen base and adapters), activations, a reference model or
critic where set, and the decode copies it casts and holds until the rollout takes them
(two at most). The run fits when both do. Which split to choose: planning/split.py.
"""

from __future__ import annotations

import dataclasses
import math

from april_jax import buckets, sharding
from april_jax.models import qwen3
from april_jax.models import lora as lora_lib
from april_jax.rl import advantages
from april_jax.rl import batch as batch_lib
from april_jax.rl import layout
from april_jax.sampler.engine_config import EngineConfig

GB = 1e9


def dtype_bytes(name: str) -> int:
  return {"float32": 4, "bfloat16": 2}[name]


@dataclasses.dataclass
class Plan:
  resident: dict[str, float]  # bytes per device held for the whole run
  programs: dict[str, float]  # bytes per device each program adds while it runs
  host_buffer_bytes: float  # worst case held by the partial buffer on the host
  device_capacity: float  # 0 = unknown

  @property
  def resident_total(self) -> float:
    return sum(self.resident.values())

  def peak(self, program: str) -> float:
    return self.resident_total + self.programs[program]

  @property
  def device_total(self) -> float:
    return max(self.peak(name) for name in self.programs)

  @property
  def fits(self) -> bool:
    return self.device_capacity <= 0 or self.device_total <= self.device_capacity

  def to_json(self) -> dict:
    """The numbers of `table`, in bytes (the last line `plan` prints, as with --compile)."""
    return {
        "resident_bytes": {k: int(v) for k, v in self.resident.items()},
        "program_bytes": {k: int(v) for k, v in self.programs.items()},
        "peak_bytes_per_device": int(self.device_total),
        "host_buffer_bytes": int(self.host_buffer_bytes),
        "device_capacity_bytes": int(self.device_capacity),
        "fits": self.fits,
    }

  def table(self) -> str:
    lines = [f"{'resident (GB per device)':<34}"]
    lines += [f"  {name:<32}{value / GB:>10.2f}" for name, value in self.resident.items()]
    lines.append(f"{'program (GB per device)':<34}{'adds':>10}{'peak':>10}")
    lines += [
        f"  {name:<32}{added / GB:>10.2f}{self.peak(name) / GB:>10.2f}"
        for name, added in self.programs.items()
    ]
    lines.append(f"{'peak':<34}{self.device_total / GB:>20.2f}")
    if self.device_capacity > 0:
      lines.append(f"{'capacity':<34}{self.device_capacity / GB:>20.2f}")
    lines.append(
        f"{'host: buffer KV per snapshot (max)':<34}" f"{self.host_buffer_bytes / GB:>20.2f}"
    )
    return "\n".join(lines)


def kv_bytes_per_token(cfg: qwen3.Qwen3Config, kv_dtype: str) -> int:
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(kv_dtype)


def _split(size: int, logical: str, mesh, rules) -> int:
  """How many ways one dim of this logical axis and size is split on the mesh."""
  spec = sharding.logical_to_spec((logical,), (size,), mesh, rules)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return math.prod(mesh.shape[a] for a in axes)


def params_bytes(cfg: qwen3.Qwen3Config, mesh, rules, itemsize: int) -> float:
  """Bytes one device holds of the params under these rules."""
  import jax  # pylint: disable=g-import-not-at-top

  shapes = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0)))
  return _tree_bytes(qwen3.param_logical_axes(cfg), shapes, mesh, rules, itemsize)


def critic_bytes(cfg: qwen3.Qwen3Config, mesh, rules, itemsize: int) -> float:
  """Bytes one device holds of PPO's critic (the backbone and a scalar head)."""
  import jax  # pylint: disable=g-import-not-at-top

  from april_jax.rl import critic  # pylint: disable=g-import-not-at-top

  shapes = jax.eval_shape(
      lambda: critic.critic_params(qwen3.init_params(cfg, jax.random.key(0)), cfg)
  )
  return _tree_bytes(critic.logical_axes(cfg), shapes, mesh, rules, itemsize)


def lora_bytes(cfg: qwen3.Qwen3Config, spec: lora_lib.LoraSpec, mesh, rules) -> float:
  """Bytes one device holds of float32 LoRA adapters, each factor sharded like the side
  of the weight it touches (models/lora.py)."""
  import jax  # pylint: disable=g-import-not-at-top

  shapes = jax.eval_shape(lambda: lora_lib.init(cfg, spec, jax.random.key(0)))
  return _tree_bytes(lora_lib.logical_axes(cfg, spec), shapes, mesh, rules, 4)


def _lora_critic_bytes(x: "PlanInputs") -> float:
  """A LoRA critic's trained params on one device: its adapters and its float32 head."""
  head = x.cfg.hidden_size / _split(x.cfg.hidden_size, "norm", x.mesh, x.rules) + 1
  return lora_bytes(x.cfg, x.lora, x.mesh, x.rules) + 4 * head


def largest_target_bytes(cfg: qwen3.Qwen3Config, targets, mesh, rules, itemsize: int) -> float:
  """Bytes one device holds of the largest of these layer-stacked projections."""
  import jax  # pylint: disable=g-import-not-at-top

  shapes = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0)))["layers"]
  axes = qwen3.param_logical_axes(cfg)["layers"]
  return max(_tree_bytes({t: axes[t]}, {t: shapes[t]}, mesh, rules, itemsize) for t in targets)


def _tree_bytes(axes, shapes, mesh, rules, itemsize: int) -> float:
  import jax  # pylint: disable=g-import-not-at-top

  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
  total = 0.0
  for logical, leaf in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(shapes)):
    spec = sharding.logical_to_spec(logical, leaf.shape, mesh, rules)
    split = math.prod(
        math.prod(mesh.shape[a] for a in ((s,) if isinstance(s, str) else s))
        for s in spec
        if s is not None
    )
    total += math.prod(leaf.shape) * itemsize / split
  return total


def make_plan(
    config,
    cfg: qwen3.Qwen3Config,
    num_devices: int,
    device_bytes: float = 0.0,
    native_16bit: bool = True,
):
  """The plan of a run on `num_devices` devices: one mesh's (colocated), or with
  mesh.rollout_devices > 0 each mesh's (SplitPlan: the rollout's and the learner's, each
  for what it holds)."""
  if config.mesh.rollout_devices:
    return make_split_plan(config, cfg, num_devices, device_bytes, native_16bit)
  return plan_part(config, cfg, num_devices, config.mesh.shape, device_bytes, native_16bit)


def plan_part(
    config, cfg, num_devices: int, mesh_shape, device_bytes, native_16bit, part: str = "both"
) -> Plan:
  """One mesh's plan: `part` "both" (colocated), "rollout" (the engine, its weights and
  KV pool) or "learner" (masters, optimizer, activations, the decode copies waiting to be
  published)."""
  x = PlanInputs.of(config, cfg, num_devices, mesh_shape)
  resident, programs = {}, {}
  if part in ("both", "rollout"):
    resident.update(_sampler_resident(x))
    programs.update(_sampler_programs(x, native_16bit))
  if part in ("both", "learner"):
    resident.update(_learner_resident(x))
    programs.update(_learner_programs(x))
  cast = [k for k in programs if k.startswith("decode_params") or k.startswith("decode_adapters")]
  if part == "rollout":  # the learner casts; the rollout takes a weight at a time
    for k in cast:
      del programs[k]
    layer_weights = tuple(qwen3.param_logical_axes(cfg)["layers"])  # the experts too
    programs["publish (one weight arriving)"] = largest_target_bytes(
        cfg, layer_weights, x.mesh, x.decode_rules, x.cb
    )
  if part == "learner":  # cast here, then held until the rollout takes it (two at most)
    programs.update(
        {k: v for k, v in _sampler_programs(x, native_16bit).items() if k in _CAST_PROGRAMS}
    )
    resident["decode copies waiting to publish (2)"] = 2 * params_bytes(
        cfg, x.mesh, x.decode_rules, x.cb
    )
  r = config.rollout
  host = 0.0
  if part != "learner" and r.resume_mode == "kv":
    # The buffer's KV in mode kv: what the pool held when the step ended, at most.
    tokens = min(
        r.num_slots * x.max_len, pool_pages(config, x.mesh, x.decode_rules)[0] * r.page_size
    )
    host = tokens * kv_bytes_per_token(cfg, config.model.kv_dtype)
  return Plan(
      resident=resident, programs=programs, host_buffer_bytes=host, device_capacity=device_bytes
  )


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """A mesh by its axes' sizes alone: what the byte counts read of a mesh (`.shape`)."""

  shape: dict


@dataclasses.dataclass(frozen=True)
class PlanInputs:
  """What one mesh's plan reads: the run's config and model, the mesh's devices and
  shape, the learner's and the sampler's rules, the compute dtype's bytes, a sample's
  longest length and the LoRA spec (None: a full fine-tune)."""

  config: object
  cfg: qwen3.Qwen3Config
  num_devices: int
  mesh: MeshShape
  rules: tuple
  decode_rules: tuple
  cb: int
  max_len: int
  lora: lora_lib.LoraSpec | None

  @classmethod
  def of(cls, config, cfg, num_devices: int, mesh_shape) -> "PlanInputs":
    shape = sharding.resolve_mesh_shape(tuple(mesh_shape), num_devices)
    return cls(
        config=config,
        cfg=cfg,
        num_devices=num_devices,
        mesh=MeshShape(dict(zip(sharding.MESH_AXES, shape))),
        rules=tuple(tuple(r) for r in config.mesh.rules),
        decode_rules=tuple(tuple(r) for r in config.mesh.decode_rules),
        cb=dtype_bytes(config.model.dtype),
        max_len=config.data.max_prompt_len + config.rollout.max_response_len,
        lora=lora_lib.LoraSpec.from_config(config.train.lora),
    )


_CAST_PROGRAMS = ("decode_params (cast)", "decode_adapters (cast)", "decode_params (merge)")


# ------------------------------------------------------------------------- split meshes
@dataclasses.dataclass
class SplitPlan:
  """The rollout mesh's plan and the learner mesh's; the interface of Plan."""

  rollout: Plan
  learner: Plan
  rollout_devices: int
  learner_devices: int

  @property
  def device_capacity(self) -> float:
    return self.rollout.device_capacity

  @property
  def device_total(self) -> float:
    return max(self.rollout.device_total, self.learner.device_total)

  @property
  def host_buffer_bytes(self) -> float:
    return self.rollout.host_buffer_bytes

  @property
  def fits(self) -> bool:
    return self.rollout.fits and self.learner.fits

  def to_json(self) -> dict:
    return {
        "rollout_devices": self.rollout_devices,
        "learner_devices": self.learner_devices,
        "rollout": self.rollout.to_json(),
        "learner": self.learner.to_json(),
        "peak_bytes_per_device": int(self.device_total),
        "fits": self.fits,
    }

  def table(self) -> str:
    return (
        f"rollout mesh ({self.rollout_devices} devices)\n{self.rollout.table()}\n"
        f"learner mesh ({self.learner_devices} devices)\n{self.learner.table()}"
    )


def make_split_plan(
    config, cfg, num_devices: int, device_bytes: float = 0.0, native_16bit: bool = True
) -> SplitPlan:
  """Each mesh's plan: the rollout's and the learner's (see SPLIT below)."""
  k = int(config.mesh.rollout_devices)
  m = config.mesh
  return SplitPlan(
      rollout=plan_part(config, cfg, k, m.rollout_shape, device_bytes, native_16bit, "rollout"),
      learner=plan_part(
          config, cfg, num_devices - k, m.shape, device_bytes, native_16bit, "learner"
      ),
      rollout_devices=k,
      learner_devices=num_devices - k,
  )


def pool_pages(config, mesh, decode_rules) -> tuple[int, int]:
  """The KV pool's usable pages in all, and the pages of one slot shard (its scratch
  page included), as slot_ops.device_fns builds it."""
  shards = _split(config.rollout.num_slots, "batch", mesh, decode_rules)
  usable = EngineConfig.from_run_config(config).usable_pages
  per_shard = -(-usable // shards) + 1
  return usable, per_shard


def prompt_kv_bytes(config, cfg: qwen3.Qwen3Config, kv_heads: float) -> float:
  """The KV of one prefill call of prompts started together (prefill_rows of them at
  the longest prompt bucket), which the engine keeps for the rest of the last one's
  group (sampler/prefill_cache.py); kv_heads: the KV heads on one device."""
  econf = EngineConfig.from_run_config(config)
  T = buckets.bucket(config.data.max_prompt_len, econf.min_bucket, econf.max_len)
  rows = econf.prefill_rows(T)
  return (
      2 * cfg.num_layers * rows * T * kv_heads * cfg.head_dim * dtype_bytes(config.model.kv_dtype)
  )


def _sampler_resident(x: PlanInputs) -> dict[str, float]:
  """What the sampler holds for the whole run: its weights, the slot state, a prefill's
  KV kept for its group."""
  cfg, r, m = x.cfg, x.config.rollout, x.config.model
  slots = r.num_slots / _split(r.num_slots, "batch", x.mesh, x.decode_rules)
  kv_heads = cfg.num_kv_heads / _split(cfg.num_kv_heads, "kv_heads", x.mesh, x.decode_rules)
  _, per_shard = pool_pages(x.config, x.mesh, x.decode_rules)
  pool = 2 * cfg.num_layers * per_shard * kv_heads * r.page_size * cfg.head_dim
  rows = slots * x.max_len * 12 + slots * -(-x.max_len // r.page_size) * 4  # + page table
  if cfg.num_experts:  # each position's recorded experts, a byte each
    rows += slots * x.max_len * math.prod(cfg.route_shape)
  return {
      "decode params": _decode_bytes(x),
      "slot state (KV cache)": pool * dtype_bytes(m.kv_dtype) + rows,
      "the last prefill's KV (kept)": prompt_kv_bytes(x.config, cfg, kv_heads),
  }


def _learner_resident(x: PlanInputs) -> dict[str, float]:
  """What the learner holds for the whole run: the trained weights and their optimizer
  state, a reference model, PPO's critic."""
  cfg = x.cfg
  resident = _trained(x)
  if x.lora is None and (x.config.train.kl_coef > 0 or x.config.train.reward_kl_coef > 0):
    resident["reference params"] = params_bytes(cfg, x.mesh, x.rules, x.cb)  # LoRA: the base
  if _has_critic(x.config):
    resident.update(_critic_resident(x))
  return resident


def _unmerged(x: PlanInputs) -> bool:
  """Whether the sampler decodes a LoRA run's base itself, adapters beside it."""
  return x.lora is not None and x.config.train.lora.decode == "unmerged"


def _decode_bytes(x: PlanInputs) -> float:
  """The sampler's params beyond the learner's: a decode copy in the compute dtype, or
  (LoRA decoded unmerged) only the adapters in it, beside the frozen base it reads."""
  if _unmerged(x):
    return lora_bytes(x.cfg, x.lora, x.mesh, x.rules) * x.cb / 4
  return params_bytes(x.cfg, x.mesh, x.decode_rules, x.cb)


def optimizer_state_name(config) -> str:
  """The plan's line for the AdamW moments of the full model (train.moments_dtype)."""
  return f"optimizer state ({config.train.moments_dtype})"


def _trained(x: PlanInputs) -> dict[str, float]:
  """The learner's weights: float32 masters and AdamW moments (of train.moments_dtype),
  or with LoRA the frozen base in the compute dtype, the float32 adapters and their
  moments."""
  if x.lora is None:
    masters = params_bytes(x.cfg, x.mesh, x.rules, 4)
    moments = 2 * masters * dtype_bytes(x.config.train.moments_dtype) / 4
    return {"master params (float32)": masters, optimizer_state_name(x.config): moments}
  adapters = lora_bytes(x.cfg, x.lora, x.mesh, x.rules)
  return {
      f"base params (frozen, {x.config.model.dtype})": params_bytes(x.cfg, x.mesh, x.rules, x.cb),
      "LoRA adapters (float32)": adapters,
      "adapter optimizer state (float32)": 2 * adapters,
  }


def _critic_resident(x: PlanInputs) -> dict[str, float]:
  """PPO's critic: float32 params and moments; with LoRA its adapters, head and moments,
  over the policy's base (shared) or train.critic_path's (its own, compute dtype)."""
  if x.lora is None:
    critic = critic_bytes(x.cfg, x.mesh, x.rules, 4)
    return {"critic params (float32)": critic, "critic optimizer state (float32)": 2 * critic}
  critic = _lora_critic_bytes(x)
  out = {
      "critic adapters and head (float32)": critic,
      "critic optimizer state (float32)": 2 * critic,
  }
  if x.config.train.critic_path:
    base = params_bytes(x.cfg, x.mesh, x.rules, x.cb)
    out[f"critic base params (frozen, {x.config.model.dtype})"] = base
  return out


def _has_critic(config) -> bool:
  return config.train.advantage in advantages.CRITIC_ADVANTAGES


def _sampler_programs(x: PlanInputs, native_16bit: bool) -> dict[str, float]:
  """What each sampler program adds on a device, beyond the resident arrays."""
  cfg, r, m = x.cfg, x.config.rollout, x.config.model
  split = lambda n, axis: n / _split(n, axis, x.mesh, x.decode_rules)
  masters = params_bytes(cfg, x.mesh, x.rules, 4)
  decode_params = params_bytes(cfg, x.mesh, x.decode_rules, x.cb)
  upcast = 0.0 if native_16bit or x.cb == 4 else 2 * decode_params  # 16-bit weights as f32
  slots, kv_heads = split(r.num_slots, "batch"), split(cfg.num_kv_heads, "kv_heads")
  # One sequence's KV at the longest bucket.
  seq_kv = 2 * cfg.num_layers * x.max_len * kv_heads * cfg.head_dim * dtype_bytes(m.kv_dtype)
  chunk = min(m.attention_chunk, x.max_len)
  heads, mlp, D = (
      split(cfg.num_heads, "heads"),
      split(cfg.intermediate_size, "mlp"),
      cfg.hidden_size,
  )
  prefill_act = x.max_len * 4 * (3 * heads * chunk + 3 * mlp + 4 * D)
  snapshot_width = 4
  logits = slots * split(cfg.vocab_size, "vocab") * 4
  # A chunk of decode_block pooled positions, gathered (k, v) and scored.
  block = max(r.decode_block, r.page_size)
  attention = 4 * block * kv_heads * cfg.head_dim * 4 + 2 * slots * kv_heads * cfg.head_dim * 4
  # Prompts that start together: prefill_rows of them at the longest prompt bucket, as
  # many tokens as one max_len sequence at most (EngineConfig.prefill_rows).
  together = prompt_kv_bytes(x.config, cfg, kv_heads)
  programs = {
      "prefill": seq_kv + prefill_act + upcast,
      "prefill (prompts together)": together + prefill_act * together / seq_kv + upcast,
      "insert": seq_kv,
      "insert (prompts together)": together,
      "insert_rows (restore)": 2 * snapshot_width * seq_kv,  # the rows in, and their copy
      "decode": 3 * logits + attention + upcast,
      "extract_kv (snapshot)": 1.5 * snapshot_width * seq_kv,
  }
  if x.lora is None:  # cast where the masters lie, then moved to the decode layout
    programs["decode_params (cast)"] = decode_params + (masters if x.num_devices > 1 else 0.0)
  elif _unmerged(x):  # the adapters cast and scaled: the base is not touched
    programs["decode_adapters (cast)"] = _decode_bytes(x)
  else:  # merged a layer at a time into a new copy, one target's stack its scratch
    base = params_bytes(cfg, x.mesh, x.rules, x.cb)
    scratch = largest_target_bytes(cfg, x.lora.targets, x.mesh, x.rules, x.cb)
    programs["decode_params (merge)"] = (
        decode_params + scratch + (base if x.num_devices > 1 else 0.0)
    )
  return programs


def _learner_programs(x: PlanInputs) -> dict[str, float]:
  """The learner: one microbatch of `rows` rows per device at the longest length bucket,
  or, packed (train.packing), rows of pack_len tokens."""
  cfg, r, m = x.cfg, x.config.rollout, x.config.model
  t = layout.train_section(x.config)
  split = lambda n, axis: n / _split(n, axis, x.mesh, x.rules)
  L, D = cfg.num_layers, cfg.hidden_size
  masters = params_bytes(cfg, x.mesh, x.rules, 4)
  T = batch_lib.bucket_len(x.max_len, max_len=x.max_len)
  per_call = r.batch_size * r.n_samples_per_prompt // (t.num_minibatches * t.num_microbatches)
  rows = max(1, per_call // _split(1 << 20, "batch", x.mesh, x.rules))
  if layout.pack_len(t, T) is not None:
    T = layout.pack_len(t, T)  # one call of rows x pack_len, however many are needed
  elif not (t.microbatch_by_length and t.num_microbatches > 1):
    rows *= t.num_microbatches  # one fused call over every microbatch
  chunk = min(m.attention_chunk, x.max_len)
  heads, mlp = split(cfg.num_heads, "heads"), split(cfg.intermediate_size, "mlp")
  if cfg.num_experts:  # each token's k experts, padded to whole blocks, and k copies of it
    k = cfg.num_experts_per_tok
    mlp = 1.5 * k * split(cfg.moe_intermediate_size, "mlp") + k * D
  layer_act = rows * T * 4 * (4 * D + 3 * mlp + 3 * heads * chunk)
  logits_chunk = 3 * rows * min(t.logprob_chunk, T) * split(cfg.vocab_size, "vocab") * 4
  saved = (L if m.remat else 3 * L) * rows * T * D * x.cb
  full_layer = masters / L * min(x.num_devices, 8)  # one layer's gathered weights, float32
  # With LoRA the gradients, their sum and the update are the adapters' size.
  trained = masters if x.lora is None else lora_bytes(cfg, x.lora, x.mesh, x.rules)
  programs = {
      "old logprobs": layer_act + logits_chunk + full_layer / 2,
      "gradients": trained + trained + saved + 2 * layer_act + logits_chunk + full_layer,
      "optimizer update": trained + 1.8 * trained,
  }
  if x.config.train.kl_coef > 0 or x.config.train.reward_kl_coef > 0:
    programs["reference logprobs"] = programs["old logprobs"]
  if _has_critic(x.config):  # the same backbone without the vocabulary's logits
    critic = critic_bytes(cfg, x.mesh, x.rules, 4) if x.lora is None else _lora_critic_bytes(x)
    programs["critic values"] = layer_act + full_layer / 2
    programs["critic gradients"] = critic + critic + saved + 2 * layer_act + full_layer
    programs["critic update"] = critic + 1.8 * critic
  return programs


def pages_that_fit(config, cfg, num_devices: int, capacity: float, native_16bit=True):
  """The most KV pages (rollout.kv_pages) with which the arithmetic plan fits `capacity`,
  or None if not even one sequence's pages fit."""
  r = config.rollout
  max_len = config.data.max_prompt_len + r.max_response_len
  low = -(-max_len // r.page_size)  # one sequence at max_len: the least the pool may hold
  high = EngineConfig.from_run_config(config).usable_pages
  fits = lambda pages: make_plan(
      _with_pages(config, pages), cfg, num_devices, capacity, native_16bit
  ).fits
  if not fits(low):
    return None
  while low < high:  # the plan grows with the pool: the largest that fits
    mid = (low + high + 1) // 2
    low, high = (mid, high) if fits(mid) else (low, mid - 1)
  return low


def _with_pages(config, pages: int):
  return config.overridden({"rollout.kv_pages": pages})


def what_fits(config, cfg, num_devices: int, capacity: float, native_16bit=True) -> str:
  """One sentence naming the KV pool that fits, or saying that none does."""
  return pool_sentence(config, pages_that_fit(config, cfg, num_devices, capacity, native_16bit))


def compiled_pages_that_fit(config, cfg: qwen3.Qwen3Config, mesh, excess: float):
  """The KV pool (rollout.kv_pages) `excess` bytes per device smaller than the config's,
  in whole pages: what the compiled programs fit with, since the pool is resident and no
  program's own bytes depend on its size. None if not even one sequence's pages remain."""
  r = config.rollout
  decode_rules = tuple(tuple(x) for x in config.mesh.decode_rules)
  kv_heads = cfg.num_kv_heads / _split(cfg.num_kv_heads, "kv_heads", mesh, decode_rules)
  page = 2 * cfg.num_layers * kv_heads * r.page_size * cfg.head_dim
  page *= dtype_bytes(config.model.kv_dtype)
  usable, _ = pool_pages(config, mesh, decode_rules)
  pages = usable - math.ceil(excess / page) * _split(r.num_slots, "batch", mesh, decode_rules)
  low = -(-(config.data.max_prompt_len + r.max_response_len) // r.page_size)
  return pages if pages >= low else None


def pool_sentence(config, pages: int | None) -> str:
  r = config.rollout
  if pages is None:
    return (
        "not even one sequence's KV pages fit beside the learner: shard over more devices, "
        "enable model.remat or add microbatches"
    )
  max_len = config.data.max_prompt_len + r.max_response_len
  return (
      f"it fits with rollout.kv_pages={pages} ({pages * r.page_size:,} KV positions, "
      f"{pages * r.page_size // max_len} sequences at max_len; the slots keep sharing them)"
  )


def check_fits(plan: Plan, suggestion: str = "") -> None:
  if not plan.fits:
    raise MemoryError(
        f"the config needs {plan.device_total / GB:.1f} GB per device but a device holds "
        f"{plan.device_capacity / GB:.1f} GB:\n{plan.table()}\n"
        + (suggestion + ". " if suggestion else "")
        + "Lower rollout.kv_pages (the KV pool), rollout.max_response_len, enable "
        "model.remat, add microbatches, or shard over more devices."
    )
