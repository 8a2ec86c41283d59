"""The scheduler benchmark runs end to end and reports both sides (no timing asserted)."""

import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.benchmarks import length_dists, scheduler_bench
import cli
from conftest import load_config


def _tiny_config():
  config = load_config("tiny")
  config.rollout.n_samples_per_prompt = 4  # the benchmarks' recorded setting (BENCHMARKS.md)
  config.rollout.dynamic_sampling = False
  return config


def test_scheduler_bench_reports_both_sides_and_april_fills_slots_better():
  config = _tiny_config()
  config.rollout.max_response_len = 96
  out = scheduler_bench.run(config, shape="deepmath", steps=3)
  for key in (
      "april_tokens_per_s",
      "baseline_tokens_per_s",
      "speedup",
      "april_slot_occupancy",
      "baseline_slot_occupancy",
      "off_policy_token_frac",
      "staleness_max",
  ):
    assert key in out
  # Occupancy is a count (kept tokens / slot-steps), not a timing.
  assert out["april_slot_occupancy"] > out["baseline_slot_occupancy"]
  assert out["baseline_off_policy_token_frac"] == 0.0 == out["baseline_staleness_max"]
  # The yardsticks: occupancy is counted; decoding is a share of each side's rollout time.
  assert out["occupancy_ideal"] == pytest.approx(
      out["april_slot_occupancy"] / out["baseline_slot_occupancy"]
  )
  assert out["of_occupancy_ideal"] == pytest.approx(out["speedup"] / out["occupancy_ideal"])
  for side in ("april", "baseline"):
    assert 0 < out[f"{side}_decode_frac"] < 1
    parts = ("decode", "start", "resume", "snapshot", "host")
    shares = [out[f"{side}_{part}_frac"] for part in parts]
    assert all(0 <= share < 1 for share in shares)
    assert sum(shares) == pytest.approx(1.0)
    assert out[f"{side}_start_frac"] > 0  # every step starts groups: prefills
  # Only APRIL leaves samples unfinished, so only it resumes partials; with a pool that
  # holds every slot's max_len, their KV stays in it (resume mode kv): none to the host.
  assert out["april_resume_frac"] > 0 == out["baseline_resume_frac"]
  assert out["april_kv_host_mb_per_step"] == 0 == out["baseline_kv_host_mb_per_step"]
  assert out["of_host_free_ideal"] == pytest.approx(out["speedup"] / out["host_free_ideal"])


def test_scheduler_bench_engine_is_the_configs_at_the_bench_prompt_length():
  config = _tiny_config()
  config.rollout.page_size = 32
  config.rollout.kv_pages = 40
  config.rollout.prefill_width = 2
  config.rollout.resume_mode = "recompute"
  engine = scheduler_bench.engine_config(config)
  assert (engine.page_size, engine.kv_pages, engine.prefill_width) == (32, 40, 2)
  assert engine.resume_mode == "recompute"
  assert engine.num_slots == config.rollout.num_slots
  max_len = scheduler_bench.PROMPT_LEN + config.rollout.max_response_len
  assert (engine.max_len, engine.prompt_len) == (max_len, scheduler_bench.PROMPT_LEN)


def test_length_distributions_are_long_tailed():
  for shape in length_dists.SHAPES:
    d = length_dists.describe(shape, 512)
    assert d["p50"] < d["mean"] < d["p90"] < d["max"] == 512
    assert 0 < d["at_cap_frac"] < 0.05


def test_scheduler_sweep_reports_one_row_per_ratio_and_no_gain_at_ratio_one():
  config = _tiny_config()
  config.rollout.max_response_len = 64
  out = scheduler_bench.sweep(config, steps=2, ratios=(1.0, 2.0))
  assert [r["ratio"] for r in out["sweep"]] == [1.0, 2.0]
  one, two = out["sweep"]
  # N' = N leaves nothing to over-provision: the same slot-steps as the baseline.
  assert one["april_slot_occupancy"] == one["baseline_slot_occupancy"]
  assert two["april_slot_occupancy"] > two["baseline_slot_occupancy"]


