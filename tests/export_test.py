"""`python -m april_jax.export` never destroys: it refuses the run's own model folder
(by path or through a symlink, with or without --overwrite), the run's workdir and any
folder above it, any non-empty folder without --overwrite, and with it any folder that
holds more than an earlier export, leaving every file there byte for byte; a mistyped
workdir creates nothing; a missing step names the steps there; a failed export leaves
--out as it was."""

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

from april_jax import export as export_lib
from april_jax.checkpoint import Checkpointer
from april_jax.settings import base
from april_jax.validation import resume as resume_check
from april_jax.errors import InputError
from april_jax.models import hf_io, qwen3
import cli

CFG = qwen3.Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A pretrained model folder and a workdir whose checkpoints 1 and 2 loaded it."""
  root = tmp_path_factory.mktemp("export")
  model = root / "model"
  hf_io.save_pretrained(model, CFG, qwen3.init_params(CFG, jax.random.key(0)))
  (model / "tokenizer.json").write_text('{"pretend": "tokenizer"}')
  config = base.get_config()
  config.model.path = str(model)
  checkpointer = Checkpointer(str(root / "workdir"))
  for step in (1, 2):
    params = qwen3.init_params(CFG, jax.random.key(step))
    host = {"step": step, "config": resume_check.as_json(config)}
    checkpointer.save(step, {"params": params}, {"ids": np.arange(3)}, host)
  checkpointer.close()
  return root / "workdir", model


def _export(*args):
  return cli.run(*args, module="april_jax.export", devices=None, timeout=300)


def _checksums(folder: Path) -> dict[str, str]:
  return {
      str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
      for p in sorted(folder.rglob("*"))
      if p.is_file()
  }


def _one_line_refusal(proc) -> str:
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  (line,) = proc.stderr.strip().splitlines()
  return line


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("through_symlink", [False, True])
def test_export_refuses_the_runs_own_model_folder(run, tmp_path, overwrite, through_symlink):
  workdir, model = run
  before = _checksums(model)
  out = model
  if through_symlink:
    out = tmp_path / "link"
    out.symlink_to(model)
  args = [f"--workdir={workdir}", f"--out={out}"] + (["--overwrite"] if overwrite else [])
  line = _one_line_refusal(_export(*args))
  assert "the folder the run loaded its model from" in line and "model.path" in line
  assert _checksums(model) == before
  # A folder above the model (which --overwrite would replace whole) is refused too.
  line = _one_line_refusal(_export(f"--workdir={workdir}", f"--out={model.parent}", "--overwrite"))
  assert "inside or above" in line
  assert _checksums(model) == before


def test_export_never_replaces_the_runs_workdir_or_a_folder_above_it(run, tmp_path):
  """`--out=<workdir> --overwrite` would have replaced the run's checkpoints by its export."""
  workdir = tmp_path / "runs" / "workdir"
  shutil.copytree(run[0], workdir)
  before = _checksums(tmp_path)
  line = _one_line_refusal(_export(f"--workdir={workdir}", f"--out={workdir}", "--overwrite"))
  assert f"--out={workdir} is the run's workdir" in line and "--overwrite" in line
  for out in (workdir.parent, tmp_path):
    with pytest.raises(InputError, match="is above the run's workdir"):
      export_lib.export(str(workdir), str(out), overwrite=True)
  assert _checksums(tmp_path) == before


def test_export_never_writes_inside_the_workdir_where_a_lora_run_keeps_its_base(run, tmp_path):
  """`--out=<workdir>/lora_base --format=peft --overwrite` once deleted the only copy of a
  LoRA run's warm-started base (it holds only files an export writes)."""
  workdir = tmp_path / "workdir"
  shutil.copytree(run[0], workdir)
  base = workdir / "lora_base"
  base.mkdir()
  (base / "config.json").write_text('{"the": "base"}')
  (base / "model.safetensors").write_bytes(b"the base's weights")
  before = _checksums(workdir)
  line = _one_line_refusal(
      _export(f"--workdir={workdir}", f"--out={base}", "--format=peft", "--overwrite")
  )
  assert f"--out={base} is inside the run's workdir" in line, line
  for out in (base, workdir / "exports" / "step2", workdir / "checkpoints"):
    for overwrite in (False, True):
      with pytest.raises(InputError, match="is inside the run's workdir"):
        export_lib.export(str(workdir), str(out), overwrite=overwrite)
  assert _checksums(workdir) == before
  assert not (workdir / "exports").exists()


