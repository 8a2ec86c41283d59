"""The child side of the Python tool (python_tool.py): it runs the model's code.

python_tool.run_python starts a fresh interpreter with this file's source,
`python -I -c <source> <settings JSON>`, in its working folder (under kernel isolation,
kernel_isolation.py, inside a sandbox of namespaces). The child reads the code from its
stdin, then, before any of it runs:

  * under kernel isolation, makes its scratch folder (`make_scratch`): a mount namespace
    of its own, a tmpfs bounded in bytes and in inodes (files and folders, however they
    are made: sqlite3 makes them with no audit event) at the working folder, Python's
    folders that lay under it put back read-only, then every capability dropped (the
    sandbox gave it CAP_SYS_ADMIN for this alone). A failure ends the child (status 4);
  * starts a thread that ends the process when its caller's end of a pipe closes (the
    caller died, whatever stood between them): the one thread it ever starts, after the
    capabilities are gone (a thread's are its own);
  * limits itself (setrlimit, soft and hard): address space, CPU seconds, the size of any
    file it writes (its stdout included), open files, locked memory, POSIX message
    queues, no new processes, no core dumps;
  * loads a seccomp filter (libseccomp, through ctypes) that refuses, with EPERM, the
    system calls math code never needs: new processes, threads and programs (fork, vfork,
    clone of any kind, execve; clone3 answers ENOSYS), sockets of every family, ptrace
    and process_vm_*, kill and signals to any other process, another process's limits,
    affinity, priority or scheduling, fallocate (which grows a file's blocks past the
    file size limit), mounts and namespaces, bpf, keyrings, io_uring, perf events,
    userfaultfd, kernel modules, open file description locks and the like, and what
    takes from budgets the whole host shares: SysV shared memory, semaphores and message queues, POSIX message queues, aio
    contexts (io_setup), inotify instances, POSIX timers, memfd_secret, sync and syncfs.
    So one call adds a fixed number of tasks to the host (bwrap, its init, this process
    and its one thread), whatever the code does. It binds every thread of the process
    (TSYNC) and every later line, C code included. Under `seccomp: "required"` a filter that cannot load ends
    the child (status 3);
  * takes away what math code has no use for and no audit event covers: fork_exec of
    `_posixsubprocess`, mkfifo, mknod, memfd_create, pidfd_open and pidfd_send_signal;
  * installs an audit hook (sys.addaudithook, which cannot be removed) that refuses, with
    a PermissionError naming the event: sockets, new processes (subprocess, os.system,
    os.exec*, os.fork*, os.posix_spawn*), ctypes, signals to other processes, changing
    directory, links, chmod/chown, rlimits, tracing, gc's object lists, subinterpreters,
    a fresh import of the modules disarmed here; reading a frame (tb_frame, gi_frame, ...) anywhere but in _frame_entries,
    and replacing a function's code, so that the hook's own objects are harder to reach
    (not out of reach: code that corrupts its own interpreter's memory, through numpy's
    raw buffers say, gets past any hook, which is why the kernel is the barrier); any write, remove, rename or mkdir outside the working
    folder, or more than MAX_FILES_WRITTEN files and folders made or written; any read
    outside it but Python's own stdlib and site-packages; opening a directory outside it,
    or a device other than /dev/null, /dev/zero and /dev/urandom.

It then runs the code as `__main__` (a fresh module in sys.modules: this file's own
module, and the hook's objects with it, are not reachable from there) and, like a
notebook, prints the repr of a last expression when nothing else was printed. An exception becomes the last lines of its
traceback on stderr (the runner's own frames left out) and exit status 1; a MemoryError
one line naming the memory limit.

The hook checks paths with functions bound before the model's code runs (posix.lstat,
posix.readlink, ...), never with os.path or builtins the code could rebind, and it calls
no method of an argument that is not a plain str, bytes or int, so no model code runs
inside the hook. This file imports nothing of the package: it runs alone.
"""

