"""The Python tool runs the model's code in a separate, limited process: its output or its
traceback comes back, and what math code has no business doing (the network, new
processes, files outside its folder, endless loops, all the memory) is refused or
stopped, with a message the model can read. Tests named "the hook" run with
isolation="none", where the audit hook is the layer that answers (under the kernel's
isolation it is the second layer: python_tool_isolation_test.py). The environment turns
Qwen3 tool calls into runs, and its config validates."""

import json
import os
import re
import resource
import shutil
import time

import pytest

from april_jax.validation import checks as validate
from april_jax.data import load_records
from april_jax.envs import base, kernel_isolation, python_tool
from april_jax.envs.base import EnvReset
from april_jax.envs.python_tool import INSTRUCTIONS, SYSTEM_PROMPT, TOOL, Limits
import cli
from conftest import MATH_DIR, MODEL_CONFIGS_DIR, QWEN3_TOKENIZER_DIR, TOOL_ISOLATION, load_config

SHORT = Limits(timeout_s=2.0, cpu_s=2)


def run_python(code: str, limits: Limits = Limits(), isolation: str = TOOL_ISOLATION) -> str:
  return python_tool.run_python(code, limits, isolation)


def PythonToolEnv():  # pylint: disable=invalid-name
  return python_tool.PythonToolEnv(TOOL_ISOLATION)


# ------------------------------------------------------------------ what comes back
def test_stdout_comes_back():
  assert run_python("print(6 * 7)\nprint('done')") == "42\ndone\n"


@pytest.mark.parametrize(
    "code,output",
    [
        ("from fractions import Fraction\nFraction(1, 3) + Fraction(1, 6)", "Fraction(1, 2)\n"),
        ("x = 12\nx ** 2", "144\n"),
        ("print('shown')\n1 + 1", "shown\n"),  # something printed: no repr added
        ("x = [1, 2]\nx.append(3)", ""),  # a None value is not shown
        ("import math\nmath.comb(10, 3)", "120\n"),
    ],
)
def test_a_last_expression_is_shown_when_nothing_was_printed(code, output):
  assert run_python(code) == output


def test_an_exception_comes_back_as_the_traceback_of_the_model_s_code():
  out = run_python("print('before')\nx = 10\ny = x / 0\nprint('after')")
  assert out.startswith("before\nTraceback (most recent call last):\n")
  assert 'File "<code>", line 3, in <module>\n    y = x / 0\n' in out
  assert out.rstrip().endswith("ZeroDivisionError: division by zero")
  assert "after" not in out
  for runner_detail in ("<string>", "python_sandbox", "hook", "exec("):
    assert runner_detail not in out


def test_a_syntax_error_names_the_line():
  out = run_python("x = 1\ny = (x +\n")
  assert 'File "<code>", line 2' in out and "SyntaxError" in out
  assert "Traceback" not in out  # no frame of the runner's


@pytest.mark.parametrize(
    "code,message",
    [
        ("import sys\nsys.exit(3)", "error: the code called sys.exit(3)"),
        ("import os\nos._exit(4)", "error: the code exited with status 4"),
    ],
)
def test_a_non_zero_exit_is_one_line(code, message):
  assert run_python(code) == message


def test_long_output_is_cut_and_says_so():
  out = run_python("print('x' * 10000)", Limits(max_output_chars=100))
  assert out == "x" * 100 + "\n... [output cut at 100 characters]\n"


# ------------------------------------------------------------------ what is refused
@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 1), timeout=1)",
        "import socket\nsocket.socket()",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1', timeout=1)",
    ],
)
def test_the_hook_refuses_the_network(code):
  out = run_python(code, SHORT, isolation="none")
  assert re.search(r"socket\.\w+ is not allowed here", out), out


def test_without_unshare_the_hook_alone_refuses_the_network(monkeypatch):
  monkeypatch.setattr(python_tool, "_network_isolation", lambda: ())
  code = "import socket\nsocket.create_connection(('127.0.0.1', 1), timeout=1)"
  out = run_python(code, SHORT, isolation="none")
  assert "socket.getaddrinfo is not allowed here" in out


def test_the_child_sees_python_s_libraries_but_not_the_trainer_s_package_or_environment(
    monkeypatch,
):
  monkeypatch.setenv("TRAINER_SECRET", "hidden")
  code = (
      "import os, math, fractions, itertools, numpy, sympy\n"
      "print(sorted(os.environ.get(k, '-') for k in ('TRAINER_SECRET', 'HOME')))\n"
      "import april_jax"
  )
  out = run_python(code)
  assert "hidden" not in out and "TRAINER_SECRET" not in out
  # Not on its path, or (an editable install's finder) its files are refused.
  last = out.rstrip().splitlines()[-1]
  assert last == "ModuleNotFoundError: No module named 'april_jax'" or (
      "april_jax" in last and "refused (outside the working folder)" in last
  ), last


