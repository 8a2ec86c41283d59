"""One RL run: its parts built from a config (run_parts.py), then rollout -> learn -> log -> save.

  step k (policy version k = params after k updates):
    rollout   scheduler.step(k) on the engine holding the learner's params, version k
    learn     the step's groups -> TrainBatch (rl/batch.py: rows, shaped rewards) ->
              rl/learn.py's learn: old and reference logprobs (and a critic's values),
              advantages, the policy's updates (and the critic's)
    log       metrics.jsonl, TensorBoard, rollouts.jsonl, a progress line
    eval      every eval_every steps: pass@1 / avg@k (evaluation.py), on the run's own
              engine
    save      every checkpoint_every steps, at the end, and on SIGTERM (which cuts the
              step's rollout at once: what it drew stays in the partial buffer;
              sigterm_stop.py)

Resume: a workdir with checkpoints continues from the latest intact one (see
resume.py), if the config matches the saved one (configs/resume_check.py); with a
fixed seed the continuation equals the uninterrupted run (timings aside).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from absl import logging
import jax
import numpy as np

from april_jax import checkpoint as checkpoint_lib
from april_jax import distributed
from april_jax import lora_base
from april_jax import resume
from april_jax import run_parts
from april_jax import run_report
from april_jax import user_output
from april_jax.checkpoint import Checkpointer, abstract_like
from april_jax.configs import resume_check
from april_jax.rollout import run_episodes
from april_jax.errors import DiskFull, InputError
from april_jax.metrics import MetricsWriter, log_progress
from april_jax.models import hf_io
from april_jax.models import lora as lora_lib
from april_jax.rl import batch as batch_lib
from april_jax.rl import learn as learn_lib
from april_jax.rl.advantages import CRITIC_ADVANTAGES
from april_jax.rollout import in_flight
from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout import rollout_metrics
from april_jax.rollout.async_rollout import AsyncRollout
from april_jax.rollout.channel import TO_LEARNER, TO_ROLLOUT, Channel
from april_jax.rollout.remote_rollout import RemoteRollout
from april_jax.rollout.remote_weights import WeightServer
from april_jax.rollout_side import RolloutSide
from april_jax.rollout import failures as failures_lib
from april_jax.sigterm_stop import SigtermStop
from april_jax.task import make_task
from april_jax.workdir_lock import WorkdirLock


class Trainer:
  """One run in a workdir: its parts built from the config (run_parts.py), resumed from
  its newest intact checkpoint if it has one, then `run`: the loop of steps."""

  def __init__(self, config, workdir: str):
    self.config, self.workdir = config, workdir
    c = config
    # One run per workdir (the primary holds the lock; the hosts of a run share the workdir).
    self._lock = WorkdirLock(workdir) if distributed.is_primary() else None
    if self._lock is not None:  # saves cut short by a kill: never read, and as big as one
      checkpoint_lib.remove_unfinished(workdir)
    self.user_output = self._relay_user_output()
    self.place = run_parts.Placement.from_config(c)
    self.model_cfg, self.paths = run_parts.checked_model(c)
    self.lora = lora_lib.LoraSpec.from_config(c.train.lora)  # None: every weight trains
    self.checkpointer = Checkpointer(workdir, alone=distributed.working_alone())
    resuming = self.checkpointer.latest_step() is not None
    # The adapters a fresh LoRA run starts from, read before any weight, warm start or
    # compile: a missing or damaged train.lora_path is one line at once.
    adapters = (
        None if resuming else lora_base.start_adapters(c.train.lora_path, self.lora, self.model_cfg)
    )
    run_parts.check_memory(c, self.model_cfg)  # before any weight is allocated
    params, self.tokenizer = run_parts.load_params(c, self.model_cfg, self.lora, self.place)
    self.task = make_task(c, self.tokenizer)
    self._check_same_checkpoints()
    params = run_parts.starting_params(
        c, self.model_cfg, params, self.lora, resuming, workdir, self.task, self.place
    )
    learner = run_parts.make_learner(c, self.model_cfg, params, self.lora, adapters, self.place)
    if self.lora is not None:
      params = learner.frozen  # the frozen base, held once (the critic may share it)
    critic = None
    if c.train.advantage in CRITIC_ADVANTAGES:
      critic = run_parts.make_critic(c, self.model_cfg, params, self.lora, self.place)
    self.learners = learn_lib.Learners(learner, critic)
    del params  # the learner's masters are the params now
    # The rollout's half: here, or (a split run across processes) in the rollout's own
    # process (rollout_server.py), reached through async_rollout.
    self.remote = distributed.working_alone()
    self.side = None if self.remote else RolloutSide(
        c, self.model_cfg, self.paths, learner.decode_params(), self.tokenizer, self.task,
        self.place,
    )  # fmt: skip
    self.publisher = None if self.side is None else self.side.publisher
    self.async_rollout: AsyncRollout | RemoteRollout | None = None  # split: started by run()
    self._rollout_restore = None  # a remote rollout's state from the checkpoint resumed
    self._waiting: list = []  # batches drawn before a checkpoint and not trained yet
    self._async_totals: dict[str, float] = {}  # the split run's counts at the last step
    self.primary = distributed.is_primary()  # the one process that writes and prints
    self.writer = MetricsWriter(workdir, enabled=self.primary)
    self.next_step = 0
    self.resumed = resuming
    self._failures = failures_lib.FailureStreak(c.rollout.max_failed_steps)
    self.stop = SigtermStop()
    if resuming:
      self._resume()
    else:
      self._start_afresh()

  # ------------------------------------------------------------------- set-up helpers
  def _relay_user_output(self) -> user_output.OutputRelay:
    """What user code prints goes to the workdir's log (one a process), not through the
    run's own lines."""
    os.makedirs(self.workdir, exist_ok=True)
    index = jax.process_index()
    name = user_output.LOG_NAME if index == 0 else f"user_output.{index}.log"
    return user_output.start(self.workdir, name)

  def _start_afresh(self) -> None:
    """Drops the lines of an earlier attempt that never checkpointed (these steps run again,
    the evaluation before training too). If the workdir's checkpoints were set aside as
    damaged, that run's metrics.jsonl and rollouts.jsonl are kept beside them instead."""
    aside = os.path.join(self.workdir, "damaged_checkpoints")
    kept = [
        path
        for path in (self.writer.metrics_path, self.writer.rollouts_path)
        if self.primary and os.path.isfile(path) and os.path.getsize(path)
    ]
    if kept and os.path.isdir(aside) and os.listdir(aside):
      target = checkpoint_lib.keep_aside(self.checkpointer.directory, "metrics")
      os.makedirs(target)
      for path in kept:
        os.replace(path, os.path.join(target, os.path.basename(path)))
      print(
          f"april_jax: warning: starting afresh; the metrics of the run whose checkpoints "
          f"were set aside as damaged are kept in {target}",
          file=sys.stderr,
          flush=True,
      )
    self.writer.truncate_after(-1)

  def _check_same_checkpoints(self) -> None:
    """Every process must see the same latest checkpoint (a workdir they all share)."""
    if distributed.process_count() == 1:
      return
    mine = self.checkpointer.latest_step()
    steps = distributed.gather(np.array([-1 if mine is None else mine], np.int32))
    steps = steps.reshape(-1).tolist()
    if len(set(steps)) > 1:
      raise InputError(
          f"processes see different latest checkpoints in {self.workdir} "
          f"({steps} by process, -1 = none): the workdir must be one "
          "directory shared by all hosts"
      )

  def rollout_state(self) -> tuple[dict, dict]:
    """What a checkpoint keeps of the rollout, taken where it stands still (between two
    of its batches): the partial buffer with the batches drawn and not yet trained
    (rollout/in_flight.py), and as JSON the scheduler's counters, the data position and
    those batches' shape."""
    waiting = self._waiting + (
        [] if self.async_rollout is None else self.async_rollout.waiting_results()
    )
    return self.side.capture(waiting)

  def save(self, step: int, metrics: dict[str, float] | None, rollout=None) -> float:
    """Checkpoints the state after `step` updates (the step's metrics line so far goes
    with it; None: a step cut short, whose line is written already); the seconds it
    took. `rollout`: the rollout's state (rollout_state), taken where it stood still."""
    start = time.perf_counter()
    arrays, learner = self.learners.checkpoint()
    buffer, rollout_host = self.rollout_state() if rollout is None else rollout
    problem = self.checkpointer.room_problem(step, arrays, buffer)
    if distributed.any_process(problem is not None):  # all stop alike, or none does
      raise DiskFull(problem or f"another process found no room for checkpoint {step}")
    host = {
        "step": step,
        "version": step,
        **rollout_host,
        "learner": learner,
        "config": resume_check.as_json(self.config),
        "model": hf_io.architecture(self.model_cfg),
        "metrics": None if metrics is None else {"step": step, **metrics},
    }
    self.checkpointer.save(step, arrays, buffer, host)
    return time.perf_counter() - start

  def _resume(self) -> None:
    """Restores the newest intact checkpoint of the same config (resume.py: a damaged one
    is set aside with a warning; a changed config, or no intact one, is an InputError)."""
    target = abstract_like(self.learners.checkpoint()[0])
    found = resume.newest_intact(
        self.checkpointer, self.config, self.model_cfg, target, primary=self.primary
    )
    self._restore(*found)

  def _restore(self, step: int, arrays, buffer, host) -> None:
    self.learners.restore(arrays, host["learner"])
    if self.remote:  # the rollout's process takes its part when it starts
      own, self._waiting = in_flight.from_state(buffer, host.get("waiting"))
      kept = {k: host[k] for k in ("scheduler", "data")}
      self._rollout_restore = own, kept
      buffered = str(PartialBuffer.groups_in(own))
    else:
      self._set_policy(step)
      self._waiting = self.side.restore(buffer, host)
      buffered = str(len(self.side.scheduler.buffer))
    self.writer.truncate_after(step, host.get("metrics"))
    self.next_step = step  # the loop's index of step step + 1
    if self.primary:
      drawn = f", {len(self._waiting)} drawn batches to train" if self._waiting else ""
      print(
          f"resumed from step {step} ({buffered} groups in the partial buffer{drawn})", flush=True
      )

  def _set_policy(self, version: int) -> None:
    """The engine decodes the learner's params from now on (before the rollout's thread
    starts, or colocated)."""
    params = self.learners.policy.decode_params()
    if self.publisher is None:
      self.side.engine.set_policy(params, version)
    else:
      self.publisher.swap(self.side.engine, params, version)

  def _report(self) -> None:
    """The end-of-run summary on stdout and the progress plot in the workdir."""
    lines = run_report.read_metrics(self.workdir)
    if lines:
      run_report.plot(lines, self.workdir)
    print(run_report.summary(lines, self.workdir), flush=True)
    if self.config.env.name and self.config.env.isolation == "none":
      print(f"  warning          {run_episodes.NO_ISOLATION}", flush=True)

  # ---------------------------------------------------------------------------- eval
  def evaluate(self) -> dict[str, float]:
    """On the run's own engine (empty between steps) and its current params."""
    return self.side.evaluate()

  def _evaluate_before_training(self, metrics: dict[str, float] | None = None) -> None:
    """The warm-started (or loaded) policy's score (`metrics`, where the rollout's
    process gave it), as the line of step 0: step k's line holds the params after k
    updates."""
    metrics = self.evaluate() if metrics is None else metrics
    self.writer.write(0, metrics)
    if self.primary:
      logging.info("evaluation before training: %s", metrics)
      print(f"before training: eval pass@1 {metrics['eval/pass@1']:.3f}", flush=True)

  # ---------------------------------------------------------------------------- loop
  @property
  def stopped(self) -> bool:
    """Whether SIGTERM stopped the run early (after saving)."""
    return self.stop.stopped

  def _check_failures(self, result, step: int) -> None:
    """Says what failed in the step's user code; stops a run whose every sample fails the
    same way (rollout.max_failed_steps), before it trains on it."""
    tally = failures_lib.StepFailures.of(result.groups + result.rejected)
    if self.primary and tally.failed:
      print(f"april_jax: warning: {tally.line(step)}", file=sys.stderr, flush=True)
    why = self._failures.see(tally, step)
    # Process 0's verdict and words for every process (their rewards are its rewards).
    why = distributed.agree_json(why) if distributed.process_count() > 1 else why
    if why is not None:
      raise failures_lib.StepsFailed(why)

  def train_step(self, step: int) -> dict[str, float] | None:
    """Step step + 1: rollout, learn; its metrics, or None when SIGTERM cut its rollout
    (nothing trained; what it drew is in the partial buffer)."""
    c = self.config
    version = step  # the params after `step` updates
    result = self._draw(step)
    if result is None or result.cut:  # None: the rollout's thread closed before a batch
      self.stop.cut_drew = result is not None and (
          result.stats.get("new_tokens", 0) > 0 or bool(result.rejected)
      )
      return None
    self._check_failures(result, step + 1)
    start = time.perf_counter()
    batch = batch_lib.TrainBatch.from_groups(
        result.groups,
        version,
        pad_id=self.tokenizer.pad_id,
        max_len=c.data.max_prompt_len + c.rollout.max_response_len,
        train=c.train,
        max_response_len=c.rollout.max_response_len,
    )
    metrics = rollout_metrics(result, version)
    state, learned = learn_lib.learn(self.learners.state(), batch, self.learners)
    self.learners.put(state)
    metrics.update(learned)
    metrics["time/train_s"] = time.perf_counter() - start
    self.writer.write_rollouts(step + 1, result.groups)  # step k: the k-th update's data
    return metrics

  def _draw(self, index: int):
    """Batch `index` (trained by update index + 1): one kept by the checkpoint resumed
    from, else drawn now (colocated) or taken from the rollout's thread (split)."""
    if self._waiting:
      return self._waiting.pop(0)
    if self.async_rollout is not None:
      return self.async_rollout.take(index)
    assert self.side.engine.version == index, (self.side.engine.version, index)
    one_process = distributed.process_count() == 1  # waits for rewards end at once only there
    give_up = (lambda: self.stop.requested) if one_process else None
    return self.side.scheduler.step(index, cut_now=self.stop.cut_now, give_up=give_up)

  def _publish(self, step: int, evaluate: bool, save: bool, stop: bool):
    """The params after `step` updates to the engine; then, where the rollout holds them,
    the evaluation and the capture of the rollout's state for a checkpoint, when due.
    Returns (evaluation metrics or {}, rollout state or None). A split run that stops
    publishes nothing: the rollout's thread is cut, and what it holds is captured where
    it stands (the batches drawn ahead with it)."""
    wanted = (["evaluate"] if evaluate else []) + (["capture"] if save else [])
    if self.async_rollout is None:
      self.side.engine.set_policy(self.learners.policy.decode_params(), step)
      done = [self._service(name)() for name in wanted]
    else:
      if stop:
        start = time.perf_counter()
        if self.remote:  # in one process the rollout's thread sees the stop itself
          self.async_rollout.cut()
        done = [self._ask_rollout("capture")] if save else []
      else:
        params = self.learners.policy.decode_params()
        start = time.perf_counter()
        asked = wanted if self.remote else [self._service(name) for name in wanted]
        done = [r.result() for r in self.async_rollout.publish(params, step, asked)]
      # Waiting for the rollout's boundary (and its evaluation) is the learner waiting.
      self.async_rollout.waits.learner_s += time.perf_counter() - start
    return (done.pop(0) if evaluate else {}), (done.pop(0) if save else None)

  def _service(self, name: str):
    """A request the learner makes of its own rollout, by name."""
    return {"evaluate": self.evaluate, "capture": self.rollout_state}[name]

  def _ask_rollout(self, name: str):
    """A named request of the rollout's thread (here or in its process), answered."""
    if self.remote:
      return self.async_rollout.request(name)
    return self.async_rollout.request(self._service(name))

  def _async_metrics(self) -> dict[str, float]:
    """Split meshes: each side's wait and the weights' copies since the last step."""
    a = self.async_rollout
    p = a.publish_stats
    now = {
        "async/rollout_wait_s": a.waits.rollout_s,
        "async/learner_wait_s": a.waits.learner_s,
        "async/publish_s": p.seconds,
        "async/publish_bytes": float(p.bytes),
        "async/weight_swaps": float(a.swaps),
    }
    last, self._async_totals = self._async_totals, now
    return {k: v - last.get(k, 0.0) for k, v in now.items()}

  def _start_rollout_thread(self) -> None:
    """Split meshes: the rollout draws on its thread from here on (rollout/async_rollout.py)."""
    c = self.config
    if self.remote:
      self._start_remote_rollout()
      return
    if self.publisher is None:
      return
    self.async_rollout = AsyncRollout(
        self.side.scheduler,
        self.publisher,
        depth=0 if c.rollout.max_staleness == 0 else 1,
        in_flight=c.rollout.in_flight_updates,
        resume_mode=c.rollout.resume_mode,
        first_batch=self.next_step,
        version=self.side.engine.version,
        waiting=self._waiting,
        cut_now=self.stop.cut_now,
    )
    self._waiting = []
    self.async_rollout.start()

  def _start_remote_rollout(self) -> None:
    """A split run across processes: the rollout's process starts drawing with these
    weights (and the checkpoint's rollout state); the batches the checkpoint holds drawn
    stay here, trained first."""
    c = self.config
    self.async_rollout = RemoteRollout(
        Channel(send_on=TO_ROLLOUT, receive_on=TO_LEARNER),
        WeightServer(
            distributed.coordinator_host(),
            self.place.mesh.devices.flat,
            self.place.rollout_mesh.devices.size,
        ),
        first_batch=self.next_step + len(self._waiting),
        cut_now=self.stop.cut_now,
    )
    evaluate_first = (
        self.next_step == 0 and bool(c.eval_every) and c.eval.before_training and not self.resumed
    )
    metrics = self.async_rollout.start(
        self.learners.policy.decode_params(),
        self.next_step,
        rollout=self._rollout_restore,
        evaluate_first=evaluate_first,
    )
    if evaluate_first:
      self._evaluate_before_training(metrics)

  def run(self) -> None:
    """Compiles, then runs steps next_step + 1 .. num_steps (or until SIGTERM), closes
    what the run opened and says how it ended."""
    previous = signal.signal(signal.SIGTERM, self.stop.handle)
    try:
      self._compile()
      self._start_rollout_thread()
      for index in range(self.next_step, self.config.num_steps):
        if self._one_step(index):
          break
    finally:
      signal.signal(signal.SIGTERM, previous)
      self._close(failing=sys.exc_info()[1] is not None)
    if self.stopped:
      # Every process has finished writing its part of the last checkpoint before any
      # leaves with the stopped status (a launcher such as `srun --kill-on-bad-exit`
      # would otherwise end the others mid-write).
      distributed.any_process(False)
    if self.primary:
      self._report()
      self._say_how_it_stopped()

  def _compile(self) -> None:
    """The sampler's and (with train.warm_up) the learner's programs for every bucket,
    and the evaluation before training of a fresh run."""
    c = self.config
    if self.primary:
      print(
          "compiling the sampler and the learner for every length bucket (once per run; "
          "the compilation cache keeps them for the next)",
          flush=True,
      )
    if self.next_step == 0 and not self.remote:  # the rollout's process compiles its own
      self.side.engine.warm_up()
      if c.eval_every and c.eval.before_training and not self.resumed:
        self._evaluate_before_training()
    if c.train.warm_up:
      self.learners.policy.warm_up(
          c.rollout.batch_size * c.rollout.n_samples_per_prompt,
          batch_lib.all_bucket_lens(c.data.max_prompt_len + c.rollout.max_response_len),
      )

  def _one_step(self, index: int) -> bool:
    """Step index + 1: train, evaluate, save, log. True when the run stops here."""
    c = self.config
    step = index + 1  # steps count from 1 everywhere a user sees them: step k = k updates
    self.user_output.new_step()
    start = time.perf_counter()
    metrics = self.train_step(index)
    if metrics is None:  # SIGTERM cut its rollout: keep what it drew, leave
      if self.stop.save_cut(index, self.checkpointer.latest_step()):
        rollout = None if self.async_rollout is None else self._ask_rollout("capture")
        self.save(index, None, rollout)
      self.stop.stop_during(step)
      return True
    last = step == c.num_steps
    # Decided once per step, and by every process alike (SIGTERM may reach only one); a
    # stopping run skips evaluation to save within the scheduler's grace period.
    stop = self.stop.agreed() or (self.remote and self.async_rollout.stopping)
    evaluate = not stop and bool(c.eval_every) and (step % c.eval_every == 0 or last)
    save = stop or last or bool(c.checkpoint_every and step % c.checkpoint_every == 0)
    start_publish = time.perf_counter()
    evaluated, rollout = self._publish(step, evaluate, save, stop)
    metrics.update(evaluated)
    metrics["time/step_s"] = start_publish - start  # rollout (or the wait for it) + learn
    if self.async_rollout is not None:
      metrics.update(self._async_metrics())
    if save:
      metrics["time/checkpoint_s"] = self.save(step, metrics, rollout)
    self.writer.write(step, metrics)
    if self.primary and c.log_every and (index % c.log_every == 0 or last):
      log_progress(step, c.num_steps, metrics)
    if stop:
      self.stop.stop_after(step)
    return stop

  def _close(self, failing: bool) -> None:
    """Ends the workers, the checkpoint writer and the metric files; releases the lock.
    After an error, a failure to close is logged: the error that ended the run is the one
    to report (a full disk fails the closing writes too)."""
    closes = [self.checkpointer.close, self.writer.close, user_output.stop]
    if self.side is not None:
      closes = self.side.closers() + closes
    if self.async_rollout is not None:
      closes.insert(0, lambda: self.async_rollout.close(failing=failing))
    for close in closes:
      try:
        close()
      except Exception as e:  # pylint: disable=broad-except
        if not failing:
          raise
        logging.info("while closing after an error: %s", e, exc_info=True)
    if self._lock is not None:
      self._lock.release()

  def _say_how_it_stopped(self) -> None:
    """After the summary: the line of a run SIGTERM stopped, and what its rerun resumes."""
    line = self.stop.line(self.config.num_steps)
    if line is not None:
      print(line, flush=True)
