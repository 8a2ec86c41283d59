"""The messages between a split run's processes (rollout/channel.py, rollout/wire.py):
header and arrays come back exactly, in order, a big one through its parts, and the store
keeps nothing once they are read. One process with jax.distributed's service started,
in a subprocess (the service lives as long as its process)."""

import subprocess
import sys
import textwrap

from multihost_test import _free_port

SCRIPT = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=1, process_id=0)
    from jax._src import distributed as jax_distributed
    from april_jax.rollout import channel

    channel.PART_BYTES = 1000  # a small part: the big message below takes several
    learner = channel.Channel(send_on=channel.TO_ROLLOUT, receive_on=channel.TO_LEARNER)
    rollout = channel.Channel(send_on=channel.TO_LEARNER, receive_on=channel.TO_ROLLOUT)
    assert rollout.receive(0.05) is None  # nothing sent yet: a timeout, not an error
    big = np.arange(5000, dtype=np.float32).reshape(50, 100)
    learner.send({"kind": "a", "n": 1})
    learner.send({"kind": "b", "nested": {"x": [1, 2]}}, {"big": big, "ids": np.array([7], np.int32)})
    learner.send({"kind": "c"})
    first, second, third = (rollout.receive(5.0) for _ in range(3))
    assert first == ({"kind": "a", "n": 1}, {}), first
    assert third == ({"kind": "c"}, {}), third
    header, arrays = second
    assert header == {"kind": "b", "nested": {"x": [1, 2]}}, header
    assert arrays["big"].dtype == np.float32 and (arrays["big"] == big).all()
    assert arrays["ids"].tolist() == [7]
    rollout.send({"kind": "back"})
    assert learner.receive(5.0) == ({"kind": "back"}, {})
    left = jax_distributed.global_state.client.key_value_dir_get("april_jax/")
    assert left == [], left
    print("ok")
    """)


def test_messages_cross_in_order_whole_and_leave_nothing_behind():
  proc = subprocess.run(
      [sys.executable, "-c", SCRIPT, str(_free_port())],
      capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