import _stat
import _thread
import ast
import builtins
import errno
import io

try:  # the seccomp filter loads through it; a Python built without libffi has none
  import ctypes
except ImportError:
  ctypes = None
import itertools
import json
import linecache
import os
import posix
import resource
import signal
import sys
import traceback
import types

CODE_FILENAME = "<code>"  # the model's code, as tracebacks name it
TRACEBACK_LINES = 20  # the last lines of a traceback kept
LINE_CHARS = 300  # a traceback line longer than this is cut
MAX_OPEN_FILES = 64
MAX_FILES_WRITTEN = 64  # opens for writing, each file at most the file size limit
READABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
WRITABLE_DEVICES = ("/dev/null",)

REFUSED_EVENTS = frozenset({
    "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "os.chdir", "os.link",
    "os.symlink", "os.chmod", "os.chown", "os.chflags", "os.lchflags", "os.setxattr",
    "os.removexattr", "resource.setrlimit", "resource.prlimit", "sys.settrace",
    "sys.setprofile", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "cpython.PyInterpreterState_New",
})  # fmt: skip
REFUSED_PREFIXES = (
    "socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
)  # fmt: skip
# Modules loaded (and disarmed) before the hook: a fresh import of one would undo that.
REFUSED_IMPORTS = frozenset({
    "os", "posix", "signal", "_signal", "_posixsubprocess", "ctypes", "_ctypes", "resource",
    "_posixshmem", "gc",
})  # fmt: skip
REFUSED_IMPORT_PREFIXES = ("_test", "_xx")  # CPython's test modules and subinterpreters
# Events that change the file system: (positions of paths, positions of dir_fd).
CHANGES = {
    "os.remove": ((0,), (1,)),
    "os.rmdir": ((0,), (1,)),
    "os.mkdir": ((0,), (2,)),
    "os.rename": ((0, 1), (2, 3)),
    "os.utime": ((0,), (3,)),
    "os.truncate": ((0,), ()),
}
LISTINGS = ("os.listdir", "os.scandir")
# What the seccomp filter refuses with EPERM (names this kernel does not know are skipped).
REFUSED_SYSCALLS = (
    "fork", "vfork", "execve", "execveat", "socket", "socketpair", "ptrace",
    "process_vm_readv", "process_vm_writev", "process_madvise", "kill", "tkill",
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "kcmp", "mount", "umount2",
    "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "bpf", "keyctl", "add_key",
    "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "reboot", "swapon", "swapoff", "syslog", "acct",
    "quotactl", "open_by_handle_at", "name_to_handle_at", "mknod", "mknodat",
    "memfd_create", "fanotify_init", "lookup_dcookie", "sethostname", "setdomainname",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "ioperm", "iopl",
    "vhangup", "personality", "uselib", "nfsservctl", "fallocate", "process_mrelease",
    "setpriority", "clone",
    # Host-wide budgets: SysV IPC (and the multiplexer some ABIs have), POSIX message
    # queues, aio contexts, inotify instances, POSIX timers, secret memory, sync.
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl", "ipc", "mq_open", "mq_unlink", "mq_timedsend",
    "mq_timedreceive", "mq_notify", "mq_getsetattr", "io_setup", "io_destroy", "io_submit",
    "io_cancel", "io_getevents", "io_pgetevents", "inotify_init", "inotify_init1",
    "inotify_add_watch", "timer_create", "memfd_secret", "sync", "syncfs",
)  # fmt: skip
SIGNAL_OWNER_FCNTLS = (8, 10, 15)  # F_SETOWN, F_SETSIG, F_SETOWN_EX
# Open file description locks: held by a mapping after close, on files of the host's
# (the read-only binds), past the open-files limit; sqlite3 uses F_SETLK, not these.
OFD_LOCK_FCNTLS = (37, 38)  # F_OFD_SETLK, F_OFD_SETLKW
# Refused unless their first argument is 0, this process (prlimit64 could set another
# process's CPU limit to zero, which kills it).
SELF_ONLY_BY_PID = (
    "prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
)  # fmt: skip
# Refused unless their first argument is this process: signals to another process.
SELF_ONLY_SYSCALLS = ("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
SECCOMP_FAILED_EXIT = 3
SCRATCH_FAILED_EXIT = 4
# make_scratch's system calls: a mount namespace, a tmpfs, binds cloned and put back
# (open_tree and move_mount have these numbers on every architecture).
CLONE_NEWNS, MS_NOSUID, MS_NODEV = 0x00020000, 0x2, 0x4
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
AT_FDCWD, OPEN_TREE_CLONE, AT_RECURSIVE, MOVE_MOUNT_F_EMPTY_PATH = -100, 1, 0x8000, 4
LINUX_CAPABILITY_VERSION_3, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 0x20080522, 47, 4
# Frames (and through them the hook's own objects) are read by format_error's code alone;
# functions' code is never replaced.
FRAME_READS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
CODE_WRITES = frozenset({"__code__"})
RUNNER_FILENAME = "<string>"  # this file's, run with -c
SOURCE_BYTES = 1 << 20  # of a file a traceback line is read from
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def limit_resources(settings: dict) -> None:
  """The limits as soft and hard limits (a CPU second more for the hard one, so SIGXCPU
  says why); none above a hard limit already set."""
  mb = 1 << 20
  cpu_s = max(1, int(settings["cpu_s"]))
  for which, soft, hard in (
      (resource.RLIMIT_AS, settings["memory_mb"] * mb, settings["memory_mb"] * mb),
      (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
      (resource.RLIMIT_FSIZE, settings["max_file_mb"] * mb, settings["max_file_mb"] * mb),
      (resource.RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
      (resource.RLIMIT_NPROC, 0, 0),
      # 1, not 0: a core pattern that pipes to a helper (apport, systemd-coredump) is
      # skipped only at 1; a dump of 1 byte is none.
      (resource.RLIMIT_CORE, 1, 1),
      (resource.RLIMIT_MEMLOCK, 0, 0),
      (resource.RLIMIT_MSGQUEUE, 0, 0),
  ):
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
      soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (int(soft), int(hard)))
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead


class _ArgCompare(ctypes.Structure if ctypes else object):
  """libseccomp's struct scmp_arg_cmp."""

  _fields_ = [
      ("arg", ctypes.c_uint),
      ("op", ctypes.c_int),
      ("datum_a", ctypes.c_uint64),
      ("datum_b", ctypes.c_uint64),
  ] if ctypes else []  # fmt: skip


def confine_syscalls() -> str | None:
  """Loads the seccomp filter REFUSED_SYSCALLS names (clone3 as ENOSYS); None when it
  holds, else why it could not be loaded."""
  if ctypes is None:
    return "ctypes is missing"
  try:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
  except OSError as e:
    return f"libseccomp.so.2: {e}"
  allow, einval_errno = 0x7FFF0000, 0x00050000  # SCMP_ACT_ALLOW, SCMP_ACT_ERRNO(0)
  lib.seccomp_init.restype = ctypes.c_void_p
  lib.seccomp_init.argtypes = [ctypes.c_uint32]
  lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
  lib.seccomp_rule_add_array.argtypes = [
      ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
      ctypes.POINTER(_ArgCompare),
  ]  # fmt: skip
  lib.seccomp_load.argtypes = [ctypes.c_void_p]
  context = lib.seccomp_init(allow)
  if not context:
    return "seccomp_init failed"
  eperm, enosys = einval_errno | errno.EPERM, einval_errno | errno.ENOSYS

  def refuse(name: str, action: int, *compare: _ArgCompare) -> bool:
    number = lib.seccomp_syscall_resolve_name(name.encode())
    if number < 0:  # __NR_SCMP_ERROR: not a system call of this kernel
      return True
    array = (_ArgCompare * len(compare))(*compare) if compare else None
    return lib.seccomp_rule_add_array(context, action, number, len(compare), array) == 0

  not_equal, equal = 1, 4  # SCMP_CMP_NE, SCMP_CMP_EQ
  rules = [refuse(name, eperm) for name in REFUSED_SYSCALLS]
  me = os.getpid()
  rules += [refuse(name, eperm, _ArgCompare(0, not_equal, me, 0)) for name in SELF_ONLY_SYSCALLS]
  # Limits, affinity and scheduling of any process but itself named as pid 0 (a rule
  # compares an argument once, so its own pid given explicitly is refused too).
  other = _ArgCompare(0, not_equal, 0, 0)
  rules += [refuse(name, eperm, other) for name in SELF_ONLY_BY_PID]
  # fcntl's signal-on-I/O owner: a way to signal any process without kill.
  fcntls = SIGNAL_OWNER_FCNTLS + OFD_LOCK_FCNTLS
  rules += [refuse("fcntl", eperm, _ArgCompare(1, equal, cmd, 0)) for cmd in fcntls]
  rules.append(refuse("clone3", enosys))
  if not all(rules):
    return "a seccomp rule could not be added"
  # A system call of another ABI (x32, int 0x80) ends the whole process, not one thread.
  lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
  if lib.seccomp_attr_set(context, 2, 0x80000000) != 0:  # ACT_BADARCH, ACT_KILL_PROCESS
    return "seccomp's bad-architecture action could not be set"
  # Every thread of the process, the lifeline's included, gets the filter (TSYNC).
  if lib.seccomp_attr_set(context, 4, 1) != 0:  # SCMP_FLTATR_CTL_TSYNC
    return "seccomp's thread synchronisation could not be set"
  if lib.seccomp_load(context) != 0:
    return f"seccomp_load failed (errno {ctypes.get_errno()})"
  return None


class _CapHeader(ctypes.Structure if ctypes else object):
  """struct __user_cap_header_struct."""

  _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)] if ctypes else []


