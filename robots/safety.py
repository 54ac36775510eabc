"""The safety layer: every joint command on its way to an arm passes ``SafetyLayer.filter``,
whatever the policy, the server or the network does.

In order, for one command (radians, one value per joint):
1. a command with a NaN or an infinity is rejected whole: the arm holds its last command;
2. each joint is clipped to its position limits;
3. each joint moves at most ``max_step`` from the last command sent (a rate limit per step);
4. the tool point (forward kinematics) must stay inside the workspace box: a command that would
   leave it is cut back along the way from the last command to the furthest point inside.
Each intervention is logged and counted by kind. The watchdog, emergency stop and the shutdown
to a safe pose use the same filter (robots/control.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from embodied.robots.kinematics import ArmGeometry, tool_point

log = logging.getLogger(__name__)


# the tool point's box in the base frame (metres): the fingertips (6 mm below the tool point) down
# to the table and no lower, within the SO-101's reach (0.4 m out at its zero pose, 0.53 m up with
# the arm straight)
WORKSPACE_LOW = (-0.45, -0.45, 0.006)
WORKSPACE_HIGH = (0.45, 0.45, 0.55)


@dataclass
class SafetyConfig:
    """Per-robot limits, in radians and metres (robots/arm.py has the defaults of each arm)."""

    joint_low: tuple[float, ...]
    joint_high: tuple[float, ...]
    max_step: float | tuple[float, ...] = 0.05  # radians per control step (1.5 rad/s at 30 Hz)
    workspace_low: tuple[float, float, float] = WORKSPACE_LOW
    workspace_high: tuple[float, float, float] = WORKSPACE_HIGH
    safe_pose: tuple[float, ...] = ()  # where torque may be switched off (the arm rests folded)
    geometry: ArmGeometry = field(default_factory=ArmGeometry)
    hold_after_s: float = 0.25  # watchdog: no fresh action for this long -> hold position
    stop_after_s: float = 1.0  # still none -> move to the safe pose and stop

    def validate(self) -> None:
        n = len(self.joint_low)
        if len(self.joint_high) != n or (self.safe_pose and len(self.safe_pose) != n):
            raise ValueError("safety: joint_low, joint_high and safe_pose need one value per joint")
        if any(lo >= hi for lo, hi in zip(self.joint_low, self.joint_high)):
            raise ValueError("safety: joint_low must be below joint_high for every joint")
        if not 0 < self.hold_after_s < self.stop_after_s:
            raise ValueError("safety: need 0 < hold_after_s < stop_after_s")


class SafetyLayer:
    def __init__(self, cfg: SafetyConfig):
        cfg.validate()
        self.cfg = cfg
        self.low = np.asarray(cfg.joint_low, float)  # f64 [A]
        self.high = np.asarray(cfg.joint_high, float)  # f64 [A]
        self.max_step = np.broadcast_to(np.asarray(cfg.max_step, float), self.low.shape).copy()
        self.box = (np.asarray(cfg.workspace_low, float), np.asarray(cfg.workspace_high, float))
        self.counts: Counter[str] = Counter()
        self.last: np.ndarray | None = None  # the last command sent (radians)

    def start(self, present: np.ndarray) -> None:
        """Begin from the arm's measured position (the reference of the first rate limit)."""
        self.last = np.clip(np.asarray(present, float), self.low, self.high)

    def inside(self, joints: np.ndarray) -> bool:
        return self.outside(joints) == 0.0

    def outside(self, joints: np.ndarray) -> float:
        """How far the tool point is outside the workspace box (metres; 0 inside it)."""
        p = tool_point(joints, self.cfg.geometry)
        below = np.maximum(self.box[0] - p, 0.0)
        above = np.maximum(p - self.box[1], 0.0)
        return float(np.linalg.norm(below + above))

    def _intervene(self, kind: str, detail: str) -> None:
        """Count an intervention; log it at its 1st, 10th, 100th, ... time of its kind (a policy
        pressing on a limit would otherwise log every step; the counts go to the summary). Rate
        limits are how every move to a pose goes: debug only."""
        self.counts[kind] += 1
        count = self.counts[kind]
        if kind == "rate_limit":
            log.debug("safety: %s (%s)", kind, detail)
        elif str(count).rstrip("0") == "1":  # 1, 10, 100, ...
            log.warning("safety: %s (%s; %d so far)", kind, detail, count)

    def filter(self, command: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """command: float [A] radians -> (the command to send, float64 [A]; interventions made)."""
        if self.last is None:
            raise RuntimeError("SafetyLayer.start(present) must be called before the first command")
        q = np.asarray(command, float)
        kinds = []
        if q.shape != self.low.shape or not np.all(np.isfinite(q)):
            self._intervene("nonfinite", f"rejected {q.tolist()}")
            return self.last.copy(), ["nonfinite"]
        clipped = np.clip(q, self.low, self.high)
        beyond = np.abs(clipped - q) > 1e-9  # (a target an ulp outside, by rounding, is not)
        if beyond.any():
            kinds.append("joint_limit")
            self._intervene("joint_limit", f"joints {np.flatnonzero(beyond).tolist()}")
        step = np.clip(clipped - self.last, -self.max_step, self.max_step)
        # (beyond rounding: a step of max_step taken as last + s gives back s to an ulp)
        if np.any(np.abs(clipped - self.last) > np.asarray(self.max_step) * (1 + 1e-9)):
            kinds.append("rate_limit")
            self._intervene("rate_limit", f"max |step| {np.abs(clipped - self.last).max():.3f} rad")
        target = self.last + step
        if not self.inside(target) and self.outside(target) > self.outside(self.last):
            # the furthest point inside the box on the way there (bisection on the fraction);
            # from outside it (an arm that starts there, or pressed there), no step further out
            lo, hi = 0.0, 1.0
            if not self.inside(self.last):
                lo = hi = 0.0
            for _ in range(20):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if self.inside(self.last + mid * step) else (lo, mid)
            target = self.last + lo * step
            kinds.append("workspace")
            self._intervene(
                "workspace",
                f"tool point {tool_point(self.last + step, self.cfg.geometry).round(3).tolist()}",
            )
        self.last = target
        return target.copy(), kinds

    def within_limits(self, pose: np.ndarray) -> np.ndarray:
        """``pose`` clipped to the joint limits: where ``toward`` steps to (f64 [6])."""
        return np.clip(np.asarray(pose, float), self.low, self.high)

    def toward(self, pose: np.ndarray) -> np.ndarray:
        """One rate-limited step from the last command toward ``pose`` (a start pose, the safe
        pose): the rate limit is the plan here, not an intervention. Joint by joint, each part of
        the step that keeps the tool point in the box (or no further out) is taken, so that a
        straight line in joint space that dips out of the box (from a pose at the table, say)
        still makes headway instead of holding forever."""
        goal = self.within_limits(pose)
        step = np.clip(goal - self.last, -self.max_step, self.max_step)
        q = self.last.copy()
        for j in np.flatnonzero(step):
            trial = q.copy()
            trial[j] += step[j]
            if self.inside(trial) or self.outside(trial) <= self.outside(q):
                q = trial
        return self.filter(q)[0]