def test_the_hook_refuses_reading_a_file_outside_the_folder():
  out = run_python("print(open('/etc/passwd').read())", SHORT, isolation="none")
  assert "PermissionError: open '/etc/passwd': refused (outside the working folder)" in out
  assert "root:" not in out


@pytest.mark.parametrize(
    "write",
    [
        "open({path!r}, 'w').write('escaped')",
        "import pathlib\npathlib.Path({path!r}).write_text('escaped')",
        "import os\nos.open({path!r}, os.O_WRONLY | os.O_CREAT)",
        "open('inside', 'w').close()\nimport os\nos.rename('inside', {path!r})",
    ],
)
def test_the_hook_refuses_writing_a_file_outside_the_folder_and_nothing_is_written(tmp_path, write):
  outside = tmp_path / "outside.txt"
  out = run_python(write.format(path=str(outside)), SHORT, isolation="none")
  assert "PermissionError" in out and "refused (outside the working folder)" in out
  assert not outside.exists()


@pytest.mark.parametrize("isolation", sorted({TOOL_ISOLATION, "none"}))
def test_files_inside_the_folder_can_be_written_and_read_and_the_folder_goes_away(isolation):
  name = f"notes-{os.getpid()}-{time.monotonic_ns()}.txt"
  code = (
      "import os\n"
      f"with open({name!r}, 'w') as f:\n"
      "  f.write('kept')\n"
      "os.mkdir('sub')\n"
      "open('sub/more.txt', 'w').write('!')\n"
      f"print(open({name!r}).read() + open('sub/more.txt').read())\n"
      "print(os.getcwd())\n"
  )
  text, folder = run_python(code, isolation=isolation).splitlines()
  assert text == "kept!"
  if isolation == "kernel":  # a tmpfs of the sandbox's own at /tmp: nothing on the host
    assert folder == "/tmp" and not os.path.exists(os.path.join(folder, name))
  else:
    assert not os.path.exists(folder)


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.system('touch {marker}')",
        "import subprocess\nsubprocess.run(['touch', '{marker}'])",
        "import os\nos.posix_spawn('/usr/bin/touch', ['touch', '{marker}'], {{}})",
        "import os\nif os.fork() == 0:\n  open('{marker}', 'w')",
    ],
)
def test_the_hook_refuses_new_processes(tmp_path, code):
  marker = tmp_path / "ran"
  out = run_python(code.format(marker=marker), SHORT, isolation="none")
  assert "PermissionError" in out and "is not allowed here" in out
  assert not marker.exists()


def test_an_endless_loop_is_stopped_at_the_time_limit():
  start = time.monotonic()
  out = run_python("print('started')\nwhile True:\n  pass", Limits(timeout_s=1.0, cpu_s=10))
  assert time.monotonic() - start < 4.0
  assert out == "started\nerror: ran past the 1 s time limit"


def test_the_cpu_time_limit_stops_a_busy_child_before_the_wall_time_limit():
  start = time.monotonic()
  out = run_python("while True:\n  pass", Limits(timeout_s=10.0, cpu_s=1))
  assert time.monotonic() - start < 4.0
  assert out == "error: ran past the 1 s CPU time limit"


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(10**10)", "x = [0] * 10**10", "x = []\nwhile True: x.append(' ' * 10**6)"],
)
def test_a_memory_bomb_hits_the_memory_limit_and_this_process_stays_as_it_was(code):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB
  out = run_python(code, Limits(timeout_s=10.0, memory_mb=512))
  assert out == "error: MemoryError: ran past the 512 MB memory limit"
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000
  assert run_python("print('next')") == "next\n"


# ------------------------------------------------------------------ the environment
CALL = '<tool_call>\n{{"name": "python", "arguments": {{"code": {code}}}}}\n</tool_call>'


