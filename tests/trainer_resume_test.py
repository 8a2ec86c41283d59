"""The trainer's choice when a checkpoint's restore fails: damage sets it aside and the one
before is tried; a machine short of memory, files or quota stops the run with nothing moved;
a model of another shape is refused before anything is read."""

import dataclasses

import jax
import numpy as np
import pytest

from april_jax.checkpoint import Checkpointer
from april_jax.configs import base, resume_check
from april_jax.errors import InputError
from april_jax.models import hf_io, qwen3
from april_jax.trainer import Trainer

CFG = qwen3.Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=16,
)  # fmt: skip


def _trainer(workdir, read_error):
  """A Trainer with only what resuming reads: two checkpoints whose arrays fail to restore
  with `read_error`."""
  config = base.get_config()
  checkpointer = Checkpointer(str(workdir))
  for step in (1, 2):
    host = {"config": resume_check.as_json(config), "model": hf_io.architecture(CFG)}
    checkpointer.save(step, {"x": jax.numpy.zeros(4)}, {"ids": np.arange(3)}, host)
  checkpointer.manager.wait_until_finished()
  trainer = object.__new__(Trainer)
  trainer.config, trainer.model_cfg, trainer.primary = config, CFG, True
  trainer.checkpointer = checkpointer

  def read(step):
    raise read_error

  trainer._read_quietly = read  # pylint: disable=protected-access
  return trainer


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
  trainer = _trainer(tmp_path, error)
  with pytest.raises(raised, match=words) as info:
    trainer._resume()  # pylint: disable=protected-access
  assert "nothing was set aside" in str(info.value)
  assert Checkpointer(str(tmp_path)).steps() == [2, 1]
  assert not (tmp_path / "damaged_checkpoints").exists()


def test_a_damaged_restore_sets_each_checkpoint_aside_in_turn(tmp_path, capsys):
  trainer = _trainer(tmp_path, ValueError("a chunk's header is corrupt"))
  with pytest.raises(InputError, match="no intact checkpoint"):
    trainer._resume()  # pylint: disable=protected-access
  assert sorted(p.name for p in (tmp_path / "damaged_checkpoints").iterdir()) == ["1", "2"]
  assert capsys.readouterr().err.count("is damaged (ValueError: a chunk's header") == 2


def test_a_model_of_another_shape_is_refused_before_any_read(tmp_path):
  trainer = _trainer(tmp_path, AssertionError("never read"))
  trainer.model_cfg = dataclasses.replace(CFG, hidden_size=64)
  with pytest.raises(InputError, match="hidden_size: 32 -> 64"):
    trainer._resume()  # pylint: disable=protected-access
  assert Checkpointer(str(tmp_path)).steps() == [2, 1]
