"""Domain randomisation on MuJoCo Warp: the randomised model fields made per world.

MuJoCo Warp's kernels read a model field as ``field[world % len(field)]``: a field of one row is
shared, a field of B rows is each world's own. ``BatchedWorlds`` tiles the fields the
randomisation changes to B rows (once, before any CUDA graph is captured) and writes the rows of
the worlds that reset through torch views, on the device, with no host synchronisation. The light
has no per-world brightness in MuJoCo Warp's renderer; its position is per world.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from embodied.simulators.mujoco.randomize import WorldParams
from embodied.simulators.mujoco.worlds import Randomized

# the model fields randomisation writes (MuJoCo Warp's names)
FIELDS = (
    "body_mass",
    "body_inertia",
    "body_invweight0",
    "dof_invweight0",
    "body_subtreemass",
    "geom_size",
    "geom_rbound",
    "geom_aabb",
    "geom_friction",
    "actuator_gainprm",
    "actuator_biasprm",
    "cam_pos",
    "light_pos",
)


class BatchedWorlds:
    """The randomised fields of MuJoCo Warp model ``m`` as B rows, with torch views."""

    def __init__(self, wp: ModuleType, m, nominal: Randomized, num_worlds: int, device):
        self.nominal = nominal
        self.view: dict[str, torch.Tensor] = {}
        for name in FIELDS:
            one = getattr(m, name)
            rows = np.repeat(one.numpy()[:1], num_worlds, axis=0)  # [B, ...] of row 0
            tiled = wp.array(rows, dtype=one.dtype, device=one.device)
            setattr(m, name, tiled)
            self.view[name] = wp.to_torch(tiled)  # f32 [B, ...], no copy
        self._friction_geoms = torch.tensor(nominal.friction_geoms, device=device)
        self._friction = torch.tensor(nominal.friction, dtype=torch.float32, device=device)
        self._kp = torch.tensor(nominal.kp, dtype=torch.float32, device=device)
        self._camera_pos = torch.tensor(nominal.camera_pos, dtype=torch.float32, device=device)
        self._light_pos = torch.tensor(nominal.light_pos, dtype=torch.float32, device=device)
        self._inertia = torch.tensor(nominal.inertia, dtype=torch.float32, device=device)
        self._invweight = torch.tensor(nominal.invweight, dtype=torch.float32, device=device)
        self._dof_invweight = torch.tensor(
            nominal.dof_invweight, dtype=torch.float32, device=device
        )

    def put(self, ids: torch.Tensor, p: WorldParams) -> None:
        """Worlds ``ids`` (int64 [N] on the device) take the draws ``p`` (N worlds)."""
        v = self.view
        n = self.nominal
        if n.cube_body >= 0:
            half = n.half * p.cube_scale  # f32 [N]
            v["geom_size"][ids, n.cube_geom] = half[:, None].expand(-1, 3)
            v["geom_rbound"][ids, n.cube_geom] = half * 3.0**0.5
            v["geom_aabb"][ids, n.cube_geom, 1] = half[:, None].expand(-1, 3)
            # as Randomized.apply: a solid cube, what mj_setConst derives (inverse weights, masses)
            scales = torch.stack([p.mass_scale, p.mass_scale * p.cube_scale**2], 1)  # f32 [N, 2]
            v["body_mass"][ids, n.cube_body] = n.mass * p.mass_scale
            v["body_inertia"][ids, n.cube_body] = self._inertia * scales[:, 1:]
            v["body_invweight0"][ids, n.cube_body] = self._invweight / scales
            dofs = slice(n.cube_dof, n.cube_dof + 6)
            per_dof = scales.repeat_interleave(3, dim=1)  # f32 [N, 6]
            v["dof_invweight0"][ids, dofs] = self._dof_invweight / per_dof
            v["body_subtreemass"][ids, n.cube_body] = n.mass * p.mass_scale
            v["body_subtreemass"][ids, 0] = n.world_mass + n.mass * (p.mass_scale - 1.0)
        friction = self._friction * p.friction_scale[:, None]  # f32 [N, G]
        v["geom_friction"][ids[:, None], self._friction_geoms, 0] = friction
        kp = self._kp * p.gain_scale  # f32 [N, 6]
        v["actuator_gainprm"][ids, :, 0] = kp
        v["actuator_biasprm"][ids, :, 1] = -kp
        v["cam_pos"][ids, n.camera] = self._camera_pos + p.camera_offset
        v["light_pos"][ids, 0] = self._light_pos + p.light_offset
