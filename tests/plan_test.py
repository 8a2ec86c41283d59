"""The real configs at their real shapes: every program compiled on 8 fake CPU devices
(no weights) fits, gathers no KV cache, shards optimizer state and microbatches; the
arithmetic plan agrees with the compiled programs."""

import dataclasses
import json

import jax
import pytest

from april_jax.planning import memory
from april_jax import sharding
from april_jax.planning import compile_check
from april_jax.validation import checks as validate
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES
from april_jax.models import hf_io, lora, qwen3
from april_jax.rl import step as step_lib
from april_jax.rl import update as update_lib
from april_jax.sampler import EngineConfig
import cli
from conftest import MODEL_CONFIGS_DIR, load_settings

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")


_REPORTS = {}


def _compiled(name, devices, gb, variant=None):
  """The compile check of configs/<name>.py[:variant] (compiled once per test session)."""
  key = (name, variant)
  if key not in _REPORTS:
    config = load_settings(name, variant)
    cfg = hf_io.model_config(config)
    mesh = sharding.make_mesh(tuple(config.mesh.shape), jax.devices()[:devices])
    _REPORTS[key] = (config, cfg, compile_check.check(config, cfg, mesh, gb * 1e9))
  return _REPORTS[key]


def test_shipped_shapes_are_the_released_qwen3_configs():
  for name in ("qwen3_4b", "qwen3_8b"):
    path = MODEL_CONFIGS_DIR / f"{name.replace('_', '-')}.config.json"
    from_hf = hf_io.config_from_hf(json.loads(path.read_text()))
    assert hf_io.model_config(load_settings(name)) == dataclasses.replace(from_hf, attention="auto")
    assert QWEN3_SHAPES[name]["hidden_size"] == from_hf.hidden_size


def test_resident_bytes_are_exact_float32_masters_and_moments_sharded_8_ways():
  config = load_settings("qwen3_8b")
  cfg = hf_io.model_config(config)
  p = memory.make_plan(config, cfg, num_devices=8, device_bytes=80e9)
  masters = p.resident["master params (float32)"]
  # Every matrix divides by 8; the RMSNorm weights (L x (2D + 2H) + D) are replicated.
  norms = 36 * (2 * 4096 + 2 * 128) + 4096
  assert masters == (cfg.num_params() - norms) * 4 / 8 + norms * 4
  assert p.resident["optimizer state (float32)"] == 2 * masters
  assert p.resident["decode params"] == (cfg.num_params() - norms) * 2 / 8 + norms * 2
  # KV: one pool on every device (one data replica), 8 KV heads over 8 devices: 4,352
  # pages of 256 positions + 1 scratch page, 2 x 36 layers x 128 x 2 B; plus the rows of
  # 256 slots of 1024 + 16384 tokens (int32/float32) and their page tables (68 pages).
  assert p.resident["slot state (KV cache)"] == (
      2 * 36 * (4352 + 1) * 1 * 256 * 128 * 2 + 256 * 17408 * 12 + 256 * 68 * 4
  )
  # The host buffer holds at most what the pool held: 4,352 x 256 positions of KV.
  assert p.host_buffer_bytes == 4352 * 256 * 147456
  assert p.fits


def test_a_config_that_cannot_fit_is_refused_with_the_numbers():
  config = load_settings("qwen3_8b", changes={"rollout.kv_pages": 8 * 4352})  # 165 GB a device
  too_big = memory.make_plan(config, hf_io.model_config(config), 8, 80e9)
  assert not too_big.fits
  with pytest.raises(MemoryError, match="needs .* GB per device but a device holds 80.0 GB"):
    memory.check_fits(too_big)


def test_a_config_that_does_not_fit_is_told_the_kv_pool_that_does():
  config = load_settings("qwen3_8b", "ppo")
  cfg = hf_io.model_config(config)
  assert memory.make_plan(config, cfg, 8, 80e9).fits  # PPO with its critic fits 8 x 80 GB
  pages = memory.pages_that_fit(config, cfg, 8, 70e9)
  fits = lambda n: memory.make_plan(memory._with_pages(config, n), cfg, 8, 70e9).fits
  assert 68 <= pages < 4352 and fits(pages) and not fits(pages + 1)
  sentence = memory.what_fits(config, cfg, 8, 70e9)
  assert f"it fits with rollout.kv_pages={pages}" in sentence
  assert "not even one sequence" in memory.what_fits(config, cfg, 8, 20e9)


