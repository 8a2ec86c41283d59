"""The start-up check of the fast attention paths (models/path_check.py): on this CPU auto
checks nothing and changes nothing; a fast path that raises or returns numbers off by
more than the tolerance is dropped in one line under auto and refused with FastPathFailed
when named; one that agrees is taken. The failing and mismatching fast paths are stand-ins
passed through `fast`; the portable paths they are held to are the real ones."""

import functools

import numpy as np
import pytest

from april_jax import errors
from april_jax.models import hf_io
from april_jax.models import path_check as pc
from april_jax.sampler import EngineConfig

import cli
import conftest

SETTINGS = pc.Settings()  # bfloat16, 4 query heads over 2 KV heads of 16, pages of 16


def _raises(s):
  raise RuntimeError("no cuDNN kernel for this shape\nsecond line, not shown")


@functools.cache
def _portable(name):
  return pc.PORTABLE[name](SETTINGS)


def _off_by_5_percent(name):
  """A fast path `name` whose numbers are 5% off the portable path's (2.5x bfloat16's
  tolerance)."""
  return lambda s: tuple(np.asarray(x, np.float32) * 1.05 for x in _portable(name))


def test_on_this_cpu_auto_takes_the_portable_paths_and_checks_nothing():
  assert pc.takes(SETTINGS) == {}
  paths = pc.check(SETTINGS, fast={"cudnn": _raises, "pallas": _raises})
  assert (paths.attention, paths.decode_attention) == ("auto", "auto")
  assert paths.verified == {} and paths.warnings == () and paths.summary() is None
  assert paths.taken == {
      "attention": "blockwise",
      "packed attention": "blockwise",
      "decode attention": "xla",
  }


def test_the_settings_of_a_run_config_and_what_named_paths_take():
  config = conftest.load_config("tiny")
  settings = pc.Settings.of(config, hf_io.model_config(config))
  assert settings == pc.Settings(dtype="float32", kv_dtype="float32")
  # Named, cuDNN is checked (every row kind the run computes); the kernel interpreted on a
  # CPU is not a fast path.
  assert pc.takes(pc.Settings(attention="cudnn")) == {"cudnn": True, "cudnn_packed": True}
  assert pc.takes(pc.Settings(attention="cudnn", packed=False)) == {"cudnn": True}
  assert pc.takes(pc.Settings(decode_attention="pallas")) == {}


def test_auto_falls_back_in_one_line_when_a_fast_path_raises():
  seen = []
  counted = lambda s: seen.append(s) or _portable("cudnn_packed")
  paths = pc.check(
      SETTINGS,
      fast={"cudnn": _raises, "cudnn_packed": counted},
      paths={"cudnn": False, "cudnn_packed": False},
  )
  assert paths.attention == "blockwise" and paths.decode_attention == "auto"
  assert paths.warnings == (
      "cuDNN attention (a row per sample) failed its check on this device (RuntimeError: no "
      "cuDNN kernel for this shape); the run takes blockwise attention (model.attention=auto)",
  )
  assert seen == []  # the family fell back: its packed path is not run
  assert paths.verified == {} and paths.taken["packed attention"] == "blockwise"
  assert "1 fell back" in paths.summary()


def test_auto_falls_back_in_one_line_when_a_fast_path_differs():
  paths = pc.check(
      SETTINGS,
      fast={"cudnn_packed": _off_by_5_percent("cudnn_packed")},
      paths={"cudnn_packed": False},
  )
  assert paths.attention == "blockwise"
  (line,) = paths.warnings
  assert line.startswith(
      "cuDNN attention (packed rows) failed its check on this device (max |difference| 5.0e-02 "
      "of the largest |value| against blockwise attention, over the tolerance 2e-02 in bfloat16)"
  )
  assert "\n" not in line


def test_auto_falls_back_from_the_decode_kernel_to_the_xla_path():
  paths = pc.check(SETTINGS, fast={"pallas": _raises}, paths={"pallas": False})
  assert (paths.attention, paths.decode_attention) == ("auto", "xla")
  assert paths.warnings[0].endswith(
      "the run takes the XLA decode attention (rollout.decode_attention=auto)"
  )
  engine = paths.engine_config(EngineConfig(num_slots=2, max_len=64))
  assert engine.decode_attention == "xla"


