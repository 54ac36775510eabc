"""Forward kinematics of the SO-101 for the safety layer's workspace box: joint angles (radians)
-> tool point (metres, in the arm's base frame).

The chain is the SO-101 of simulators/mujoco/arm.py (the digital twin; TheRobotStudio's
description): each joint turns about the z axis of its own frame, which sits at a fixed position
and orientation in its parent's. robots/ may not import the simulators, so the numbers are
written here too; tests/test_robots.py checks this against MuJoCo's own tool-point site. Another
arm (a Koch, an SO-100 with its own links) gives its own ``ArmGeometry`` in the safety config.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Frame = tuple[tuple[float, float, float], tuple[float, float, float, float]]  # pos, quat w x y z

SO101_FRAMES: tuple[Frame, ...] = (
    ((0.0388353, 0.0, 0.0624), (0.0, 0.0, -1.0, 0.0)),  # shoulder_pan
    ((-0.0303992, -0.0182778, -0.0542), (0.5, -0.5, -0.5, -0.5)),  # shoulder_lift
    ((-0.11257, -0.028, 0.0), (0.707107, 0.0, 0.0, 0.707107)),  # elbow_flex
    ((-0.1349, 0.0052, 0.0), (0.707107, 0.0, 0.0, -0.707107)),  # wrist_flex
    ((0.0, -0.0611, 0.0181), (0.0172091, -0.0172091, 0.706897, 0.706897)),  # wrist_roll
)


@dataclass(frozen=True)
class ArmGeometry:
    """The joints' frames from the base to the wrist roll (each turning about its own z), and the
    tool point in the last one's frame (the twin's SO-101 by default)."""

    frames: tuple[Frame, ...] = SO101_FRAMES
    tcp: tuple[float, float, float] = (0.0133, -0.0002, -0.0984)


def _quat_matrix(quat: tuple[float, float, float, float]) -> np.ndarray:
    """float64 [3, 3] rotation of a unit quaternion (w, x, y, z)."""
    w, x, y, z = np.asarray(quat, np.float64) / np.linalg.norm(quat)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


def _rot_z(angle: np.ndarray) -> np.ndarray:
    """Rotation matrices float64 [N, 3, 3] about z."""
    c = np.cos(angle)
    s = np.sin(angle)
    zero = np.zeros_like(c)  # f64 [N]
    one = np.ones_like(c)  # f64 [N]
    rows = [[c, -s, zero], [s, c, zero], [zero, zero, one]]
    return np.stack([np.stack(r, -1) for r in rows], -2)


def tool_point(joints: np.ndarray, geometry: ArmGeometry = ArmGeometry()) -> np.ndarray:
    """joints: float [..., >=5] radians (pan, lift, elbow, wrist flex, wrist roll, [gripper]) ->
    float64 [..., 3] tool-point position."""
    q = np.asarray(joints, dtype=np.float64)
    lead = q.shape[:-1]
    q = q.reshape(-1, q.shape[-1])
    p = np.zeros((len(q), 3))  # f64 [N, 3]
    R = np.broadcast_to(np.eye(3), (len(q), 3, 3))  # f64 [N, 3, 3]
    for j, (pos, quat) in enumerate(geometry.frames):
        p = p + R @ np.asarray(pos, np.float64)
        R = R @ _quat_matrix(quat) @ _rot_z(q[:, j])
    p = p + R @ np.asarray(geometry.tcp, np.float64)
    return p.reshape(*lead, 3)
