"""Checkpoints: safetensors weights, optimizer, RNG and counters; a crash never leaves a
half-written checkpoint behind ``RUN/last`` or ``RUN/best``.

Layout::

    RUN/last -> checkpoints/iter_000010   the newest checkpoint
    RUN/best -> checkpoints/iter_000008   the best one (mark_best); retention keeps it
    RUN/checkpoints/iter_000010/model.safetensors  trainable weights and the other buffers
    RUN/checkpoints/iter_000010/trainer.pt         optimizer, RNG state, counters
    RUN/checkpoints/iter_000010/meta.json          the caller's meta plus "frozen"
    RUN/checkpoints/frozen-<digest>.safetensors    frozen weights, written once, shared
    RUN/checkpoints/iter_000010/model-tp00-of-02.safetensors  on the megatron backend: each TP
        rank's shard of the sharded weights and their Adam state (embodied/megatron/shards.py)

Frozen weights are parameters with requires_grad=False and the buffers of modules whose own
parameters are all frozen (BatchNorm statistics of a frozen encoder); their file is named by a
digest of its content, so checkpoints with the same frozen weights share it. A checkpoint is
written into a hidden directory, fsynced and renamed into place; a link is replaced by renaming
a new link over it. Names starting with "." in checkpoints/ belong to a save in progress; the
next save removes what an interrupted one left. ``load_checkpoint`` joins the shards of a sharded
checkpoint: every reader sees the torch layout.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from embodied.frozen_weights import frozen_digest, frozen_keys
from embodied.schema import UserError

MODEL = "model.safetensors"
STATE = "trainer.pt"
META = "meta.json"
LAST = "last"
BEST = "best"
ITERATION = re.compile(r"iter_(\d+)")


def misfit_detail(error: RuntimeError) -> str:
    """The first finding of ``load_state_dict``'s error (its first line only says it failed)."""
    text = str(error)
    return next((line.strip() for line in text.splitlines()[1:] if line.strip()), text)


def weights_misfit(path, error: RuntimeError) -> UserError:
    """Checkpoint ``path``'s weights that do not fit the policy its config builds now (a file
    the config names changed since: a vlm_path's model), as one line."""
    return UserError(f"{path}: its weights do not fit its policy ({misfit_detail(error)})")


class CheckpointError(UserError):
    """A checkpoint whose files cannot be read: damaged, or not written by embodied."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, say); the previous one stands."""


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
    run_dir: str | Path,
    iteration: int,
    *,
    model: torch.nn.Module,
    optimizer,
    counters: dict,
    meta: dict,
    rng: dict | None = None,
    keep: int | None = None,
    protect: Iterable[int] = (),
    shards=None,
) -> Path:
    """Write ``RUN/checkpoints/iter_{iteration:06d}`` and point ``RUN/last`` at it.

    rng: saved instead of the current RNG state (a dict as rng_state() returns it).
    keep: then delete the oldest checkpoints beyond the newest ``keep`` (None: keep all), never
    the one just saved, the best one or the iterations in ``protect``.
    shards: (directory) -> meta.json's "shards", called with ``staging_dir`` once it exists:
    writes the shard files there (with the other ranks) of the weights under its "modules",
    which model.safetensors then leaves out; the optimizer leaves out their state.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep: at least 1 checkpoint, got {keep}")
    run_dir = Path(run_dir)
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(run_dir, iteration)
    tmp = staging_dir(run_dir, iteration)
    trainer = {
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "rng": rng if rng is not None else rng_state(),
        "counters": counters,
    }
    try:
        _write_staged(tmp, model, trainer, meta, shards)
    except (OSError, RuntimeError, SafetensorError) as e:  # (safetensors' is neither)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, RuntimeError) and not _write_failed(e):
            raise  # (a fault of the shards' writer or of torch: its own traceback)
        raise CheckpointWriteError(not_written(final, run_dir, e)) from e
    _move_in(tmp, final, run_dir)
    _point(run_dir / LAST, final)
    if keep is not None:
        spare = {iteration, best_iteration(run_dir), *protect}
        _prune(ckpts, keep, spare)
    _remove_leftovers(run_dir)
    _remove_unused_frozen(ckpts)
    return final


def _write_staged(tmp: Path, model: torch.nn.Module, trainer: dict, meta: dict, shards) -> None:
    """The checkpoint's files, synced, into the staging directory ``tmp`` (its frozen weights
    beside it, in checkpoints/, where they are missing)."""
    state = model.state_dict(keep_vars=True)
    frozen_names = frozen_keys(model)
    frozen = {k: v for k, v in state.items() if k in frozen_names}
    frozen_file = _save_frozen(tmp.parent, model, frozen) if frozen else None
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    sharded = {}
    if shards is not None:
        from embodied.megatron.shards import module_prefixes

        sharded = {"shards": shards(tmp)}
        prefixes = tuple(module_prefixes(sharded["shards"]))
        state = {k: v for k, v in state.items() if not k.startswith(prefixes)}
    _save_tensors({k: v for k, v in state.items() if k not in frozen}, tmp / MODEL)
    _write_trainer_and_meta(tmp, trainer, {**meta, **sharded, "frozen": frozen_file})


def _write_failed(error: RuntimeError) -> bool:
    """Whether torch's ``error`` is its writer's report of a file it could not write (a full
    disk, a quota): torch.save raises RuntimeError for those."""
    said = str(error)
    return any(m in said for m in ("PytorchStreamWriter", "inline_container", "iostream error"))


def not_written(final: Path, run_dir: Path, error: BaseException) -> str:
    """Why the checkpoint ``final`` is not there, the disk's free space and what stands."""
    free_mb = shutil.disk_usage(final.parent).free / 2**20
    last = _target(run_dir / LAST)
    stands = f"the last complete checkpoint is {last}" if last else "no checkpoint was saved"
    why = " ".join(str(error).split()) or type(error).__name__
    return f"checkpoint {final} not written ({why}; {free_mb:.0f} MiB free there); {stands}"


