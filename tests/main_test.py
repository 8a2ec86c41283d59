"""python -m april_jax.main end to end: bad configs fail fast, the tiny run learns, and a
killed run resumes exactly where its checkpoint left it."""

import socket
import signal
import time

import numpy as np
import pytest

import cli

LEARNS = "test_tiny_run_learns_the_builtin_task"


@pytest.fixture(scope="module", autouse=True)
def first_run(request, tmp_path_factory):
  """The README's first run, its first 20 steps, started when this module's tests start
  (if its test is selected) and running beside them: it runs for a minute on one core,
  and the others are mostly other processes' compiles. (workdir, process) or None."""
  if not any(item.name == LEARNS for item in request.session.items):
    yield None
    return
  workdir = tmp_path_factory.mktemp("first_run")
  proc = cli.launch(
      "--config.num_steps=20", "--config.checkpoint_every=0", config="tiny.py", workdir=workdir
  )
  try:
    yield workdir, proc
  finally:
    proc.kill()  # a no-op once it has ended


def test_wrong_config_exits_with_a_clear_message_before_compiling(tmp_path):
  proc = cli.launch(
      "--config.rollout.over_sampling_batch_size=4",
      "--config.rollout.n_samples_per_prompt=1",
      "--config.train.policy_loss=nope",
      "--config.model.path=/no/such/model",
      "--config.rollout.temperature=nan",
      "--config.train.lr=inf",
      config="tiny.py",
      workdir=tmp_path / "w",
  )
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 2, err
  assert "Traceback" not in err
  for field in (
      "rollout.temperature must be a finite number, got nan",
      "train.lr must be a finite number, got inf",
      "rollout.over_sampling_batch_size (4) must be >= rollout.batch_size (8)",
      "rollout.n_samples_per_prompt must be >= 2",
      "policy_loss",
      "model.path '/no/such/model'",
  ):
    assert field in err
  assert not (tmp_path / "w" / "checkpoints").exists()  # nothing was built


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--config=configs/nope.py"], "cannot load the config file: [Errno 2] No such file"),
        (["--config.rollout.nope=1"], "names a field the config does not have: \"'nope'\""),
        (["--bogus=1"], "Unknown command line flag 'bogus'"),
        (["--config.rollout.batch_size=abc"], "--config.rollout.batch_size=abc: invalid literal"),
        (["--config=configs/tiny.py:nope"], "configs/tiny.py variant 'nope': its one variant is"),
        (
            ["--config=configs/tiny_lookup.py:tis+nope"],
            "configs/tiny_lookup.py has no variants (got 'tis+nope')",
        ),
        (
            ["--config=configs/qwen3_8b.py:nosuchvariant"],
            "the config file failed: ValueError: configs/qwen3_8b.py variant 'nosuchvariant'",
        ),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(tmp_path, flags, expected):
  proc = cli.launch(*flags, config="tiny.py", workdir=tmp_path / "w")
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 2, err[-3000:]
  assert err.strip().splitlines() == [err.strip()] and err.startswith("april_jax: "), err[-3000:]
  assert expected in err


@pytest.mark.parametrize(
    "process_id,expected", [(0, "1 of 2 processes joined"), (1, "did not answer")]
)
def test_a_lone_process_of_a_multi_host_run_says_so_in_one_line_and_exits_5(
    tmp_path, process_id, expected
):
  with socket.socket() as s:  # a free port
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  proc = cli.launch(
      f"--config.distributed.coordinator_address=localhost:{port}",
      "--config.distributed.num_processes=2",
      f"--config.distributed.process_id={process_id}",
      "--config.distributed.initialization_timeout_s=3",
      config="tiny.py",
      workdir=tmp_path / "w",
  )
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 5, err[-3000:]
  (line,) = err.strip().splitlines()
  assert line.startswith("april_jax: ") and expected in line and f"localhost:{port}" in line


