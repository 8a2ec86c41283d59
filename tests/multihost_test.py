"""Multi-host on one machine: two processes with 4 CPU devices each, joined by
jax.distributed (a local coordinator, gloo collectives), against one process with 8.

The same tiny RL run (multi-turn, with a tool that process 0 alone calls, its answers
shared) must give the same metrics and params either way; killing one of the two
processes must end the other promptly, with a clear message; and restarting both must
resume from the last checkpoint and finish like the uninterrupted run."""

import signal
import socket
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cli

TINY = "tiny_lookup.py"  # multi-turn: episodes agree across hosts
STEPS = 2  # checkpoints 1 and 2: the pair is killed after the first, resumes for the second
RUN = [
    f"--config.num_steps={STEPS}",
    "--config.checkpoint_every=1",
    "--config.eval_every=0",
    "--config.train.sft_steps=10",
    "--config.rollout.max_response_len=16",
    "--config.rollout.n_samples_per_prompt=4",
    "--config.train.lr=3e-4",
    "--config.mesh.shape=(2,2,2)",
    # Every call answered right after the decode call that ended its turn: runs that
    # must be equal cannot depend on when an environment's call returns.
    "--config.env.overlap=false",
]
# The runs turn XLA's backend optimisations off (optimised=False), as conftest.py does for
# the tests: they are mostly compiling.


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _two_processes(workdir, port=None):
  port = port or _free_port()
  return [
      cli.launch(
          *RUN,
          f"--config.distributed.coordinator_address=localhost:{port}",
          "--config.distributed.num_processes=2",
          f"--config.distributed.process_id={i}",
          "--config.distributed.heartbeat_timeout_s=15",
          config=TINY,
          workdir=workdir,
          devices=4,
          optimised=False,
      )
      for i in range(2)
  ]


def _finish(procs, timeout=600):
  outs = [p.communicate(timeout=timeout) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return outs


def _metrics(workdir):
  return cli.read_jsonl(Path(workdir) / "metrics.jsonl")


def _params(workdir, step):
  """The checkpoint's params on this process's first device, as numpy."""
  path = Path(workdir).resolve() / "checkpoints" / str(step) / "state"
  checkpointer = ocp.StandardCheckpointer()
  meta = checkpointer.metadata(path)
  meta = dict(getattr(meta, "item_metadata", meta))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  restored = checkpointer.restore(
      path, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
  )
  return {"/".join(map(str, p)): np.asarray(x) for p, x in _flatten(restored["params"])}


def _flatten(tree, prefix=()):
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield from _flatten(value, prefix + (key,))
  else:
    yield prefix, tree


def _assert_same_run(a, b):
  assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, STEPS + 1))
  for ma, mb in zip(a, b):
    assert set(ma) == set(mb)
    for key, value in ma.items():
      if not cli.timing(key):
        assert mb[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (ma["step"], key)


def _killed_at_the_first_checkpoint(workdir):
  """Two processes until checkpoint 1 exists, then process 1 is killed: (process 0's
  exit status and stderr, seconds it took to end after the kill)."""
  procs = _two_processes(workdir)
  ckpt = workdir / "checkpoints" / "1"
  deadline = time.monotonic() + 600
  while (
      not ckpt.is_dir() and all(p.poll() is None for p in procs) and (time.monotonic() < deadline)
  ):
    time.sleep(0.2)
  assert all(p.poll() is None for p in procs), "a process ended before the kill"
  procs[1].send_signal(signal.SIGKILL)
  killed_at = time.monotonic()
  _, err = procs[0].communicate(timeout=120)  # bounded: no hang
  waited = time.monotonic() - killed_at
  procs[1].communicate()
  return procs[0].returncode, err, waited


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The same run twice: 1 process x 8 devices, and 2 processes x 4 devices that lose a
  process after checkpoint 1 and are restarted (a straight 2-process run is the first
  half of this one: comparing the whole of it checks both)."""
  root = tmp_path_factory.mktemp("multihost")
  # Alongside: the pair spends much of its time waiting.
  one = cli.launch(*RUN, config=TINY, workdir=root / "one", devices=8, optimised=False)
  killed = _killed_at_the_first_checkpoint(root / "two")
  ((one_out, _),) = _finish([one])
  outs = _finish(_two_processes(root / "two"))
  return root / "one", root / "two", one_out, outs, killed


def test_two_processes_give_the_metrics_and_params_of_one(runs):
  one, two, one_out, outs, _ = runs
  _assert_same_run(_metrics(one), _metrics(two))
  assert _metrics(two)[-1]["rollout/buffer_groups"] > 0  # partials crossed steps (and hosts)
  p1, p2 = _params(one, STEPS), _params(two, STEPS)
  assert p1.keys() == p2.keys() and len(p1) > 5
  # gloo sums across processes in another order than one process does. Adam divides by
  # sqrt(v), so where a gradient is itself at rounding level its update's size and sign
  # are noise: up to lr per update apart (lr 3e-4, STEPS updates, 2 sides). Elsewhere the
  # difference stays at float32 rounding; a wrong shard or a missed reduction would move
  # most elements, not a few.
  bound = 2 * 3e-4 * STEPS
  for name in p1:
    diff = np.abs(p2[name] - p1[name])
    assert diff.max() <= bound, (name, diff.max())
    off = ~np.isclose(p2[name], p1[name], rtol=1e-4, atol=1e-5)
    assert off.mean() < 1e-3 and diff.mean() < 1e-6, (name, off.sum(), diff.mean())
  # Only process 0 prints progress (and writes metrics: one file, one line per step).
  last = f"step {STEPS}/{STEPS}"
  assert last in one_out and last in outs[0][0] and "step" not in outs[1][0]


def test_a_killed_process_fails_its_peer_promptly_and_both_resume(runs):
  _, _, _, outs, (returncode, err, waited) = runs
  assert returncode != 0
  if returncode == 4:  # the next collective noticed (the usual case)
    assert "another process died" in err and "Restart all processes" in err, err[-2000:]
  else:  # or the coordination service's heartbeat check ended it
    assert "heartbeat" in err or "another task died" in err, err[-2000:]
  assert waited < 60, waited
  assert "resumed from step" in outs[0][0]  # and finished like one process did (above)
