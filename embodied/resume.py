"""Resuming a run from a checkpoint: the check that the config still describes the same run,
and the run directory taken back to the checkpoint (the metrics rows logged after it, the later
checkpoints and rollout records, the evaluation beside training that the resumed run runs
again)."""

from __future__ import annotations

from pathlib import Path

import torch

from embodied.checkpoint import (
    META,
    checkpoint_dir,
    drop_checkpoints_after,
    point_best,
)
from embodied.config import ConfigError
from embodied.logger import metrics_line, read_jsonl, write_atomic
from embodied.record_files import ABANDONED, drop_records_after


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out: dict[str, object] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


# keys a resumed run may change: where it writes, how it reports and how long it goes on
RESUME_FREE = (
    "runner.name",
    "runner.output_dir",
    "runner.resume",
    "runner.resume_force",
    "runner.overwrite",
    "runner.progress",
    "runner.max_minutes",
    "runner.eval_every",
    "runner.eval_episodes",
    "runner.final_eval_episodes",
    "runner.save_every",
    "runner.keep_checkpoints",
    "runner.video",
    "runner.trace",
    "runner.report",
    # what the run records (rollouts, spikes): records draw no random number
    "runner.record_rollouts",
    "runner.keep_rollouts",
    "runner.spike_factor",
    "env.num_workers",  # environments are seeded per episode: the worker layout changes nothing
    "env.step_timeout_s",
)
# where the roles run and which backend trains them: the same numbers (to float rounding);
# but for how far collection runs ahead and the precision (bf16 is not float32's rounding)
RESUME_FREE_PREFIX = ("cluster.", "trainer.")
RESUME_BOUND = ("cluster.max_staleness", "trainer.precision")


def check_resume(
    saved: dict, current: dict, checkpoint: Path, force: bool, trained_in: str | None = None
) -> None:
    """Refuse to resume when a key that changes the run's numbers differs from the checkpoint's
    config. ``runner.total_env_steps`` may grow unless the learning rate anneals over it. Keys
    newer than the checkpoint (not in its config) are not compared. ``trained_in``: the
    precision the checkpoint's meta.json records, compared once the engine is built
    (``load_resumed``: ``auto`` depends on the device) instead of ``trainer.precision``'s text
    (checkpoints from before 2026-11-29 record none)."""
    before = _torch_in_float32(flatten(saved))
    now = _torch_in_float32(flatten(current))
    free = set(RESUME_FREE)
    if trained_in is not None:
        free.add("trainer.precision")
    if not now.get("algorithm.anneal_lr", False):
        free.add("runner.total_env_steps")
    # (a key the checkpoint's config lacks is newer than the run: it takes its default)
    changed = [
        k
        for k in sorted(before)
        if k not in free
        and (not k.startswith(RESUME_FREE_PREFIX) or k in set(RESUME_BOUND) - free)
        and before.get(k) != now.get(k)
    ]
    if not changed or force:
        return
    first = changed[0]
    more = f" (and {len(changed) - 1} more: {', '.join(changed[1:4])})" if len(changed) > 1 else ""
    raise ConfigError(
        f"runner.resume: {first} is {now.get(first)!r} here but {before.get(first)!r} in "
        f"{checkpoint}{more}; that changes the run: set runner.resume_force=true to resume anyway"
    )


def check_rl_resume(resume: dict, current: dict, force: bool) -> None:
    """``check_resume`` for a loaded checkpoint an RL run resumes. One of embodied sft is refused
    whatever ``force`` says: its config holds no algorithm to compare, and the resumed run would
    write over the SFT run."""
    if "sft" in resume["meta"]:
        raise ConfigError(
            f"runner.resume: {resume['path']} is a checkpoint of embodied sft, not of an RL run: "
            f"start RL from its weights with runner.init_from={resume['path']}"
        )
    meta = resume["meta"]
    check_resume(meta["config"], current, resume["path"], force, meta.get("precision"))


def check_reference(checkpoint: dict, rebuilt: str | None, runner) -> None:
    """A ConfigError where a resumed run's KL reference (its digest ``rebuilt``: from
    ``runner.init_from`` as it reads now, or the seed) is not the one the ``checkpoint``'s run
    penalised against: the init_from run's ``last`` moved on since, say; with
    ``runner.resume_force`` a note. (Checkpoints from before it was saved say nothing, and a
    resumed run without a KL penalty has no reference.)"""
    saved = checkpoint["meta"].get("reference_digest")
    if saved is None or rebuilt is None or saved == rebuilt:
        return
    said = (
        f"runner.init_from: {runner.init_from or 'null (the seed)'} gives other weights than "
        f"the KL penalty's reference of the run {checkpoint['path']} resumes (its weights when "
        "it started)"
    )
    if runner.resume_force:
        print(f"note: {said}; runner.resume_force: the penalty is against these")
        return
    raise ConfigError(f"{said}: point it at the checkpoint the run started from")