@needs_8
def test_the_critics_programs_compile_within_15_percent_of_the_plan():
  config = load_settings("qwen3_8b", "ppo")
  cfg = hf_io.model_config(config)
  mesh = sharding.make_mesh(tuple(config.mesh.shape), jax.devices()[:8])
  arrays = {}
  mb = compile_check._longest_microbatch(config, cfg, mesh, with_ref=False)
  programs = compile_check._critic_programs(config, cfg, mesh, mb, arrays)
  arithmetic = memory.make_plan(config, cfg, 8, 80e9, native_16bit=False)
  for name, item in (("critic params (float32)", 1), ("critic optimizer state (float32)", 2)):
    assert compile_check.device_bytes(arrays[name]) == pytest.approx(
        arithmetic.resident["critic params (float32)"] * item, rel=1e-3
    )
  assert [p.name for p in programs] == ["critic values", "critic gradients", "critic update"]
  for program in programs:
    compiled = arithmetic.resident_total + program.added_bytes
    estimated = arithmetic.peak(program.name)
    assert abs(estimated - compiled) <= 0.15 * compiled, (program.name, estimated, compiled)
  assert max(arithmetic.peak(p.name) for p in programs) < 80e9


def test_planner_cli_names_a_missing_model_shape():
  out = cli.run(
      "--config.model.init.hidden_size=0",
      config="tiny.py",
      module="april_jax.plan",
      devices=None,
      timeout=120,
  )
  assert out.returncode == 2 and "no model shape" in out.stderr


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("--device_memory_gb=nan", "--device_memory_gb takes a number of GB > 0"),
        ("--device_memory_gb=-1", "--device_memory_gb takes a number of GB > 0"),
        ("--devices=0", "--devices takes a count >= 1"),
        ("--config.rollout.kv_pages=1", "rollout.kv_pages=1 cannot hold one sequence"),
        ("--config.mesh.device_memory_gb=-1", "mesh.device_memory_gb must be a number of GB > 0"),
    ],
)
def test_planner_cli_refuses_nonsense_with_exit_2_and_no_traceback(flag, expected):
  out = cli.run(flag, config="qwen3_8b.py", module="april_jax.plan", devices=None, timeout=120)
  assert out.returncode == 2 and expected in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr and out.stderr.startswith("april_jax.plan: ")
  assert not out.stdout  # nothing planned, no verdict