class _CapData(ctypes.Structure if ctypes else object):
  """struct __user_cap_data_struct (two of them: version 3's 64 bits)."""

  _fields_ = [
      ("effective", ctypes.c_uint32),
      ("permitted", ctypes.c_uint32),
      ("inheritable", ctypes.c_uint32),
  ] if ctypes else []  # fmt: skip


def drop_capabilities(libc) -> str | None:
  """Every capability gone, ambient, effective, permitted and inheritable (no way back:
  the bounding set, which only limits what an execve could gain, may keep
  CAP_SYS_ADMIN, and execve is refused); None when /proc says so, else what failed."""
  libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
  header, data = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
  if libc.capset(ctypes.byref(header), data) != 0:
    return f"capset: {os.strerror(ctypes.get_errno())}"
  with open("/proc/self/status", encoding="ascii") as f:
    held = [
        line.strip()
        for line in f
        if line.startswith(("CapInh", "CapPrm", "CapEff", "CapAmb")) and line.split()[1].strip("0")
    ]
  return f"capabilities still held: {held}" if held else None


def make_scratch(spec: dict) -> str | None:
  """The working folder under kernel isolation (kernel_isolation.Scratch): a mount
  namespace of its own; binds under the folder cloned; a tmpfs of spec["mb"] MB and
  spec["inodes"] inodes mounted there; the binds put back (read-only, as they were) and
  the links made again; the folder made current; every capability dropped. None when all
  of it holds, else what failed."""
  if ctypes is None:
    return "ctypes is missing"
  libc = ctypes.CDLL(None, use_errno=True)
  failed = lambda what: f"{what}: {os.strerror(ctypes.get_errno())}"
  if libc.unshare(CLONE_NEWNS) != 0:
    return failed("unshare(CLONE_NEWNS)")
  clones = []
  for path in spec["mounts"]:
    flags = OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC
    fd = libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), flags)
    if fd < 0:
      return failed(f"open_tree {path}")
    clones.append((path, fd))
  folder, options = spec["path"], f"size={spec['mb']}m,nr_inodes={spec['inodes']},mode=0700"
  if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()):
    return failed(f"mount a tmpfs at {folder}")
  for path, fd in clones:
    os.makedirs(path, exist_ok=True)
    moved = libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, path.encode(), MOVE_MOUNT_F_EMPTY_PATH)
    if moved != 0:
      return failed(f"move_mount {path}")
    os.close(fd)
  for target, path in spec["links"]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(target, path)
  os.chdir(folder)
  return drop_capabilities(libc)


