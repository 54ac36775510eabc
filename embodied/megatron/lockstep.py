"""Tensor-parallel ranks for a run without a cluster (``trainer.tensor_parallel`` > 1): this
process is TP rank 0 and does all that a run does; ranks 1.. are helper processes that each
hold their shard of the learner and follow rank 0's learner in lockstep.

Every learner call that changes the learner's state or takes part in a collective (an update,
the normaliser, a load, a checkpoint: each rank writes its shard) is sent to every helper
first, through a pipe of its own: its name, its arguments (CPU tensors, pickled) and rank 0's
generator state. Every rank then runs the same call on the same data from the same state, so
the shards stay one model. The pipes have no timeout (a helper may wait through a long
collection or evaluation); a helper whose pipe closes (rank 0 is gone) exits. The collectives
inside a call keep the process group's timeout.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import multiprocessing
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from embodied import numerics
from embodied.checkpoint import (
    CheckpointWriteError,
    checkpoint_dir,
    not_written,
    rng_state,
    set_rng_state,
    staging_dir,
)
from embodied.config import ConfigError
from embodied.megatron import RankLost
from embodied.schema import UserError

# a helper that died leaves rank 0 waiting in a collective: this bounds the wait
COLLECTIVE_TIMEOUT_S = 600
# a helper sends its error before it exits, so before rank 0's collective fails: a margin only
HELPER_REPORT_S = 5


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _address() -> str:
    """Where the ranks meet: a file in a directory of its own, removed when this process
    exits (a TCP port picked and released beforehand could be taken in between)."""
    directory = tempfile.mkdtemp(prefix="embodied-tp-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return f"file://{directory}/rendezvous"


def _join(rank: int, size: int, address: str, device: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        backend, init_method=address, rank=rank, world_size=size, timeout=timeout
    )


def start_ranks(cfg, device, learner_class: type, *args) -> list:
    """Start TP ranks 1.. (processes, each building ``learner_class(cfg, *args, device)``) and
    make this process rank 0 of their group; returns [(process, its end of the control pipe)]."""
    if torch.device(device).type == "cuda":
        raise ConfigError(
            "trainer.tensor_parallel: ranks in processes of one run are CPU-only for now "
            "(each GPU rank needs a device of its own); use runner.device=cpu (embodied "
            "replay: --device cpu)"
        )
    size = cfg.trainer.tensor_parallel
    address = _address()
    context = multiprocessing.get_context("spawn")
    helpers = []
    for rank in range(1, size):
        ours, theirs = context.Pipe()
        serve_args = (rank, size, address, theirs, cfg, str(device), learner_class, args)
        helper = context.Process(target=serve, args=serve_args, daemon=True)
        helper.start()
        theirs.close()
        helpers.append((helper, ours))
    _join(0, size, address, str(device))
    pids = ", ".join(str(helper.pid) for helper, _ in helpers)
    print(f"trainer.tensor_parallel={size}: TP rank 0 in this process, the others in {pids}")
    return helpers


def serve(
    rank: int,
    size: int,
    address: str,
    control,
    cfg,
    device: str,
    learner_class: type,
    args: tuple,
) -> None:
    """A helper rank: build the learner (rank 0's initial weights arrive in its constructor),
    then run each call rank 0 sends until it says stop or is gone."""
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: rank 0 decides when to
    # stop (it saves first, which needs every rank), and ends the helpers itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    numerics.setup(cfg.runner.torch_threads)  # (and the pins of the run that started it)
    _join(rank, size, address, device)
    try:
        _serve_calls(rank, control, learner_class(cfg, *args, torch.device(device)))
    except (ConfigError, UserError):  # (every rank meets them: rank 0 says it, in one line)
        sys.exit(1)


def _serve_calls(rank: int, control, learner) -> None:
    """Run each call rank 0 sends to this helper's ``learner`` until it says stop or is gone."""
    while True:
        try:
            name, args, rng = control.recv()
        except EOFError:  # rank 0 is gone
            return
        if name == "stop":
            break
        set_rng_state(rng)
        if name == "save":  # this rank's shard; rank 0 writes the rest
            (directory,) = args
            try:
                learner.engine.write_shards(Path(directory))
            except Exception as error:  # (a full disk here: rank 0 reports it)
                control.send(("failed", f"TP rank {rank}: {type(error).__name__}: {error}"))
                sys.exit(1)
            continue
        getattr(learner, name)(*args)
    learner.close()


def _close_quietly(learner) -> None:
    """``learner.close()`` after a failure: its own error would hide the failure's."""
    try:
        learner.close()
    except Exception:
        pass


class Lockstep:
    """Rank 0's learner, each state-changing call broadcast to the helper ranks first."""

    def __init__(self, learner, helpers: list):
        self.learner = learner
        self.helpers = helpers
        self.busy = False  # inside a call: a failure there may leave the helpers in a collective

    def __getattr__(self, name: str):
        if name in getattr(self.learner, "lockstep_calls", ()):  # (a learner's own calls)
            return functools.partial(self._positional_call, name)
        return getattr(self.learner, name)  # (what only reads: device, lr, engine, ...)

    def _broadcast(self, name: str, *args) -> None:
        message = (name, args, rng_state())
        for _, control in self.helpers:
            control.send(message)

    def _call(self, name: str, *args, **kw):
        """``name`` on every rank: broadcast, then here. A helper gone (its pipe, or the
        collective it left) is a ``RankLost`` naming it, not the pipe's or gloo's error."""
        self.busy = True
        try:
            self._broadcast(name, *args)
            result = getattr(self.learner, name)(*args, **kw)
        except (OSError, RuntimeError) as error:
            self._raise_if_one_died(name, error)
            raise
        self.busy = False
        return result

    def _raise_if_one_died(self, name: str, error: BaseException) -> None:
        """``RankLost`` for a helper that has exited (or does within HELPER_REPORT_S: a
        collective fails as its peer's process ends). One that ended on an error of its own
        (exit code 1: every rank may have met the same one) has this rank's error named too."""
        deadline = time.monotonic() + HELPER_REPORT_S
        while True:
            for rank, (helper, _) in enumerate(self.helpers, 1):
                if not helper.is_alive():
                    how = f"TP rank {rank} (pid {helper.pid}) exited with code {helper.exitcode}"
                    here = "" if helper.exitcode < 0 else f"; rank 0: {_first_line(error)}"
                    raise RankLost(f"{how} during {name}{here}") from error
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)

    def _positional_call(self, name: str, *args):
        return self._call(name, *args)  # (the helpers get positional arguments only)

    def init_normalizer(self, obs) -> None:
        self._call("init_normalizer", obs)

    def add_round(self, batch) -> dict:
        return self._call("add_round", batch)

    def update(self) -> dict:
        return self._call("update")

    def start_update(self):
        return self._call("start_update")

    def set_lr(self, lr: float) -> None:
        self._call("set_lr", lr)

    def load(self, checkpoint: dict) -> None:
        self._call("load", checkpoint)

    def save(self, run_dir, iteration: int, **kw):
        """The helpers write their shards where rank 0's save stages the checkpoint. A helper
        that fails (its shard not written, or gone) fails the save as a full disk does here:
        CheckpointWriteError, with the helper's error where it sent one."""
        self.busy = True
        try:
            self._broadcast("save", str(staging_dir(run_dir, iteration)))
            path = self.learner.save(run_dir, iteration, **kw)
        except CheckpointWriteError:
            raise
        except (OSError, RuntimeError) as error:  # (a collective with a helper gone, its pipe)
            said = self._helper_failure()  # (a helper that could not write its shard says so)
            if said is None:
                self._raise_if_one_died("save", error)
            why = said or error
            final = checkpoint_dir(run_dir, iteration)
            raise CheckpointWriteError(not_written(final, Path(run_dir), why)) from error
        self.busy = False
        return path

    def _helper_failure(self) -> str | None:
        """What a helper that failed said before it exited, if one did."""
        for _, control in self.helpers:
            try:
                if control.poll(HELPER_REPORT_S):
                    kind, said = control.recv()
                    if kind == "failed":
                        return said
            except (EOFError, OSError):
                continue
        return None

    def close(self) -> None:
        """Stop the helper ranks and leave the group. After a failure inside a call the helpers
        may be waiting in a collective that never completes: they are terminated instead."""
        if not self.helpers:
            return
        if not self.busy:
            try:
                self._broadcast("stop")
            except OSError:  # (a helper gone since the last call: its pipe is broken)
                self.busy = True
        if self.busy:
            for helper, _ in self.helpers:
                helper.kill()  # (they ignore SIGTERM)
                helper.join(timeout=10)
            self.helpers = []
            _close_quietly(self.learner)  # (its process group: a later run in this process)
            return
        for helper, _ in self.helpers:
            helper.join(timeout=60)
            if helper.is_alive():
                helper.kill()
        self.helpers = []
        self.learner.close()
