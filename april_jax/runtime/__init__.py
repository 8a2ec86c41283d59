"""The processes a run is made of and how they end: worker processes for user code
(workers.py, forkserver_guard.py), Ctrl-C and SIGTERM (interrupt.py, sigterm_stop.py),
the process tree (process_tree.py), what user code prints (user_output.py), one run per
workdir (workdir_lock.py), several hosts (distributed.py, rendezvous.py)."""