def die_with_parent() -> None:
  """The kernel kills this process when the one that started it ends: bwrap's init, or
  under isolation="none" the caller (unshare execs this in its place)."""
  if ctypes is None:
    return
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def end_with_caller(lifeline: int | None) -> None:
  """A thread that ends this process when the caller's end of the pipe `lifeline` closes:
  the call is over, or the caller died, however the processes between them were started
  or killed."""
  if lifeline is None:
    return
  read, leave = os.read, os._exit

  def watch():
    try:
      while read(lifeline, 1):
        pass
    except OSError:
      pass
    leave(1)

  _thread.start_new_thread(watch, ())


def _refused(name: str):
  def refuse(*args, **kwargs):
    raise PermissionError(f"{name} is not allowed here")

  return refuse


def disarm_modules() -> None:
  """Loads the modules whose import the hook would refuse or that reach past it, and
  takes away what no audit event covers."""
  import _posixsubprocess  # pylint: disable=g-import-not-at-top
  import _signal  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top,unused-import

  _posixsubprocess.fork_exec = _refused("_posixsubprocess.fork_exec")
  for module, names in (
      (os, ("mkfifo", "mknod", "pidfd_open", "memfd_create")),
      (posix, ("mkfifo", "mknod", "pidfd_open", "memfd_create")),
      (signal, ("pidfd_send_signal",)),
      (_signal, ("pidfd_send_signal",)),
  ):
    for name in names:
      if hasattr(module, name):
        delattr(module, name)


