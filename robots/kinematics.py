"""Forward kinematics of a 5-DoF desktop arm (SO-100/SO-101 class) for the safety layer's
workspace box: joint angles (radians) -> tool point (metres, in the arm's base frame).

The chain is the one of the MuJoCo arm in simulators/mujoco/arm.py (the digital twin): pan about
z, then shoulder lift, elbow and wrist flex about y, wrist roll about x; at zero the upper arm
points up and the forearm forward (+x). tests/test_robots.py checks this against MuJoCo's own
tool-point site. A real arm's link lengths and zero pose after LeRobot's calibration differ
somewhat: give its own ``ArmGeometry`` in the robot's safety config where that matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArmGeometry:
    """Link offsets in metres (the twin's defaults)."""

    shoulder_height: float = 0.05  # base to the pan joint
    lift_height: float = 0.05  # pan joint to the shoulder-lift joint
    upper_arm: float = 0.116  # shoulder lift to elbow, along z at zero
    forearm: float = 0.135  # elbow to wrist flex, along x at zero
    wrist_to_roll: float = 0.04  # wrist flex to the roll joint, along x
    roll_to_tcp: float = 0.06  # roll joint to the tool point, along x


def _rot(axis: str, angle: np.ndarray) -> np.ndarray:
    """Rotation matrices float64 [N, 3, 3] about a principal axis."""
    c, s = np.cos(angle), np.sin(angle)
    one = np.ones_like(c)  # f64 [N]
    zero = np.zeros_like(c)  # f64 [N]
    rows = {
        "x": [[one, zero, zero], [zero, c, -s], [zero, s, c]],
        "y": [[c, zero, s], [zero, one, zero], [-s, zero, c]],
        "z": [[c, -s, zero], [s, c, zero], [zero, zero, one]],
    }[axis]
    return np.stack([np.stack(r, -1) for r in rows], -2)


def tool_point(joints: np.ndarray, geometry: ArmGeometry = ArmGeometry()) -> np.ndarray:
    """joints: float [..., >=5] radians (pan, lift, elbow, wrist flex, wrist roll, [gripper]) ->
    float64 [..., 3] tool-point position."""
    q = np.asarray(joints, dtype=np.float64)
    lead = q.shape[:-1]
    q = q.reshape(-1, q.shape[-1])
    g = geometry
    p = np.zeros((len(q), 3))
    p[:, 2] = g.shoulder_height
    R = _rot("z", q[:, 0])
    p = p + R @ np.array([0, 0, g.lift_height])
    R = R @ _rot("y", q[:, 1])
    p = p + R @ np.array([0, 0, g.upper_arm])
    R = R @ _rot("y", q[:, 2])
    p = p + R @ np.array([g.forearm, 0, 0])
    R = R @ _rot("y", q[:, 3])
    p = p + R @ np.array([g.wrist_to_roll, 0, 0])
    R = R @ _rot("x", q[:, 4])  # the roll turns about the tool axis: it moves no tool point on it
    p = p + R @ np.array([g.roll_to_tcp, 0, 0])
    return p.reshape(*lead, 3)