def test_overwrite_replaces_only_an_earlier_export(run, tmp_path):
  workdir, _ = run
  downloaded = tmp_path / "downloaded_model"
  downloaded.mkdir()
  (downloaded / "config.json").write_text('{"theirs": true}')
  (downloaded / "model.safetensors").write_bytes(b"their weights")
  (downloaded / "README.md").write_text("a model card")
  (downloaded / "original").mkdir()
  (downloaded / "original" / "consolidated.pth").write_bytes(b"more weights")
  checkpoints = tmp_path / "checkpoints_by_mistake"
  shutil.copytree(workdir / "checkpoints", checkpoints)
  before = _checksums(tmp_path)
  line = _one_line_refusal(_export(f"--workdir={workdir}", f"--out={downloaded}", "--overwrite"))
  assert f"--out={downloaded} holds what an export does not write (README.md, original)" in line
  with pytest.raises(InputError, match=r"holds what an export does not write \(1, 2"):
    export_lib.export(str(workdir), str(checkpoints), overwrite=True)
  assert _checksums(tmp_path) == before

  # An earlier export, sharded, with its tokenizer: replaced whole.
  earlier = tmp_path / "earlier_export"
  earlier.mkdir()
  for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
    (earlier / name).write_text("{}")
  for i in (1, 2):
    (earlier / f"model-0000{i}-of-00002.safetensors").write_bytes(b"old shard")
  assert export_lib.export(str(workdir), str(earlier), overwrite=True) == 2
  assert sorted(_checksums(earlier)) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_export_refuses_a_non_empty_folder_unless_told_to_overwrite(run, tmp_path):
  workdir, _ = run
  out = tmp_path / "other_model"
  out.mkdir()
  (out / "model.safetensors").write_bytes(b"someone's weights")
  (out / "config.json").write_text('{"mine": true}')
  before = _checksums(out)
  line = _one_line_refusal(_export(f"--workdir={workdir}", f"--out={out}"))
  assert f"--out={out} is not empty" in line and "--overwrite" in line
  assert _checksums(out) == before

  proc = _export(f"--workdir={workdir}", f"--out={out}", "--overwrite")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "exported checkpoint 2" in proc.stdout
  # Replaced whole, as asked: only the export's own files, none of the old bytes.
  assert sorted(_checksums(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
  assert not set(_checksums(out).values()) & set(before.values())
  loaded_cfg, params = hf_io.load_pretrained(str(out), "float32")
  assert loaded_cfg.hidden_size == CFG.hidden_size
  assert (out / "tokenizer.json").read_text() == '{"pretend": "tokenizer"}'
  # Nothing of the staging is left beside --out.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["other_model"]


def test_a_mistyped_workdir_creates_nothing_and_a_missing_step_names_the_steps(run, tmp_path):
  workdir, _ = run
  typo = tmp_path / "wrokdir"
  line = _one_line_refusal(_export(f"--workdir={typo}", f"--out={tmp_path / 'out'}"))
  assert f"--workdir={typo} does not exist" in line
  assert not typo.exists() and not (tmp_path / "out").exists()
  empty = tmp_path / "empty"
  empty.mkdir()
  line = _one_line_refusal(_export(f"--workdir={empty}", f"--out={tmp_path / 'out'}"))
  assert "holds no checkpoints" in line and list(empty.iterdir()) == []

  line = _one_line_refusal(_export(f"--workdir={workdir}", f"--out={tmp_path / 'out'}", "--step=7"))
  assert "no checkpoint 7" in line and "the steps there: 1, 2" in line
  assert not (tmp_path / "out").exists()
  proc = _export(f"--workdir={workdir}", f"--out={tmp_path / 'out'}", "--step=1")
  assert proc.returncode == 0 and "exported checkpoint 1" in proc.stdout, proc.stderr[-3000:]


def test_a_failed_export_leaves_out_as_it_was(run, tmp_path, monkeypatch):
  workdir, _ = run
  out = tmp_path / "previous_export"
  out.mkdir()
  (out / "config.json").write_text('{"an": "earlier export"}')
  before = _checksums(out)

  def fail_midway(path, cfg, params):
    (Path(path) / "config.json").write_text("half")
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(hf_io, "save_pretrained", fail_midway)
  with pytest.raises(OSError, match="No space left"):
    export_lib.export(str(workdir), str(out), overwrite=True)
  assert _checksums(out) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["previous_export"]
  with pytest.raises(InputError, match="is a file"):
    (tmp_path / "a_file").write_text("x")
    export_lib.export(str(workdir), str(tmp_path / "a_file"))
  assert os.path.isfile(tmp_path / "a_file")


def test_a_saved_config_this_version_cannot_hold_is_refused_naming_the_field(tmp_path):
  """A field an older version saved and this one dropped is left out; a value of the wrong
  type is an InputError naming it, and nothing is written."""
  saved = resume_check.as_json(base.get_config())
  saved["train"]["an_old_field"] = 1
  saved["train"]["lr"] = "fast"
  checkpointer = Checkpointer(str(tmp_path / "workdir"))
  host = {"step": 1, "config": saved, "model": hf_io.architecture(CFG)}
  params = {"params": qwen3.init_params(CFG, jax.random.key(7))}
  checkpointer.save(1, params, {"ids": np.arange(3)}, host)
  checkpointer.close()
  with pytest.raises(InputError, match=r"checkpoint 1 .*train\.lr must be a float, got 'fast'"):
    export_lib.export(str(tmp_path / "workdir"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_a_run_whose_model_folder_moved_exports_from_the_checkpoint_alone(tmp_path, capsys):
  """The checkpoint keeps the model's architecture: export needs no model folder."""
  config = base.get_config()
  config.model.path = str(tmp_path / "moved_away")
  checkpointer = Checkpointer(str(tmp_path / "workdir"))
  params = qwen3.init_params(CFG, jax.random.key(7))
  host = {"step": 1, "config": resume_check.as_json(config), "model": hf_io.architecture(CFG)}
  checkpointer.save(1, {"params": params}, {"ids": np.arange(3)}, host)
  checkpointer.close()
  out = tmp_path / "out"
  assert export_lib.export(str(tmp_path / "workdir"), str(out)) == 1
  assert f"tokenizer folder {tmp_path / 'moved_away'} is gone" in capsys.readouterr().err
  loaded_cfg, loaded = hf_io.load_pretrained(str(out), "float32")
  assert loaded_cfg.num_layers == CFG.num_layers and loaded_cfg.vocab_size == CFG.vocab_size
  np.testing.assert_array_equal(loaded["embed"], params["embed"])


def test_the_next_export_tidies_what_a_killed_one_left(run, tmp_path):
  """A kill mid-write leaves a staging folder (a partial model) beside --out; a kill between
  the two renames leaves the previous export moved aside and --out missing."""
  workdir, _ = run
  out = tmp_path / "exports" / "policy"
  assert export_lib.export(str(workdir), str(out), step=1) == 1
  previous = _checksums(out)
  staging = tmp_path / "exports" / ".policy.export-abc123"
  staging.mkdir()
  (staging / "model.safetensors").write_bytes(b"half a model")
  moved = tmp_path / "exports" / ".policy.old-def456"
  moved.mkdir()
  out.rename(moved / "out")
  # Without --overwrite: the previous export is back in place first, so it is refused.
  with pytest.raises(InputError, match="is not empty"):
    export_lib.export(str(workdir), str(out))
  assert _checksums(out) == previous
  assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["policy"]
  assert export_lib.export(str(workdir), str(out), overwrite=True) == 2
  # Killed after the new export was in place, before the old one was removed: it goes.
  leftover = tmp_path / "exports" / ".policy.old-ghi789"
  leftover.mkdir()
  shutil.copytree(out, leftover / "out")
  current = _checksums(out)
  assert export_lib.export(str(workdir), str(tmp_path / "exports" / "policy"), overwrite=True)
  assert _checksums(out) == current
  assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["policy"]


@pytest.fixture
def read_only_mount(tmp_path):
  """An empty read-only tmpfs at tmp_path/rom (skipped where mounting is not allowed)."""
  where = tmp_path / "rom"
  where.mkdir()
  proc = subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(where)],
      capture_output=True,
      text=True,
      check=False,
  )
  if proc.returncode:
    pytest.skip(f"cannot mount a read-only filesystem here: {proc.stderr.strip()[:200]}")
  yield where
  subprocess.run(["umount", str(where)], check=False)


@pytest.mark.parametrize("inside,overwrite", [(True, False), (False, True)])
def test_export_onto_a_read_only_place_is_one_line_leaving_nothing(
    run, tmp_path, read_only_mount, inside, overwrite
):
  """Into a read-only mount, or (with --overwrite) onto the mount point itself: one line
  naming it, exit 2, and no staging or set-aside folder left beside it."""
  workdir, _ = run
  out = read_only_mount / "export" if inside else read_only_mount
  line = _one_line_refusal(
      _export(f"--workdir={workdir}", f"--out={out}", *(["--overwrite"] if overwrite else []))
  )
  assert line.startswith(f"april_jax.export: --out {out}: cannot write there"), line
  assert sorted(p.name for p in tmp_path.iterdir()) == ["rom"]  # nothing beside it
  assert not any(read_only_mount.iterdir())