def python_roots() -> tuple[str, ...]:
  """The folders of sys.path inside Python's own prefixes (stdlib, lib-dynload,
  site-packages): the code may read there. sys.path keeps only these."""
  prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
  prefixes |= {os.path.realpath(sys.base_exec_prefix)}
  roots = []
  for entry in sys.path:
    real = os.path.realpath(entry) if entry else ""
    if real and any(real == p or real.startswith(p.rstrip("/") + "/") for p in prefixes):
      roots.append(real)
  sys.path[:] = roots
  return tuple(roots)


def _path_tools():
  """text (a path argument as a str), resolve (os.path.realpath), under and mode_of, made
  of objects bound now."""
  lstat, stat, readlink, getcwd = posix.lstat, posix.stat, posix.readlink, posix.getcwd
  is_link, kind, str_, bytes_ = _stat.S_ISLNK, type, str, bytes
  failure, refused = (OSError, ValueError), PermissionError

  def text(path, event):
    if kind(path) is str_:
      return path
    if kind(path) is bytes_:
      return path.decode("utf-8", "surrogateescape")
    raise refused(f"{event}: refused (a path that is not a str)")

  def resolve(path):  # os.path.realpath, from the bound functions only
    pending = ((path if path.startswith("/") else getcwd() + "/" + path).split("/"))[::-1]
    parts, links = [], 0
    while pending:
      part = pending.pop()
      if part in ("", "."):
        continue
      if part == "..":
        parts = parts[:-1]
        continue
      here = "/" + "/".join(parts + [part])
      try:
        mode = lstat(here).st_mode
      except failure:
        mode = 0
      if not is_link(mode):
        parts.append(part)
        continue
      links += 1
      if links > 40:
        raise refused(f"{path}: too many symbolic links")
      target = readlink(here)
      parts = [] if target.startswith("/") else parts
      pending.extend(target.split("/")[::-1])
    return "/" + "/".join(parts)

  def under(path, roots):
    for root in roots:
      if path == root or path.startswith(root.rstrip("/") + "/"):
        return True
    return False

  def mode_of(path):
    try:
      return stat(path).st_mode
    except failure:
      return 0

  return text, resolve, under, mode_of


