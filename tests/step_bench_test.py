"""The step benchmark runs whole RL steps on both sides and sets each phase against its
floor (no timing asserted beyond positive, finite seconds)."""

import json
import math

import pytest

from april_jax.benchmarks import floors, step_bench
from april_jax.benchmarks.report import Report
from april_jax.models import qwen3
import cli
from conftest import load_config


def test_step_bench_times_every_phase_of_both_sides_beside_its_floor(tmp_path):
  config = load_config("tiny")
  config.rollout.n_samples_per_prompt = 4  # the benchmarks' recorded setting (BENCHMARKS.md)
  config.rollout.max_response_len = 48
  report = Report(str(tmp_path / "report"), "step")
  out = step_bench.run(config, shape="dapo_math", steps=2, report=report)
  assert out["mode"] == "step" and out["steps"] == 2
  floored = set(step_bench.FLOORED) | {"rollout", "step"}
  for side in ("april", "baseline"):
    phases, side_floors = out[f"{side}_phases"], out[f"{side}_floors"]
    assert set(phases) == set(step_bench.PHASES)
    assert all(math.isfinite(s) and s > 0 for s in phases.values()), phases
    assert set(side_floors) == floored  # the rest of the rollout is host work: no floor
    assert all(math.isfinite(f) and f > 0 for f in side_floors.values()), side_floors
    parts = ("decode", "prefill")
    assert side_floors["rollout"] == pytest.approx(sum(side_floors[p] for p in parts))
    assert side_floors["step"] == pytest.approx(sum(side_floors[p] for p in step_bench.FLOORED))
    assert out["padded_per_real"][side] >= 1
    mfu = out["learner_mfu"][side]
    # The same seconds divide both: real tokens are a subset of the positions computed.
    assert 0 < mfu["real"] <= mfu["padded"] and math.isfinite(mfu["padded"])
    assert out["checkpoint_bytes"][side] > 0
  # The same cast (masters in, compute-dtype copy out) on both sides.
  assert out["april_floors"]["cast"] == out["baseline_floors"]["cast"]
  assert all(v > 0 and math.isfinite(v) for v in out["ceilings"].values())
  assert out["compiles_while_timed"] == 0  # every program was compiled before the clock ran
  check = out["packed_attention"]  # float32 blockwise on the CPU: the same to rounding
  assert check["ok"] and check["implementation"] == "blockwise" and check["max_rel_diff"] < 1e-5
  json.dumps(out)  # the JSON line carries it all
  report.write("step", out)
  assert (tmp_path / "report" / "step.md").is_file()


def test_learner_flops_count_the_passes_over_the_body_attention_and_head():
  cfg = qwen3.Qwen3Config(
      vocab_size=100,
      hidden_size=8,
      intermediate_size=16,
      num_layers=2,
      num_heads=2,
      num_kv_heads=1,
      head_dim=4,
      tie_word_embeddings=True,
  )
  body = cfg.num_params() - 100 * 8
  assert floors.body_params(cfg) == body
  lengths = [3, 5]
  attention = 2 * 2 * 2 * 4 * (3 * 4 + 5 * 6)  # layers x heads x head_dim x n(n+1), x2
  forward = 2 * body * 8 + attention
  assert floors.body_flops(cfg, lengths) == forward
  head = 2 * 8 * 100 * 8
  # One old-logprob pass, then one epoch: 3 forwards, the body once more rematerialised.
  got = floors.learner_flops(cfg, lengths, logprob_passes=1, epochs=1, remat=True)
  assert got == (forward + head) + (4 * forward + 3 * head)
  got = floors.learner_flops(cfg, lengths, logprob_passes=0, epochs=2, remat=False)
  assert got == 2 * (3 * forward + 3 * head)
  # LoRA's frozen base: no weight gradients, so a gradient pass is 2 forwards.
  got = floors.learner_flops(cfg, lengths, 1, 1, remat=True, frozen_base=True)
  assert got == (forward + head) + (3 * forward + 2 * head)
  assert floors.kv_bytes_per_position(cfg, "bfloat16") == 2 * 2 * 1 * 4 * 2


def test_gpu_bench_qwen3_1_7b_is_the_released_shape():
  cfg = qwen3.Qwen3Config.from_init(load_config("gpu_bench", "qwen3_1_7b").model.init)
  # Qwen3-1.7B's model card: 1.7B parameters, 1.4B of them outside the embedding.
  assert 1.70e9 < cfg.num_params() < 1.75e9
  assert 1.38e9 < floors.body_params(cfg) < 1.42e9
  for variant in ("qwen3_0_6b", "qwen3_4b"):  # the others are unchanged
    assert load_config("gpu_bench", variant).model.init.num_layers in (28, 36)
  lora_8b = load_config("gpu_bench", "qwen3_8b_lora")
  assert 8.1e9 < qwen3.Qwen3Config.from_init(lora_8b.model.init).num_params() < 8.3e9
  assert lora_8b.train.lora.rank == 32 and lora_8b.model.dtype == "bfloat16"


def test_step_mode_from_the_command_line_ends_with_its_json_line():
  # With LoRA (the step_lora part of launch/bench_gpu.sh); the whole fine-tune runs above.
  proc = cli.run(
      "--mode=step",
      "--steps=1",
      "--max_response_len=32",
      "--out_dir=",
      "--config.train.lora.rank=4",
      config="tiny.py",
      module="april_jax.bench",
      devices=None,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["mode"] == "step" and result["max_response_len"] == 32
  assert result["lora"]["rank"] == 4 and result["compiles_while_timed"] == 0
  table = proc.stdout.splitlines()[:-1]
  assert any(line.startswith("checkpoint ") for line in table)  # the phase table printed