def test_the_env_runs_every_call_of_a_turn_and_a_turn_without_one_ends_it():
  env = base.load("python_tool", {"isolation": TOOL_ISOLATION})
  assert isinstance(env, python_tool.PythonToolEnv) and env.isolation == TOOL_ISOLATION
  code = "from sympy import factorint\nprint(factorint(360))"
  turn = "I will factor it.\n" + CALL.format(code=json.dumps(code))
  step = env.step({"calls": 0}, turn)
  assert (step.observation, step.done, step.state) == (
      ["{2: 3, 3: 2, 5: 1}\n"],
      False,
      {"calls": 1},
  )
  two = CALL.format(code=json.dumps("x = 1")) + CALL.format(code=json.dumps("1 / 0"))
  step = env.step({"calls": 1}, two)
  assert step.observation[0] == "(no output)" and "ZeroDivisionError" in step.observation[1]
  assert (len(step.observation), step.state, step.done) == (2, {"calls": 2}, False)
  step = env.step({"calls": 0}, '<tool_call>{"name": "python", "arguments": {}}</tool_call>')
  assert step.observation == ['error: a python call needs {"arguments": {"code": "..."}}']
  step = env.step(
      {"calls": 0}, '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
  )
  assert step.observation == ["error: there is no tool 'search': the tool is 'python'"]
  fenced = CALL.format(code=json.dumps("```python\nprint(5)\n```"))
  assert env.step({"calls": 0}, fenced).observation == ["5\n"]
  final = env.step({"calls": 3}, "So the answer is \\boxed{360}.")
  assert (final.observation, final.done, final.state) == (None, True, {"calls": 3})


def test_the_calls_of_a_turn_share_its_time_and_the_turn_is_answered(monkeypatch):
  monkeypatch.setattr(python_tool.PythonToolEnv, "turn_budget_s", 3.0)
  sleep = CALL.format(code=json.dumps("import time\ntime.sleep(2)\nprint('done')"))
  began = time.monotonic()
  step = PythonToolEnv().step({"calls": 0}, sleep * 3)
  assert time.monotonic() - began < 3.0 + 2 * python_tool.KILL_WAIT_S  # not 3 x 2 s of calls
  assert step.observation[0] == "done\n"
  assert "time limit" in step.observation[1]  # it had the turn's last second
  assert step.observation[2] == "error: not run: this turn's calls used its 3 s"


def test_a_malformed_call_runs_nothing_and_says_what_was_wrong(tmp_path):
  marker = tmp_path / "ran"
  code = f"open({str(marker)!r}, 'w')"
  for turn in [
      f"<tool_call>{code}</tool_call>",  # bare code
      "<tool_call>{'name': 'python', 'arguments': {'code': " + repr(code) + "}}</tool_call>",
      CALL.format(code=json.dumps(code)) + "<tool_call>oops</tool_call>",  # a bad second call
  ]:
    step = PythonToolEnv().step({"calls": 0}, turn)
    assert len(step.observation) == 1 and step.observation[0].startswith("error: tool call ")
  assert not marker.exists()


def test_reset_opens_with_the_tool_s_system_prompt_and_the_row_s_problem():
  env = PythonToolEnv()
  dapo_row = load_records(MATH_DIR / "dapo_format_aime24.parquet")[0][0]["row"]
  rows = [
      ({"problem": "What is 2 + 2?", "answer": "4"}, "What is 2 + 2?"),
      ({"question": "Half of 48?", "answer": "24"}, "Half of 48?"),
      (dapo_row, dapo_row["extra_info"]["raw_problem"]),
      (
          {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "3 * 3?"}]},
          "3 * 3?",
      ),
  ]
  for row, question in rows:
    reset = env.reset(row)
    assert reset == EnvReset(
        state={"calls": 0},
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": question},
        ],
        tools=[TOOL],
    )
  assert env.reset({"answer": "4"}) == {"calls": 0}  # no problem found: the row's prompt


def test_the_fallback_system_prompt_is_the_tool_block_qwen3_s_template_writes():
  from april_jax.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top

  tok = Tokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)
  question = {"role": "user", "content": "What is 2 + 2?"}
  with_tools = tok.apply_chat_template(
      [{"role": "system", "content": INSTRUCTIONS}, question], tools=[TOOL]
  )
  assert tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, question]) == (
      with_tools
  )
  assert "\\boxed{" in SYSTEM_PROMPT and '"name": "python"' in SYSTEM_PROMPT


# ------------------------------------------------------------------ the config
def test_the_math_python_tool_config_validates(tmp_path):
  c = load_config("math_python_tool")
  assert (c.env.name, c.rollout.reward, c.env.turn_stop) == ("python_tool", "math", "")
  assert c.env.observation_format == "chat_template"
  assert python_tool.PythonToolEnv.limits.timeout_s < c.env.timeout_s
  c.env.isolation = TOOL_ISOLATION
  with pytest.raises(validate.ConfigError, match="data.source '' needs a pretrained model"):
    validate.validate(c)  # the model and the data are the user's to give
  model = tmp_path / "Qwen3-4B"
  model.mkdir()
  shutil.copy(MODEL_CONFIGS_DIR / "qwen3-4b.config.json", model / "config.json")
  c.model.path = str(model)
  c.data.source = str(MATH_DIR / "dapo_format_aime24.parquet")
  c.eval.path = str(MATH_DIR / "math500.json")
  validate.validate(c)