def _path_rules(work: str, read_roots: tuple[str, ...]):
  """check_open, check_listing and check_change for the hook, made of objects bound now."""
  text, resolve, under, mode_of = _path_tools()
  is_dir, is_char, is_block = _stat.S_ISDIR, _stat.S_ISCHR, _stat.S_ISBLK
  kind, str_, int_, len_, next_, refused = type, str, int, len, next, PermissionError
  write_flags, max_written = WRITE_FLAGS, MAX_FILES_WRITTEN
  readable, writable = READABLE_DEVICES, WRITABLE_DEVICES
  writes = itertools.count()

  def check_open(path, mode, flags):
    if kind(path) is int_:
      return  # a file already open
    real = resolve(text(path, "open"))
    writing = kind(mode) is str_ and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
    writing = writing or (kind(flags) is int_ and flags & write_flags)
    st_mode, inside = mode_of(real), under(real, (work,))
    if (is_char(st_mode) or is_block(st_mode)) and real not in readable:
      raise refused(f"open {path!r}: refused (a device)")
    if writing and not (inside or real in writable):
      raise refused(f"open {path!r} for writing: refused (outside the working folder)")
    if writing and next_(writes) >= max_written:
      raise refused(f"open {path!r} for writing: refused (over {max_written} files)")
    if not inside and is_dir(st_mode):
      raise refused(f"open {path!r}: refused (a directory outside the working folder)")
    if not (inside or under(real, read_roots) or real in readable):
      raise refused(f"open {path!r}: refused (outside the working folder)")

  def check_listing(path, event):
    if kind(path) is int_:
      return
    real = resolve("." if path is None else text(path, event))
    if not under(real, (work,) + read_roots):
      raise refused(f"{event} {path!r}: refused (outside the working folder)")

  def check_change(event, args, paths, dir_fds):
    for i in dir_fds:
      if i < len_(args) and not (args[i] is None or (kind(args[i]) is int_ and args[i] < 0)):
        raise refused(f"{event} with dir_fd: refused")
    for i in paths:
      if event in ("os.truncate", "os.utime") and kind(args[i]) is int_:
        continue  # a file already open
      if not under(resolve(text(args[i], event)), (work,)):
        raise refused(f"{event} {args[i]!r}: refused (outside the working folder)")
    if event == "os.mkdir" and next_(writes) >= max_written:  # folders count as files
      raise refused(f"{event} {args[0]!r}: refused (over {max_written} files)")

  return check_open, check_listing, check_change


