"""Forward and inverse kinematics of the SO-101 (simulators/mujoco/arm.py) in torch, batched over
worlds on any device: what the scripted experts steer with.

``forward`` follows the description's body frames from the base to the gripper (each joint turns
about its frame's z) and returns the tool point and the gripper's frame. ``solve`` is damped
Gauss-Newton on a residual of the tool point's position and, optionally, the gripper pointing
down with its jaws closing along a table axis; its Jacobian is taken by finite differences, all
worlds and all perturbations in one batch.
"""

from __future__ import annotations

import mujoco
import numpy as np
import torch

from embodied.simulators.mujoco.arm import BODIES, JOINTS, RANGES, TCP

ARM_JOINTS = 5  # pan, lift, elbow, wrist flex, wrist roll: the gripper moves no frame of the chain


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split()]


def _quat_matrix(q: list[float]) -> torch.Tensor:
    """f64 [3, 3] rotation of a quaternion (w, x, y, z), normalised first (MuJoCo's own)."""
    quat = np.array(q, dtype=np.float64)
    mujoco.mju_normalize4(quat)
    matrix = np.zeros(9)
    mujoco.mju_quat2Mat(matrix, quat)
    return torch.from_numpy(matrix.reshape(3, 3))


class Chain:
    """The SO-101's joint frames from the base to the gripper, on ``device`` (float32)."""

    def __init__(self, device: torch.device | str = "cpu"):
        links = [b for b in BODIES if b.joint in JOINTS[:ARM_JOINTS]]  # in chain order
        self.offsets = torch.tensor([_floats(b.pos) for b in links], device=device)  # f32 [5, 3]
        rotations = [_quat_matrix(_floats(b.quat)) for b in links]
        self.rotations = torch.stack(rotations).float().to(device)  # f32 [5, 3, 3]
        self.tcp = torch.tensor(_floats(TCP), device=device)  # f32 [3]
        lows = [RANGES[j][0] for j in JOINTS[:ARM_JOINTS]]
        highs = [RANGES[j][1] for j in JOINTS[:ARM_JOINTS]]
        self.low = torch.tensor(lows, device=device)  # f32 [5]
        self.high = torch.tensor(highs, device=device)  # f32 [5]

    def forward(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: f32 [N, >=5] joint angles -> (tool point f32 [N, 3], gripper frame f32 [N, 3, 3],
        its columns the frame's axes in the base frame)."""
        n = q.shape[0]
        p = torch.zeros(n, 3, device=q.device)  # f32 [N, 3]
        R = torch.eye(3, device=q.device).expand(n, 3, 3)  # f32 [N, 3, 3]
        for j in range(ARM_JOINTS):
            p = p + R @ self.offsets[j]
            c = torch.cos(q[:, j])
            s = torch.sin(q[:, j])
            zero = torch.zeros_like(c)
            one = torch.ones_like(c)
            turn = torch.stack(
                [
                    torch.stack([c, -s, zero], -1),
                    torch.stack([s, c, zero], -1),
                    torch.stack([zero, zero, one], -1),
                ],
                -2,
            )  # f32 [N, 3, 3]: about the frame's z
            R = R @ self.rotations[j] @ turn
        return p + R @ self.tcp, R

    def residual(
        self, q: torch.Tensor, target: torch.Tensor, down: bool, across: torch.Tensor | None
    ) -> torch.Tensor:
        """f32 [N, 3] (position) or [N, 7] (and the fingers pointing down, the jaws closing
        across ``across`` (f32 [N, 2], a direction on the table) or else along a table axis).
        Orientation weighs 0.01 per radian against metres: position comes first."""
        p, R = self.forward(q)
        r = [p - target]
        if down:
            r.append(0.01 * (R[:, :, 2] - R.new_tensor([0.0, 0.0, 1.0])))  # fingers point down
            jaw = R[:, :, 0]  # the direction the jaws close along
            if across is None:
                aligned = 2.0 * jaw[:, 0] * jaw[:, 1]  # sin 2(angle to x): 0 along x and y
            else:
                aligned = (jaw[:, :2] * across).sum(1)  # cos(angle to across): 0 across it
            r.append(0.01 * aligned[:, None])
        return torch.cat(r, 1)

    def solve(
        self,
        target: torch.Tensor,
        start: torch.Tensor,
        *,
        down: bool = False,
        across: torch.Tensor | None = None,
        iterations: int = 12,
        damping: float = 1e-4,
    ) -> torch.Tensor:
        """Joint angles f32 [N, 5] that bring the tool point to ``target`` (f32 [N, 3]), from
        ``start`` (f32 [N, >=5]); with ``down`` the gripper points down, its jaws closing across
        ``across`` or else along x or y. Without it the wrist roll stays where it started."""
        q = start[:, :ARM_JOINTS].clone()
        free = ARM_JOINTS if down else ARM_JOINTS - 1
        eps = 1e-3
        eye = torch.eye(free, device=q.device)
        for _ in range(iterations):
            bumped = q[None].repeat(free + 1, 1, 1)  # f32 [free + 1, N, 5]
            for k in range(free):
                bumped[k + 1, :, k] += eps
            repeat = None if across is None else across.repeat(free + 1, 1)
            r = self.residual(bumped.flatten(0, 1), target.repeat(free + 1, 1), down, repeat)
            r = r.view(free + 1, q.shape[0], -1)  # f32 [free + 1, N, R]
            J = ((r[1:] - r[:1]) / eps).permute(1, 2, 0)  # f32 [N, R, free]
            JT = J.transpose(1, 2)
            # (solve_ex: solve checks for a singular matrix by a read from a GPU; damped, none is)
            step = torch.linalg.solve_ex(
                JT @ J + damping * eye, -(JT @ r[0][..., None]), check_errors=False
            ).result
            q[:, :free] = q[:, :free] + step[..., 0]
            q = torch.maximum(torch.minimum(q, self.high), self.low)
        return q
