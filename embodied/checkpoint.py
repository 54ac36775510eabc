"""Checkpoints: safetensors weights, optimizer, RNG and counters, written atomically.

Layout: ``RUN/checkpoints/iter_000010/{model.safetensors, trainer.pt, meta.json}`` and the symlink
``RUN/last`` pointing at the newest one. A checkpoint is written into a temporary directory and
renamed into place, and ``last`` is replaced with an atomic rename, so a crash never leaves a
half-written checkpoint behind ``last``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MODEL, STATE, META = "model.safetensors", "trainer.pt", "meta.json"


def rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: Path, iteration: int, *, model: torch.nn.Module, optimizer, counters: dict, meta: dict
) -> Path:
    run_dir = Path(run_dir)
    final = run_dir / "checkpoints" / f"iter_{iteration:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp / MODEL)
    )
    torch.save(
        {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "rng": rng_state(),
            "counters": counters,
        },
        tmp / STATE,
    )
    (tmp / META).write_text(json.dumps(meta, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    link, tmp_link = run_dir / "last", run_dir / ".last.tmp"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    os.symlink(final.relative_to(run_dir), tmp_link)
    os.replace(tmp_link, link)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint path, a run directory (its ``last``) or ``RUN/last``."""
    p = Path(path)
    if (p / META).is_file():
        return p.resolve()
    if (p / "last" / META).is_file():
        return (p / "last").resolve()
    raise FileNotFoundError(f"no checkpoint at {p} (expected {p / META} or {p / 'last' / META})")


def load_checkpoint(path: str | Path, *, with_trainer_state: bool = True) -> dict:
    ckpt = resolve_checkpoint(path)
    out = {
        "path": ckpt,
        "meta": json.loads((ckpt / META).read_text()),
        "model": load_file(str(ckpt / MODEL)),
    }
    if with_trainer_state:
        out.update(torch.load(ckpt / STATE, weights_only=False))
    return out
