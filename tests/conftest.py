"""Shared test set-up: 8 CPU devices for sharding tests, the configs/ files' configs, tiny
Qwen3 models (ours, and random HF ones saved by transformers), the sampler tests' model
and params, the Qwen3 tokenizer."""

import atexit
import importlib.abc
import importlib.util
import lzma
import os
import shutil
import sys
import tempfile

# Must happen before JAX initialises its backends.
# The tests run small programs a few times each, so compiling is most of their time: XLA's
# backend optimisations cost more to run than they save here (without them the sampler
# tests take 75 s instead of 124 s). The `python -m april_jax.main` subprocesses set their
# own flags.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, inherited by the `python -m
# april_jax.main` subprocesses: each compiles the same small programs, and XLA's compile
# is most of a tiny run's start-up. Entries are keyed by program, shapes and devices, so a
# cached executable is the one a fresh compile would give.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="april_jax_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# Test processes use it too: each test file's programs are let go when it ends (below),
# and the next file that needs one loads it instead of compiling it again. (Writing to it
# once crashed XLA's serializer in workers that had loaded torch; torch now loads only in
# hf_oracle.py's processes.)

from pathlib import Path  # pylint: disable=g-import-not-at-top

import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

import hf_oracle  # pylint: disable=g-import-not-at-top


class _NoTorch(importlib.abc.MetaPathFinder):
  """Refuses to import torch in a test process (hf_oracle.py says why): whatever tries
  gets an ImportError naming this, as if torch were not installed."""

  def find_spec(self, name, path=None, target=None):
    if name == "torch" or name.startswith("torch."):
      raise ImportError("torch does not load in a test process (tests/hf_oracle.py)")
    return None


sys.meta_path.insert(0, _NoTorch())

# The real data the tests read ships with them (tests/data/README.md: sources, licenses).
TEST_DATA = Path(__file__).resolve().parent / "data"
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
MATH_DIR = TEST_DATA / "math"
MODEL_CONFIGS_DIR = TEST_DATA / "model_configs"


def _unpacked_qwen3_tokenizer() -> Path:
  """The Qwen3 tokenizer folder, its tokenizer.json unpacked from the shipped .xz once."""
  folder = Path(tempfile.mkdtemp(prefix="april_jax_qwen3_tokenizer_"))
  atexit.register(shutil.rmtree, folder, True)
  source = TEST_DATA / "tokenizers" / "qwen3"
  for name in ("tokenizer_config.json", "chat_template.jinja", "LICENSE"):
    shutil.copy(source / name, folder / name)
  (folder / "tokenizer.json").write_bytes(
      lzma.decompress((source / "tokenizer.json.xz").read_bytes())
  )
  return folder


QWEN3_TOKENIZER_DIR = _unpacked_qwen3_tokenizer()


def _tool_isolation() -> str:
  """The Python tool's isolation for tests that are not about isolation: "kernel" (the
  default) where this machine allows its sandbox, else "none", so that they still run
  where the kernel gives no user namespaces (the refusal itself, and the sandbox's
  barrier: python_tool_isolation_test.py)."""
  from april_jax.envs import kernel_isolation  # pylint: disable=g-import-not-at-top

  return "none" if kernel_isolation.kernel_refuses() else "kernel"


TOOL_ISOLATION = _tool_isolation()


@pytest.fixture(scope="module")
def qwen3_tokenizer():
  """The real Qwen3 tokenizer (april_jax.tokenizer.Tokenizer)."""
  from april_jax.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top

  return Tokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)


def load_config(name: str, arg=None):
  """configs/<name>.py's config (its get_config(arg); arg: a variant, as after the colon
  of --config=configs/<name>.py:<arg>)."""
  spec = importlib.util.spec_from_file_location(name, CONFIGS_DIR / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def load_settings(name: str, arg=None, changes: dict | None = None):
  """load_config's config as RunSettings, with `changes` ({"rollout.kv_pages": 64})."""
  from april_jax.settings.run import RunSettings  # pylint: disable=g-import-not-at-top

  settings = RunSettings.from_config(load_config(name, arg))
  return settings.overridden(changes) if changes else settings


def tiny_qwen3(**overrides):
  """A 2-layer Qwen3 of 48 tokens for learner tests (the model package's own config)."""
  from april_jax.models import qwen3  # pylint: disable=g-import-not-at-top

  shape = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2)
  shape.update(num_heads=4, num_kv_heads=2, head_dim=8)
  return qwen3.Qwen3Config(**dict(shape, **overrides))


def sampler_qwen3():
  """The sampler tests' model: tiny_qwen3 with 96 tokens and heads of 16."""
  return tiny_qwen3(vocab_size=96, head_dim=16)


@pytest.fixture(scope="session")
def sampler_params():
  """Random params of sampler_qwen3() (key 0, std 0.35), one set for the session."""
  import jax  # pylint: disable=g-import-not-at-top
  from april_jax.models import qwen3  # pylint: disable=g-import-not-at-top

  return qwen3.init_params(sampler_qwen3(), jax.random.key(0), std=0.35)


