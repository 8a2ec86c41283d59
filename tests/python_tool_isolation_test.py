"""The Python tool's kernel isolation holds against code that looks for a way out.

Every escape found against the audit-hook sandbox (readline, sqlite3, Tcl, fresh C modules
under a dotted name, the hook's own objects, a native library the code writes) is tried
again through `run_python`, with the audit hook on and with it off: the kernel's barrier
must hold alone. What the code would reach is set up for real: a stand-in for the trainer
(a process it would signal), a secret file, listeners on 127.0.0.1, ::1, a unix socket
and an abstract one. Where the kernel gives no user namespaces the tool refuses to start,
in one line (simulated with a bwrap that fails as the kernel would), and isolation=none
runs with the hook alone.
"""

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time

import pytest

from april_jax.envs import base, kernel_isolation, python_tool
from april_jax.envs.python_tool import Limits, PythonToolEnv, run_python

pytestmark = pytest.mark.skipif(
    kernel_isolation.kernel_refuses(),
    reason=f"the kernel refuses the sandbox here: {kernel_isolation.problem()}",
)

LIMITS = Limits(timeout_s=10.0, cpu_s=5)
SECRET = "the-trainers-secret-4711"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """What an escape would reach: a stand-in trainer, a secret, listeners of every kind."""
  tmp = tmp_path_factory.mktemp("world")
  secret = tmp / "secret.txt"
  secret.write_text(SECRET)
  import sqlite3  # pylint: disable=g-import-not-at-top

  db = sqlite3.connect(tmp / "secret.db")
  db.execute("create table t(x)")
  db.execute("insert into t values (?)", (SECRET,))
  db.commit()
  db.close()
  trainer = subprocess.Popen(
      [sys.executable, "-c", "import time; time.sleep(600)"],
      env={**os.environ, "TRAINER_TOKEN": SECRET},
  )
  listeners = {}
  tcp4 = socket.socket(socket.AF_INET)
  tcp4.bind(("127.0.0.1", 0))
  listeners["tcp4"] = tcp4
  try:
    tcp6 = socket.socket(socket.AF_INET6)
    tcp6.bind(("::1", 0))
    listeners["tcp6"] = tcp6
  except OSError:
    pass
  unix = socket.socket(socket.AF_UNIX)
  unix.bind(str(tmp / "trainer.sock"))
  listeners["unix"] = unix
  abstract = socket.socket(socket.AF_UNIX)
  abstract.bind(f"\0april_jax_test_{os.getpid()}")
  listeners["abstract"] = abstract
  for listener in listeners.values():
    listener.listen(8)
    listener.setblocking(False)
  yield {
      "before": set(python_tool.process_tree.descendants()),  # the trainer, and others'
      "tmp": tmp,
      "secret": str(secret),
      "db": str(tmp / "secret.db"),
      "trainer": trainer.pid,
      "port4": tcp4.getsockname()[1],
      "port6": listeners["tcp6"].getsockname()[1] if "tcp6" in listeners else 0,
      "unix": str(tmp / "trainer.sock"),
      "abstract": f"\0april_jax_test_{os.getpid()}",
      "listeners": listeners,
      "purelib": sysconfig.get_paths()["purelib"],
  }
  trainer.kill()
  trainer.wait()
  for listener in listeners.values():
    listener.close()


def _state(pid: int) -> str:
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rpartition(")")[2].split()[0]


def _nothing_reached(world) -> None:
  """The trainer runs, no listener was connected to, no file appeared beside the secret."""
  assert _state(world["trainer"]) in ("S", "R"), _state(world["trainer"])
  for name, listener in world["listeners"].items():
    with pytest.raises(BlockingIOError):
      listener.accept()
      pytest.fail(f"the {name} listener was reached")
  assert sorted(p.name for p in world["tmp"].iterdir()) == [
      "secret.db",
      "secret.txt",
      "trainer.sock",
  ]


