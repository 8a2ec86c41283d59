"""Which checkpoint a run resumes from when a restore fails (resume.py): damage sets it
aside and the one before is tried; a machine short of memory, files or quota stops the run
with nothing moved; a model of another shape is refused before anything is read."""

import dataclasses

import jax
import numpy as np
import pytest

from april_jax.run import resume
from april_jax.checkpoint import Checkpointer
from april_jax.settings import base
from april_jax.validation import resume as resume_check
from april_jax.errors import InputError
from april_jax.models import hf_io, qwen3

CFG = qwen3.Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=16,
)  # fmt: skip


def _checkpoints(workdir, read_error):
  """Two checkpoints whose arrays fail to restore with `read_error`."""
  config = base.get_config()
  checkpointer = Checkpointer(str(workdir))
  for step in (1, 2):
    host = {"config": resume_check.as_json(config), "model": hf_io.architecture(CFG)}
    checkpointer.save(step, {"x": jax.numpy.zeros(4)}, {"ids": np.arange(3)}, host)
  checkpointer.manager.wait_until_finished()

  def restore(step, target):
    raise read_error

  checkpointer.restore = restore
  return checkpointer, config


def _resume(checkpointer, config, model_cfg=CFG):
  return resume.newest_intact(checkpointer, config, model_cfg, target=None)


@pytest.mark.parametrize(
    "error, raised, words",
    [
        (
            RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.1GiB"),
            MemoryError,
            "restoring checkpoint 2 of",
        ),
        (OSError(24, "Too many open files"), InputError, "ran short of resources"),
    ],
)
def test_a_restore_short_of_memory_or_files_moves_nothing(tmp_path, error, raised, words):
  checkpointer, config = _checkpoints(tmp_path, error)
  with pytest.raises(raised, match=words) as info:
    _resume(checkpointer, config)
  assert "nothing was set aside" in str(info.value)
  assert Checkpointer(str(tmp_path)).steps() == [2, 1]
  assert not (tmp_path / "damaged_checkpoints").exists()


def test_a_damaged_restore_sets_each_checkpoint_aside_in_turn(tmp_path, capsys):
  checkpointer, config = _checkpoints(tmp_path, ValueError("a chunk's header is corrupt"))
  with pytest.raises(InputError, match="no intact checkpoint"):
    _resume(checkpointer, config)
  assert sorted(p.name for p in (tmp_path / "damaged_checkpoints").iterdir()) == ["1", "2"]
  assert capsys.readouterr().err.count("is damaged (ValueError: a chunk's header") == 2


def test_a_model_of_another_shape_is_refused_before_any_read(tmp_path):
  checkpointer, config = _checkpoints(tmp_path, AssertionError("never read"))
  with pytest.raises(InputError, match="hidden_size: 32 -> 64"):
    _resume(checkpointer, config, dataclasses.replace(CFG, hidden_size=64))
  assert Checkpointer(str(tmp_path)).steps() == [2, 1]
