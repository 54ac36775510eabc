"""Observations and actions between env workers and rollout workers, without the driver.

An env worker collects its rows' round itself (``rollout.collect``, the embedded loop); where the
policy lives in a rollout worker, its ``act`` and ``value`` go through a connection of its own to
that worker (``multiprocessing.connection`` over TCP: one mechanism within a node and across
nodes; the waiting side sleeps in the kernel, where a Ray channel's reader spins a core, and a
worker-to-worker actor call costs 6x as much: docs/benchmarks.md, ``benchmarks/channels.py``).

A rollout worker serves a fixed list of env workers (its members) in lockstep: it takes one act
request from each member in order, acts once on their observations joined, and answers each its
rows, so the batch and its draws are those of one policy acting on all their rows, whatever the
timing. Value requests draw nothing: they are answered as they come. The round ends when every
member has said so; in an evaluation (deterministic acts, which draw nothing) each member ends when
its episodes do, and the others go on. A member lost midway closes its connection: the rollout
worker's read ends and so does the round (and the reverse), so nothing waits for a dead peer. A peer
on a node lost without closing its end is found by TCP keepalive within about 25 s, and a member
lost before it connected ends the rollout worker's wait at ``cluster.connect_timeout_s``.
"""

from __future__ import annotations

import secrets
import socket
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import torch

from embodied.cluster.wire import from_wire, to_wire
from embodied.inference import InferencePolicy
from embodied.schema import Observation, PolicyOutput

ACT = "act"
VALUE = "value"
END = "end"
BACKLOG = 1024  # connections a listener queues (the default, 1, loses some of 8 at once)
KEEPALIVE = (10, 5, 3)  # TCP keepalive: idle seconds, seconds between probes, probes


class NotConnected(RuntimeError):
    """A worker asked for a round without its connections: Ray restarted it since the last one
    (the driver treats it as lost, and connects everyone afresh)."""


# why a worker Ray restarted since it last took part is NotConnected (the driver's messages)
UNLINKED = "restarted since the last round: not connected"
UNSYNCED = "restarted since the last sync: its policy copy has none of the learner's weights"
UNGROUPED = "restarted since the last sync: not in the weight-sync group"


class OutOfStep(RuntimeError):
    """The members of a rollout worker asked for different things in one lockstep step (a bug,
    not a broken link)."""


class DirectInference:
    """An env worker's view of its rollout worker's policy: ``act`` and ``value`` as an
    ``InferencePolicy`` has them, each a request and its answer over ``connection``. The
    observations and the answers stay on ``device`` (the env worker's)."""

    def __init__(self, connection: Connection, device: torch.device, has_critic: bool):
        self.connection = connection
        self.device = device
        self.has_critic = has_critic
        self.version = -1  # the weights' version, as the rollout worker's last answer gave it
        self.waited_s = 0.0  # seconds spent waiting for answers (not this worker's work)

    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        self.connection.send((ACT, to_wire(obs), deterministic))
        out, self.version = self._answer()
        return from_wire(out, self.device)

    def value(self, obs: Observation) -> torch.Tensor:
        if not self.has_critic:
            return torch.zeros(obs.batch_size, device=self.device)
        self.connection.send((VALUE, to_wire(obs)))
        return from_wire(self._answer(), self.device)

    def _answer(self):
        t0 = time.perf_counter()
        answer = self.connection.recv()
        self.waited_s += time.perf_counter() - t0
        return answer

    def end_round(self) -> None:
        """Tell the rollout worker that this member's round is over."""
        self.connection.send((END,))

    def close(self) -> None:
        self.connection.close()


def listen(host: str) -> tuple[socket.socket, tuple[str, int], bytes]:
    """A listening socket at ``host`` (this node's address) for the members' connections: (it,
    its address, the key a member must know to connect)."""
    key = secrets.token_bytes(16)
    # a backlog for every member connecting at once: beyond it a connection can be dropped
    # after the member thinks it is made, and the member would wait for its handshake forever
    server = socket.create_server((host, 0), backlog=BACKLOG)
    return server, server.getsockname()[:2], key


def connect(address: tuple[str, int], key: bytes, member: int) -> Connection:
    """A member's connection to the rollout worker at ``address``; the first message says which
    member it is (connections are accepted in any order)."""
    sock = socket.create_connection(tuple(address))
    connection = _authenticated(sock, key, accepted=False)
    connection.send(member)
    return connection