ESCAPES = {
    # readline's C code raises no audit event.
    "readline reads any file": """
        import readline
        readline.read_history_file({secret!r})
        print("ESC" "APED", readline.get_history_item(1))
    """,
    "readline writes a .pth into site-packages": """
        import readline
        readline.add_history("import os; open({tmp!r} + '/pth_ran', 'w')")
        readline.write_history_file({purelib!r} + "/april_escape.pth")
        print("ESC" "APED: wrote the .pth")
    """,
    "readline writes beside the secret": """
        import readline
        readline.add_history("x")
        readline.write_history_file({tmp!r} + "/written")
        print("ESC" "APED: wrote a file")
    """,
    "sqlite3 reads a database anywhere": """
        import sqlite3
        print("ESC" "APED", sqlite3.connect({db!r}).execute("select x from t").fetchall())
    """,
    "sqlite3 creates a database anywhere": """
        import sqlite3
        sqlite3.connect({tmp!r} + "/created.db").execute("create table t(x)")
        print("ESC" "APED: created a database")
    """,
    "Tcl runs a command": """
        import tkinter
        print("ESC" "APED", tkinter.Tcl().eval("exec kill -STOP {trainer}"))
    """,
    "Tcl reads a file": """
        import tkinter
        print("ESC" "APED", tkinter.Tcl().eval("set f [open {{{secret}}}]; read $f"))
    """,
    "Tcl reaches the network": """
        import tkinter
        print("ESC" "APED", tkinter.Tcl().eval("socket 127.0.0.1 {port4}"))
    """,
    "a fresh _posixsubprocess runs a program": """
        import _imp, importlib.machinery, importlib.util, subprocess
        origin = importlib.util.find_spec("_posixsubprocess").origin
        fresh = _imp.create_dynamic(importlib.machinery.ModuleSpec("x._posixsubprocess", None, origin=origin))
        subprocess._posixsubprocess = fresh
        subprocess.run(["/bin/kill", "-STOP", "{trainer}"])
        print("ESC" "APED: ran a program")
    """,
    "a fresh _socket connects": """
        import _imp, importlib.machinery, importlib.util
        origin = importlib.util.find_spec("_socket").origin
        fresh = _imp.create_dynamic(importlib.machinery.ModuleSpec("x._socket", None, origin=origin))
        s = fresh.socket(2, 1)
        s.connect(("127.0.0.1", {port4}))
        print("ESC" "APED: connected")
    """,
    # Under the hook's refusal, or in the sandbox's own /dev/shm: never the host's.
    "a fresh _posixshmem makes shared memory": """
        import _imp, importlib.machinery, importlib.util, os
        origin = importlib.util.find_spec("_posixshmem").origin
        fresh = _imp.create_dynamic(importlib.machinery.ModuleSpec("x._posixshmem", None, origin=origin))
        fd = fresh.shm_open("/april_escape_{trainer}", os.O_CREAT | os.O_RDWR, 0o600)
        print("made", fd)
    """,
    "a fresh posix signals the trainer": """
        import _imp, importlib.machinery
        fresh = _imp.create_builtin(importlib.machinery.ModuleSpec("posix", None))
        fresh.kill({trainer}, 19)
        print("ESC" "APED: signalled")
    """,
    "the hook's own objects switched off": """
        import gc, sys
        try:
            open({secret!r})
        except PermissionError as e:
            tb = e.__traceback__
            while tb is not None:
                for value in list(tb.tb_frame.f_locals.values()):
                    cells = getattr(value, "__closure__", None) or ()
                    if callable(value) and hasattr(value, "__code__"):
                        value.__code__ = (lambda *a, **k: None).__code__
                tb = tb.tb_next
        print("ESC" "APED", open({secret!r}).read())
    """,
    "the trainer's environment read": """
        print("ESC" "APED", open("/proc/{trainer}/environ").read())
    """,
    "the trainer killed": """
        import os, signal
        os.kill({trainer}, signal.SIGKILL)
        print("ESC" "APED: killed")
    """,
    "127.0.0.1 reached": """
        import socket
        socket.create_connection(("127.0.0.1", {port4}), timeout=2)
        print("ESC" "APED: connected")
    """,
    "::1 reached": """
        import socket
        socket.create_connection(("::1", {port6}), timeout=2)
        print("ESC" "APED: connected")
    """,
    "a unix socket reached": """
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.connect({unix!r})
        print("ESC" "APED: connected")
    """,
    "an abstract unix socket reached": """
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.connect({abstract!r})
        print("ESC" "APED: connected")
    """,
    "sleepers in sessions of their own": """
        import os, subprocess, sys
        for _ in range(5):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        print("ESC" "APED: started sleepers")
    """,
}


