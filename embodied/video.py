"""MP4 writing of evaluation frames (imageio + ffmpeg)."""

from __future__ import annotations

import os
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import torch


def tile(frames: torch.Tensor, max_tiles: int = 4) -> np.ndarray:
    """uint8 [B, H, W, 3] -> one uint8 [rows*H, cols*W, 3] grid of the first ``max_tiles`` envs."""
    f = frames[:max_tiles].cpu().numpy()
    n = f.shape[0]
    cols = int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / cols))
    pad = np.zeros((rows * cols - n, *f.shape[1:]), dtype=np.uint8)
    f = np.concatenate([f, pad]).reshape(rows, cols, *f.shape[1:])
    return f.transpose(0, 2, 1, 3, 4).reshape(rows * f.shape[2], cols * f.shape[3], 3)


def write_mp4(path: Path, frames: list[np.ndarray], fps: float) -> Path:
    """``frames`` as ``path``, whole or not at all (a full disk leaves no half video there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.partial{path.suffix}")  # (ffmpeg reads the suffix)
    try:
        imageio.mimwrite(str(partial), frames, fps=fps, codec="libx264", macro_block_size=16)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