def accept(server: socket.socket, key: bytes, members: int, timeout_s: float) -> list[Connection]:
    """The ``members`` connections, in member order; ``NotConnected`` where they have not all
    connected within ``timeout_s`` (a member lost before it connected)."""
    deadline = time.monotonic() + timeout_s
    connections: dict[int, Connection] = {}
    while len(connections) < members:
        server.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            sock, _ = server.accept()
        except TimeoutError:
            raise NotConnected(
                f"{len(connections)} of {members} env workers connected within {timeout_s:g} s "
                "(cluster.connect_timeout_s)"
            ) from None
        sock.setblocking(True)
        connection = None
        try:
            connection = _authenticated(sock, key, accepted=True)
            connections[connection.recv()] = connection
        except (AuthenticationError, EOFError, OSError):  # not a member: a wrong key, a probe
            (sock if connection is None else connection).close()
    return [connections[m] for m in range(members)]


def _authenticated(sock: socket.socket, key: bytes, accepted: bool) -> Connection:
    """``sock`` as a connection both ends proved they know ``key`` on (as ``Listener`` and
    ``Client`` do it), with TCP keepalive: a peer whose node vanishes without closing its end
    breaks the connection within about 25 s (``KEEPALIVE``), where it would wait forever."""
    idle, interval, probes = KEEPALIVE
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
    connection = Connection(sock.detach())
    if accepted:
        deliver_challenge(connection, key)
        answer_challenge(connection, key)
    else:
        answer_challenge(connection, key)
        deliver_challenge(connection, key)
    return connection


def serve(connections: list[Connection], inference: InferencePolicy) -> tuple[int, float]:
    """One round for the members at ``connections`` (see the module docstring); returns the act
    requests served and the seconds spent waiting for requests (not this worker's work). A
    member that leaves ends it with ``ConnectionError``, members that ask for different things
    with ``OutOfStep``."""
    device = inference.device
    served = 0
    waited_s = 0.0
    acting = list(enumerate(connections))  # (member, its connection) until it ends
    while acting:
        t0 = time.perf_counter()
        requests = [_next_act(member, c, inference) for member, c in acting]
        waited_s += time.perf_counter() - t0  # (value answers included: they are brief)
        ended = [request[0] == END for request in requests]
        acting = [link for link, end in zip(acting, ended) if not end]
        requests = [request for request in requests if request[0] != END]
        if not requests:
            break
        kinds = [request[0] for request in requests]
        sampled = [not request[2] for request in requests]
        # a sampled batch's members are fixed (its draws are those of one policy acting on
        # all their rows); deterministic acts draw nothing, so members may end apart
        if set(kinds) != {ACT} or len(set(sampled)) > 1 or (any(ended) and any(sampled)):
            raise OutOfStep(f"env workers out of step: {['end' if e else 'act' for e in ended]}")
        parts = [from_wire(request[1], device) for request in requests]
        out = inference.act(Observation.cat(parts), deterministic=requests[0][2])
        lo = 0
        for (_, connection), part in zip(acting, parts):
            hi = lo + part.batch_size
            connection.send((to_wire(_rows(out, lo, hi)), inference.version))
            lo = hi
        served += 1
    return served, waited_s


def _next_act(member: int, connection: Connection, inference: InferencePolicy) -> tuple:
    """The member's next act (or end) request; value requests before it answered at once."""
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            raise ConnectionError(f"env worker {member} of this rollout worker left") from None
        if request[0] != VALUE:
            return request
        value = inference.value(from_wire(request[1], inference.device))
        connection.send(to_wire(value))


def _rows(out: PolicyOutput, lo: int, hi: int) -> PolicyOutput:
    return PolicyOutput(
        actions=out.actions[lo:hi],
        logprob=out.logprob[lo:hi],
        value=out.value[lo:hi],
        extras={k: v[lo:hi] for k, v in out.extras.items()},
    )


def members_of(rollout_workers: int, env_workers: int) -> list[range]:
    """Which env workers each rollout worker serves: contiguous, as even as can be."""
    R, W = rollout_workers, env_workers
    return [range(W * r // R, W * (r + 1) // R) for r in range(R)]
