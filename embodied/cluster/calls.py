"""What every proxy of the cluster's workers shares: a call's answers with a dead worker (or one
Ray restarted since it last took part) as ``WorkerLost`` naming the worker, a worker that could
not start as its cause, a wait for a restarted worker, the traffic counters."""

from __future__ import annotations

import importlib
import re
import time

from embodied.checkpoint import CheckpointWriteError
from embodied.cluster.direct import NotConnected
from embodied.config import ConfigError
from embodied.roles import WorkerLost, WorkerNotStarted
from embodied.schema import UserError

# a worker's errors that are the user's to fix, raised as themselves (one line): the text of
# Ray's wrapper of them is the worker's traceback
USERS_ERRORS = (ConfigError, UserError, CheckpointWriteError)
RESTART_TIMEOUT_S = 300.0  # how long a lost worker may take to come back
LOSS_NOTICE_S = 10.0  # how long after its peers' errors Ray may take to report a worker's death
RAY_GONE = (
    "Ray's GCS no longer answers: the cluster's daemons stopped (a signal to every process of "
    "the job?), and nothing can be restarted"
)


def get(refs, role: str, name=None):
    """``ray.get``, with a dead worker, or one that Ray restarted since it last took part
    (``NotConnected``), as ``WorkerLost``, before any other worker's error; a worker's
    ``ConfigError`` as itself (one line: the user's to fix). ``name(i)`` describes the worker of
    ``refs[i]`` (of a single reference: ``name(0)``, or ``name`` itself, a string)."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as error:
        raise lost(role, error, _named(refs, name)) from None
    except ray.exceptions.RayTaskError as error:
        if isinstance(refs, list):  # (Ray raises the first error to arrive)
            _raise_if_one_was_lost(refs, role, name)
        if isinstance(error.cause, USERS_ERRORS):
            raise error.cause from None
        if not isinstance(error.cause, NotConnected):
            raise
        raise WorkerLost(role, str(error.cause), _named(refs, name)) from None


def _raise_if_one_was_lost(refs: list, role: str, name) -> None:
    """``WorkerLost`` for the first call in ``refs`` whose worker died or was restarted, once
    Ray has had time to say so: a survivor's error (a collective they shared, broken by the
    loss) reaches ``ray.get`` first and would hide it, and recovery would never start."""
    import ray

    ray.wait(refs, num_returns=len(refs), timeout=LOSS_NOTICE_S)  # (a death's error comes later)
    for index, ref in enumerate(refs):
        if not ray.wait([ref], timeout=0)[0]:
            continue
        worker = name(index) if callable(name) else name
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as error:
            raise lost(role, error, worker) from None
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, NotConnected):
                raise WorkerLost(role, str(error.cause), worker) from None


def _named(refs, name) -> str | None:
    """``name(i)`` of the first call in ``refs`` that failed (None without ``name``)."""
    import ray

    if name is None or isinstance(name, str):
        return name
    if not isinstance(refs, list):
        return name(0)
    for index, ref in enumerate(refs):
        if ray.wait([ref], timeout=0)[0]:
            try:
                ray.get(ref)
            except Exception:
                return name(index)
    return None


def lost(role: str, error: Exception, worker: str | None = None) -> Exception:
    """``WorkerLost`` with the first line of Ray's message; a lost actor worker takes the
    learner's state (weights, optimizer) with it: the run can only resume. A worker whose
    constructor raised: that error (``not_started``)."""
    if getattr(error, "actor_init_failed", False):
        return not_started(role, str(error), worker)
    text = str(error).strip()
    detail = text.splitlines()[0] if text else type(error).__name__
    if role == "actor":
        detail += "; the learner's state (weights, optimizer) was lost with it"
    return WorkerLost(role, detail, worker)


def not_started(role: str, text: str, worker: str | None = None) -> Exception:
    """The error a worker's constructor raised, from Ray's ``text`` of it (Ray keeps the
    exception's text only): a user's error (``ConfigError``, ``UserError``: a one-line message
    naming what to change) as itself, anything else as ``WorkerNotStarted`` naming the worker and
    the traceback's last line."""
    kind, message = _last_exception(text)
    user_error = _user_error(kind)
    if user_error is not None:
        return user_error(message)
    worker = worker or f"{role} worker"
    place = re.search(r"\(pid=(\d+), ip=([^,)]+)", text)  # (Ray's first line names them)
    if place and "(" not in worker:
        worker += f" (pid {place[1]} on {place[2]})"
    first = message.splitlines()[0] if message else ""
    return WorkerNotStarted(f"{worker} could not start: {kind.rsplit('.', 1)[-1]}: {first}")


def _last_exception(text: str) -> tuple[str, str]:
    """(the exception's qualified type name, its message) of the last exception in a traceback's
    ``text``: the lines after the last indented one."""
    lines = text.rstrip().splitlines()
    start = max((i for i, line in enumerate(lines) if line.startswith(" ")), default=-1) + 1
    kind, _, message = "\n".join(lines[start:]).strip().partition(": ")
    return kind, message


def _user_error(kind: str) -> type[Exception] | None:
    """``ConfigError`` or ``UserError`` where ``kind`` (a qualified name) is one of them."""
    module, _, name = kind.rpartition(".")
    if not module.startswith("embodied"):
        return None
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    for user_error in (ConfigError, UserError):
        if isinstance(cls, type) and issubclass(cls, user_error):
            return user_error
    return None


class Traffic:
    """What crossed between this process and a role's workers since the last ``take``."""

    def __init__(self):
        self.wait_s = 0.0  # seconds this process waited for answers
        self.bytes = 0  # bytes of the arrays sent and received
        self.rows = 0  # environment rows answered

    def take(self) -> tuple[float, int, int]:
        """(seconds waited, bytes, rows), then zeros."""
        out = (self.wait_s, self.bytes, self.rows)
        self.__init__()
        return out


def wait_alive(role: str, worker, name: str | None = None) -> None:
    """Wait until Ray has restarted ``worker`` (it answers a ping); ``WorkerLost`` after
    ``RESTART_TIMEOUT_S``; the error of a constructor that raised at once (``lost``)."""
    import ray

    deadline = time.time() + RESTART_TIMEOUT_S
    while True:
        try:
            ray.get(worker.ping.remote(), timeout=30)
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            if getattr(error, "actor_init_failed", False):
                raise lost(role, error, name) from None
            if not control_plane_up():
                raise WorkerLost(role, RAY_GONE, name) from None
            if time.time() > deadline:
                raise WorkerLost(
                    role, f"not back {RESTART_TIMEOUT_S:.0f} s after it was lost", name
                ) from None
            time.sleep(0.5)


def control_plane_up(timeout_s: float = 2.0) -> bool:
    """Whether Ray's GCS still answers a connection: a signal to every process of a job stops
    the daemons of a cluster the run joined (and with them every worker), and a call through
    them then waits until Ray ends this process, 60 s on."""
    import socket

    import ray

    host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True