def test_planner_cli_plans_a_real_config_with_no_other_flag():
  out = cli.run(config="qwen3_8b.py", module="april_jax.plan", devices=None, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "8.19B params" in out.stdout and "gradients" in out.stdout
  assert "not checked against a device" in out.stdout  # no capacity given, no verdict
  last = json.loads(out.stdout.strip().splitlines()[-1])  # the machine-readable line
  assert last["device_capacity_bytes"] == 0 and last["fits"] in (True, False)
  resident, programs = last["resident_bytes"].values(), last["program_bytes"].values()
  assert "decode" in last["program_bytes"] and "gradients" in last["program_bytes"]
  assert abs(last["peak_bytes_per_device"] - sum(resident) - max(programs)) <= len(resident) + 1


@needs_8
def test_qwen3_8b_every_program_fits_8_x_80gb_compiled_at_real_shapes():
  config, cfg, report = _compiled("qwen3_8b", 8, 80)
  names = [p.name for p in report.programs]
  for expected in (
      "prefill",
      "prefill (prompts together)",
      "insert",
      "insert (prompts together)",
      "insert_rows (restore)",
      "decode",
      "extract_kv (snapshot)",
      "decode_params (cast)",
      "old logprobs",
      "gradients",
      "optimizer update",
  ):
    assert expected in names
  assert report.fits, report.table()
  assert report.peak_bytes < 80e9


@needs_8
def test_no_program_gathers_the_kv_cache_and_the_sampler_moves_activations_only():
  config, cfg, report = _compiled("qwen3_8b", 8, 80)
  cache = report.resident["slot state (KV cache)"]  # one device's share (20.5 GB)
  sampler = [p.name for p in report.programs[:7]]
  assert sampler[0] == "prefill" and sampler[-1] == "extract_kv (snapshot)"
  for program in report.programs:
    assert program.largest_collective() < cache / 8, (program.name, program.collectives)
    if program.name in sampler:
      # Tensor-parallel decode: activations (at most a prefill's [17408, 4096] float32
      # all-reduce, 0.29 GB), never weights or KV.
      assert program.largest_collective() < 0.02 * cache, (program.name, program.collectives)
  insert = next(p for p in report.programs if p.name == "insert")
  # Written in place, not copied: the scratch is the incoming sequence's KV (its
  # transpose into the cache layout: 2 x 36 layers x 17,408 x 1 local head x 128 x 2 B).
  assert insert.temp_bytes <= 1.05 * 2 * 36 * 17408 * 1 * 128 * 2
  decode = next(p for p in report.programs if p.name == "decode")
  # The slot state is updated in place, but for its page table, which each decode call
  # takes from the host (KVManager.table): 256 slots x 68 pages, int32, on every device.
  econf = EngineConfig.from_run_config(config)
  table = 4 * econf.num_slots * -(-econf.max_len // econf.page_size)
  assert table == 69632
  assert decode.alias_bytes >= cache - table


@needs_8
def test_optimizer_state_is_sharded_like_the_params():
  config = load_settings("qwen3_8b")
  cfg = hf_io.model_config(config)
  mesh = sharding.make_mesh(tuple(config.mesh.shape))
  t = config.train
  static = update_lib.make_static(cfg, t, 1.0, True, "bfloat16")
  optimizer, schedule = step_lib.make_optimizer(t, 100)
  shapes = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0)))
  progs = update_lib.build_programs(static, optimizer, shapes, mesh, schedule=schedule)
  masters = compile_check._abstract(shapes, progs.param_sh)  # pylint: disable=protected-access
  opt = compile_check._abstract(jax.eval_shape(optimizer.init, shapes), progs.opt_sh)  # pylint: disable=protected-access
  params_share = compile_check.device_bytes(masters)
  norms = 36 * (2 * 4096 + 2 * 128) + 4096  # replicated
  assert params_share == (cfg.num_params() - norms) * 4 / 8 + norms * 4
  # mu and nu, each exactly the params' share; step counts are a few bytes.
  assert 2 * params_share <= compile_check.device_bytes(opt) < 2 * params_share + 1024
  compiled = progs.init_opt.lower(masters).compile()
  assert compiled.memory_analysis().output_size_in_bytes < 2 * params_share + 1024