def test_a_broken_model_folder_or_an_unusable_workdir_is_one_line_and_exit_2(tmp_path):
  (tmp_path / "model").mkdir()
  (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen3",')
  (tmp_path / "a_file").write_text("")
  for flags, expected in [
      ([f"--config.model.path={tmp_path / 'model'}"], "model/config.json is not valid JSON"),
      ([f"--workdir={tmp_path / 'a_file' / 'w'}"], "cannot be created or written: Not a directory"),
  ]:
    proc = cli.launch(*flags, config="tiny.py", workdir=tmp_path / "w")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    lines = [l for l in err.strip().splitlines() if not l.startswith("WARNING")]
    assert len(lines) == 1 and lines[0].startswith("april_jax: ") and expected in lines[0], err


def test_bfloat16_run_evaluates_every_step_on_its_engine_and_finishes(tmp_path):
  proc = cli.launch(
      "--config.model.dtype=bfloat16",
      "--config.model.kv_dtype=bfloat16",
      "--config.num_steps=2",
      "--config.eval_every=1",
      "--config.train.sft_steps=2",
      "--config.eval.num_prompts=4",
      config="tiny.py",
      workdir=tmp_path,
      optimised=False,  # bfloat16 programs of its own: mostly compiling
  )
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  metrics = cli.read_jsonl(tmp_path / "metrics.jsonl")
  assert [m["step"] for m in metrics] == [0, 1, 2]  # 0: the evaluation before training
  assert all("eval/pass@1" in m for m in metrics)
  assert all(np.isfinite(m["train/loss"]) for m in metrics[1:])
  assert "step 2/2" in out


def test_killed_run_resumes_from_its_checkpoint_like_an_uninterrupted_run(tmp_path):
  # PPO with a critic: the checkpoint holds the policy, the critic and both optimizers.
  # (GRPO's kill-and-resume: the two-process run of multihost_test.py.)
  steps = [
      "--config.num_steps=6",
      "--config.checkpoint_every=2",
      "--config.eval_every=0",
      "--config.train.sft_steps=20",
      "--config.rollout.n_samples_per_prompt=4",
      "--config.train.advantage=gae",
      "--config.train.critic_lr=1e-3",
      "--config.rollout.dynamic_sampling=False",
  ]
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  cli.run_beside_a_killed_one(steps, "tiny.py", straight, killed, checkpoint=4)
  proc = cli.launch(*steps, config="tiny.py", workdir=killed)
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  assert "resumed from step" in out

  a, b = cli.read_jsonl(straight / "metrics.jsonl"), cli.read_jsonl(killed / "metrics.jsonl")
  assert [m["step"] for m in b] == list(range(1, 7))
  assert all(m["critic/value_loss"] > 0 for m in b)  # the critic trained, and resumed
  assert [set(m) for m in a] == [set(m) for m in b]
  for ma, mb in zip(a, b):
    for key, value in ma.items():
      if not cli.timing(key):
        assert mb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (ma["step"], key)

  assert list((killed / "tb").glob("events.out.tfevents.*"))  # TensorBoard files too
  ra, rb = cli.read_jsonl(straight / "rollouts.jsonl"), cli.read_jsonl(killed / "rollouts.jsonl")
  trained = [r["prompt_id"] for r in rb]
  assert len(trained) == len(set(trained)) == 6 * 8  # no prompt trained twice or lost
  assert trained == [r["prompt_id"] for r in ra]


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
  proc = cli.launch(
      "--config.num_steps=40",
      "--config.checkpoint_every=0",
      "--config.eval_every=0",
      "--config.train.sft_steps=0",
      "--config.rollout.n_samples_per_prompt=4",
      config="tiny.py",
      workdir=tmp_path,
  )
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.monotonic() + 600
  while proc.poll() is None and time.monotonic() < deadline:
    if metrics.exists() and len(cli.read_jsonl(metrics)) >= 2:
      break
    time.sleep(0.2)
  assert proc.poll() is None, "the run ended before SIGTERM"
  # A second run on the same workdir is refused, in one line, and leaves the first alone.
  second = cli.launch("--config.num_steps=40", config="tiny.py", workdir=tmp_path)
  _, second_err = second.communicate(timeout=300)
  assert second.returncode == 2, second_err[-3000:]
  message = [line for line in second_err.splitlines() if line.startswith("april_jax:")]
  assert len(message) == 1 and f"workdir {tmp_path} is in use by another run (pid {proc.pid}" in (
      message[0]
  )
  assert "Traceback" not in second_err
  assert proc.poll() is None
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 143, err[-3000:]  # stopped, not finished, with a status of its own
  assert "Traceback" not in err
  last = cli.read_jsonl(metrics)[-1]["step"]
  assert last < 40
  assert (tmp_path / "checkpoints" / str(last)).is_dir()  # saved at the step it stopped
  (stopped,) = [l for l in out.splitlines() if l.startswith("stopped by SIGTERM")]
  # The summary says so: mostly the signal comes mid-rollout, which is cut and kept.
  assert stopped.startswith(
      (
          f"stopped by SIGTERM during step {last + 1} of 40: its rollouts so far are kept in "
          f"checkpoint {last}",
          f"stopped by SIGTERM after step {last} of 40: checkpoint {last} is saved",
          f"stopped by SIGTERM during step {last + 1} of 40 (checkpoint ",  # none to keep
      )
  ), stopped


def test_a_config_that_cannot_fit_is_refused_with_the_numbers(tmp_path):
  proc = cli.launch("--config.mesh.device_memory_gb=0.001", config="tiny.py", workdir=tmp_path)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 3, err[-2000:]
  assert "GB per device but a device holds 0.0 GB" in err and "slot state (KV cache)" in err


def test_the_persistent_compilation_cache_defaults_to_the_workdir(tmp_path, monkeypatch):
  import jax  # pylint: disable=g-import-not-at-top
  from april_jax import main as main_lib  # pylint: disable=g-import-not-at-top
  from april_jax.settings import base  # pylint: disable=g-import-not-at-top

  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  before = (
      jax.config.jax_compilation_cache_dir,
      jax.config.jax_persistent_cache_min_compile_time_secs,
  )
  config = base.get_config()
  try:
    main_lib._use_compilation_cache(config, str(tmp_path))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla_cache")
    config.compilation_cache_dir = str(tmp_path / "elsewhere")
    main_lib._use_compilation_cache(config, str(tmp_path))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "elsewhere")
  finally:
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_tiny_run_learns_the_builtin_task(first_run):
  # The README's first run, its first 20 steps: APRIL, the default (the synchronous
  # baseline learns the same per step: the e2e benchmark's curves). Started with the
  # module (first_run); this test, the module's last, waits for it.
  tmp_path, proc = first_run
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, err[-3000:]
  evals = [m for m in cli.read_jsonl(tmp_path / "metrics.jsonl") if "eval/pass@1" in m]
  # Before training (step 0) the warm-started policy stops late: greedy is rarely right.
  # Seeded, so deterministic on a given platform; measured here: 0.000 -> 0.266 (and
  # 0.672 after the whole run's 120 steps, README).
  assert [m["step"] for m in evals] == [0, 20]
  first, last = evals[0]["eval/pass@1"], evals[1]["eval/pass@1"]
  assert first < 0.1 and last > first + 0.15, (first, last)
  assert "before training: eval pass@1 " in out and "step 20/20" in out
  # The end-of-run summary, and the plot it points to.
  summary = out[out.index("run summary: steps 1-20") :]
  assert f"eval pass@1      {first:.3f} (step 0) -> {last:.3f} (step 20)" in summary
  assert "reward" in summary and "slot occupancy" in summary and "off-policy" in summary
  assert str(tmp_path / "progress.png") in summary
  assert (tmp_path / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
