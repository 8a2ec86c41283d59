"""A Python interpreter for tool calls on math problems (env.name = "python_tool").

  run_python("print(sum(range(10)))")   -> "45\\n"
  run_python("from fractions import Fraction\\nFraction(1, 3) + Fraction(1, 6)")
                                        -> "Fraction(1, 2)\\n"  (a last expression's repr)
  run_python("1 / 0")                   -> the traceback's last lines, ZeroDivisionError
  run_python("while True: pass")        -> "error: ran past the 5 s time limit"

The model's code never runs in this process: a policy that optimises a reward writes it,
and will look for a way out. Each call starts a fresh interpreter (`python -I`: no
PYTHON* variables, no user site-packages, no current folder on sys.path) with the code
on its stdin, a minimal environment, and its stdout and stderr in unlinked files.

  isolation="kernel" (the default): in a bubblewrap sandbox (kernel_isolation.py): its
      own user, pid, mount, network and IPC namespaces, a read-only view of Python and the
      system's libraries, a tmpfs bounded in bytes and files as its working folder, no
      thread but its own, nothing of the host's files, processes or network. IsolationUnavailable (one line) where the kernel
      allows no such sandbox.
  isolation="none": in a temporary folder of the host's, removed afterwards, under
      `unshare -rn` where that works (no network). Not a barrier: the audit hook below
      runs inside the code's own interpreter.

Either way the child (python_sandbox.py) limits itself with setrlimit (address space,
CPU seconds, file size, open files, no core dumps), loads a seccomp filter (no new
processes or programs, no sockets, no signals to other processes, no ptrace, ...) and
an audit hook that answers refusals in words the model can read. Past `Limits.timeout_s`
of wall time the call is killed with everything it started; it also ends when this
process dies (a pipe it watches closes). Nothing here raises for the code's sake.

`PythonToolEnv` is the tool as a multi-turn environment, in Qwen3's tool-call format.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from april_jax.runtime import process_tree
from april_jax.envs import kernel_isolation
from april_jax.envs.base import EnvError, EnvReset, EnvStep, register
from april_jax.envs.kernel_isolation import IsolationUnavailable
from april_jax.envs.tool_calls import ToolCall, tool_results

ISOLATIONS = ("kernel", "none")  # env.isolation
# A wait for the killed child (already dead in practice) and for the unshare probe.
KILL_WAIT_S = 5.0
MIN_CALL_S = 0.5  # a call with less of its turn's time left is not started


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one run may use."""

  timeout_s: float = 5.0  # wall time; past it the child's process group is killed
  cpu_s: int = 5  # RLIMIT_CPU, seconds
  memory_mb: int = 1024  # RLIMIT_AS: the child's address space
  max_output_chars: int = 4000  # stdout (and the error) shown, at most
  max_file_mb: int = 16  # RLIMIT_FSIZE: each file the code writes, its stdout included
  scratch_mb: int = 64  # isolation="kernel": the size of its working folder (a tmpfs)
  scratch_inodes: int = 256  # isolation="kernel": files and folders that folder can hold