def test_the_hook_counts_folders_as_files_so_a_flood_of_them_stops_and_is_removed():
  code = "import os\nfor i in range(100000):\n  os.mkdir(f'd{i}')"
  out = run_python(code, SHORT, isolation="none")
  assert "refused (over 64 files)" in out, out


def test_a_folder_nested_past_python_s_recursion_limit_is_still_removed(monkeypatch):
  made = []
  real_mkdtemp = python_tool.tempfile.mkdtemp

  def remembered(*args, **kwargs):
    made.append(real_mkdtemp(*args, **kwargs))
    return made[-1]

  monkeypatch.setattr(python_tool.tempfile, "mkdtemp", remembered)
  # 60 folders, each renamed into the next: nested 60 deep, which the hook allows; the
  # removal is then given a nesting deeper than its recursion limit.
  code = (
      "import os\n"
      "os.mkdir('n')\n"
      "for i in range(60):\n"
      "  os.mkdir('m')\n"
      "  os.rename('n', 'm/n')\n"
      "  os.rename('m', 'n')\n"
      "print('nested')\n"
  )
  monkeypatch.setattr(python_tool.shutil, "rmtree", _recursion_error)
  assert run_python(code, SHORT, isolation="none") == "nested\n"
  assert made and not os.path.exists(made[0])


def _recursion_error(*args, **kwargs):
  raise RecursionError("maximum recursion depth exceeded")


# ------------------------------------------------ where the kernel allows no sandbox
@pytest.fixture
def no_user_namespaces(tmp_path, monkeypatch):
  """A bwrap that fails as bwrap does where the kernel refuses user namespaces."""
  fake = tmp_path / "bin" / "bwrap"
  fake.parent.mkdir()
  fake.write_text(
      "#!/bin/sh\necho 'bwrap: No permissions to create a new namespace, likely because the "
      "kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n"
  )
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
  kernel_isolation.problem.cache_clear()
  yield fake.parent
  kernel_isolation.problem.cache_clear()


def test_a_sandbox_that_cannot_see_python_names_that_not_the_kernel(tmp_path, monkeypatch):
  fake = tmp_path / "bin" / "bwrap"
  fake.parent.mkdir()
  fake.write_text(
      "#!/bin/sh\necho 'bwrap: execvp /opt/env/bin/python: No such file or directory' >&2\n"
      "exit 1\n"
  )
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
  kernel_isolation.problem.cache_clear()
  try:
    with pytest.raises(base.EnvError) as refusal:
      base.load("python_tool", {"isolation": "kernel"})
    line = str(refusal.value)
    assert "the sandbox cannot start Python at" in line and "execvp" in line, line
    assert "env.isolation=none" not in line and "kernel refuses" not in line
    assert not kernel_isolation.kernel_refuses()
  finally:
    kernel_isolation.problem.cache_clear()


def test_without_user_namespaces_the_tool_refuses_in_one_line_and_none_runs(no_user_namespaces):
  with pytest.raises(base.EnvError) as refusal:
    base.load("python_tool", {"isolation": "kernel"})
  line = str(refusal.value)
  assert "\n" not in line and line.startswith("env.isolation=kernel: ")
  assert "the kernel refuses a user namespace here" in line and "env.isolation=none" in line
  with pytest.raises(kernel_isolation.IsolationUnavailable):
    python_tool.run_python("print(1)")  # isolation="kernel", the default
  env = base.load("python_tool", {"isolation": "none"})
  assert env.isolation == "none" and run_python("print(6 * 7)", isolation="none") == "42\n"


def test_without_user_namespaces_a_command_stops_in_one_line(no_user_namespaces, tmp_path):
  transcript = tmp_path / "t.json"
  transcript.write_text('{"row": {"question": "1+1?", "answer": "2"}, "turns": ["2"]}')
  proc = cli.run(
      f"--transcript={transcript}",
      config="math_python_tool.py",
      module="april_jax.replay",
      devices=None,
      timeout=300,
  )  # its PATH (os.environ's, patched) finds the failing bwrap first
  assert proc.returncode == 2, proc.stderr[-2000:]
  (line,) = [l for l in proc.stderr.splitlines() if l.strip()]
  assert "the kernel refuses a user namespace here" in line and "env.isolation=none" in line
  assert "Traceback" not in proc.stderr