# Escapes whose first move succeeds inside the sandbox, on what is the sandbox's own.
HARMLESS_INSIDE = {"a fresh _posixshmem makes shared memory"}


@pytest.mark.parametrize("hook", [True, False], ids=["with_hook", "kernel_alone"])
@pytest.mark.parametrize("escape", sorted(ESCAPES))
def test_an_escape_fails_and_reaches_nothing(world, escape, hook):
  code = textwrap.dedent(ESCAPES[escape]).format(**world)
  out = run_python(code, LIMITS, isolation="kernel", audit_hook=hook)
  assert "ESCAPED" not in out and SECRET not in out, out
  if escape not in HARMLESS_INSIDE:
    assert "error" in out.lower(), out  # refused, with a message
  _nothing_reached(world)
  assert not os.path.exists(os.path.join(world["purelib"], "april_escape.pth"))
  assert not os.path.exists(f"/dev/shm/april_escape_{world['trainer']}")
  assert set(python_tool.process_tree.descendants()) <= world["before"]  # nothing survives


def test_a_native_library_the_code_writes_and_imports_reaches_nothing(world, tmp_path):
  if shutil.which("gcc") is None:
    pytest.skip("no gcc to build the native library")
  source = tmp_path / "escape.c"
  source.write_text(textwrap.dedent("""
          #include <fcntl.h>
          #include <signal.h>
          #include <stdio.h>
          #include <unistd.h>
          #include <arpa/inet.h>
          #include <sys/socket.h>
          __attribute__((constructor)) static void escape(void) {
            char buffer[256] = {0};
            int fd = open("%(secret)s", O_RDONLY);
            if (fd >= 0 && read(fd, buffer, sizeof buffer - 1) > 0) printf("ESCAPED %%s\\n", buffer);
            if (kill(%(trainer)d, SIGSTOP) == 0) printf("ESCAPED: stopped the trainer\\n");
            int s = socket(AF_INET, SOCK_STREAM, 0);
            struct sockaddr_in a = {0};
            a.sin_family = AF_INET; a.sin_port = htons(%(port4)d);
            a.sin_addr.s_addr = htonl(0x7f000001);
            if (s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0) printf("ESCAPED: connected\\n");
            if (fork() == 0) { execl("/bin/sh", "sh", "-c", "kill -STOP %(trainer)d", (char *)0); _exit(0); }
            printf("native code ran\\n");
            fflush(stdout);
          }
          """) % world)
  library = tmp_path / "escape.so"
  subprocess.run(["gcc", "-shared", "-fPIC", "-o", library, source], check=True)
  suffix = sysconfig.get_config_var("EXT_SUFFIX")
  code = (
      "import base64, sys\n"
      f"open('escape{suffix}', 'wb').write(base64.b64decode({__import__('base64').b64encode(library.read_bytes())!r}))\n"
      "sys.path.insert(0, '.')\n"
      "import escape\n"
  )
  for hook in (False, True):
    out = run_python(code, LIMITS, isolation="kernel", audit_hook=hook)
    assert "ESCAPED" not in out and SECRET not in out, out
    if not hook:
      assert "native code ran" in out, out  # it did run: the kernel is what stopped it
  time.sleep(0.5)
  _nothing_reached(world)


def test_ordinary_math_code_runs_in_the_sandbox():
  code = (
      "from fractions import Fraction\n"
      "import numpy as np, sympy\n"
      "print(Fraction(1, 3) + Fraction(1, 6))\n"
      "print(np.linalg.det(np.array([[2.0, 1.0], [1.0, 3.0]])).round(6))\n"
      "print(sympy.factorint(2**32 + 1))\n"
  )
  assert run_python(code) == "1/2\n5.0\n{641: 1, 6700417: 1}\n"
  # Threads are refused (each is a task of the host's), in Python's own words.
  thread = "import threading\nthreading.Thread(target=print).start()\n"
  assert run_python(thread).endswith("RuntimeError: can't start new thread"), run_python(thread)


