"""What a MuJoCo Warp step checks without waiting on the device (simulators/mujoco/warp_env.py).

Two things go wrong inside the device's work where no one sees them: a world needs more contacts
or constraints than MuJoCo Warp's buffers hold (it drops the rest silently), and a policy sends
an action that is not finite (its world's servo target would stay NaN until the episode ends).
``StepGuard`` keeps both on the device: a kernel launched after every substep tracks the buffer
peaks (they only grow), and every step marks the worlds whose action was not finite (that action
acts as zero meanwhile). They reach the host where a step reads the device anyway (the done
mask), else one call late at each reset and where episodes end (``LaggedRead``: no wait), and
at ``close``: an error naming the task, the buffer or the worlds.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import torch

from embodied.schema import UserError


class BufferOverflow(UserError, RuntimeError):
    """A world needed more contacts or constraints than MuJoCo Warp's buffers hold (its message
    names the setting that raises them: a user's fix, one line)."""


class LaggedRead:
    """A small device tensor read on the host one call late, so that no call waits on the
    device: each call starts a copy into host memory (pinned on a GPU) and returns what the
    call before copied, or None (the first call, or that copy still in flight on a GPU)."""

    def __init__(self, like: torch.Tensor):
        pinned = like.device.type == "cuda"
        self._host = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
        self._landed: torch.cuda.Event | None = None  # on a GPU: set when the copy is done
        self._copied = False  # a copy was started and not returned yet

    def __call__(self, source: torch.Tensor) -> list | None:
        ready = self._copied and (self._landed is None or self._landed.query())
        if self._copied and not ready:
            return None  # in flight: returned by a later call
        before = self._host.tolist() if ready else None
        self._host.copy_(source, non_blocking=True)
        if source.device.type == "cuda":
            self._landed = torch.cuda.Event()
            self._landed.record(torch.cuda.current_stream(source.device))
        self._copied = True
        return before


@cache
def _peak_kernel():
    """Warp kernel: peaks[0] = max(peaks[0], contacts of all worlds), peaks[1] = max(peaks[1],
    constraints of any one world). Launched after every substep, so no overflow goes unseen."""
    import warp as wp

    @wp.kernel
    def track_peaks(
        nacon: wp.array(dtype=int), nefc: wp.array(dtype=int), peaks: wp.array(dtype=int)
    ):
        world = wp.tid()
        wp.atomic_max(peaks, 1, nefc[world])
        if world == 0:
            wp.atomic_max(peaks, 0, nacon[0])

    return track_peaks


class StepGuard:
    """The buffer peaks and the worlds given a non-finite action of one env's MuJoCo Warp data
    ``data`` (``nworld`` worlds on torch's ``device``); ``task`` names the env in errors."""

    def __init__(self, wp: Any, data: Any, task: str, device: torch.device):
        self._wp = wp
        self._data = data
        self.task = task
        self.peaks = wp.zeros(2, dtype=int)  # int32 [2]: contacts (all worlds), constraints
        self._peaks = wp.to_torch(self.peaks)  # (a view)
        # bool [B]: the worlds given a non-finite action since the env was built
        self._non_finite = torch.zeros(data.nworld, dtype=torch.bool, device=device)
        self._lagged = LaggedRead(self._flags())
        self.raised = False  # an error was raised (close does not raise it again)

    def track_peaks(self) -> None:
        """After a substep, on the current stream (a CUDA graph captures it)."""
        d = self._data
        self._wp.launch(_peak_kernel(), dim=d.nworld, inputs=[d.nacon, d.nefc, self.peaks])

    def restart_peaks(self) -> None:
        self.peaks.zero_()

    def finite(self, actions: torch.Tensor) -> torch.Tensor:
        """``actions`` (f32 [B, A]) with every non-finite entry 0; its world is marked."""
        finite = torch.isfinite(actions)  # bool [B, A]
        self._non_finite |= ~finite.all(1)
        return torch.where(finite, actions, torch.zeros_like(actions))

    def _flags(self) -> torch.Tensor:
        """int32 [3]: the peak contacts and constraints, and how many worlds had a bad action."""
        return torch.cat([self._peaks, self._non_finite.sum().to(torch.int32).view(1)])

    @property
    def buffer_peaks(self) -> tuple[int, int]:
        """(contacts of all worlds, constraints of one world): the largest counts seen so far."""
        contacts, constraints = self._peaks.tolist()
        return contacts, constraints

    def check(self) -> None:
        """Raise what the flags say now (reads three ints from the device)."""
        self._raise_on(*self._flags().tolist())

    def check_lagged(self) -> None:
        """Check the flags as the last call copied them, and copy them again (no wait: they only
        grow, so a later look misses nothing)."""
        flags = self._lagged(self._flags())
        if flags is not None:
            self._raise_on(*flags)

    def read_with(self, terminated: torch.Tensor) -> np.ndarray:
        """The terminated mask (bool [B]) on the host, the flags checked in the same read."""
        flags = torch.cat([terminated.to(torch.int32), self._flags()]).cpu().numpy()  # one sync
        self._raise_on(*flags[-3:].tolist())
        return flags[:-3].astype(bool)

    def _raise_on(self, contacts: int, constraints: int, non_finite: int) -> None:
        d = self._data
        self.raised = contacts > d.naconmax or constraints > d.njmax or non_finite > 0
        if contacts > d.naconmax:
            raise BufferOverflow(
                f"MuJoCo Warp task {self.task!r}: {contacts} contacts in one substep (all worlds "
                f"together), more than its contact buffer holds ({d.naconmax}); raise "
                "env.nconmax (contacts per world)"
            )
        if constraints > d.njmax:
            raise BufferOverflow(
                f"MuJoCo Warp task {self.task!r}: {constraints} constraints in one world, more "
                f"than its constraint buffer holds ({d.njmax}); raise env.njmax"
            )
        if non_finite:
            worlds = torch.nonzero(self._non_finite).flatten().tolist()
            raise UserError(
                f"MuJoCo Warp task {self.task!r}: the actions of environments {worlds} were not "
                "finite (NaN or infinite; those entries acted as 0)"
            )