def test_resume_bench_compares_kv_and_recompute_on_the_same_workload():
  from april_jax.benchmarks import resume_bench  # pylint: disable=g-import-not-at-top

  config = _tiny_config()
  config.rollout.max_response_len = 64
  out = resume_bench.run(config, steps=2)
  # Same workload: the same partials are resumed. In mode kv their KV stays in the pool
  # (the pool holds every slot's max_len), so the host holds what recompute's does.
  assert out["kv_partial_samples_per_step"] == out["recompute_partial_samples_per_step"] > 0
  assert out["kv_buffer_bytes_max"] == out["recompute_buffer_bytes_max"] > 0


def test_decode_bandwidth_bound_is_params_plus_kv_bytes_per_step():
  from april_jax.benchmarks import sampler_bench  # pylint: disable=g-import-not-at-top

  cfg = sampler_bench.BENCH_MODELS["qwen3_0_6b"]
  assert 0.59e9 < cfg.num_params() < 0.61e9  # Qwen3-0.6B
  bound = sampler_bench.decode_bound_tokens_per_s(
      cfg, batch=64, mean_len=512, param_bytes=2, kv_bytes=2, hbm_gbps=4800
  )
  kv = 2 * 28 * 64 * 512 * 8 * 128 * 2
  assert bound == 64 * 4800e9 / (cfg.num_params() * 2 + kv)


def test_sampler_bench_without_transformers_reports_the_roofline():
  from april_jax.benchmarks import sampler_bench  # pylint: disable=g-import-not-at-top

  out = sampler_bench.run(
      models=("tiny",),
      batch=4,
      prompt_len=8,
      new_tokens=16,
      repeats=1,
      sync_every=8,
      hf=False,
      hbm_gbps=100.0,
      copy_gbps=10.0,
  )
  assert out["tiny_april_jax_tokens_per_s"] > 0
  step_bytes = out["tiny_model_params"] * 4 + 2 * 2 * 4 * (8 + 8) * 2 * 32 * 4
  assert out["tiny_step_bytes"] == step_bytes
  assert out["tiny_copy_bandwidth_frac"] == pytest.approx(
      step_bytes / (out["tiny_decode_step_ms"] / 1e3) / 10e9
  )
  assert out["tiny_bandwidth_bound_tokens_per_s"] > 0
  assert out["tiny_decode_step_ms"] > 0 and out["tiny_static_decode_step_ms"] > 0
  assert out["tiny_static_outputs_equal_frac"] == 1.0  # same greedy tokens as the yardstick
  assert out["tiny_static_outputs_agreeing_prefix_frac"] == 1.0
  # One layer's attention timed both ways, on the same keys and values, to the same result.
  assert out["tiny_attention_max_abs_diff"] < 1e-5
  assert min(out[f"tiny_attention_{k}_us"] for k in ("paged", "dense", "gather")) > 0
  assert out["tiny_speedup_vs_transformers"] != out["tiny_speedup_vs_transformers"]  # NaN
  # The host round trip: a decode step at one per call, against sync_every (8) per call.
  assert out["tiny_host_sync_every"] == 8
  assert out["tiny_host_step_us"] > 0 and out["tiny_host_step_us_one_per_call"] > 0
  assert np.isfinite(out["tiny_host_round_trip_us"])  # the median of paired differences


def test_sampler_bench_refuses_a_run_too_short_to_time_a_decode_step():
  from april_jax.benchmarks import sampler_bench  # pylint: disable=g-import-not-at-top

  with pytest.raises(ValueError, match=r"new_tokens \(8\) must exceed sync_every \(8\)"):
    sampler_bench.run(models=("tiny",), new_tokens=8, sync_every=8, hf=False)