# Small Qwen3 shapes covering the cases the model must get right.
TINY_HF_CONFIGS = {
    # head_dim (32) independent of hidden_size / num_heads (64 / 4 = 16), as in Qwen3-4B.
    "head_dim_decoupled": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        rope_theta=1e6,
    ),
    "untied": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
    ),
    "tied": dict(
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
}


def save_random_hf_qwen3(
    path: Path, seed: int = 0, vocab_size: int = 256, num_layers: int = 2, **overrides
) -> Path:
  """Saves a random Qwen3ForCausalLM with transformers, weights at realistic magnitudes,
  in a process of its own (hf_oracle.py: torch never loads in a test process).

  The default init (std 0.02) makes every layer nearly the identity, which would hide
  mistakes; here matrices get std 1/sqrt(fan_in) and norm weights vary around 1.
  """
  hf_oracle.require("torch", "transformers")
  kwargs = dict(
      seed=seed,
      vocab_size=vocab_size,
      intermediate_size=96,
      num_hidden_layers=num_layers,
      rms_norm_eps=1e-6,
      max_position_embeddings=512,
  )
  kwargs.update(overrides)
  return hf_oracle.save_random(path, **kwargs)


@pytest.fixture(scope="session", params=sorted(TINY_HF_CONFIGS))
def hf_model_dir(request, tmp_path_factory):
  """A folder with a tiny random transformers-saved Qwen3, one per TINY_HF_CONFIGS entry."""
  path = tmp_path_factory.mktemp(f"hf_{request.param}")
  return save_random_hf_qwen3(path, **TINY_HF_CONFIGS[request.param])


@pytest.fixture
def compiles():
  """The XLA compilations that happen while the test runs, one entry each."""
  import jax  # pylint: disable=g-import-not-at-top

  events = []
  listener = lambda name, *_, **__: (
      events.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
  )
  jax.monitoring.register_event_duration_secs_listener(listener)
  yield events
  jax.monitoring.unregister_event_duration_listener(listener)


def mesh_or_skip(shape):
  """A mesh of CPU devices of this shape (None: no mesh); skips when too few devices."""
  if shape is None:
    return None
  import jax  # pylint: disable=g-import-not-at-top
  from april_jax import sharding  # pylint: disable=g-import-not-at-top

  if len(jax.devices()) < int(np.prod(shape)):
    pytest.skip(f"needs {int(np.prod(shape))} (CPU) devices")
  return sharding.make_mesh(shape)


def step_at(scheduler, step: int, version: int, **options):
  """One scheduler step with its engine's policy at `version` (the params it holds)."""
  scheduler.engine.set_policy(scheduler.engine.params, version)
  return scheduler.step(step, **options)


@pytest.fixture(scope="session", autouse=True)
def torch_stays_out():
  """Torch never loads in a test process (hf_oracle.py says why); checked at the end."""
  yield
  assert "torch" not in sys.modules, "torch loaded in a test process: use tests/hf_oracle.py"


@pytest.fixture(scope="module", autouse=True)
def compiled_programs_dropped_after_each_file():
  """Each test file's compiled programs are let go when it ends: XLA's CPU compiler
  segfaults in a process that holds many (a loop of fresh engine warm-ups crashes within
  about 9 without this, and ran 26 with it)."""
  yield
  import jax  # pylint: disable=g-import-not-at-top

  jax.clear_caches()


# The files that take longest (`--durations`), slowest first: each worker takes whole
# files in collection order, so these start first and the two finish together rather
# than one running a long file alone at the end. The rest keep their order.
SLOW_FILES = (
    "main_test.py", "multihost_test.py", "lora_run_test.py", "interrupt_test.py",
    "bench_test.py", "stops_test.py", "resume_faults_test.py", "packing_test.py",
    "sampler_test.py", "async_run_test.py", "step_bench_test.py", "async_resume_test.py",
    "real_data_test.py", "export_test.py", "split_processes_test.py",
    "user_code_failures_test.py", "disk_full_test.py", "plan_test.py", "rl_update_test.py",
    "speculative_run_test.py", "speculative_test.py",
)  # fmt: skip


def pytest_terminal_summary(terminalreporter):
  """One line on the Python tool's sandbox: its tests ran, or why they were skipped (only
  where the kernel itself refuses it), or that it fails on this machine."""
  from april_jax.envs import kernel_isolation  # pylint: disable=g-import-not-at-top

  why = kernel_isolation.problem()
  if why is None:
    line = "kernel isolation: available here; the sandbox's tests ran"
  elif kernel_isolation.kernel_refuses():
    line = f"kernel isolation: the kernel refuses it here, its tests were skipped ({why})"
  else:
    line = f"kernel isolation: FAILS on this machine ({why})"
  terminalreporter.write_line(line)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOW_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
