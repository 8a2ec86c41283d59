"""The kernel's confinement of the Python tool's child (python_sandbox.py), set up before
any of the model's code runs. The child is this file's source followed by
python_sandbox.py's, run as `python -I -c <source>` (kernel_isolation.runner_source):
it imports nothing of the package, and every name here is the child's own.

  make_scratch       under kernel isolation, the working folder: a mount namespace of its
                     own, a tmpfs bounded in bytes and in inodes (files and folders however
                     made) at the working folder, Python's folders that lay under it put
                     back read-only; then every capability dropped (the sandbox gave
                     CAP_SYS_ADMIN for this alone)
  end_with_caller    the one thread the child starts: it ends the process when its caller's
                     end of a pipe closes (the call is over, or the caller died), started
                     after the capabilities are gone (a thread's are its own)
  limit_resources    rlimits, soft and hard: address space, CPU seconds, file size, open
                     files, locked memory, POSIX message queues, no new processes, no core
  confine_syscalls   the seccomp filter (libseccomp, through ctypes) on every thread
                     (TSYNC): REFUSED_SYSCALLS with EPERM (new processes and threads, sockets,
                     ptrace, signals to others, mounts and namespaces, and what draws on
                     budgets the whole host shares: SysV IPC, POSIX queues and timers, aio,
                     inotify, memfd_secret, sync), clone3 with ENOSYS, another ABI's system
                     call with the process's death
"""

import errno
import os
import resource
import signal

try:  # the seccomp filter loads through it; a Python built without libffi has none
  import ctypes
except ImportError:
  ctypes = None
import _thread

MAX_OPEN_FILES = 64

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