def make_hook(work: str, read_roots: tuple[str, ...], formatter_code):
  """The audit hook: refuses what the module docstring lists. Frames are read by
  `formatter_code` (_frame_entries's), run with this module's globals, alone."""
  check_open, check_listing, check_change = _path_rules(work, read_roots)
  kind, str_, len_, refused = type, str, len, PermissionError
  # Copies of the module's constants, strings included, held by the hook alone: the
  # module's own (reachable from a frame's globals) are not the ones it reads.
  copy = lambda names: tuple("".join(list(name)) for name in names)
  events, prefixes = frozenset(copy(REFUSED_EVENTS)), copy(REFUSED_PREFIXES)
  imports, import_prefixes = frozenset(copy(REFUSED_IMPORTS)), copy(REFUSED_IMPORT_PREFIXES)
  listings, changes = copy(LISTINGS), {e: v for e, v in zip(copy(CHANGES), CHANGES.values())}
  frame_reads, code_writes = frozenset(copy(FRAME_READS)), frozenset(copy(CODE_WRITES))
  caller = sys._getframe
  runner_globals = globals()

  def hook(event, args):
    if event == "object.__getattr__":
      if args[1] in frame_reads:
        reader = caller(1)
        if reader.f_code is not formatter_code or reader.f_globals is not runner_globals:
          raise refused(f"reading a frame ({args[1]}) is not allowed here")
    elif event == "object.__setattr__":
      if args[1] in code_writes:
        raise refused(f"setting a function's {args[1]} is not allowed here")
    elif event == "open":
      n = len_(args)
      check_open(args[0], args[1] if n > 1 else None, args[2] if n > 2 else 0)
    elif event in events or event.startswith(prefixes):
      raise refused(f"{event} is not allowed here")
    elif event == "import":
      name = args[0]
      if kind(name) is not str_ or name in imports:
        raise refused(f"import {name if kind(name) is str_ else '?'}: not allowed here")
      if name.startswith(import_prefixes):
        raise refused(f"import {name}: not allowed here")
    elif event in listings:
      check_listing(args[0] if args else None, event)
    elif event in changes:
      check_change(event, args, *changes[event])

  return hook


def _stdout_is_empty() -> bool:
  try:
    sys.stdout.flush()
    return os.fstat(1).st_size == 0
  except Exception:  # pylint: disable=broad-except  # stdout closed or replaced
    return False


def _source_reader(code: str):
  """line(filename, number): the source line a traceback shows; the model's code from its
  own text, any other file through a bound open (the hook decides what it may read), at
  most SOURCE_BYTES of it. Nothing here calls what the model's code can replace."""
  code_lines, open_, stat, is_regular = code.splitlines(), io.open, posix.stat, _stat.S_ISREG
  limit, failure = SOURCE_BYTES, (OSError, ValueError)

  def line(filename, number):
    if filename == CODE_FILENAME:
      return code_lines[number - 1].strip() if 0 < number <= len(code_lines) else ""
    try:
      if not is_regular(stat(filename).st_mode):
        return ""
      with open_(filename, "rb") as f:
        text = f.read(limit).decode("utf-8", "replace").splitlines()
    except failure:
      return ""
    return text[number - 1].strip() if 0 < number <= len(text) else ""

  return line


def _make_frame_entries():
  """frame_entries(tb): (file, line, function) of each frame of a real traceback. The one
  code that may read frames (the hook checks): it keeps their names and numbers only, and
  calls nothing the model's code could have replaced while it holds one."""
  traceback_type, kind = types.TracebackType, type

  def frame_entries(tb):
    entries = []
    while kind(tb) is traceback_type:
      code = tb.tb_frame.f_code
      entries.append((code.co_filename, tb.tb_lineno, code.co_name))
      tb = tb.tb_next
    return entries

  return frame_entries


_frame_entries = _make_frame_entries()


def format_error(error: BaseException, source_line) -> str:
  """The traceback's last lines, from the model's code on, without the runner's own
  frames (the hook's among them); each line at most LINE_CHARS."""
  tb = error.__traceback__
  # Its own lines only: an exception it was raised during would be formatted with frames.
  error.__cause__, error.__context__, error.__suppress_context__ = None, None, True
  try:
    message = traceback.format_exception_only(type(error), error)
  except Exception:  # pylint: disable=broad-except  # its __str__ raised, say
    message = [f"{type(error).__name__}\n"]
  entries = _frame_entries(tb)
  first = next((i for i, entry in enumerate(entries) if entry[0] == CODE_FILENAME), None)
  entries = [] if first is None else [e for e in entries[first:] if e[0] != RUNNER_FILENAME]
  lines = ["Traceback (most recent call last):\n"] if entries else []
  for filename, number, name in entries:
    lines.append(f'  File "{filename}", line {number}, in {name}\n')
    source = source_line(filename, number)
    if source:
      lines.append(f"    {source}\n")
  lines = "".join(lines + message).splitlines()
  lines = [line if len(line) <= LINE_CHARS else line[:LINE_CHARS] + " ..." for line in lines]
  if len(lines) > TRACEBACK_LINES:
    lines = [lines[0], "  ...", *lines[-(TRACEBACK_LINES - 2) :]]
  return "\n".join(lines) + "\n"


