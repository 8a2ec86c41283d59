"""A LoRA run from the command line (train.lora): killed after a checkpoint and resumed it
equals the uninterrupted run (PPO, so the critic's adapters resume too, over a
warm-started base the run keeps beside its checkpoints); its export loads both ways users
load it (a merged model folder, a PEFT folder that peft puts onto the base, with the same
logits); a bad LoRA setting is one line naming the field."""

import json
import shutil

import jax
import numpy as np
import pytest

from april_jax.run import lora_base
from april_jax.validation import checks as validate
from april_jax.models import hf_io, lora, peft_io, qwen3
from conftest import load_config
import cli
import hf_oracle

STEPS = [
    "--config.num_steps=4",
    "--config.checkpoint_every=2",
    "--config.eval_every=0",
    "--config.train.sft_steps=20",
    "--config.rollout.n_samples_per_prompt=4",
    "--config.train.advantage=gae",
    "--config.train.critic_lr=1e-3",
    "--config.rollout.dynamic_sampling=False",
    "--config.train.lora.rank=4",
    "--config.train.lora.lr=3e-3",
    "--config.train.lora.decode=unmerged",  # the sampler reads the frozen base itself
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The uninterrupted run's workdir and the killed-and-resumed one's (and its output)."""
  root = tmp_path_factory.mktemp("lora")
  straight, killed = root / "straight", root / "killed"
  cli.run_beside_a_killed_one(STEPS, "tiny.py", straight, killed, checkpoint=2)
  resumed = cli.run(*STEPS, config="tiny.py", workdir=killed)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  return straight, killed, resumed.stdout


def test_a_killed_lora_run_resumes_like_the_uninterrupted_run(runs):
  straight, killed, out = runs
  assert "resumed from step 2" in out
  a, b = cli.read_jsonl(straight / "metrics.jsonl"), cli.read_jsonl(killed / "metrics.jsonl")
  assert [m["step"] for m in b] == [1, 2, 3, 4]
  assert all(m["critic/value_loss"] > 0 and m["train/updates"] == m["step"] for m in b)
  for ma, mb in zip(a, b):
    for key, value in ma.items():
      if not cli.timing(key):
        assert mb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (ma["step"], key)
  host = json.loads((killed / "checkpoints" / "4" / "host" / "metadata").read_text())
  saved = host["learner"]["lora"]
  assert saved["rank"] == 4 and saved["targets"] == list(lora.TARGETS)
  assert host["learner"]["critic"]["lora"]["base_fingerprint"] == saved["base_fingerprint"]
  assert lora_base.saved(str(killed))  # the warm-started base, kept for resume and export


def _export(workdir, out, *flags):
  proc = cli.run(f"--workdir={workdir}", f"--out={out}", *flags, module="april_jax.export")
  assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_export_loads_merged_and_as_a_peft_folder_onto_the_base_alike(runs, tmp_path):
  hf_oracle.require("torch", "transformers", "peft")
  straight, _, _ = runs
  _export(straight, tmp_path / "merged")
  _export(straight, tmp_path / "adapter", "--format=peft")
  spec, adapters = peft_io.load_peft(tmp_path / "adapter", hf_io.load_config(tmp_path / "merged"))
  assert spec.rank == 4 and np.abs(adapters["layers"]["q"]["b"]).max() > 0  # trained
  written = json.loads((tmp_path / "adapter" / peft_io.CONFIG_NAME).read_text())
  assert written["base_model_name_or_path"] == lora_base.saved(str(straight))  # warm-started
  tokens = [[5, 17, 33, 2, 60, 61, 9]]
  base = lora_base.saved(str(straight))
  merged = hf_oracle.logits(tmp_path / "merged", tokens)
  over_base = hf_oracle.logits(base, tokens, adapter_dir=tmp_path / "adapter")
  np.testing.assert_allclose(over_base, merged, atol=2e-4)
  unadapted = hf_oracle.logits(base, tokens, adapter_dir=tmp_path / "adapter", disable_adapter=True)
  assert np.abs(unadapted - merged).max() > 1e-3  # the adapters matter


def test_a_merged_export_over_another_base_is_refused_naming_it(runs, tmp_path):
  straight, _, _ = runs
  moved = tmp_path / "run"
  shutil.copytree(straight, moved, ignore=shutil.ignore_patterns("xla_cache"))
  other = lora_base.saved(str(moved))
  cfg = hf_io.load_config(other)
  hf_io.save_pretrained(other, cfg, qwen3.init_params(cfg, jax.random.key(7)))
  proc = cli.run(f"--workdir={moved}", f"--out={tmp_path / 'o'}", module="april_jax.export")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert f"the base model in {other} is not the one the adapters were trained over" in (proc.stderr)
  assert not (tmp_path / "o").exists()


def test_a_fresh_start_over_model_path_forgets_an_earlier_saved_base(tmp_path):
  c = _tiny(rank=4)
  c.train.sft_steps = 0
  base = qwen3.init_params(hf_io.model_config(c), jax.random.key(0))
  lora_base.keep(str(tmp_path), c, hf_io.model_config(c), base)  # a random init: saved
  assert lora_base.saved(str(tmp_path))
  c.model.path = str(tmp_path / "model")  # a later start of the workdir, over a folder
  lora_base.keep(str(tmp_path), c, hf_io.model_config(_tiny(rank=4)), base)
  assert lora_base.saved(str(tmp_path)) is None


def test_peft_export_of_a_full_fine_tune_is_one_line(tmp_path):
  # A full fine-tune's checkpoint (the export tests' fixture shape, in a few lines).
  from april_jax.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  from april_jax.settings import base  # pylint: disable=g-import-not-at-top
  from april_jax.validation import resume as resume_check  # pylint: disable=g-import-not-at-top

  cfg = qwen3.Qwen3Config(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
      num_kv_heads=1, head_dim=16,
  )  # fmt: skip
  checkpointer = Checkpointer(str(tmp_path / "w"))
  host = {"step": 1, "config": resume_check.as_json(base.get_config()), "learner": {}}
  host["model"] = hf_io.architecture(cfg)
  params = qwen3.init_params(cfg, jax.random.key(0))
  checkpointer.save(1, {"params": params}, {"ids": np.arange(3)}, host)
  checkpointer.close()
  proc = cli.run(
      f"--workdir={tmp_path / 'w'}", f"--out={tmp_path / 'o'}", "--format=peft",
      module="april_jax.export",
  )  # fmt: skip
  assert proc.returncode == 2
  assert "--format=peft writes LoRA adapters; this run trained every weight" in proc.stderr


def _problems(config) -> str:
  with pytest.raises(validate.ConfigError) as raised:
    validate.validate(config)
  return str(raised.value)


def _tiny(**lora_fields):
  c = load_config("tiny")
  c.train.lora.update(lora_fields)
  return c


@pytest.mark.parametrize(
    "fields, expected",
    [
        (dict(rank=-1), "train.lora.rank must be >= 0"),
        (dict(rank=33), "train.lora.rank must be in [1, 32]"),  # k, v: 2 heads of 16
        (dict(rank=4, targets="q,attn"), "train.lora.targets has unknown modules ['attn']"),
        (dict(rank=4, lr=0.0), "train.lora.lr must be > 0"),
        (dict(rank=4, targets="q,v,q"), "train.lora.targets lists ['q'] more than once"),
        (dict(rank=4, decode="fused"), "train.lora.decode must be one of ('merged', 'unmerged')"),
    ],
)
def test_a_bad_lora_setting_names_its_field(fields, expected):
  assert expected in _problems(_tiny(**fields))


def test_a_lora_path_or_critic_of_another_base_is_named(tmp_path):
  small = qwen3.Qwen3Config(
      vocab_size=136, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
      num_kv_heads=1, head_dim=16,
  )  # fmt: skip
  hf_io.save_pretrained(tmp_path / "other", small, qwen3.init_params(small, jax.random.key(0)))
  spec = lora.LoraSpec(4, 8.0, ("q", "v"))
  peft_io.save_peft(tmp_path / "adapter", spec, lora.init(small, spec, jax.random.key(1)))
  c = _tiny(rank=4, alpha=8.0, targets="q,v")
  c.train.lora_path = str(tmp_path / "adapter")
  c.train.advantage, c.rollout.dynamic_sampling = "gae", False
  c.train.critic_path = str(tmp_path / "other")
  found = _problems(c)
  assert "train.lora_path's adapter: " not in found  # rank 4 fits this base too
  assert "train.critic_path" in found and "hidden_size 32 (the policy's 64)" in found
  c.train.critic_path = ""
  c.train.lora.rank = 8
  assert "holds adapters of another shape: rank 4 (train.lora.rank is 8)" in _problems(c)
  c.train.lora.rank, c.train.lora.targets = 4, "v,q"  # any order: PEFT's own on reading
  assert lora.LoraSpec.from_config(c.train.lora).targets == ("q", "v")
  assert "train.lora_path" not in _problems_or_none(c)
  c.train.lora.rank = 0
  assert "train.lora_path is set but train.lora.rank is 0" in _problems(c)


def _problems_or_none(config) -> str:
  try:
    validate.validate(config)
  except validate.ConfigError as e:
    return str(e)
  return ""


@pytest.mark.parametrize("bad", ["another_width", "missing", "damaged"])
def test_a_bad_lora_path_stops_the_run_in_one_line_before_any_weight_or_warm_start(tmp_path, bad):
  small = qwen3.Qwen3Config(
      vocab_size=136, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
      num_kv_heads=1, head_dim=16,
  )  # fmt: skip
  spec = lora.LoraSpec(4, 32.0)
  adapter = tmp_path / "adapter"
  if bad != "missing":
    peft_io.save_peft(adapter, spec, lora.init(small, spec, jax.random.key(1)))
  if bad == "damaged":
    (adapter / peft_io.WEIGHTS_NAME).write_bytes(np.random.default_rng(0).bytes(4096))
  proc = cli.run(
      "--config.train.lora.rank=4", f"--config.train.lora_path={adapter}",
      "--config.train.sft_steps=300", config="tiny.py", workdir=tmp_path / "w", timeout=300,
  )  # fmt: skip
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.startswith("april_jax")]
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"april_jax: train.lora_path '{adapter}'"), lines[0]
  expected = {
      "another_width": "q_proj.lora_A.weight has shape (4, 32); this base model needs (4, 64)",
      "missing": "no such folder (a PEFT adapter to start from)",
      "damaged": f"{adapter / peft_io.WEIGHTS_NAME} cannot be read as safetensors: ",
  }[bad]
  assert expected in lines[0], lines[0]
  # Refused before the warm start (which prints its progress) and before any save.
  assert "warm" not in proc.stdout.lower(), proc.stdout[-2000:]
  assert not (tmp_path / "w" / "lora_base").exists()
