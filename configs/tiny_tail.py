"""The built-in task with more of a response tail: APRIL against the baseline on a CPU.

  python -m april_jax.bench --mode=e2e --config=configs/tiny_tail.py --seeds=0,1,2
  python -m april_jax.main --config=configs/tiny_tail.py --workdir=/tmp/april_tail

`configs/tiny.py` with longer answers (median 12 symbols, a heavier tail to the ring's
64) and 64 slots, so that every admitted sample decodes at once, as a large inference
batch does on a GPU: a synchronous step then lasts as long as its longest answer.
"""

import importlib.util
import os


def _tiny():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py")
  spec = importlib.util.spec_from_file_location("april_jax_config_tiny", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(arg=None):
  c = _tiny().get_config(arg)
  c.data.task.median = 12.0
  c.data.task.sigma = 1.0
  c.rollout.num_slots = 64   # N' x n: APRIL's whole over-provisioned batch in flight
  c.train.sft_steps = 100
  return c