@functools.cache
def _network_isolation() -> tuple[str, ...]:
  """isolation="none": `unshare -rn` where it works here (checked once), else nothing."""
  unshare = shutil.which("unshare")
  if unshare is None:
    return ()
  try:
    probe = subprocess.run(
        [unshare, "-rn", "true"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=KILL_WAIT_S,
        check=False,
    )
  except (OSError, subprocess.SubprocessError):
    return ()
  return (unshare, "-rn") if probe.returncode == 0 else ()


def check_isolation(isolation: str) -> None:
  """ValueError for an unknown mode; IsolationUnavailable (one line) when "kernel" cannot
  run on this machine."""
  if isolation not in ISOLATIONS:
    raise ValueError(f"isolation={isolation!r}: one of {ISOLATIONS}")
  if isolation == "kernel":
    why = kernel_isolation.problem()
    if why is None:
      return
    if kernel_isolation.kernel_refuses():
      raise IsolationUnavailable(
          f"the Python tool cannot isolate model code here: {why}. Set "
          "env.isolation=none to run it under the audit hook only (not a barrier: "
          "docs/environments.md)"
      )
    raise IsolationUnavailable(f"the Python tool's sandbox does not start: {why}")


def _child_environment(work: str) -> dict[str, str]:
  """Only what Python and its math libraries need: no variable of the trainer's."""
  env = {
      "HOME": work,
      "TMPDIR": work,
      "PATH": "/usr/bin:/bin",
      "LANG": "C.UTF-8",
      # One thread each: the sandbox refuses new threads (and processes).
      "OPENBLAS_NUM_THREADS": "1",
      "OMP_NUM_THREADS": "1",
      "MKL_NUM_THREADS": "1",
  }
  if "LD_LIBRARY_PATH" in os.environ:  # a Python built against libraries found there
    env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
  return env


def _run_child(
    code: Any, stdout: Any, stderr: Any, work: str, limits: Limits, isolation: str, hook: bool
):
  """Runs the runner on `code` (a file at its start) in `work`, its stdout and stderr into
  the given files. The exit status (negative: the signal), or None when it ran past the
  time limit."""
  settings = {
      "audit_hook": hook,
      "work_dir": work,
      "memory_mb": int(limits.memory_mb),
      "cpu_s": int(limits.cpu_s),
      "max_file_mb": int(limits.max_file_mb),
      "seccomp": "required" if isolation == "kernel" else "where_possible",
  }
  if isolation == "kernel":
    scratch = kernel_isolation.scratch(limits.scratch_mb, limits.scratch_inodes)
    settings["scratch"] = scratch.settings()
  # The child ends when this end closes: when the call is over, or this process dies
  # (even while bwrap starts, before its --die-with-parent holds).
  lifeline, keep = os.pipe()
  settings["lifeline_fd"] = lifeline
  python = [sys.executable, "-I", "-c", kernel_isolation.runner_source(), json.dumps(settings)]
  if isolation == "kernel":
    command, cwd = kernel_isolation.command(python), None
  else:
    command, cwd = [*_network_isolation(), *python], work
  try:
    child = subprocess.Popen(  # pylint: disable=consider-using-with
        command,
        cwd=cwd,
        env=_child_environment(work),
        stdin=code,
        stdout=stdout,
        stderr=stderr,
        pass_fds=(lifeline,),
        start_new_session=True,
    )
    os.close(lifeline)
    lifeline = None
    try:
      status = _wait(child, limits.timeout_s)
    except subprocess.TimeoutExpired:
      _kill(child, isolation)
      return None
  finally:
    os.close(keep)
    if lifeline is not None:
      os.close(lifeline)
  if isolation == "kernel" and status > 128:  # bwrap exits 128 + n for its child's signal n
    return -(status - 128)
  return status


def _wait(child: subprocess.Popen, timeout_s: float) -> int:
  """child.wait(timeout_s), woken the moment the child ends (a pidfd; Popen.wait polls
  every 50 ms, which was most of a short call's time)."""
  try:
    pidfd = os.pidfd_open(child.pid)
  except (AttributeError, OSError):  # not Linux 5.3+
    return child.wait(timeout=timeout_s)
  try:
    ended, _, _ = select.select([pidfd], [], [], max(0.0, timeout_s))
  finally:
    os.close(pidfd)
  if not ended:
    raise subprocess.TimeoutExpired(child.args, timeout_s)
  return child.wait()


def _kill(child: subprocess.Popen, isolation: str) -> None:
  """Ends a child past its time, and everything it started."""
  if isolation == "kernel":
    # bwrap's child is the sandbox's pid 1: killed, the kernel kills the rest of the
    # namespace, and bwrap (which reaps it, so nothing is left behind) exits.
    for pid in process_tree.children(child.pid):
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    try:
      child.wait(timeout=KILL_WAIT_S)
      return
    except subprocess.TimeoutExpired:
      pass
  try:
    os.killpg(child.pid, signal.SIGKILL)  # its session's group
  except ProcessLookupError:
    pass
  child.wait(timeout=KILL_WAIT_S)


def _read_head(f: Any, max_chars: int) -> tuple[str, bool]:
  """The file's first max_chars characters, and whether there was more."""
  f.seek(0)
  head = f.read(4 * max_chars + 4)  # UTF-8: at most 4 bytes a character
  more = bool(f.read(1))
  text = head.decode("utf-8", "replace")
  return text[:max_chars], more or len(text) > max_chars


def _read_tail(f: Any, max_chars: int) -> str:
  """The file's last max_chars characters ("..." first when there was more)."""
  f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * max_chars))
  text = f.read().decode("utf-8", "replace")
  return text if len(text) <= max_chars else "..." + text[-(max_chars - 3) :]