def _write_trainer_and_meta(staging: Path, trainer: dict, meta: dict) -> None:
    """trainer.pt and meta.json into the staging directory, each synced, then the directory."""
    torch.save(trainer, staging / STATE)
    fsync(staging / STATE)
    (staging / META).write_text(json.dumps(meta, indent=2))
    fsync(staging / META)
    fsync(staging)


def checkpoint_dir(run_dir: str | Path, iteration: int) -> Path:
    """``RUN/checkpoints/iter_{iteration:06d}``: where the checkpoint of ``iteration`` lives."""
    return Path(run_dir) / "checkpoints" / f"iter_{iteration:06d}"


def staging_dir(run_dir: str | Path, iteration: int) -> Path:
    """Where ``save_checkpoint`` writes the checkpoint of ``iteration`` before renaming it into
    place (other ranks write their shards there)."""
    return Path(run_dir) / "checkpoints" / f".iter_{iteration:06d}.tmp"


def mark_best(run_dir: str | Path, iteration: int) -> Path:
    """Point ``RUN/best`` at the checkpoint of ``iteration`` (which must exist)."""
    run_dir = Path(run_dir)
    ckpt = checkpoint_dir(run_dir, iteration)
    if not (ckpt / META).is_file():
        raise FileNotFoundError(f"no checkpoint {ckpt} to mark as the best")
    _point(run_dir / BEST, ckpt)
    return ckpt


def point_best(run_dir: str | Path, iteration: int | None) -> None:
    """``RUN/best`` at the checkpoint of ``iteration`` where it exists, else no ``best``: a run
    resumed from an older checkpoint takes that checkpoint's best, which a later checkpoint's
    may have replaced."""
    run_dir = Path(run_dir)
    if iteration is not None and (checkpoint_dir(run_dir, iteration) / META).is_file():
        mark_best(run_dir, iteration)
    elif (run_dir / BEST).is_symlink():
        (run_dir / BEST).unlink()
        fsync(run_dir)


def drop_checkpoints_after(run_dir: str | Path, iteration: int) -> list[str]:
    """Remove the checkpoints newer than ``iteration`` (a run resumed from an older checkpoint
    abandons them: left, they would count as the newest and the best); returns their names.
    ``best`` goes with them if it pointed at one; ``last`` then points at ``iteration``'s."""
    run_dir = Path(run_dir)
    ckpts = run_dir / "checkpoints"
    if not ckpts.is_dir():
        return []
    later = [path for it, path in iteration_dirs(ckpts) if it > iteration]
    if not later:
        return []
    # the links first: a crash at any point leaves them at complete checkpoints
    _point(run_dir / LAST, checkpoint_dir(run_dir, iteration))
    best = _target(run_dir / BEST)
    if best is not None and best in {path.resolve() for path in later}:
        (run_dir / BEST).unlink()
    for path in later:
        os.replace(path, ckpts / f".{path.name}.deleted")  # gone at once, removed below
    fsync(ckpts)
    _remove_leftovers(run_dir)
    _remove_unused_frozen(ckpts)
    return [path.name for path in later]