def test_the_sandbox_sees_no_process_and_no_file_of_the_host():
  code = (
      "import os\n"
      "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
      "print(sorted(os.listdir('/')))\n"
      "print(os.getuid(), os.path.exists('/etc/passwd'))\n"
  )
  pids, top, who = run_python(code, audit_hook=False).splitlines()  # the kernel's view
  assert pids == "['1', '2']"  # bwrap's init and the child itself
  # The binds: the system's libraries, Python's installation (wherever it lives) and the
  # sandbox's own dev, proc and tmp; nothing of the host's /etc but the loader's files.
  python_top = {sys.base_prefix.split("/")[1], sys.prefix.split("/")[1]}
  assert set(eval(top)) <= {"dev", "etc", "lib", "lib32", "lib64", "proc", "tmp", "usr"} | python_top  # pylint: disable=eval-used
  assert who == "65534 False"  # nobody, and no /etc/passwd


def test_under_isolation_none_the_seccomp_filter_still_refuses_processes_and_sockets():
  for code in ("import os\nos.fork()", "import socket\nsocket.socket()"):
    out = run_python(code, LIMITS, isolation="none", audit_hook=False)
    assert out.rstrip().endswith("PermissionError: [Errno 1] Operation not permitted"), out


def test_the_tool_bench_times_both_sides_on_the_same_calls(capsys):
  from april_jax.benchmarks import tool_bench  # pylint: disable=g-import-not-at-top

  result = tool_bench.run(repeats=1)
  for side in ("kernel", "none"):
    assert set(result[side]["seconds_per_call"]) == set(tool_bench.CODES)
    assert result[side]["calls_per_s"] > 0
  table = capsys.readouterr().out
  assert "calls/s" in table and "kernel" in table and "none" in table


# ------------------------------------------------------------- nothing outlives a call
def _processes_with(marker: str) -> list[int]:
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          found.append(int(name))
    except OSError:
      pass
  return found


def _wait_until(predicate, seconds: float = 30.0) -> bool:
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.1)
  return predicate()