def _status_error(status: int | None, limits: Limits) -> str:
  """One line for an end the child did not describe itself."""
  if status is None:
    return f"error: ran past the {limits.timeout_s:g} s time limit"
  if status == -signal.SIGXCPU:
    return f"error: ran past the {limits.cpu_s} s CPU time limit"
  if status < 0:
    try:
      name = signal.Signals(-status).name
    except ValueError:
      name = f"signal {-status}"
    why = " (past its CPU time limit, or by the system)" if name == "SIGKILL" else ""
    return f"error: the process was killed by {name}{why}"
  return f"error: the code exited with status {status}"


def _outcome(stdout: Any, stderr: Any, status: int | None, limits: Limits) -> str:
  """stdout, then the error (the child's own words, else one line of ours), cut to size."""
  error = _read_tail(stderr, limits.max_output_chars // 2).strip()
  if status is None or status < 0 or (status != 0 and not error):
    error = _status_error(status, limits)
  budget = max(0, limits.max_output_chars - len(error))
  out, cut = _read_head(stdout, budget)
  if cut:
    out = out.rstrip("\n") + f"\n... [output cut at {budget} characters]\n"
  if not error:
    return out
  return out + ("" if not out or out.endswith("\n") else "\n") + error


def _remove(folder: str) -> None:
  """Removes a working folder however deep the code nested it (shutil.rmtree recurses)."""
  try:
    shutil.rmtree(folder)
  except (OSError, RecursionError):
    subprocess.run(["rm", "-rf", "--", folder], check=False, capture_output=True)


def run_python(
    code: str, limits: Limits = Limits(), isolation: str = "kernel", audit_hook: bool = True
) -> str:
  """Runs `code` in a separate, limited Python process (see the module docstring). Returns
  its stdout, followed by the error when it failed: the traceback's last lines, or one
  line for a time-out, the memory limit or another end. Never raises for the code's sake;
  IsolationUnavailable when isolation="kernel" cannot run on this machine. audit_hook=False
  leaves the second layer out (the tests show that the kernel's barrier holds alone)."""
  check_isolation(isolation)
  folder = None
  try:
    with (
        tempfile.TemporaryFile() as code_file,
        tempfile.TemporaryFile() as stdout,
        tempfile.TemporaryFile() as stderr,
    ):
      code_file.write(code.encode("utf-8", "replace"))
      code_file.seek(0)
      if isolation == "kernel":
        work = kernel_isolation.SCRATCH_DIR
      else:
        folder = tempfile.mkdtemp(prefix="python_tool_")
        work = os.path.realpath(folder)
      try:
        status = _run_child(code_file, stdout, stderr, work, limits, isolation, audit_hook)
      except OSError as e:
        return f"error: could not start Python: {e}"
      return _outcome(stdout, stderr, status, limits)
  except Exception as e:  # pylint: disable=broad-except  # never the trainer's failure
    return f"error: the tool failed: {type(e).__name__}: {e}"
  finally:
    if folder is not None:
      _remove(folder)


# ----------------------------------------------------------------- the environment
TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Runs Python 3 code in a fresh process and returns what it printed (a last "
            "expression's value too, when nothing was printed) or its error. The standard "
            "library is there (math, fractions, itertools, ...), and sympy and numpy where "
            "installed. Each call starts from scratch. No network; a time limit of a few "
            "seconds."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to run."}},
            "required": ["code"],
        },
    },
}

INSTRUCTIONS = (
    "Solve the math problem. You may run Python code to compute or to check a step. "
    "Finish with the final answer as \\boxed{answer}."
)


def tools_system_prompt(instructions: str, tools: list[dict]) -> str:
  """A system message as Qwen3's chat template writes one for `tools` (function tools):
  the instructions, then the tools' JSON schemas in <tools></tools> and the call format."""
  schemas = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
  return (
      f"{instructions}\n\n# Tools\n\nYou may call one or more functions to assist with the "
      "user query.\n\nYou are provided with function signatures within <tools></tools> XML "
      f"tags:\n<tools>{schemas}\n</tools>\n\nFor each function call, return a json object "
      "with function name and arguments within <tool_call></tool_call> XML tags:\n"
      '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
  )


