"""Waiting for a multi-host run's processes before JAX joins them, with a time limit
that ends in a plain message instead of an abort.

JAX's coordination service aborts a process (SIGABRT and a C++ stack) whose peers do
not register within the initialization timeout, even when the peers simply never
started. So the processes meet first on the coordinator's own port: process 0 listens
there, every other process connects (retrying until the deadline) and says who it is;
once all have come, process 0 answers each one "go", everyone lets go of the port, and
`jax.distributed.initialize` finds every peer already running. If the deadline passes,
`PeersMissing` says how many came and which ones did not, and the caller exits with a
status of its own.
"""

from __future__ import annotations

import socket
import time

HELLO = b"april_jax rendezvous"


class PeersMissing(Exception):
  """Not every process of the run came within the time limit."""


def _split(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def wait_for_peers(address: str, num_processes: int, process_id: int, timeout_s: float) -> None:
  """Returns once all num_processes processes of the run have reached this point."""
  if num_processes <= 1:
    return
  deadline = time.monotonic() + timeout_s
  if process_id == 0:
    _host(address, num_processes, deadline, timeout_s)
  else:
    _join(address, num_processes, process_id, deadline, timeout_s)


def _host(address: str, n: int, deadline: float, timeout_s: float) -> None:
  _, port = _split(address)
  if socket.has_dualstack_ipv6():
    server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
  else:
    server = socket.create_server(("", port))
  joined: dict[int, socket.socket] = {}
  try:
    while len(joined) < n - 1 and time.monotonic() < deadline:
      server.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
      try:
        conn, _ = server.accept()
      except socket.timeout:
        continue
      conn.settimeout(5.0)
      try:
        words = conn.recv(256).split()
        peer, peers = int(words[-2]), int(words[-1])
        if b" ".join(words[:-2]) != HELLO or peers != n or not 0 < peer < n:
          raise ValueError(words)
      except (OSError, ValueError, IndexError):
        conn.close()  # not one of ours, or a process of a run of another size
        continue
      if peer in joined:
        joined[peer].close()  # a restarted peer: keep its newest connection
      joined[peer] = conn
    if len(joined) < n - 1:
      missing = sorted(set(range(1, n)) - set(joined))
      raise PeersMissing(
          f"{len(joined) + 1} of {n} processes joined within {timeout_s:g} s at the "
          f"coordinator {address} (missing process ids: "
          f"{', '.join(map(str, missing[:16]))}{', ...' if len(missing) > 16 else ''}); "
          "start every process of the run, or raise distributed.initialization_timeout_s"
      )
    for conn in joined.values():
      conn.sendall(b"go\n")
    for conn in joined.values():  # the peer closes first, so the port is free for JAX
      try:
        conn.recv(16)
      except OSError:
        pass
  finally:
    for conn in joined.values():
      conn.close()
    server.close()


def _join(address: str, n: int, process_id: int, deadline: float, timeout_s: float) -> None:
  host, port = _split(address)
  while True:
    try:
      conn = socket.create_connection((host, port), timeout=5.0)
      conn.sendall(HELLO + f" {process_id} {n}\n".encode())
      conn.settimeout(max(1.0, deadline - time.monotonic() + 10.0))
      answer = conn.recv(16)
      conn.close()
      if answer.startswith(b"go"):
        return
      if not answer:  # process 0 gave up on the others
        raise PeersMissing(
            f"process {process_id} of {n}: the coordinator {address} (process 0) gave up "
            f"waiting for the other processes within {timeout_s:g} s"
        )
    except OSError as e:  # refused (not listening yet), timed out, reset
      if time.monotonic() >= deadline:
        raise PeersMissing(
            f"process {process_id} of {n}: the coordinator {address} (process 0) did not "
            f"answer within {timeout_s:g} s ({type(e).__name__}); start process 0, or "
            "check distributed.coordinator_address"
        ) from None
      time.sleep(0.5)
