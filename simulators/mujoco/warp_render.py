"""Batched rgb rendering on the env's device with MuJoCo Warp's ray caster: every world's cameras
in one launch, read into torch as uint8 [B, H, W, 3] without leaving the device.

MuJoCo Warp packs each pixel as one 32-bit word (0xAARRGGBB) in a buffer of all worlds' cameras
(``rgb_data``: [B, pixels of all cameras]); ``images`` views it through torch and unpacks the
channels with integer shifts. Before a render the scene's bounding volumes are refitted to where
the bodies are now (``refit_bvh``).
"""

from __future__ import annotations

from types import ModuleType

import mujoco
import torch


class WarpCameras:
    """``cameras`` (names in the model) at ``size`` x ``size`` for ``num_worlds`` worlds."""

    def __init__(
        self,
        wp: ModuleType,
        mjw: ModuleType,
        host_model: mujoco.MjModel,
        num_worlds: int,
        cameras: tuple[str, ...],
        size: int,
    ):
        self._mjw = mjw
        names = [host_model.camera(i).name for i in range(host_model.ncam)]
        active = [name in cameras for name in names]
        self.context = mjw.create_render_context(
            host_model,
            nworld=num_worlds,
            cam_res=(size, size),
            render_rgb=True,
            render_depth=False,
            cam_active=active,
            use_textures=False,
        )
        # the render context orders the active cameras by their index in the model
        order = [name for name in names if name in cameras]
        offsets = self.context.rgb_adr.numpy()
        self._offset = {name: int(offsets[k]) for k, name in enumerate(order)}
        self._packed = wp.to_torch(self.context.rgb_data).view(torch.int32)  # [B, P], no copy
        self.size = size

    def images(self, m, d) -> dict[str, torch.Tensor]:
        """Render every world's cameras now: camera -> uint8 [B, size, size, 3] on the device."""
        self._mjw.refit_bvh(m, d, self.context)
        self._mjw.render(m, d, self.context)
        pixels = self.size * self.size
        out = {}
        for name, start in self._offset.items():
            word = self._packed[:, start : start + pixels]  # int32 [B, H * W]: 0xAARRGGBB
            channels = [(word >> shift) & 0xFF for shift in (16, 8, 0)]
            rgb = torch.stack(channels, -1).to(torch.uint8)  # uint8 [B, H * W, 3]
            out[name] = rgb.view(-1, self.size, self.size, 3)
        return out
