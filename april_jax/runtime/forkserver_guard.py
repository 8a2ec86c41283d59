"""Makes the worker processes' forkserver die with the run, however the run ends.

workers.py has the forkserver import this module first (`set_forkserver_preload`); nothing
else imports it. The forkserver would otherwise outlive a run killed outright (SIGKILL,
an out-of-memory kill): it leaves when the run's end of its pipe closes, but its workers
hold that pipe too, and a worker busy in user code never lets go. From this import on,
the kernel kills the forkserver when the run's process ends (Linux), and each worker
when the forkserver ends (workers._serve). Like the workers, it ignores Ctrl-C and
SIGTERM sent to the whole process group.
"""

from april_jax.runtime import interrupt
from april_jax.runtime import workers

workers.die_with_parent()
interrupt.ignore_in_child()  # a SIGTERM to the run's process group is the run's to answer