@pytest.mark.parametrize("fast", [_raises, _off_by_5_percent("cudnn")], ids=["raises", "differs"])
def test_a_named_fast_path_that_fails_is_refused(fast):
  named = pc.Settings(attention="cudnn")
  with pytest.raises(errors.FastPathFailed) as refused:
    pc.check(named, fast={"cudnn": fast}, paths={"cudnn": True})
  assert isinstance(refused.value, errors.InputError)  # main: one line, exit 2
  message = str(refused.value)
  assert message.startswith("model.attention=cudnn: cuDNN attention (a row per sample) failed")
  assert message.endswith(
      "set model.attention=blockwise (or auto) to run blockwise attention instead"
  )
  assert ("RuntimeError: no cuDNN kernel" in message) == (fast is _raises)


def test_named_cudnn_on_this_cpu_is_refused_with_jaxs_reason():
  with pytest.raises(errors.FastPathFailed, match=r"model\.attention=cudnn: .*RuntimeError"):
    pc.check(pc.Settings(attention="cudnn"))


def test_a_named_decode_kernel_that_fails_is_refused():
  with pytest.raises(errors.FastPathFailed, match=r"^rollout\.decode_attention=pallas: the Pallas"):
    pc.check(
        pc.Settings(decode_attention="pallas"), fast={"pallas": _raises}, paths={"pallas": True}
    )


def test_fast_paths_that_agree_are_taken():
  """Dense attention stands in for cuDNN (in bfloat16, a rounding or two from blockwise), the
  kernel as Pallas interprets it on a CPU for the compiled one (the XLA path's numbers)."""
  paths = pc.check(
      SETTINGS,
      fast={"cudnn_packed": pc.attention_probe("dense", packed=True)},
      paths={"cudnn_packed": False, "pallas": False},
  )
  assert (paths.attention, paths.decode_attention) == ("auto", "auto")
  assert paths.warnings == () and list(paths.verified) == ["cudnn_packed", "pallas"]
  summary = paths.summary()
  assert summary.startswith("fast paths checked against the portable ones in ")
  assert summary.endswith(
      "(max |difference| over the largest |value|): verified cuDNN attention (packed rows) "
      f"within {paths.verified['cudnn_packed']:.1e}, the Pallas decode kernel within "
      f"{paths.verified['pallas']:.1e}; taken: attention blockwise, packed attention "
      "blockwise, decode attention xla"
  )


def test_a_fast_path_that_failed_on_another_process_falls_back_everywhere():
  agreed = []
  agree = lambda failed: agreed.append(failed) or True  # another process failed
  paths = pc.check(
      SETTINGS, agree=agree, fast={"cudnn": lambda s: _portable("cudnn")}, paths={"cudnn": False}
  )
  assert agreed == [False] and paths.attention == "blockwise"
  assert paths.warnings == (
      "cuDNN attention (a row per sample) failed on another process; the run takes blockwise "
      "attention (model.attention=auto)",
  )


def test_announce_prints_the_fallback_on_stderr_and_the_summary_on_stdout(capsys):
  paths = pc.check(SETTINGS, fast={"pallas": _raises}, paths={"pallas": False})
  pc.announce(paths)
  out, err = capsys.readouterr()
  assert err == f"april_jax: warning: {paths.warnings[0]}\n"
  assert out == paths.summary() + "\n"
  pc.announce(pc.check(SETTINGS))  # nothing checked: nothing said
  assert capsys.readouterr() == ("", "")


def test_main_refuses_named_cudnn_on_this_cpu_in_one_line_before_building_anything(tmp_path):
  proc = cli.launch("--config.model.attention=cudnn", config="tiny.py", workdir=tmp_path / "w")
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 2, err[-3000:]
  lines = [l for l in err.strip().splitlines() if not l.startswith("WARNING")]
  assert len(lines) == 1, err[-3000:]
  assert lines[0].startswith(
      "april_jax: model.attention=cudnn: cuDNN attention (a row per sample) failed its check "
      "on this device (RuntimeError: "
  )
  assert not (tmp_path / "w" / "checkpoints").exists()