def check_weights_fit(state: dict, policy, key: str, path, spare: str | None = None) -> None:
    """A ``ConfigError`` naming config key ``key`` when the weights ``state`` (a checkpoint's, at
    ``path``) do not load into ``policy`` (a torch module): weights of other shapes, or missing
    or unexpected ones (beside those whose names start with ``spare``)."""
    mine = policy.state_dict()
    resized = [k for k, v in state.items() if k in mine and v.shape != mine[k].shape]
    if resized:  # (another chunk size or camera size: load_state_dict's RuntimeError)
        k = resized[0]
        raise ConfigError(
            f"{key}: {path} does not fit this policy: {len(resized)} weights of other shapes, "
            f"e.g. {k} {tuple(state[k].shape)} here {tuple(mine[k].shape)} (a chunk size, image "
            "size or layer size that differs from the checkpoint's config)"
        )
    unmatched = sorted(set(mine).symmetric_difference(state))
    bad = [k for k in unmatched if spare is None or not k.startswith(spare)]
    if bad:
        raise ConfigError(f"{key}: {path} does not fit this policy (mismatched weights: {bad[:5]})")


def trained_in(engine) -> str:
    """The precision ``engine`` trains in: "bf16" (megatron's shards) or "fp32"."""
    return "bf16" if getattr(engine, "dtype", torch.float32) == torch.bfloat16 else "fp32"


def load_resumed(engine, checkpoint: dict, force: bool) -> None:
    """A resumed run's weights and optimizer state into ``engine``; ones that do not fit it (a
    forced resume's other policy or trainable weights), or another precision than the
    checkpoint's unless ``force``, are a ``ConfigError``, not torch's."""
    path = checkpoint["path"]
    saved = checkpoint["meta"].get("precision")
    if saved not in (None, trained_in(engine)) and not force:
        raise ConfigError(
            f"runner.resume: {path} trained in {saved} but this run trains in "
            f"{trained_in(engine)} (trainer.precision: auto is bf16 on a GPU, fp32 on the CPU); "
            "that changes the run: set runner.resume_force=true to resume anyway"
        )
    check_weights_fit(checkpoint["model"], engine.torch_policy, "runner.resume", path)
    groups = (checkpoint.get("optimizer") or {}).get("param_groups", [])
    saved = sum(len(group["params"]) for group in groups)
    trained = sum(p.requires_grad for p in engine.torch_policy.parameters())
    if groups and saved != trained:
        raise ConfigError(
            f"runner.resume: {path}'s optimizer state holds {saved} weights but this run trains "
            f"{trained} (a frozen part that differs from the checkpoint's config)"
        )
    if checkpoint.get("main_weights"):  # (a bf16 megatron run's: continued from, either backend)
        checkpoint = {**checkpoint, "model": {**checkpoint["model"], **checkpoint["main_weights"]}}
    engine.load_state_dict(checkpoint)


def _torch_in_float32(flat: dict) -> dict:
    """``flat`` (a flattened config) with the torch backend's precision as what it trains in:
    float32, whatever the key says (``auto`` and ``fp32`` are the same run there)."""
    if "trainer.precision" in flat and flat.get("trainer.backend", "torch") == "torch":
        return {**flat, "trainer.precision": "fp32"}
    return flat