def run(code: str, memory_mb: int, max_file_mb: int) -> int:
  """Runs the code as __main__: 0, or 1 with the error written to stderr."""
  source_line = _source_reader(code)
  out_of_memory = f"error: MemoryError: ran past the {memory_mb} MB memory limit\n".encode()
  file_too_big = f"error: a file (or stdout) ran past the {max_file_mb} MB size limit\n"
  write_error = os.write
  # The code's own __main__: this file's module leaves sys.modules, so the hook's objects
  # and the runner's globals are not reachable by name from the code.
  main_module = types.ModuleType("__main__")
  sys.modules["__main__"] = main_module
  namespace = vars(main_module)
  namespace["__builtins__"] = builtins
  linecache.cache[CODE_FILENAME] = (len(code), None, code.splitlines(True), CODE_FILENAME)
  try:
    tree = ast.parse(code, CODE_FILENAME)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, CODE_FILENAME, "exec"), namespace)  # pylint: disable=exec-used
    if last is not None:
      value = eval(compile(ast.Expression(last.value), CODE_FILENAME, "eval"), namespace)
      if value is not None and _stdout_is_empty():
        print(repr(value))
  except MemoryError:
    namespace.clear()
    write_error(2, out_of_memory)
    return 1
  except SystemExit as e:
    if e.code is None or e.code == 0:
      return 0
    write_error(2, f"error: the code called sys.exit({e.code!r})\n".encode())
    return 1
  except BaseException as e:  # pylint: disable=broad-except
    too_big = isinstance(e, OSError) and e.errno == errno.EFBIG
    shown = file_too_big if too_big else format_error(e, source_line)
    write_error(2, shown.encode("utf-8", "replace"))
    return 1
  return 0


def main() -> None:
  settings = json.loads(sys.argv[1])
  die_with_parent()
  code = sys.stdin.buffer.read().decode("utf-8", "replace")
  null = os.open(os.devnull, os.O_RDONLY)  # the code reads an empty stdin
  os.dup2(null, 0)
  os.close(null)
  if settings.get("scratch"):
    why = make_scratch(settings["scratch"])
    if why is not None:
      os.write(2, f"error: the sandbox's scratch folder could not be made: {why}\n".encode())
      os._exit(SCRATCH_FAILED_EXIT)  # pylint: disable=protected-access
  # The one thread, started with no capability left; the filter below covers it too
  # (capabilities and filters are a thread's own).
  end_with_caller(settings.get("lifeline_fd"))
  limit_resources(settings)
  if settings.get("seccomp"):
    why = confine_syscalls()
    if why is not None and settings["seccomp"] == "required":
      os.write(2, f"error: the sandbox's seccomp filter did not load: {why}\n".encode())
      os._exit(SECCOMP_FAILED_EXIT)  # pylint: disable=protected-access
  disarm_modules()
  read_roots = python_roots()
  sys.dont_write_bytecode = True
  sys.argv = [CODE_FILENAME]
  sys.stdout.reconfigure(line_buffering=True)  # what was printed survives a kill
  if settings.get("audit_hook", True):
    work = os.path.realpath(settings["work_dir"])
    sys.addaudithook(make_hook(work, read_roots, _frame_entries.__code__))
  exit_now = os._exit
  status = run(code, settings["memory_mb"], settings["max_file_mb"])
  try:
    sys.stdout.flush()
  except Exception:  # pylint: disable=broad-except  # e.g. past the file size limit
    pass
  exit_now(status)


if __name__ == "__main__":
  main()
