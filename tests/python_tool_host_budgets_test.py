"""What one Python tool call can take from the host is bounded by the kernel alone.

Each attack runs with the audit hook off, as code that has passed it would (the hook is
a second layer inside the code's own interpreter): threads by the thousand, SysV shared
memory, semaphores and message queues, POSIX message queues and timers, aio contexts,
inotify instances, files made with no audit event (sqlite3), secret memory, sync. Each
is refused by the seccomp filter or bounded by the scratch folder's inode count, and
ordinary math still runs. The Python tool also starts from a virtual environment under
/tmp, and the hook's own objects are not reachable from the code's __main__.
"""

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from april_jax.envs import kernel_isolation
from april_jax.envs.python_tool import Limits, run_python

pytestmark = pytest.mark.skipif(
    kernel_isolation.kernel_refuses(),
    reason=f"the kernel refuses the sandbox here: {kernel_isolation.problem()}",
)

ROOT = Path(__file__).resolve().parents[1]
LIMITS = Limits(timeout_s=20.0, cpu_s=10)
# System call numbers the attacks call by hand (libc wraps none of them, or not all).
SYSCALLS = {
    "x86_64": {"clone": 56, "io_setup": 206, "sync": 162, "memfd_secret": 447},
    "aarch64": {"clone": 220, "io_setup": 0, "sync": 81, "memfd_secret": 447},
}.get(platform.machine())
PRELUDE = textwrap.dedent("""
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    def said(name, result):
        print(name, 'ok' if result >= 0 else errno.errorcode[ctypes.get_errno()])
    """)


def kernel_alone(code: str) -> str:
  return run_python(PRELUDE + textwrap.dedent(code), LIMITS, audit_hook=False)


def test_threads_are_refused_and_the_process_keeps_its_own_two():
  out = kernel_alone(f"""
      import _thread, threading, time
      threading.stack_size(65536)
      started = 0
      try:
          for _ in range(5000):
              _thread.start_new_thread(time.sleep, (5,))
              started += 1
      except RuntimeError as e:
          print('refused:', e)
      print('started', started)
      flags = 0x100 | 0x200 | 0x400 | 0x800 | 0x10000  # CLONE_VM|FS|FILES|SIGHAND|THREAD
      said('raw clone', libc.syscall({SYSCALLS["clone"]}, flags, 0, 0, 0, 0))
      print('tasks', len(os.listdir('/proc/self/task')))
      """)
  assert out.splitlines() == [
      "refused: can't start new thread",
      "started 0",
      "raw clone EPERM",
      "tasks 2",  # the runner's own thread and its lifeline watcher, started before
  ], out


def test_sysv_ipc_posix_queues_and_timers_are_refused():
  out = kernel_alone("""
      IPC_PRIVATE, IPC_CREAT = 0, 0o1000
      said('shmget', libc.shmget(IPC_PRIVATE, 1 << 28, IPC_CREAT | 0o600))
      said('semget', libc.semget(IPC_PRIVATE, 16, IPC_CREAT | 0o600))
      said('msgget', libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600))
      said('mq_open', libc.mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None))
      timer = ctypes.c_void_p()
      said('timer_create', libc.timer_create(0, None, ctypes.byref(timer)))
      """)
  assert out.splitlines() == [
      "shmget EPERM",
      "semget EPERM",
      "msgget EPERM",
      "mq_open EPERM",
      "timer_create EPERM",
  ], out


def test_host_wide_budgets_aio_inotify_secret_memory_and_sync_are_refused():
  out = kernel_alone(f"""
      context = ctypes.c_ulong(0)
      said('io_setup', libc.syscall({SYSCALLS["io_setup"]}, 65536, ctypes.byref(context)))
      said('inotify_init', libc.inotify_init())
      said('inotify_init1', libc.inotify_init1(0))
      said('memfd_secret', libc.syscall({SYSCALLS["memfd_secret"]}, 0))
      said('sync', libc.syscall({SYSCALLS["sync"]}))
      said('syncfs', libc.syncfs(1))
      """)
  assert out.splitlines() == [
      f"{name} EPERM"
      for name in ("io_setup", "inotify_init", "inotify_init1", "memfd_secret", "sync", "syncfs")
  ], out


