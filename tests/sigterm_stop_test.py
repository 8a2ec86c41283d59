"""How SIGTERM's stop is recorded and said (april_jax/runtime/sigterm_stop.py); the stops
themselves, end to end, are stops_test.py's."""

import signal

from april_jax.runtime.sigterm_stop import SigtermStop


def test_the_handler_asks_for_a_stop_that_one_process_sees_at_once():
  stop = SigtermStop()
  assert not stop.cut_now()
  stop.handle(signal.SIGTERM, None)
  assert stop.requested and stop.cut_now() and not stop.stopped


def test_a_fresh_run_cut_before_it_drew_saves_nothing_and_says_so():
  stop = SigtermStop()
  assert not stop.save_cut(index=0, latest=None)
  assert not stop.stopped  # stopped once the cut is handled, not before
  stop.stop_during(1)
  assert stop.stopped
  assert stop.line(4) == (
      "stopped by SIGTERM during step 1 of 4 (nothing drawn yet; its rollouts are drawn "
      "again); rerun the same command to resume"
  )


def test_a_cut_that_drew_saves_the_state_before_its_step():
  stop = SigtermStop()
  stop.cut_drew = True
  assert stop.save_cut(index=0, latest=None)
  stop.stop_during(1)
  assert stop.line(4).startswith(
      "stopped by SIGTERM during step 1 of 4: its rollouts so far are kept in checkpoint 0"
  )


def test_a_cut_whose_previous_step_is_on_disk_never_replaces_that_checkpoint():
  stop = SigtermStop()
  stop.cut_drew = True
  assert not stop.save_cut(index=3, latest=3)
  stop.stop_during(4)
  assert "during step 4 of 9 (checkpoint 3 is kept; its rollouts are drawn again)" in stop.line(9)
  later = SigtermStop()  # an older checkpoint on disk: the state before the step is saved
  later.cut_drew = True
  assert later.save_cut(index=3, latest=2)


def test_a_stop_after_a_finished_step_names_its_checkpoint_and_no_stop_says_nothing():
  stop = SigtermStop()
  assert stop.line(9) is None
  stop.stop_after(5)
  assert stop.stopped
  assert stop.line(9) == (
      "stopped by SIGTERM after step 5 of 9: checkpoint 5 is saved; rerun the same command "
      "to resume"
  )
