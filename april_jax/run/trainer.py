"""One RL run: its parts built from a config (run/parts.py, rollout/side.py), then
rollout -> learn -> log -> save.

  step k (policy version k = params after k updates):
    rollout   batch k taken from the run's Rollout (rollout/base.py: colocated, on a
              thread beside the learner, or in another process; the trainer never asks
              which), drawn by version k (or, split, within the staleness bound)
    learn     the step's groups -> TrainBatch (rl/batch.py: rows, shaped rewards) ->
              rl/learn.py's learn: old and reference logprobs (and a critic's values),
              advantages, the policy's updates (and the critic's)
    log       metrics.jsonl, TensorBoard, rollouts.jsonl, a progress line
    publish   the new params to the rollout, with the requests due at its boundary: an
              evaluation every eval_every steps (pass@1 / avg@k, rollout/evaluation.py), the
              rollout's state for a checkpoint
    save      every checkpoint_every steps, at the end, and on SIGTERM (which cuts the
              step's rollout at once: what it drew stays in the partial buffer;
              runtime/sigterm_stop.py)

Resume: a workdir with checkpoints continues from the latest intact one (see
run/resume.py), if the config matches the saved one (validation/resume.py); with a
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
from april_jax import sharding
from april_jax.checkpoint import Checkpointer, abstract_like
from april_jax.errors import DiskFull, InputError
from april_jax.metrics import MetricsWriter, log_progress
from april_jax.models import hf_io
from april_jax.models import lora as lora_lib
from april_jax.models import path_check
from april_jax.rl import batch as batch_lib
from april_jax.rl import learn as learn_lib
from april_jax.rl.advantages import CRITIC_ADVANTAGES
from april_jax.rollout import failures as failures_lib
from april_jax.rollout import rollout_metrics
from april_jax.rollout import run_episodes
from april_jax.rollout import side as rollout_side
from april_jax.run import lora_base
from april_jax.run import parts as run_parts
from april_jax.run import report as run_report
from april_jax.run import resume
from april_jax.runtime import distributed
from april_jax.runtime import user_output
from april_jax.runtime.sigterm_stop import SigtermStop
from april_jax.runtime.workdir_lock import WorkdirLock
from april_jax.validation import resume as resume_check
from april_jax.validation.checks import settings_of
from april_jax.tasks.task import make_task


class Trainer:
  """One run in a workdir: its parts built from the config (run/parts.py), resumed from
  its newest intact checkpoint if it has one, then `run`: the loop of steps."""

  def __init__(self, config, workdir: str):
    """config: RunSettings, or a config file's ConfigDict (turned into them here)."""
    c = settings_of(config)
    self.config, self.workdir = c, workdir
    # One run per workdir (the primary holds the lock; the hosts of a run share the workdir).
    self._lock = WorkdirLock(workdir) if distributed.is_primary() else None
    if self._lock is not None:  # saves cut short by a kill: never read, and as big as one
      checkpoint_lib.remove_unfinished(workdir)
    self.user_output = self._relay_user_output()
    self.stop = SigtermStop()
    self.place = sharding.Placement.from_config(c)
    self.model_cfg, self.paths = path_check.checked_model(c)
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
    # The rollout (rollout/base.py), as the config places it; started by run().
    self.rollout = rollout_side.make_rollout(
        c, self.model_cfg, self.paths, self.tokenizer, self.task, self.place, self.stop
    )
    self.primary = distributed.is_primary()  # the one process that writes and prints
    self.writer = MetricsWriter(workdir, enabled=self.primary)
    self.next_step = 0
    self.resumed = resuming
    self._failures = failures_lib.FailureStreak(c.rollout.max_failed_steps)
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

  def save(self, step: int, metrics: dict[str, float] | None, rollout) -> float:
    """Checkpoints the state after `step` updates (the step's metrics line so far goes
    with it; None: a step cut short, whose line is written already); the seconds it
    took. `rollout`: the rollout's state (its "capture"), taken where it stood still."""
    start = time.perf_counter()
    arrays, learner = self.learners.checkpoint()
    buffer, rollout_host = rollout
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
    buffered, drawn = self.rollout.restore(buffer, host)
    self.writer.truncate_after(step, host.get("metrics"))
    self.next_step = step  # the loop's index of step step + 1
    if self.primary:
      to_train = f", {drawn} drawn batches to train" if drawn else ""
      print(
          f"resumed from step {step} ({buffered} groups in the partial buffer{to_train})",
          flush=True,
      )

  def _report(self) -> None:
    """The end-of-run summary on stdout and the progress plot in the workdir."""
    lines = run_report.read_metrics(self.workdir)
    if lines:
      run_report.plot(lines, self.workdir)
    print(run_report.summary(lines, self.workdir), flush=True)
    if self.config.env.name and self.config.env.isolation == "none":
      print(f"  warning          {run_episodes.NO_ISOLATION}", flush=True)

  # ---------------------------------------------------------------------------- eval
  def _evaluate_before_training(self, metrics: dict[str, float]) -> None:
    """The warm-started (or loaded) policy's score, as the line of step 0: step k's
    line holds the params after k updates."""
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
    result = self.rollout.take(step)
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
        route_shape=self.model_cfg.route_shape if self.model_cfg.num_experts else None,
    )
    metrics = rollout_metrics(result, version)
    state, learned = learn_lib.learn(self.learners.state(), batch, self.learners)
    self.learners.put(state)
    metrics.update(learned)
    metrics["time/train_s"] = time.perf_counter() - start
    self.writer.write_rollouts(step + 1, result.groups)  # step k: the k-th update's data
    return metrics

  def _publish(self, step: int, evaluate: bool, save: bool, stop: bool):
    """The params after `step` updates to the rollout, with the requests due at its
    boundary: (evaluation metrics or {}, the rollout's state for a checkpoint or None).
    A run that stops publishes nothing: the rollout is cut, and what it holds is
    captured where it stands (the batches drawn ahead with it)."""
    wanted = (["evaluate"] if evaluate else []) + (["capture"] if save else [])
    if stop:
      self.rollout.cut()
      done = [self.rollout.request("capture")] if save else []
    else:
      done = self.rollout.publish(self.learners.policy.decode_params(), step, wanted)
    return (done.pop(0) if evaluate else {}), (done.pop(0) if save else None)

  def _start_rollout(self) -> None:
    """The rollout starts from the learner's params (the sampler compiled first on a
    fresh run), with the evaluation before training where it is due."""
    c = self.config
    evaluate_first = (
        self.next_step == 0 and bool(c.eval_every) and c.eval.before_training and not self.resumed
    )
    metrics = self.rollout.start(
        self.learners.policy.decode_params(),
        self.next_step,
        self.next_step,
        warm_up=self.next_step == 0,
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
    """The sampler's programs for every bucket (with the rollout's start, the evaluation
    before training of a fresh run too) and, with train.warm_up, the learner's."""
    c = self.config
    if self.primary:
      print(
          "compiling the sampler and the learner for every length bucket (once per run; "
          "the compilation cache keeps them for the next)",
          flush=True,
      )
    self._start_rollout()
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
        self.save(index, None, self.rollout.request("capture"))
      self.stop.stop_during(step)
      return True
    last = step == c.num_steps
    # Decided once per step, and by every process alike (SIGTERM may reach only one); a
    # stopping run skips evaluation to save within the scheduler's grace period.
    stop = self.stop.agreed() or self.rollout.stopping
    evaluate = not stop and bool(c.eval_every) and (step % c.eval_every == 0 or last)
    save = stop or last or bool(c.checkpoint_every and step % c.checkpoint_every == 0)
    start_publish = time.perf_counter()
    evaluated, rollout = self._publish(step, evaluate, save, stop)
    metrics.update(evaluated)
    metrics["time/step_s"] = start_publish - start  # rollout (or the wait for it) + learn
    metrics.update(self.rollout.step_metrics())
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
    closes = [
        lambda: self.rollout.close(failing=failing),
        self.checkpointer.close,
        self.writer.close,
        user_output.stop,
    ]
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