def best_iteration(run_dir: str | Path) -> int | None:
    """The iteration ``RUN/best`` points at; None without one."""
    best = Path(run_dir) / BEST
    if not (best / META).is_file():
        return None
    return int(ITERATION.search(best.resolve().name).group(1))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint path, a run directory (its ``last``) or
    ``RUN/last``."""
    p = Path(path)
    if (p / META).is_file():
        return p.resolve()
    if (p / LAST / META).is_file():
        return (p / LAST).resolve()
    raise FileNotFoundError(f"no checkpoint at {p} (expected {p / META} or {p / LAST / META})")


def load_checkpoint(path: str | Path, *, with_trainer_state: bool = True) -> dict:
    """{"path", "meta", "model": the full state dict (the weights that acted)} plus
    "optimizer", "rng", "counters" and "main_weights" (a bf16 megatron run's float32 weights)
    when ``with_trainer_state``."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    model = _load_tensors(ckpt / MODEL)
    if meta.get("frozen"):  # checkpoints from before frozen weights had their own file have none
        frozen = ckpt.parent / meta["frozen"]
        if not frozen.is_file():
            raise FileNotFoundError(
                f"{ckpt} keeps its frozen weights in {frozen}, which is missing "
                "(copy it along with the checkpoint directory)"
            )
        model.update(_load_tensors(frozen))
    out = {"path": ckpt, "meta": meta, "model": model}
    if with_trainer_state:
        try:
            # (on the CPU: a GPU run's optimizer state resumes anywhere; the optimizer moves
            # it to its weights' device)
            out.update(torch.load(ckpt / STATE, map_location="cpu", weights_only=False))
        except Exception as e:  # (unpickling damaged bytes can raise almost any error)
            raise CheckpointError(
                f"{ckpt / STATE}: cannot be read ({e}); the checkpoint is damaged"
            ) from None
    if meta.get("shards"):
        from embodied.megatron.shards import join

        # (a bf16 run's float32 main weights: what a resumed run continues from, not what acted)
        mains = out.setdefault("main_weights", {}) if with_trainer_state else None
        try:
            join(
                read_shards(ckpt, meta["shards"]),
                meta["shards"],
                model,
                out.get("optimizer"),
                mains,
            )
        except CheckpointError:
            raise
        except ValueError as e:  # (shards that do not fit: named)
            raise CheckpointError(f"{ckpt}: {e}; the checkpoint is damaged") from None
    return out


def read_meta(ckpt: Path, *, of_policy: bool = False) -> dict:
    """The meta.json of checkpoint directory ``ckpt``; a CheckpointError where it is damaged or
    (``of_policy``) lacks the training config and the environment spec a policy is rebuilt
    from."""
    try:
        meta = json.loads((ckpt / META).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{ckpt / META}: not valid JSON ({e.msg}, line {e.lineno}); the checkpoint is damaged"
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{ckpt / META}: expected a JSON object, got {type(meta).__name__}")
    if of_policy:
        _require_policy_keys(ckpt, meta)
    return meta


def _require_policy_keys(ckpt: Path, meta: dict) -> None:
    missing = [key for key in ("config", "spec") if key not in meta]
    if missing:
        raise CheckpointError(
            f"{ckpt / META}: no {' or '.join(map(repr, missing))}; "
            "not a policy checkpoint written by embodied"
        )


def load_policy_checkpoint(path: str | Path, *, with_trainer_state: bool = False) -> dict:
    """``load_checkpoint`` of a checkpoint that a policy is rebuilt from: its meta.json must hold
    the training config and the environment spec."""
    ckpt = load_checkpoint(path, with_trainer_state=with_trainer_state)
    _require_policy_keys(ckpt["path"], ckpt["meta"])
    return ckpt


def write_shard(directory: Path, rank: int, size: int, tensors: dict[str, torch.Tensor]) -> None:
    """A TP rank's shard file (embodied/megatron/shards.py): ``tensors`` keyed
    "<kind>/<megatron name>" (and "step")."""
    from embodied.megatron.shards import shard_file

    _save_tensors(tensors, Path(directory) / shard_file(rank, size))


def read_shards(directory: Path, info: dict) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's shard file named in meta.json's "shards"."""
    files = []
    for name in info["files"]:
        path = Path(directory) / name
        if not path.is_file():
            raise CheckpointError(
                f"{directory}: the shard {name} is missing (a checkpoint saved at "
                f"TP={info['tensor_parallel']} needs all {len(info['files'])} shard files)"
            )
        files.append(_load_tensors(path))
    return files


def _load_tensors(path: Path) -> dict:
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise CheckpointError(f"{path}: cannot be read ({e}); the checkpoint is damaged") from None


def _save_frozen(ckpts: Path, model: torch.nn.Module, frozen: dict) -> str:
    """The name of the frozen weights' file, written unless it exists."""
    name = f"frozen-{frozen_digest(model, frozen)}.safetensors"
    if not (ckpts / name).exists():
        tmp = ckpts / f".{name}.tmp"
        try:
            _save_tensors(frozen, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)  # (the largest file: what a full disk needs back)
            raise
        os.replace(tmp, ckpts / name)
        fsync(ckpts)
    return name


def _save_tensors(tensors: dict, path: Path) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
    fsync(path)


def _move_in(tmp: Path, final: Path, run_dir: Path) -> None:
    """Rename ``tmp`` to ``final``. An existing ``final`` is renamed aside first and deleted once
    the new one is in place; links to it point meanwhile at a copy of it made of hard links."""
    if not final.exists():
        os.replace(tmp, final)
        fsync(final.parent)
        return
    links = [p for p in (run_dir / LAST, run_dir / BEST) if _target(p) == final.resolve()]
    pin = Path(tempfile.mkdtemp(prefix=f".{final.name}.pin-", dir=final.parent))
    shutil.copytree(final, pin, copy_function=_link, dirs_exist_ok=True)
    fsync(pin)
    for link in links:
        _point(link, pin)
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(tmp, final)
    fsync(final.parent)
    for link in links:
        _point(link, final)
    shutil.rmtree(old)
    shutil.rmtree(pin)


def _point(link: Path, target: Path) -> None:
    """Make the symlink ``link`` point at ``target`` (a relative path: the run can move)."""
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)
    fsync(link.parent)


def _target(link: Path) -> Path | None:
    return Path(os.path.realpath(link)) if link.is_symlink() else None


def iteration_dirs(folder: Path) -> list[tuple[int, Path]]:
    """(iteration, directory) of the ``iter_N`` folders in ``folder`` (the checkpoints in
    ``RUN/checkpoints``, the rollout records in ``RUN/rollouts``), oldest first."""
    found = [(ITERATION.fullmatch(p.name), p) for p in folder.iterdir()]
    return sorted((int(m.group(1)), p) for m, p in found if m)


def _prune(ckpts: Path, keep: int, spare: set) -> None:
    """Delete the checkpoints older than the newest ``keep``, except the iterations in spare."""
    for iteration, path in iteration_dirs(ckpts)[:-keep]:
        if iteration not in spare:
            os.replace(path, ckpts / f".{path.name}.deleted")  # gone at once, removed below


def _remove_leftovers(run_dir: Path) -> None:
    """Remove the hidden entries of checkpoints/ no link points at; a checkpoint renamed aside
    by a save interrupted before it renamed the new one in goes back instead."""
    ckpts = run_dir / "checkpoints"
    targets = {_target(run_dir / LAST), _target(run_dir / BEST)}
    for path in ckpts.glob(".*"):
        if path.resolve() in targets:
            continue
        original = ckpts / path.name[1:].removesuffix(".old")
        if path.name.endswith(".old") and not original.exists():
            os.replace(path, original)
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _remove_unused_frozen(ckpts: Path) -> None:
    metas = [p / META for p in ckpts.iterdir() if (p / META).is_file()]
    used = {json.loads(m.read_text()).get("frozen") for m in metas}
    for path in ckpts.glob("frozen-*.safetensors"):
        if path.name not in used:
            path.unlink()


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


def fsync(path: Path) -> None:
    """Flush a file or a folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