@needs_8
def test_a_microbatch_is_split_over_the_data_x_fsdp_devices():
  config = load_settings("qwen3_8b")
  r, t = config.rollout, config.train
  rows = r.batch_size * r.n_samples_per_prompt // (t.num_minibatches * t.num_microbatches)
  mesh = sharding.make_mesh(tuple(config.mesh.shape))
  shape = (1, rows, 17408)
  assert step_lib.microbatch_sharding(shape, mesh).shard_shape(shape) == (1, rows // 8, 17408)
  from april_jax.validation import checks as validate  # pylint: disable=g-import-not-at-top

  validate.validate_for_devices(config, 8)
  config = config.overridden({"train.num_microbatches": 64})  # 4 rows cannot split over 8
  with pytest.raises(validate.ConfigError, match="4 rows .* multiple of the 8 devices"):
    validate.validate_for_devices(config, 8)


@needs_8
@pytest.mark.parametrize(
    "name,variant,devices,gb",
    [("qwen3_8b", None, 8, 80), ("qwen3_4b", None, 1, 141), ("qwen3_8b", "lora", 1, 80)],
)
def test_arithmetic_plan_is_within_15_percent_of_every_compiled_program(name, variant, devices, gb):
  config, cfg, report = _compiled(name, devices, gb, variant)
  # The check compiles 16-bit programs as a GPU runs them (compile_check.GPU_LIKE).
  arithmetic = memory.make_plan(config, cfg, devices, gb * 1e9, native_16bit=True)
  assert set(arithmetic.resident) == set(report.resident)
  assert sorted(p.name for p in report.programs) == sorted(arithmetic.programs)
  assert arithmetic.resident_total == pytest.approx(report.resident_bytes, rel=1e-6)
  for program in report.programs:
    compiled, estimated = report.peak(program), arithmetic.peak(program.name)
    assert abs(estimated - compiled) <= 0.15 * compiled, (program.name, estimated, compiled)
  assert report.fits and arithmetic.fits


@pytest.mark.parametrize("decode", ["unmerged", "merged"])
def test_lora_holds_the_base_once_in_16_bits_and_float32_adapters_and_moments(decode):
  changes = {"train.kl_coef": 0.001, "train.lora.decode": decode}  # the reference is the base
  if decode == "merged":
    changes["rollout.kv_pages"] = 360  # the decode copy takes 16.4 GB of the pool
  config = load_settings("qwen3_8b", "lora", changes)
  cfg = hf_io.model_config(config)
  p = memory.make_plan(config, cfg, num_devices=1, device_bytes=80e9)
  spec = lora.LoraSpec.from_config(config.train.lora)
  assert (spec.rank, spec.alpha, len(spec.targets)) == (32, 32.0, 7)
  adapters = lora.num_params(cfg, spec) * 4
  # Unmerged, the sampler holds the adapters in 16 bits beside the base it reads.
  decode_bytes = adapters / 2 if decode == "unmerged" else cfg.num_params() * 2
  assert p.resident == {
      "base params (frozen, bfloat16)": cfg.num_params() * 2,
      "LoRA adapters (float32)": adapters,
      "adapter optimizer state (float32)": 2 * adapters,
      "decode params": decode_bytes,
      "slot state (KV cache)": p.resident["slot state (KV cache)"],
      "the last prefill's KV (kept)": p.resident["the last prefill's KV (kept)"],
  }
  assert 0.34e9 < adapters < 0.36e9  # 87M numbers: rank 32 on the 7 projections of 36 layers
  # The learner's gradients and update are the adapters' size; the merge makes a new copy.
  assert p.programs["optimizer update"] == pytest.approx(2.8 * adapters)
  assert p.programs["reference logprobs"] == p.programs["old logprobs"]
  if decode == "merged":
    assert p.programs["decode_params (merge)"] > cfg.num_params() * 2
  else:
    assert p.programs["decode_adapters (cast)"] == adapters / 2
  assert "decode_params (cast)" not in p.programs and p.fits


def test_unmerged_decoding_is_refused_on_several_devices():
  config = load_settings("qwen3_8b", "lora")
  validate.validate_for_devices(config, 1)
  config = config.overridden({"mesh.shape": (1, -1, 1), "train.num_microbatches": 32})
  with pytest.raises(validate.ConfigError, match="train.lora.decode='unmerged' decodes"):
    validate.validate_for_devices(config, 8)
  validate.validate_for_devices(config.overridden({"train.lora.decode": "merged"}), 8)


def test_a_lora_critic_shares_the_base_unless_it_has_its_own():
  config = load_settings("qwen3_8b", "lora+ppo")
  cfg = hf_io.model_config(config)
  head = (cfg.hidden_size + 1) * 4
  adapters = lora.num_params(cfg, lora.LoraSpec.from_config(config.train.lora)) * 4
  shared = memory.make_plan(config, cfg, 1, 80e9)
  assert shared.resident["critic adapters and head (float32)"] == adapters + head
  assert shared.resident["critic optimizer state (float32)"] == 2 * (adapters + head)
  assert "critic params (float32)" not in shared.resident
  assert config.rollout.kv_pages == 768 and shared.fits  # the critic takes 16 pages
  config = config.overridden({"train.critic_path": "/critic"})  # its own base, in 16 bits
  own = memory.make_plan(config, cfg, 1, 80e9)
  assert own.resident["critic base params (frozen, bfloat16)"] == cfg.num_params() * 2
  assert not own.fits  # the pool sized for a shared base does not leave room for it


@pytest.mark.parametrize("variants", ["lora", "lora+ppo", "ppo+lora", "lora+tis+overlong"])
def test_the_lora_variants_are_one_80gb_gpu_with_64_slots(variants):
  for name, pages in (("qwen3_8b", 784), ("qwen3_4b", 1080)):
    c = load_settings(name, variants)
    critic = "ppo" in variants
    assert tuple(c.mesh.shape) == (1, 1, 1) and c.rollout.num_slots >= 64 and c.model.remat
    assert c.rollout.max_response_len == 16384 and c.train.lora.rank == 32
    assert c.train.lora.decode == "unmerged"
    assert c.rollout.kv_pages == pages - (24 if name == "qwen3_4b" else 16) * critic
    assert memory.make_plan(c, hf_io.model_config(c), 1, 80e9).fits
  with pytest.raises(ValueError, match="'lora' runs on one GPU"):
    load_settings("qwen3_4b", "node+lora")


def test_lora_programs_compile_with_the_base_as_the_reference_and_the_critics():
  """Every LoRA program at a tiny shape, a KL term and PPO's critic included: the
  reference logprobs read the frozen base alone, and the critic shares it."""
  changes = {"train.lora.rank": 4, "train.kl_coef": 0.01, "train.advantage": "gae"}
  config = load_settings("tiny", changes=changes | {"model.dtype": "bfloat16"})
  cfg = hf_io.model_config(config)
  mesh = sharding.make_mesh(tuple(config.mesh.shape), jax.devices()[:1])
  report = compile_check.check(config, cfg, mesh)
  arithmetic = memory.make_plan(config, cfg, 1, native_16bit=True)
  assert set(report.resident) == set(arithmetic.resident)
  for name, value in arithmetic.resident.items():  # the weights: exact (+ Adam's counters)
    if "params" in name or "adapters" in name or "optimizer" in name:
      assert report.resident[name] == pytest.approx(value, rel=1e-6, abs=1024), name
  programs = {p.name: p for p in report.programs}
  assert sorted(programs) == sorted(arithmetic.programs)
  base = report.resident["base params (frozen, bfloat16)"]
  assert programs["reference logprobs"].resident_argument_bytes == base
  assert programs["critic values"].resident_argument_bytes == (
      base + report.resident["critic adapters and head (float32)"]
  )


def test_hlo_collectives_are_parsed_with_their_bytes():
  hlo = """
  %all-gather.1 = bf16[36,4096,128]{2,1,0} all-gather(%p), dimensions={0}
  %ar = (f32[4096]{0}, f32[8,2]{1,0}) all-reduce(%a, %b), to_apply=%add
  %rs = f32[16]{0} reduce-scatter-start(%x)
  %c = f32[4]{0} add(%x, %y)
  """
  assert compile_check.collectives(hlo) == [
      ("all-gather", 36 * 4096 * 128 * 2),
      ("all-reduce", 4096 * 4 + 16 * 4),
      ("reduce-scatter", 64),
  ]


def test_a_compiled_plan_that_does_not_fit_names_the_pool_that_would():
  """plan --compile of a config past the device's memory: exit 3, its table, and the
  sentence naming the KV pool the compiled programs fit with (or that none does)."""
  out = cli.run(
      "--compile",
      "--devices=2",
      "--device_memory_gb=0.001",
      config="tiny.py",
      module="april_jax.plan",
      devices=None,
      timeout=300,
  )
  assert out.returncode == 3, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert (
      "not even one sequence's KV pages fit" in out.stdout
      or "it fits with rollout.kv_pages=" in out.stdout
  )
  assert json.loads(out.stdout.strip().splitlines()[-1])["fits"] is False