def test_bad_bench_flags_are_one_line_each_before_anything_runs(tmp_path):
  """All in one command: absl names the first flag it cannot take; each is fixed in turn."""
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  bad = [
      ("--seeds=0,a", "--seeds takes ints >= 0"),
      ("--ratios=1,x", "--ratios takes floats >= 1"),
      (f"--out_dir={a_file}", "--out_dir names a file"),
      ("--dist=bogus", "value should be one of <dapo_math|deepmath|deepscaler>"),
  ]
  for flag, words in bad:
    proc = cli.run(
        "--mode=e2e", flag, config="tiny.py", module="april_jax.bench", devices=None, timeout=300
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert words in proc.stderr and not proc.stdout
  assert a_file.read_text() == ""


def test_e2e_bench_trains_both_sides_and_reports_the_spread():
  from april_jax.benchmarks import e2e_bench  # pylint: disable=g-import-not-at-top

  config = _tiny_config()
  config.num_steps = 2
  config.train.sft_steps = 0  # the harness is under test, not the warm-start
  config.eval.num_prompts, config.eval.k = 4, 0
  config.rollout.max_response_len = 16  # one length bucket: little to compile
  out = e2e_bench.run(config, seeds=(0,))
  for side in ("april", "baseline"):
    assert out[f"{side}_final_reward_std"] == 0.0  # one seed
    assert out[f"{side}_wall_s_mean"] > 0
    assert out[f"{side}_rollout_ms_per_step_mean"] > 0 < out[f"{side}_train_ms_per_step_mean"]
  assert out["baseline_off_policy_token_frac_mean"] == 0.0
  assert len(out["april_wall_to_baseline_final_reward_s"]) == 1
  # APRIL may run 1.5x the steps to be compared at the baseline's wall time.
  assert out["april_max_steps"] == 3 and out["num_steps"] == 2
  # How many fit in the baseline's wall time is a timing, reported, not asserted.
  assert 0 <= out["april_steps_in_baseline_wall_mean"] <= 3


def test_time_to_reach_uses_the_first_window_whose_mean_reaches_the_target():
  from april_jax.benchmarks import e2e_bench  # pylint: disable=g-import-not-at-top

  reward = np.linspace(0.0, 1.0, 30)  # step i: i / 29
  wall = 0.5 * np.arange(1, 31)
  # Window i covers steps i..i+9, mean (i + 4.5) / 29 >= 0.5 first at i = 10: step 19 ends.
  assert e2e_bench.time_to_reach(reward, wall, 0.5) == pytest.approx(10.0)
  # The same per-step curve on steps half as long gets there in half the time.
  assert e2e_bench.time_to_reach(reward, wall / 2, 0.5) == pytest.approx(5.0)
  assert np.isnan(e2e_bench.time_to_reach(reward, wall, 0.9))  # the best window: 0.845
  assert np.isnan(e2e_bench.time_to_reach(reward[:5], wall[:5], 0.0))  # shorter than a window
  # Evaluations: the first point at or above the target, at its own wall time.
  assert (
      e2e_bench.first_at(np.array([0.2, 0.5, 0.4, 0.6]), np.array([1.0, 2.0, 3.0, 4.0]), 0.45)
      == 2.0
  )
  assert np.isnan(e2e_bench.first_at(np.array([0.2]), np.array([1.0]), 0.3))


def test_agreeing_prefix_is_the_share_before_the_first_different_token():
  from april_jax.benchmarks import sampler_bench  # pylint: disable=g-import-not-at-top

  a = [np.array([1, 2, 3, 4]), np.array([5, 6, 7, 8]), np.array([1, 1])]
  b = [np.array([1, 2, 9, 4]), np.array([0, 6, 7, 8]), np.array([1, 1, 2, 2])]
  # 2 of 4 agree, then 0 of 4, then a prefix of 2 that the other runs 2 past: 2 of 4.
  assert sampler_bench._agreeing_prefix_frac(a, b) == pytest.approx((0.5 + 0.0 + 0.5) / 3)
  assert sampler_bench._agreeing_prefix_frac(a, a) == 1.0


def test_tail_step_bench_reports_both_mixes_at_the_same_live_tokens():
  from april_jax.benchmarks import sampler_bench, tail_step  # pylint: disable=g-import-not-at-top

  out = tail_step.run(
      sampler_bench.BENCH_MODELS["tiny"], slots=4, short=8, long=104, n1=4, n2=12, repeats=3
  )
  assert out["tail_prompt_lens"] == "3 x 8 + 1 x 104" and out["uniform_prompt_lens"] == "4 x 32"
  tail, uniform = np.array(out["tail_step_ms_rounds"]), np.array(out["uniform_step_ms_rounds"])
  assert out["rounds"] == len(tail) == len(uniform) == 3
  medians = (out["tail_step_ms"], out["uniform_step_ms"])
  assert medians == pytest.approx((np.median(tail), np.median(uniform)), rel=1e-12)
  ratios = tail / uniform  # the ratio is the median round's, not the ratio of the medians
  assert out["tail_over_uniform"] == pytest.approx(np.median(ratios), rel=1e-12)
  assert (out["tail_over_uniform_min"], out["tail_over_uniform_max"]) == pytest.approx(
      (ratios.min(), ratios.max()), rel=1e-12
  )


def test_tail_step_bench_decodes_through_the_kernel_it_is_asked_for(monkeypatch):
  from april_jax.benchmarks import sampler_bench, tail_step  # pylint: disable=g-import-not-at-top
  from april_jax.models import paged_attention_kernel  # pylint: disable=g-import-not-at-top

  traced = []
  kernel = paged_attention_kernel.paged_decode_attention

  def spy(*args, **kwargs):
    traced.append(args[0].shape)
    return kernel(*args, **kwargs)

  monkeypatch.setattr(paged_attention_kernel, "paged_decode_attention", spy)
  out = tail_step.run(
      sampler_bench.BENCH_MODELS["tiny"],
      slots=2,
      short=8,
      long=40,
      n1=2,
      n2=4,
      repeats=1,
      decode_attention="pallas",
  )
  assert traced, "the engine's decode step never traced the Pallas kernel"
  # A step is a difference of two timed runs: noise can make one round's negative.
  assert out["decode_attention"] == "pallas" and np.isfinite(out["tail_step_ms"])


def test_roofline_of_the_8b_config_reads_within_10_percent_of_the_live_bytes():
  from april_jax.benchmarks import roofline  # pylint: disable=g-import-not-at-top

  out = roofline.run(load_config("qwen3_8b"), devices=8, shape="dapo_math", trials=3, timed=False)
  assert 1.0 < out["paged_over_bound"] <= 1.1
  # Through the kernel: one KV head a device, 256 slots and 1,024 runs; every busy program
  # walks at most 1/1024 of the live blocks (rounded up), far less than the longest slot.
  assert 1.0 < out["kernel_over_bound"] <= 1.1
  assert out["kernel_programs"] == 256 + 1024 and out["kernel_busy_programs"] > 1000
  assert out["kernel_longest_walk_blocks"] * 8 < out["kernel_longest_slot_blocks"]
  assert out["dense_slots"] == 4352 * 256 // 17408 == 64
  assert out["dense_per_live_token_over_paged"] > 3  # every slot read up to the longest
  assert out["sequences_per_gb_kv_paged"] == pytest.approx(4 * out["sequences_per_gb_kv_dense"])
  # One chunk compiled at a device's shapes: 128 pages of 256 positions, 1 KV head of 128,
  # bfloat16 keys and values; if the gather is copied, the KV is read, written, read.
  assert out["chunk_pages"] == 32768 // 256 and out["chunk_kv_bytes"] == 2 * 128 * 256 * 128 * 2
  if out["backend"] == "cpu":  # XLA on the CPU copies the gathered pages (BENCHMARKS.md)
    assert 0.9 < out["chunk_scratch_over_kv"] < 1.2
  params = out["decode_params_gb"]
  assert out["paged_copied_gb"] == pytest.approx(params + 3 * (out["paged_gb"] - params))
  assert "chunk_gathered_us" not in out  # timed=False: compiled, not run


def test_timed_chunk_scores_gathered_pages_as_the_same_pages_side_by_side():
  from april_jax.benchmarks import roofline  # pylint: disable=g-import-not-at-top
  from april_jax.models import paged_attention, qwen3  # pylint: disable=g-import-not-at-top

  # page_partials is its gather then score_pages, and the multiply-and-sum candidate is
  # score_pages up to float32 rounding (full, one-token and empty pages): the timed
  # programs compute one function.
  rng = np.random.default_rng(3)
  pool = jnp.asarray(rng.standard_normal((2, 2, 9, 2, 16, 8)), jnp.bfloat16)  # k, v [L, P, K, T, H]
  q = jnp.asarray(rng.standard_normal((4, 2, 3, 8)), jnp.float32)
  pages, count = jnp.array([7, 2, 2, 5]), jnp.array([16, 1, 9, 0])
  got = paged_attention.page_partials(q, pool[0], pool[1], 1, pages, count, qwen3.kv_view)
  want = paged_attention.score_pages(q, pool[0][1, pages], pool[1][1, pages], count)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  reduced = roofline.score_pages_by_reduction(q, pool[0][1, pages], pool[1][1, pages], count)
  live = np.asarray(count) > 0
  for a, b in zip(reduced, want):
    np.testing.assert_allclose(np.asarray(a)[live], np.asarray(b)[live], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(reduced[1])[~live], 0.0)  # an empty page adds nothing

  kv = 2 * 4 * 2 * 16 * 8 * 2
  out = roofline.timed_chunk((1, 32, 2, 16, 8), jnp.bfloat16, (2, 3, 8), 4, kv, calls=4)
  for name in ("gathered", "reduced", "side_by_side"):
    assert out[f"chunk_{name}_us"] > 0 and out[f"chunk_{name}_scratch_bytes"] >= 0
  side = out["chunk_side_by_side_us"]
  assert out["chunk_gather_time_ratio"] == pytest.approx(out["chunk_gathered_us"] / side)
  assert out["chunk_reduced_time_ratio"] == pytest.approx(out["chunk_reduced_us"] / side)
  gbps = kv / out["chunk_gathered_us"] / 1e3
  assert out["chunk_gathered_gbps"] == pytest.approx(gbps)
  assert out["chunk_gathered_copy_frac"] == pytest.approx(gbps / out["chunk_copy_gbps"])


def test_timed_layer_runs_the_xla_path_and_the_kernel_on_the_same_pages():
  from april_jax.benchmarks import roofline  # pylint: disable=g-import-not-at-top

  lengths = [1, 16, 17, 40, 0]  # one token, a whole page, across a boundary, empty
  out = roofline.timed_layer(
      lengths, 2, 3, 16, 16, jnp.float32, calls=2, interpret=True, decode_block=32
  )
  assert out["layer_slots"] == 5
  # The XLA path reads decode_block positions a chunk: 2 pages of 16, over 7 live pages;
  # and 4x as wide: 8 pages, capped at the pool's 7.
  assert (out["layer_xla_chunk_pages"], out["layer_xla_chunks"]) == (2, 4)
  assert (out["layer_xla_wide_chunk_pages"], out["layer_xla_wide_chunks"]) == (7, 1)
  lines = roofline.layer_lines(out)
  assert "4 chunks of 2 pages" in lines[0] and "chunks of 7 pages (1 chunks)" in lines[1]
  assert out["layer_xla_wide_max_abs_diff"] < 1e-5  # the same attention, in fewer trips
  assert out["layer_live_kv_bytes"] == 2 * sum(lengths) * 2 * 16 * 4
  gbps = out["layer_live_kv_bytes"] / out["layer_xla_us"] / 1e3
  assert out["layer_xla_gbps"] == pytest.approx(gbps)
  assert len(lines) == 2 + len(roofline.LAYER_KERNELS)
  for name, line in zip(roofline.LAYER_KERNELS, lines[2:]):
    # Each kernel computes the XLA path's attention, and its line says so in numbers.
    assert out[f"layer_{name}_max_abs_diff"] < 1e-5
    gbps = out["layer_live_kv_bytes"] / out[f"layer_{name}_us"] / 1e3
    assert out[f"layer_{name}_gbps"] == pytest.approx(gbps)
    ratio = out[f"layer_{name}_us"] / out["layer_xla_us"]
    assert out[f"layer_{name}_over_xla"] == pytest.approx(ratio)
    assert f"{out[f'layer_{name}_us']:.0f} us" in line and f"{ratio:.3f}x" in line


def test_timed_layer_reports_a_kernel_the_backend_cannot_run(monkeypatch):
  from april_jax.benchmarks import roofline  # pylint: disable=g-import-not-at-top
  from april_jax.models import paged_attention_kernel  # pylint: disable=g-import-not-at-top

  def broken(*args, **kwargs):
    raise RuntimeError("out of resource: shared memory")

  monkeypatch.setattr(paged_attention_kernel, "paged_decode_attention", broken)
  out = roofline.timed_layer([5, 20], 2, 3, 16, 16, jnp.float32, calls=2, interpret=True)
  for name in roofline.LAYER_KERNELS:
    assert out[f"layer_{name}_error"] == "RuntimeError: out of resource: shared memory"
    assert f"layer_{name}_us" not in out
  assert out["layer_xla_us"] > 0
  assert out["layer_xla_wide_us"] > 0  # the XLA path's lines stand
  assert all("failed here: RuntimeError" in line for line in roofline.layer_lines(out)[2:])


def test_async_bench_summary_and_projection_from_a_runs_lines():
  from april_jax.benchmarks import async_bench  # pylint: disable=g-import-not-at-top

  line = lambda step, **kw: {
      "step": step, "time/step_s": 3.0, "time/rollout_s": 2.0, "time/train_s": 1.5,
      "rollout/lag_token_mean": 1.0, "rollout/lag_token_max": 2.0, "async/rollout_wait_s": 0.5,
      "async/learner_wait_s": 1.5, "async/publish_s": 0.01, "async/publish_bytes": 4e6, **kw,
  }  # fmt: skip
  lines = [line(1, **{"time/step_s": 30.0}), line(2), line(3, **{"eval/pass@1": 0.5})]
  s = async_bench._summary(lines, {"copy_bytes_per_s": 1e9, "lag_histogram": [0, 3, 1]})
  assert s["s_per_batch"] == 3.0  # the first step (compiling) left out
  assert s["learner_busy"] == 0.5 and s["rollout_busy"] == pytest.approx(2 / 3)
  assert s["publish_floor_s"] == pytest.approx(4e-3) and s["eval_pass@1"] == 0.5
  # One device's phases (rollout 2 s, learn 1.5 s) projected to 8: the learner in
  # proportion; the rollout as (1/8)^a. At a = 1 no split beats colocated.
  p = async_bench.project(load_config("tiny"), 2.0, 1.5, 1, 8)
  assert all(r.get("speedup", 0) < 1 for r in p["scaling_1.0"]["splits"])
  assert p["scaling_1.0"]["colocated_seconds_per_batch"] == pytest.approx(3.5 / 8)
  half = p["scaling_0.5"]
  assert half["colocated_seconds_per_batch"] == pytest.approx(2 / 8**0.5 + 1.5 / 8)
  assert half["chosen"] is not None


def test_speculative_bench_draws_the_same_tokens_and_maps_acceptance_to_tokens_per_pass():
  from april_jax.benchmarks import speculative_bench  # pylint: disable=g-import-not-at-top

  config = load_config("tiny")
  out = speculative_bench.run(config, K=3, live=(2,), budget=24, rates=(0.0, 1.0), repeats=1)
  task = out["task"]
  assert task["mismatches"]["samples_differing"] == 0
  assert task["mismatches"]["max_logprob_diff_equal_samples"] <= 1e-5
  assert task["plain"]["tokens"] == task["speculative"]["tokens"] > 0
  assert sum(task["speculative"]["drafted"].values()) > 0
  assert out["faster"] in ("plain", "speculative")
  right, wrong = out["controlled"]
  # Right drafts: K + 1 tokens a pass until the budget's last pass; wrong ones: 1.
  assert right["acceptance"] == 1.0 and right["tokens_per_pass"] > 2.5
  assert wrong["acceptance"] == 0.0 and wrong["tokens_per_pass"] == 1.0
  assert right["mismatches"] == wrong["mismatches"] == 0


def test_a_config_with_a_field_the_settings_do_not_have_is_refused_by_name(tmp_path):
  path = tmp_path / "extra_field.py"
  path.write_text(
      "from april_jax.settings import base\n"
      "def get_config():\n"
      "  c = base.get_config()\n"
      "  with c.unlocked():\n"
      "    c.train.lora_rank = 8\n"
      "  return c\n"
  )
  proc = cli.run("--mode=step", f"--config={path}", module="april_jax.bench", timeout=300)
  assert proc.returncode != 0
  assert "train.lora_rank: no such config field" in proc.stderr
  assert "Traceback" not in proc.stderr
