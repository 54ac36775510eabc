"""``WorkerVecEnv``: a VecEnv whose environments live in subprocess workers, stepped in lockstep.

Each worker builds one *core* (``make_core(n)``: n environments of a CPU simulator in that
process) and serves it over a pipe. A core speaks numpy (pickled cheaply, no torch in transit):

- ``spec`` (EnvSpec); ``reset(ids, seeds) -> packed obs of all its environments``
- ``step(ids, actions f32 [n, A]) -> (packed obs of ids, f32 [n, 4] reward/terminated/truncated/
  success, packed final obs of ids or None)`` with automatic reset of ended episodes
- ``render() -> uint8 [n, H, W, 3]``, ``close()``

where a packed obs is ``{"state", "images", "privileged", "instruction"}`` of numpy arrays (and a
list of strings). Workers are spawned (never forked: simulators and renderers hold threads and
GPU/GL contexts). Stepping a subset (``step_async``/``step_wait``) lets a rollout pipeline groups.

``num_workers=0`` runs the one core in this process instead, behind the same protocol: no
parallelism, but no round trip between processes either, which on a machine with one or two cores
costs more than parallel workers win back (docs/benchmarks.md, environment throughput).

Timeouts: a worker that does not answer a step within ``step_timeout_s`` (a reset or a render within
``RESET_TIMEOUT_FACTOR`` times that, and so a step that reaches an environment's time limit, which
its worker resets within the step) is killed, the others are stopped, the env is closed and
``WorkerTimeout`` says which worker, which environments and the seeds they were last reset with.
A hung simulator would otherwise hang the whole run. A core in this process (``num_workers=0``)
cannot time out: nothing could interrupt it.
A worker that dies (a crash, an out-of-memory kill, in a call or between calls) or whose core
raises is named the same way, with its exit code or signal, or the core's error.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import signal
import time
import traceback
from collections.abc import Callable, Sequence

import numpy as np
import torch

from embodied.schema import (
    Observation,
    StepOutput,
    UserError,
    ended_rows,
    refuse_non_finite,
    reset_seeds,
)

AUTO_RESET = "auto-reset"  # (a worker's own reset after an episode ended: its seed is its own)

# building a simulator (and its renderer) takes seconds; minutes means something is wrong
START_TIMEOUT_S = 300.0
# a pipe is polled at most this long at a time (select's timeout is a C int of milliseconds)
POLL_SLICE_S = 86400.0
RESET_TIMEOUT_FACTOR = 10  # resets and renders may take this many times the step timeout
STOP_TIMEOUT_S = 10.0  # a worker told to close has this long to answer before it is killed


class WorkerTimeout(RuntimeError):
    """A worker did not answer in time: it was killed and the env closed."""


def _serve(conn, make_core: Callable, count: int) -> None:
    torch.set_num_threads(1)
    # Ctrl-C reaches the whole process group: the main process decides when to stop (it saves
    # first), and a worker that died of it would leave the main process nothing to step
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = make_core(count)
        conn.send(("ok", core.spec))
        while True:
            cmd, arg = conn.recv()
            if cmd == "step":
                conn.send(("ok", core.step(*arg)))
            elif cmd == "reset":
                conn.send(("ok", core.reset(*arg)))
            elif cmd == "render":
                conn.send(("ok", core.render(*arg)))
            elif cmd == "close":
                core.close()
                conn.send(("ok", None))
                return
    except (KeyboardInterrupt, EOFError):
        return
    except UserError as e:  # bad input (a task's missing asset): its line, as in one process
        conn.send(("user_error", str(e)))
    except Exception:  # report to the parent instead of dying silently
        conn.send(("error", traceback.format_exc()))


class _InProcess:
    """A core in this process behind the two calls of a worker's pipe: ``send`` runs the command
    at once and ``recv`` returns its answers in order (several steps may be in flight)."""

    def __init__(self, core):
        self.core = core
        self._answers = collections.deque()

    def send(self, message) -> None:
        cmd, arg = message
        if cmd == "close":
            self._answers.append(("ok", self.core.close()))
        else:
            self._answers.append(("ok", getattr(self.core, cmd)(*([] if arg is None else arg))))

    def recv(self):
        return self._answers.popleft()

    def poll(self, timeout=None) -> bool:
        return bool(self._answers)


def _cat(packs: list[dict]) -> dict:
    if len(packs) == 1:
        return packs[0]
    return {
        "state": np.concatenate([p["state"] for p in packs]),
        "images": {k: np.concatenate([p["images"][k] for p in packs]) for k in packs[0]["images"]},
        "privileged": {
            k: np.concatenate([p["privileged"][k] for p in packs]) for k in packs[0]["privileged"]
        },
        "instruction": [s for p in packs for s in p["instruction"]],
    }


def to_observation(packed: dict) -> Observation:
    return Observation(
        state=torch.from_numpy(packed["state"]),  # f32 [B, S]
        instruction=list(packed["instruction"]),
        images={k: torch.from_numpy(v) for k, v in packed["images"].items()},  # uint8 [B, H, W, 3]
        privileged={k: torch.from_numpy(v) for k, v in packed["privileged"].items()},
    )


class WorkerVecEnv:
    """``num_envs`` environments split as evenly as possible between ``num_workers`` processes
    (0: one core in this process). ``name`` and ``task`` name the simulator and its task in
    errors; ``step_timeout_s`` bounds how long a worker may take to answer a step (module
    docstring; no bound in process)."""

    def __init__(
        self,
        make_core: Callable[[int], object],
        num_envs: int,
        num_workers: int,
        name: str = "simulator",
        task: str = "",
        step_timeout_s: float = 120.0,
    ):
        if step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s: must be > 0 (seconds), got {step_timeout_s}")
        self.num_envs = num_envs
        self.name = name
        self.device = torch.device("cpu")
        self.task = task
        self.step_timeout_s = step_timeout_s
        self.can_step_subsets = True
        self._everyone = torch.arange(num_envs)  # long [B]
        self._splits = {}
        # the seed of each one's last reset (AUTO_RESET: the worker's own, from its own seed)
        self._seeds: list[int | str | None] = [None] * num_envs
        self._elapsed = np.zeros(num_envs, np.int64)  # steps since each one's reset
        self._closed = False
        if num_workers == 0:
            self._starts = np.array([0, num_envs])  # int [2]: one worker holds them all
            self._procs = []
            core = make_core(num_envs)
            self._conns = [_InProcess(core)]
            self.spec = core.spec
            return
        n_workers = max(1, min(num_workers, num_envs))
        counts = [len(a) for a in np.array_split(np.arange(num_envs), n_workers)]
        self._starts = np.cumsum([0] + counts)
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        for count in counts:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child, make_core, count), daemon=True)
            p.start()
            # only the worker holds its end: if it dies, recv() here ends with EOFError
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        try:
            self.spec = [self._started(w) for w in range(len(self._conns))][0]
        except BaseException:
            self.close()
            raise

    def _started(self, w: int):
        conn = self._conns[w]
        if not conn.poll(START_TIMEOUT_S):
            raise WorkerTimeout(
                f"{self._who()} worker {w} ({self._environments(w)}) did not start within "
                f"{START_TIMEOUT_S:.0f} s; it was killed"
            )
        try:
            return self._payload(conn)
        except EOFError:
            raise RuntimeError(
                f"a {self.name} worker process died while starting (see its output above; a "
                "script that creates environments must guard its top level with "
                "`if __name__ == '__main__':`)"
            ) from None

    def _payload(self, conn, failed=None):
        """The answer on ``conn``; EOFError where its worker died (the caller names it). A core's
        error: ``failed(text)`` where given (it names the worker), else raised here."""
        status, payload = conn.recv()
        if status == "user_error":
            raise UserError(payload)
        if status == "error":
            if failed is not None:
                failed(payload)
            raise RuntimeError(f"{self.name} worker failed:\n{payload}")
        return payload

    # --- timeouts -------------------------------------------------------------------------
    def _timeout(self, what: str) -> float:
        """Seconds a worker has to answer a ``what`` ("step"; "reset", "render" and "step that
        resets" have ``RESET_TIMEOUT_FACTOR`` times that)."""
        return self.step_timeout_s * (1 if what == "step" else RESET_TIMEOUT_FACTOR)

    def _deadline(self, what: str) -> float | None:
        """When answers to a ``what`` sent now are due; None in process (nothing can interrupt a
        core running in this thread)."""
        if not self._procs:
            return None
        return time.monotonic() + self._timeout(what)

    def _recv(self, w: int, what: str, deadline: float | None):
        """Worker ``w``'s next answer; past ``deadline`` the worker is killed (WorkerTimeout)."""
        conn = self._conns[w]
        if deadline is not None and not _answered(conn, deadline):
            self._time_out(w, what)
        try:
            return self._payload(conn, lambda text: self._failed(w, what, text))
        except EOFError:
            self._died(w, what)

    def _send(self, w: int, what: str, message: tuple) -> None:
        """``message`` to worker ``w``; one gone since its last answer (killed while idle: an
        out-of-memory kill during an update) is named as one that died in the ``what``."""
        if not self._procs:  # (a core in this process: its own errors are its own)
            self._conns[w].send(message)
            return
        try:
            self._conns[w].send(message)
        except (BrokenPipeError, ConnectionResetError):
            self._died(w, what)

    def _failed(self, w: int, what: str, text: str) -> None:
        """Worker ``w``'s core raised in a ``what`` (the worker has ended): the others are
        stopped, the env is closed, and the error names the worker, its environments and seeds,
        with the core's traceback."""
        self._procs[w].join(timeout=STOP_TIMEOUT_S)
        self._kill(w)  # (one that has not ended by now: a thread of the core's left running)
        self.close()
        raise RuntimeError(
            f"{self._who()} worker {w} ({self._held(w)}) failed in a {what}:\n{text}"
        )

    def _died(self, w: int, what: str) -> None:
        """Worker ``w`` ended while a ``what`` was in flight: the others are stopped, the env is
        closed, and the error names it, its environments, their seeds and how it ended (an
        out-of-memory kill prints nothing of its own)."""
        proc = self._procs[w]
        proc.join(timeout=STOP_TIMEOUT_S)
        code = proc.exitcode
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        message = f"{self._who()} worker {w} ({self._held(w)}) died in a {what} ({how})"
        self._conns[w].close()
        self._conns[w] = self._procs[w] = None  # close() skips it
        self.close()
        raise RuntimeError(message)

    def _time_out(self, w: int, what: str) -> None:
        message = (
            f"{self._who()} worker {w} ({self._held(w)}) did not answer a {what} within "
            f"{self._timeout(what):g} s; it was killed"
        )
        self._kill(w)
        self.close()
        raise WorkerTimeout(message)

    def _who(self) -> str:
        return f"{self.name} {self.task}" if self.task else self.name

    def _held(self, w: int) -> str:
        lo, hi = int(self._starts[w]), int(self._starts[w + 1])
        return f"{self._environments(w)}, last reset seeds {self._seeds[lo:hi]}"

    def _environments(self, w: int) -> str:
        lo, hi = int(self._starts[w]), int(self._starts[w + 1])
        return f"environment {lo}" if hi - lo == 1 else f"environments {lo}-{hi - 1}"

    def _kill(self, w: int) -> None:
        proc = self._procs[w]
        proc.kill()
        proc.join(timeout=STOP_TIMEOUT_S)
        self._conns[w].close()
        self._conns[w] = self._procs[w] = None  # close() skips it

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._who()}: the environments are closed")

    # --- the VecEnv -----------------------------------------------------------------------
    def reset(
        self, *, seed: int | Sequence[int] | None = None, env_ids: torch.Tensor | None = None
    ) -> Observation:
        self._check_open()
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in env_ids.tolist()]
        seeds = reset_seeds(seed, ids)
        for i, s in zip(ids, seeds):
            self._seeds[i] = s
        self._elapsed[ids] = 0
        for w in range(len(self._conns)):
            lo, hi = self._starts[w], self._starts[w + 1]
            mine = [(i - lo, s) for i, s in zip(ids, seeds) if lo <= i < hi]
            self._send(w, "reset", ("reset", ([i for i, _ in mine], [s for _, s in mine])))
        deadline = self._deadline("reset")
        packs = [self._recv(w, "reset", deadline) for w in range(len(self._conns))]
        return to_observation(_cat(packs))

    def step(self, actions: torch.Tensor) -> StepOutput:
        """actions: f32 [B, A] physical units."""
        self.step_async(actions, self._everyone)
        return self.step_wait(self._everyone)

    def _split(
        self, env_ids: torch.Tensor, ordered: bool = True
    ) -> list[tuple[int, list[int], list[int]]]:
        """(worker, local ids, positions in env_ids) per worker holding some of env_ids; cached
        per id set (a rollout steps the same sets every step). ``ordered``: the ids must be
        ascending (a render places each frame by its position: any order)."""
        key = tuple(env_ids.tolist())
        if key not in self._splits:
            out = []
            for w in range(len(self._conns)):
                lo, hi = self._starts[w], self._starts[w + 1]
                pos = [j for j, i in enumerate(key) if lo <= i < hi]
                if pos:
                    out.append((w, [key[j] - lo for j in pos], pos))
            self._splits[key] = (out, list(key) == sorted(set(key)))
        out, ascending = self._splits[key]
        if ordered and not ascending:  # (a step's answers are joined in worker order)
            raise ValueError(f"env_ids: must be ascending and distinct, got {list(key)}")
        return out

    def step_async(self, actions: torch.Tensor, env_ids: torch.Tensor) -> None:
        """Start stepping environments ``env_ids`` (long [N], ascending) with actions f32 [N, A];
        workers queue requests in order, so several subsets may be in flight."""
        self._check_open()
        a = actions.detach().to("cpu", torch.float32).numpy()
        refuse_non_finite(self._who(), a, env_ids)  # (a NaN was ManiSkill's drive target)
        for w, local, pos in self._split(env_ids):
            self._send(w, "step", ("step", (local, a[pos])))

    def step_wait(self, env_ids: torch.Tensor) -> StepOutput:
        """Finish the ``step_async`` of ``env_ids``; every tensor has N = len(env_ids) rows. A
        worker that has not answered within ``step_timeout_s`` raises WorkerTimeout."""
        self._check_open()
        what = self._step_kind(env_ids) if self._procs else "step"
        deadline = self._deadline(what)
        results = [self._recv(w, what, deadline) for w, _, _ in self._split(env_ids)]
        scalars = torch.from_numpy(np.concatenate([r[1] for r in results]))  # f32 [N, 4]
        obs = to_observation(_cat([r[0] for r in results]))
        final = None
        if any(r[2] is not None for r in results):
            final = to_observation(_cat([r[2] if r[2] is not None else r[0] for r in results]))
        terminated = scalars[:, 1] > 0
        truncated = scalars[:, 2] > 0
        for i in env_ids[terminated | truncated].tolist():  # (a hang's seed is not the round's)
            self._seeds[i] = AUTO_RESET
            self._elapsed[i] = 0
        return StepOutput(
            obs=obs,
            reward=scalars[:, 0].contiguous(),
            terminated=terminated,
            truncated=truncated,
            success=scalars[:, 3] > 0,
            final_obs=final,
            ended=ended_rows(terminated | truncated),
        )

    def _step_kind(self, env_ids: torch.Tensor) -> str:
        """What a step of ``env_ids`` is, for its deadline: "step that resets" where it reaches
        an environment's time limit (its worker resets it within the step: a reset's time, as
        every round's last step on ManiSkill and LIBERO), else "step"."""
        ids = env_ids.numpy()
        self._elapsed[ids] += 1
        limit = self.spec.max_episode_steps
        return "step that resets" if (self._elapsed[ids] >= limit).any() else "step"

    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [B, H, W, 3], or [N, H, W, 3] for ``env_ids``: only their workers render."""
        self._check_open()
        if env_ids is None:
            for w in range(len(self._conns)):
                self._send(w, "render", ("render", (None,)))
            deadline = self._deadline("render")
            frames = [self._recv(w, "render", deadline) for w in range(len(self._conns))]
            return torch.from_numpy(np.concatenate(frames))
        parts = self._split(env_ids, ordered=False)
        for w, local, _ in parts:
            self._send(w, "render", ("render", (local,)))
        deadline = self._deadline("render")
        answers = [(pos, self._recv(w, "render", deadline)) for w, _, pos in parts]
        frames = np.empty((len(env_ids), *answers[0][1].shape[1:]), np.uint8)  # [N, H, W, 3]
        for pos, frame in answers:
            frames[pos] = frame
        return torch.from_numpy(frames)

    def close(self) -> None:
        """Close every core; a worker that does not finish within STOP_TIMEOUT_S is killed."""
        if self._closed:
            return
        self._closed = True
        if self._conns and not self._procs:  # in process
            self._conns[0].send(("close", None))
        for conn, proc in zip(self._conns, self._procs):
            if proc is not None:  # None: killed already
                _stop(conn, proc)
        self._conns = []
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _answered(conn, deadline: float) -> bool:
    """Whether ``conn`` has an answer by ``deadline`` (monotonic seconds), polled a slice at a
    time: a poll of more than ~24 days overflows (a week's step timeout gives resets ten)."""
    while True:
        left = deadline - time.monotonic()
        if conn.poll(max(0.0, min(left, POLL_SLICE_S))):
            return True
        if left <= POLL_SLICE_S:
            return False


def _stop(conn, proc) -> None:
    """Ask a worker to close its core, read what it still sends (answers in flight, then the
    end of the pipe when it exits) and wait for it; kill it if it does not finish in time."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    try:
        conn.send(("close", None))
        while conn.poll(max(0.0, deadline - time.monotonic())):
            conn.recv()
    except (BrokenPipeError, EOFError, OSError):
        pass  # it exited (or was gone already)
    conn.close()
    proc.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=STOP_TIMEOUT_S)