SYSTEM_PROMPT = tools_system_prompt(INSTRUCTIONS, [TOOL])

_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def _unfenced(code: str) -> str:
  """The body of a markdown code block in `code`, else `code`."""
  blocks = _FENCED.findall(code)
  return blocks[-1] if blocks else code


def call_code(call: ToolCall) -> str:
  """The code a well-formed call asks to run; ToolCallError when it names another tool
  or gives no code."""
  if call.name != "python":
    raise ToolCallError(f"there is no tool {call.name!r}: the tool is 'python'")
  code = call.arguments.get("code")
  if not isinstance(code, str):
    raise ToolCallError('a python call needs {"arguments": {"code": "..."}}')
  return _unfenced(code)


def _last_user_message(messages: Any) -> str | None:
  if not isinstance(messages, list):
    return None
  for message in reversed(messages):
    if isinstance(message, dict) and message.get("role") == "user":
      content = message.get("content")
      return content if isinstance(content, str) else None
  return None


def question_of(row: dict) -> str | None:
  """The problem a dataset row asks: its "question" or "problem" column, DAPO's
  extra_info.raw_problem, or its "prompt" (text, or the last user message of a chat)."""
  extra = row.get("extra_info")
  candidates = [
      row.get("question"),
      row.get("problem"),
      extra.get("raw_problem") if isinstance(extra, dict) else None,
      row.get("prompt") if isinstance(row.get("prompt"), str) else None,
      _last_user_message(row.get("prompt")),
  ]
  for candidate in candidates:
    if isinstance(candidate, str) and candidate.strip():
      return candidate
  return None


class ToolCallError(ValueError):
  """A well-formed call that names no code to run; the message says what one looks like."""


@register("python_tool", options=("isolation",))
class PythonToolEnv:
  """Math with a Python interpreter: the episode opens with INSTRUCTIONS, the TOOL schema
  (rendered by the chat template) and the row's problem. Each turn's calls are read as
  the hermes parser reads them (tool_calls.py) and each one's code runs, in order: one
  tool result per call (its output, its error, or what was wrong with the call); a
  malformed call runs nothing and the result says what was wrong. A turn with no call is
  the final answer and ends the episode. State: the number of turns that called."""

  # The output fits env.max_observation_tokens (512 in configs/math_python_tool.py) with
  # its "[output cut]" note; 5 s stays below env.timeout_s (10 s).
  limits = Limits(max_output_chars=1500)
  # All the calls of one turn share this much wall time, below env.timeout_s (10 s), so a
  # turn of several calls is answered, never timed out; a call that has no time left
  # does not run.
  turn_budget_s = 8.0

  def __init__(self, isolation: str = "kernel"):
    """EnvError, one line, when `isolation` (env.isolation) cannot run here."""
    try:
      check_isolation(isolation)
    except (ValueError, IsolationUnavailable) as e:
      raise EnvError(f"env.isolation={isolation}: {e}") from None
    self.isolation = isolation

  def reset(self, row: dict) -> EnvReset | dict:
    question = question_of(row)
    if question is None:
      return {"calls": 0}  # the row's own prompt
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]
    return EnvReset(state={"calls": 0}, messages=messages, tools=[TOOL])

  def step(self, state: dict, turn: str) -> EnvStep:
    deadline = time.monotonic() + self.turn_budget_s
    results = tool_results(turn, lambda call: self._run(call, deadline))
    if results is None:
      return EnvStep(observation=None, done=True, state=state)
    return EnvStep(observation=results, done=False, state={"calls": state["calls"] + 1})

  def _run(self, call: ToolCall, deadline: float) -> str:
    left = deadline - time.monotonic()
    if left < MIN_CALL_S:
      return f"error: not run: this turn's calls used its {self.turn_budget_s:g} s"
    try:
      code = call_code(call)
    except ToolCallError as e:
      return f"error: {e}"
    limits = dataclasses.replace(self.limits, timeout_s=min(self.limits.timeout_s, left))
    output = run_python(code, limits, self.isolation)
    return output if output.strip() else "(no output)"