CALLER = """
import signal, sys, threading
from april_jax.runtime import interrupt
from april_jax.envs.python_tool import Limits, run_python
interrupt.install("done")
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
limits = Limits(timeout_s=120, cpu_s=120, scratch_mb={scratch_mb})
calls = [threading.Thread(target=run_python, args=("import time\\ntime.sleep(120)", limits), daemon=True) for _ in range(2)]
for call in calls:
  call.start()
print("calling", flush=True)
for call in calls:
  call.join()
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT", "SIGTERM"])
def test_no_sandbox_outlives_its_caller_killed_interrupted_or_stopped(how):
  import signal  # pylint: disable=g-import-not-at-top

  scratch_mb = 70 + ["SIGKILL", "SIGINT", "SIGTERM"].index(how)
  marker = f'"mb": {scratch_mb},'  # in this test's sandboxes' command lines (the settings)
  caller = subprocess.Popen(
      [sys.executable, "-c", CALLER.format(scratch_mb=scratch_mb)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  try:
    assert caller.stdout.readline() == "calling\n"
    # Two calls, each bwrap and the sandbox's init (bwrap too).
    assert _wait_until(lambda: len(_processes_with(marker)) >= 4), "the sandboxes did not start"
    caller.send_signal(getattr(signal, how))
    caller.wait(timeout=60)
    assert _wait_until(lambda: not _processes_with(marker), 10.0), _processes_with(marker)
    assert caller.returncode == {"SIGKILL": -9, "SIGINT": 130, "SIGTERM": 143}[how]
  finally:
    caller.kill()
    caller.wait()


@pytest.mark.parametrize("hook", [True, False], ids=["with_hook", "kernel_alone"])
def test_a_flood_of_folders_leaves_nothing_on_the_host_and_returns(hook):
  code = (
      "import os\n"
      "for i in range(20000):\n"
      "  os.mkdir('d')\n"
      "  os.chdir('d')\n"
      "print('deep')\n"
  )
  before = set(os.listdir("/tmp"))
  out = run_python(code, LIMITS, audit_hook=hook)
  if hook:
    assert "os.chdir is not allowed here" in out, out
  else:  # the scratch's inode bound stops it
    assert out.endswith("OSError: [Errno 28] No space left on device: 'd'"), out
  assert set(os.listdir("/tmp")) - before == set()


# ------------------------------------------------- what the second attack found, closed
def test_only_the_scratch_folder_is_writable_and_it_is_bounded():
  code = (
      "import os\n"
      "for path in ('/proc/1/mem', '/dev/shm/x', '/x', '/etc/x'):\n"
      "  try:\n"
      "    open(path, 'r+b' if path.startswith('/proc') else 'wb').write(b'1')\n"
      "    print('WROTE', path)\n"
      "  except OSError as e:\n"
      "    print(path, e.errno)\n"
      "try:\n"
      "  with open('/tmp/big', 'wb') as f:\n"
      "    for _ in range(100):\n"
      "      f.write(b'0' * (1 << 20))\n"
      "except OSError as e:\n"
      "  print('scratch full', e.errno, os.path.getsize('/tmp/big') >> 20)\n"
  )
  limits = Limits(timeout_s=10.0, max_file_mb=200, scratch_mb=16)
  out = run_python(code, limits, audit_hook=False)  # the kernel alone
  assert "WROTE" not in out, out
  assert out.splitlines()[:4] == ["/proc/1/mem 30", "/dev/shm/x 30", "/x 30", "/etc/x 30"]
  assert out.splitlines()[4] in ("scratch full 28 15", "scratch full 28 16"), out  # ENOSPC


@pytest.mark.parametrize("isolation", ["kernel", "none"])
def test_fallocate_past_the_file_size_limit_and_signals_to_others_are_refused(world, isolation):
  """Through the seccomp filter, which holds under isolation="none" too."""
  code = (
      "import ctypes, os, signal\n"
      "libc = ctypes.CDLL(None, use_errno=True)\n"
      "print('fallocate', libc.fallocate(1, 1, 1 << 30, 1 << 30), ctypes.get_errno())\n"
      "tgkill = 234  # x86-64; 131 on aarch64\n"
      "import platform\n"
      "tgkill = 131 if platform.machine() == 'aarch64' else 234\n"
      f"print('tgkill', libc.syscall(tgkill, {world['trainer']}, {world['trainer']}, 19), ctypes.get_errno())\n"
      f"print('kill', libc.kill({world['trainer']}, 19), ctypes.get_errno())\n"
      "import fcntl\n"
      "r, w = os.pipe()\n"
      "try:\n"
      f"  fcntl.fcntl(r, fcntl.F_SETOWN, {world['trainer']})  # SIGIO to it on I/O\n"
      "except OSError as e:\n"
      "  print('F_SETOWN', e.errno)\n"
      "import resource\n"
      "try:\n"
      f"  resource.prlimit({world['trainer']}, resource.RLIMIT_CPU, (0, 0))  # kills it\n"
      "except OSError as e:\n"
      "  print('prlimit', e.errno)\n"
      "try:\n"
      f"  os.setpriority(os.PRIO_PROCESS, {world['trainer']}, 19)\n"
      "except OSError as e:\n"
      "  print('setpriority', e.errno)\n"
      "resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))  # its own: allowed\n"
      "signal.raise_signal(signal.SIGUSR1)  # to itself: allowed\n"
  )
  out = run_python(code, LIMITS, isolation=isolation, audit_hook=False)
  lines = out.splitlines()
  assert lines[0] == "fallocate -1 1", out  # EPERM
  assert lines[1] in ("tgkill -1 1", "tgkill -1 3"), out  # EPERM (ESRCH: not in its pid namespace)
  assert lines[2] in ("kill -1 1", "kill -1 3"), out
  assert lines[3] == "F_SETOWN 1", out
  assert lines[4:6] == ["prlimit 1", "setpriority 1"], out
  assert lines[6] == "error: the process was killed by SIGUSR1", out
  _nothing_reached(world)


def test_under_isolation_none_the_hook_cannot_be_switched_off_through_its_frames(world):
  code = textwrap.dedent(ESCAPES["the hook's own objects switched off"]).format(**world)
  out = run_python(code, LIMITS, isolation="none")
  assert SECRET not in out and "ESCAPED" not in out, out
  assert "PermissionError: reading a frame (tb_frame) is not allowed here" in out, out
  code = "def f():\n  pass\nf.__code__ = (lambda: 1).__code__"
  out = run_python(code, LIMITS, isolation="none")
  assert "PermissionError: setting a function's __code__ is not allowed here" in out, out
