"""The real-data path end to end: a random Qwen3 saved by transformers with the real Qwen3
tokenizer -> `main` on a DAPO-format parquet, evaluated on AIME-2024 -> a resume -> export
-> transformers loads the export and gives the trained policy's logits."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.checkpoint import Checkpointer
from april_jax.models import hf_io, qwen3
import cli
import hf_oracle
from conftest import MATH_DIR, QWEN3_TOKENIZER_DIR, save_random_hf_qwen3

RUN = [
    "--config.data.source=" + str(MATH_DIR / "dapo_format_aime24.parquet"),
    "--config.eval.path=" + str(MATH_DIR / "aime24.jsonl"),
    "--config.rollout.reward=math_dapo",
    "--config.rollout.dynamic_sampling=False",  # every reward is -1 (below)
    "--config.train.sft_steps=0",
    # Every reward is -1 (a random model), so GRPO's advantages are 0: the entropy bonus is
    # what moves the params.
    "--config.train.entropy_coef=0.01",
    "--config.data.max_prompt_len=320",
    "--config.rollout.max_response_len=12",
    # One group trains per step and a second is asked for: it waits in the buffer across the
    # resume and is step 2's batch.
    "--config.rollout.batch_size=1",
    "--config.rollout.n_samples_per_prompt=2",
    "--config.rollout.over_sampling_batch_size=2",
    "--config.rollout.num_slots=4",
    "--config.checkpoint_every=1",
    "--config.eval_every=2",
    "--config.eval.num_prompts=2",
    "--config.eval.k=1",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A random Qwen3 (the real vocabulary, tiny widths) saved by transformers, with the
  real Qwen3 tokenizer files beside it."""
  path = save_random_hf_qwen3(
      tmp_path_factory.mktemp("qwen3"),
      vocab_size=151936,
      hidden_size=32,
      num_attention_heads=2,
      num_key_value_heads=1,
      head_dim=16,
      tie_word_embeddings=True,
      num_layers=1,
  )
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(QWEN3_TOKENIZER_DIR / name, path / name)
  return path


def test_dapo_parquet_run_resumes_and_exports_what_transformers_reads_as_trained(
    model_dir, tmp_path
):
  workdir, out = tmp_path / "run", tmp_path / "export"
  model = f"--config.model.path={model_dir}"
  first = cli.run(
      model, *RUN, "--config.num_steps=1", config="tiny.py", workdir=workdir, optimised=False
  )
  assert first.returncode == 0, first.stderr[-3000:]
  second = cli.run(
      model, *RUN, "--config.num_steps=2", config="tiny.py", workdir=workdir, optimised=False
  )
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resumed from step 1 (1 groups in the partial buffer)" in second.stdout
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  # The evaluation before training (step -1) is the fresh start's alone: not run again.
  assert [l["step"] for l in lines] == [0, 1, 2] and "eval/pass@1" in lines[-1]
  assert "eval/pass@1" in lines[0] and "rollout/reward_mean" not in lines[0]
  # Real prompts and the real math_dapo reward (a random model is never right: -1).
  groups = [json.loads(l) for l in (workdir / "rollouts.jsonl").read_text().splitlines()]
  assert [g["step"] for g in groups] == [1, 2]
  assert all(g["prompt_id"].startswith("dapo_format_aime24:") for g in groups)
  assert all(g["rewards"] == [-1.0, -1.0] for g in groups)
  # (A warm-start needs reference responses, which a dataset does not have: refused at
  # start-up, config_test.py.)

  export = cli.run(f"--out={out}", workdir=workdir, module="april_jax.export", optimised=False)
  assert export.returncode == 0, export.stderr[-3000:]
  assert "exported checkpoint 2" in export.stdout
  assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
  hf_oracle.require("torch", "transformers")
  hello, question = hf_oracle.encode(out, ["Hello world", "What is 7 times 6? Answer: 42"])
  assert hello == [9707, 1879]

  # transformers on the export gives the logits of the checkpoint's (trained) params.
  cfg = hf_io.load_config(model_dir)
  shapes = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0), jnp.float32))
  checkpointer = Checkpointer(str(workdir))
  trained = checkpointer.restore_params(2, shapes)
  checkpointer.close()
  _, initial = hf_io.load_pretrained(model_dir)
  moved = jax.tree.map(
      lambda a, b: not np.array_equal(np.asarray(a), np.asarray(b)), trained, initial
  )
  assert any(jax.tree.leaves(moved))  # the export is the trained policy, not the initial one
  tokens = np.array([question])
  ours = np.asarray(qwen3.forward_jit(cfg, trained, jnp.asarray(tokens)))
  theirs = hf_oracle.logits(out, tokens)
  np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)


def test_a_bom_file_whose_prompts_all_exceed_max_prompt_len_is_one_line_before_warm_up(
    model_dir, tmp_path
):
  # Its first row (behind a UTF-8 BOM) counts as a record, and no prompt fits: said while
  # the data loads, with the shortest prompt's length, before anything compiles.
  data = tmp_path / "long.jsonl"
  rows = [{"problem": "What is " + " + ".join(["1"] * n) + "?", "answer": "1"} for n in (40, 30)]
  data.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
  proc = cli.run(
      f"--config.model.path={model_dir}",
      *[a for a in RUN if not a.startswith(("--config.data.source", "--config.data.max_prompt"))],
      f"--config.data.source={data}",
      "--config.data.max_prompt_len=40",
      config="tiny.py",
      workdir=tmp_path / "run",
      optimised=False,
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  (line,) = proc.stderr.strip().splitlines()
  assert f"no prompt of the 2 records in {data} fits data.max_prompt_len=40" in line, line
  assert "the shortest is" in line and "Traceback" not in proc.stderr
  assert "compiling" not in proc.stdout