def test_files_made_with_no_audit_event_are_bounded_by_the_scratch_inodes():
  out = kernel_alone("""
      import sqlite3
      made = 0
      try:
          for i in range(20000):
              db = sqlite3.connect(f'db{i}')
              db.execute('create table t(x)')
              db.close()
              made += 1
      except sqlite3.OperationalError as e:
          print('stopped:', e)
      print('made', made, 'files', len(os.listdir('.')))
      """)
  stopped, made = out.splitlines()
  assert stopped.startswith("stopped:"), out
  count = int(made.split()[1])
  assert 0 < count <= LIMITS.scratch_inodes and int(made.split()[3]) <= LIMITS.scratch_inodes


def test_the_hooks_objects_are_not_reachable_from_the_codes_main():
  code = (
      "import sys\n"
      "main = sys.modules['__main__']\n"
      "print(hasattr(main, 'REFUSED_PREFIXES'), hasattr(main, 'make_hook'), __name__)\n"
      "print([n for n, m in list(sys.modules.items()) if hasattr(m, 'REFUSED_PREFIXES')])\n"
      "x = 1\n"
      "print(main.x)\n"
  )
  assert run_python(code, LIMITS) == "False False __main__\n[]\n1\n"


@pytest.mark.parametrize("how", ["symlinks", "copies"])
def test_the_tool_runs_from_a_virtual_environment_under_tmp(tmp_path_factory, how):
  venv = Path(tmp_path_factory.mktemp(f"venv_{how}", numbered=True)) / ".venv"
  assert str(venv).startswith("/tmp/") or pytest.skip("the temporary folder is not under /tmp")
  subprocess.run(
      [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", f"--{how}", venv],
      check=True,
  )
  site = next(venv.glob("lib/python3*/site-packages"))
  (site / "april_jax_checkout.pth").write_text(str(ROOT) + "\n")  # the package, installed
  code = (
      "import sys\n"
      "from april_jax.envs import kernel_isolation\n"
      "from april_jax.envs.python_tool import run_python\n"
      "print(sys.prefix, kernel_isolation.problem())\n"
      "print(run_python('import numpy, sys; print(numpy.ones(3).sum(), sys.prefix)'), end='')\n"
      'print(run_python(\'open("x", "w").write("1"); print(open("x").read())\'), end=\'\')\n'
  )
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
  proc = subprocess.run(
      [venv / "bin" / "python", "-c", code], capture_output=True, text=True, env=env, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines() == [f"{venv} None", f"3.0 {venv}", "1"], proc.stdout


def test_every_thread_holds_the_filter_and_no_capability():
  # The lifeline thread was started before the capabilities were dropped and the filter
  # loaded, which are a thread's own: code that got into it could fork and mount.
  out = kernel_alone("""
      for task in sorted(os.listdir('/proc/self/task')):
          status = dict(line.split(':', 1) for line in open(f'/proc/self/task/{task}/status'))
          print(status['Seccomp'].strip(), status['CapEff'].strip(), status['CapPrm'].strip())
      """)
  assert out.splitlines() == ["2 0000000000000000 0000000000000000"] * 2, out


def test_ptys_and_open_file_description_locks_are_refused():
  out = kernel_alone("""
      try:
          os.open('/dev/ptmx', os.O_RDWR)
          print('a pty')
      except OSError as e:
          print('ptmx', errno.errorcode[e.errno])
      fd = os.open('/usr/lib/os-release' if os.path.exists('/usr/lib/os-release') else '.', os.O_RDONLY)
      lock = (ctypes.c_char * 32)()
      said('F_OFD_SETLK', libc.fcntl(fd, 37, lock))
      """)
  assert out.splitlines() == ["ptmx EACCES", "F_OFD_SETLK EPERM"], out


def test_the_hook_does_not_read_the_strings_its_module_holds():
  # The runner's globals are reachable through frames; the hook reads copies of its
  # strings, so rewriting the module's ("ctypes." -> "Xtypes.") in memory changes nothing.
  code = textwrap.dedent("""
      import sys
      ctypes = sys.modules['ctypes']
      runner = sys._getframe().f_back.f_globals
      s = next(p for p in runner['REFUSED_PREFIXES'] if p.startswith('ctypes'))
      x = ctypes.c_uint8(0)
      y = ctypes.c_uint64(0)
      base = id(x) + (ctypes.pointer(y)[-8] - id(y))
      ctypes.pointer(x)[id(s) + 48 - base] = ord('X')
      print(runner['REFUSED_PREFIXES'][1])
      ctypes.CDLL(None)
      """)
  out = run_python(code, LIMITS)
  assert out.splitlines()[0] == "Xtypes.", out  # the module's string was rewritten
  assert out.rstrip().endswith("PermissionError: ctypes.dlopen is not allowed here"), out
