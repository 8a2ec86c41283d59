"""One script of calls on a run's Rollout (april_jax/rollout/base.py), whichever it is: the
learner's process runs it in place of the trainer's loop (`python -m april_jax.main`
with this module preloaded, tests/cli.py), and prints what each call gave as one line,
`ROLLOUT_SCRIPT <json>`. A split run's rollout process runs as it always does.

The script: start with version 0's weights (the sampler compiled, the evaluation first),
take batch 0, publish version 1 with an evaluation and a capture, take batch 1, refuse an
unknown request, cut, capture, close. Weights: a seeded random init in the learner's
decode layout, and version 1 that init times 1.01."""

import hashlib
import json

import jax
import numpy as np

from april_jax import main
from april_jax import sharding
from april_jax.models import path_check
from april_jax.models import qwen3
from april_jax.rollout import side as rollout_side
from april_jax.runtime.sigterm_stop import SigtermStop
from april_jax.tasks import task as task_lib

MARK = "ROLLOUT_SCRIPT "


def _batch(result) -> dict:
  """What a batch holds, as numbers: every sample's tokens, versions and rewards."""
  if result is None:
    return {"none": True}
  groups = [
      {
          "id": g.group_id,
          "prompt": g.prompt.tolist(),
          "rewards": g.rewards,
          "responses": [np.asarray(s.response).tolist() for s in g.samples],
          "versions": [np.asarray(s.versions).tolist() for s in g.samples],
      }
      for g in result.groups
  ]
  text = json.dumps(groups, sort_keys=True)
  return {
      "cut": bool(result.cut),
      "groups": len(groups),
      "tokens": sum(len(r) for g in groups for r in g["responses"]),
      "sha256": hashlib.sha256(text.encode()).hexdigest(),
  }


def _capture(state) -> dict:
  """A capture's JSON, and its arrays' names and shapes."""
  arrays, host = state
  shapes = {k: list(np.shape(v)) for k, v in sorted(arrays.items())}
  return {"host": json.loads(json.dumps(host, sort_keys=True, default=str)), "arrays": shapes}


def _weights(config, model_cfg, place):
  """Version 0's and 1's decode weights, on the learner's mesh in the sampler's layout."""
  v0 = qwen3.init_params_sharded(
      model_cfg, jax.random.key(config.seed), place.mesh, place.decode_rules, config.model.dtype
  )
  return v0, jax.tree.map(lambda x: (x * 1.01).astype(x.dtype), v0)


def script(c) -> bool:
  """The script on this run's Rollout (`c`: its checked settings, as main's _train is
  given them); False (not stopped), as _train returns."""
  place = sharding.Placement.from_config(c)
  model_cfg, paths = path_check.checked_model(c)
  tokenizer = task_lib.load_tokenizer(c)
  task = task_lib.make_task(c, tokenizer)
  rollout = rollout_side.make_rollout(c, model_cfg, paths, tokenizer, task, place, SigtermStop())
  v0, v1 = _weights(c, model_cfg, place)
  out = {"kind": type(rollout).__name__}
  try:
    out["evaluate_first"] = rollout.start(v0, 0, 0, warm_up=True, evaluate_first=True)
    out["batch0"] = _batch(rollout.take(0))
    evaluated, captured = rollout.publish(v1, 1, ["evaluate", "capture"])
    out["evaluate1"], out["capture1"] = evaluated, _capture(captured)
    out["batch1"] = _batch(rollout.take(1))
    try:
      rollout.request("nope")
    except ValueError as e:
      out["unknown_request"] = str(e)
    rollout.cut()
    out["capture_after_cut"] = _capture(rollout.request("capture"))
  finally:
    rollout.close()
  print(MARK + json.dumps(out, sort_keys=True), flush=True)
  return False


main._train = script  # pylint: disable=protected-access
