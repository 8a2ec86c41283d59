"""The three rollouts behind one interface (april_jax/rollout/base.py) keep the same promises:
one script of calls (tests/rollout_script.py) against each, the engine on one CPU device
in all three, each batch drawn by one version (rollout.max_staleness=0):

  ColocatedRollout   one process, one device
  ThreadedRollout    one process, the learner on one device and the rollout on another
  RemoteRollout      two processes of one device each (a split run across processes)

Each gives the same evaluation before training and after version 1, the same batches
token for token, the same capture of its state at a boundary and after a cut, and the
same refusal of an unknown request."""

import json

import cli
from multihost_test import _free_port
from rollout_script import MARK

STOPPED = 143  # main.STOPPED_EXIT
FLAGS = [
    "--config.train.sft_steps=0",
    "--config.eval.num_prompts=8",
    "--config.rollout.max_staleness=0",  # each batch drawn by one version, in every mode
]


def _start(tmp_path, name, devices, *flags):
  return cli.launch(
      *FLAGS,
      *flags,
      config="tiny_tail.py",
      workdir=tmp_path / name,
      preload="rollout_script",
      devices=devices,
      optimised=False,
  )


def _said(proc) -> dict:
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, err[-3000:]
  (line,) = [l for l in out.splitlines() if l.startswith(MARK)]
  return json.loads(line[len(MARK) :])


def test_the_three_rollouts_answer_one_script_alike(tmp_path):
  port = _free_port()
  pair = [
      _start(
          tmp_path, "remote", 1,
          "--config.mesh.rollout_devices=1",
          f"--config.distributed.coordinator_address=localhost:{port}",
          "--config.distributed.num_processes=2",
          f"--config.distributed.process_id={i}",
          "--config.distributed.heartbeat_timeout_s=20",
      )  # fmt: skip
      for i in range(2)
  ]
  colocated = _start(tmp_path, "colocated", 1)
  threaded = _start(tmp_path, "threaded", 2, "--config.mesh.rollout_devices=1")
  said = {"colocated": _said(colocated), "threaded": _said(threaded), "remote": _said(pair[0])}
  _, rollout_err = pair[1].communicate(timeout=900)
  assert pair[1].returncode == STOPPED, rollout_err[-3000:]  # the script's cut stopped it
  kinds = {name: s.pop("kind") for name, s in said.items()}
  assert kinds == {
      "colocated": "ColocatedRollout",
      "threaded": "ThreadedRollout",
      "remote": "RemoteRollout",
  }
  first = said["colocated"]
  # The script did what it says: batches of whole groups, drawn by their version.
  assert first["batch0"]["groups"] > 0 and first["batch0"]["tokens"] > 0
  assert not first["batch0"]["cut"] and first["batch0"] != first["batch1"]
  assert "eval/pass@1" in first["evaluate_first"] and "eval/pass@1" in first["evaluate1"]
  assert first["capture1"]["host"]["waiting"] == []  # at the boundary: nothing drawn ahead
  assert "unknown rollout requests ['nope']" in first["unknown_request"]
  for name in ("threaded", "remote"):
    for key in first:
      assert said[name][key] == first[key], (name, key, said[name][key], first[key])