def trim_metrics(run_dir: Path, iteration: int, evaluated: int | None = None) -> None:
    """Drop the metrics.jsonl rows logged after ``iteration`` (by a run that went on past its
    last checkpoint), so a resumed run logs each iteration once; also the evaluation rows of
    iteration ``evaluated`` (an evaluation beside training whose result no checkpoint holds:
    the resumed run evaluates it again) and the final evaluation's (the resumed run ends with
    its own)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for row in read_jsonl(path):  # (without a line cut by the crash the run resumes from)
        at = row.get("iteration", 0)
        evaluation = any(key.startswith("eval/") for key in row)
        if at <= iteration and not (evaluation and at == evaluated) and not row.get("final"):
            kept.append(metrics_line(row))  # (an older file's NaN tokens as null)
    write_atomic(path, "".join(kept))


def rewind(run_dir: Path, resume: dict, cfg, evaluates_beside: bool) -> None:
    """Take the run back to the checkpoint ``resume`` (loaded) before it goes on from there:
    the metrics rows logged after it, those of the evaluation it will run again, the final
    evaluation's result, the later checkpoints and rollout records go; ``RUN/best`` is its
    best. An unfinished evaluation that cannot run again (``why_not_again``) keeps the rows it
    logged."""
    counters = resume["counters"]
    done = counters["iteration"]
    again = evaluation_again(cfg, evaluates_beside, run_dir, counters)
    trim_metrics(run_dir, done, None if again is None else again["iteration"])
    # the earlier process's result: the resumed run writes its own when it ends
    for result in ("metrics.json", "videos/final_eval.mp4", "videos/eval.mp4"):  # (sft's)
        (run_dir / result).unlink(missing_ok=True)
    abandoned = drop_checkpoints_after(run_dir, done)
    if abandoned:
        print(f"resuming from iteration {done}: removed the later checkpoints {abandoned}")
    records, kept = drop_records_after(run_dir, done)
    if records:
        print(f"resuming from iteration {done}: removed the later rollout records {records}")
    if kept:
        print(
            f"resuming from iteration {done}: the later non-finite and spike records {kept} "
            f"moved to {run_dir / 'rollouts' / ABANDONED} (the resumed run's iterations are "
            "other updates)"
        )
    best = counters.get("best")
    point_best(run_dir, None if best is None else best["iteration"])


def unsaved_evaluation(counters: dict) -> dict | None:
    """The counters of the evaluation beside training that was in flight when ``counters`` (a
    checkpoint's) were saved, where they lack its result: a resume from them runs it again."""
    at = counters.get("evaluating")
    if at is None:  # (sft's checkpoints: their evaluations are {task: summary}, no iteration)
        return None
    recorded = [e["iteration"] for e in counters.get("evals", [])]
    return None if at["iteration"] in recorded else at


def skipped_as_last(run, counters: dict, clock) -> bool:
    """Whether a resumed checkpoint's iteration (``counters``) was due an evaluation skipped as
    the run's last (the final one followed) and the run now goes on past it (``run``: the
    runner config, its ``total_env_steps`` or the ``clock``'s ``max_minutes`` raised): it is
    evaluated first, as a run given that budget from its start evaluated it."""
    iteration = counters["iteration"]
    due = iteration > 0 and run.eval_every and iteration % run.eval_every == 0
    evaluated = any(e["iteration"] == iteration for e in counters.get("evals", []))
    goes_on = counters["env_steps"] < run.total_env_steps and not clock.out_of_time
    return bool(due) and goes_on and not evaluated


def evaluation_again(cfg, evaluates_beside: bool, run_dir: Path, counters: dict) -> dict | None:
    """The counters (``EVALUATED_AT``) of the unsaved evaluation that a run resumed from a
    checkpoint's ``counters`` runs again beside training; None where there is none."""
    unsaved = unsaved_evaluation(counters)
    if unsaved is None or why_not_again(cfg, evaluates_beside, run_dir, counters, unsaved):
        return None
    return unsaved


def logged_again_from(cfg, evaluates_beside: bool, run_dir: Path, counters: dict) -> int:
    """The env step from which a run resumed from ``counters`` logs anew: its checkpoint's, or
    that of the evaluation it runs again where earlier (TensorBoard hides the earlier processes'
    points from there on, and gets the rows metrics.jsonl keeps from there again)."""
    again = evaluation_again(cfg, evaluates_beside, run_dir, counters)
    steps = counters["env_steps"]
    return steps if again is None else min(steps, again["env_steps"])


def why_not_again(
    cfg, evaluates_beside: bool, run_dir: Path, counters: dict, at: dict
) -> str | None:
    """Why the unfinished evaluation ``at`` of a resumed checkpoint (``counters``) cannot run
    again; None where it can: in the loop where the checkpoint is its iteration's, else beside
    training. Decided from the checkpoint alone, so that ``rewind`` and the resumed run agree."""
    run = cfg.runner
    out_of_time = run.max_minutes is not None and counters["train_seconds"] >= run.max_minutes * 60
    path = checkpoint_dir(run_dir, at["iteration"])
    if not evaluates_beside:
        if at["iteration"] == counters["iteration"]:
            return None  # (in the loop, first: the weights it evaluates are the resumed ones)
        return "it runs again only with cluster.eval.workers"
    if counters["env_steps"] >= run.total_env_steps or out_of_time:
        return "no iteration is left to run it beside"
    if not (path / META).is_file():
        return f"its checkpoint {path} is gone"
    return None
