"""Training from recordings (``runner.replay_from=RUN/rollouts``): the recorded rounds fed to a
learner in their order, without simulators, for algorithm work and debugging
(embodied/recording.py).

The learner starts from the first record's state before its update (the recorded run's initial
weights where that is iteration 1), or from ``runner.init_from`` where given. Its first update
then equals the recorded one bit for bit, its metrics and the weights after it (checked, and
said). A config whose policy the records' state does not fit is one line, as is a run directory
that holds the records (``runner.overwrite`` would delete them). Each update runs at its record's
learning rate. An update whose weights before it are the recorded run's (its digest equals the
record's) is on-policy: records of consecutive iterations, replayed from the first, reproduce
the recorded run. Any other is off-policy (rounds collected by other weights; the ratios use
their stored behaviour log-probabilities), and the run says how many were. Each update is a
metrics row; the weights are saved as a checkpoint at the end, or at a stop (Ctrl-C, SIGTERM)
after the update in progress. An update that is not finite stops the run unsaved, as in
training. No evaluation: nothing simulates; the run's ``env`` is the records' (what an
evaluation of its checkpoint builds), whatever the config says.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from embodied.events import EventLog
from embodied.logger import RunLogger
from embodied.record_files import RECORDS, record_dir, recorded_iterations
from embodied.recording import (
    Record,
    RecordError,
    not_finite,
    read_record,
    record_meta,
    restore_before,
    state_digest,
    weights_digest,
)
from embodied.replay import differences, record_config, same_reference
from embodied.report import report_at_end
from embodied.resume import flatten
from embodied.roles import Learner
from embodied.run import (
    NonFiniteUpdate,
    Stopped,
    StopSignals,
    enter_run_dir,
    run_dir_for,
    run_dir_held,
)
from embodied.run_state import RunState
from embodied.schema import EnvSpec, UserError
from embodied.train_config import run_meta


def records_of(source: Path) -> tuple[Path, list[int]]:
    """(the recorded run's directory, its recorded iterations in order) for ``source``: a run
    directory or its ``rollouts`` folder."""
    run_dir = source.parent if source.name == RECORDS else source
    found = recorded_iterations(run_dir)
    if not found:
        raise RecordError(f"runner.replay_from: {source} holds no rollout records")
    for iteration in found:  # (a damaged one fails before any update, not after some)
        record_meta(run_dir, iteration)
        path = record_dir(run_dir, iteration)
        for name in ("rounds.safetensors.zst", "learner.safetensors", "optimizer.pt"):
            if not (path / name).is_file():  # (a copy cut short; damage inside is read later)
                raise RecordError(f"{path / name}: missing from the record")
    return run_dir, found


def train_from_records(cfg) -> dict:
    """Train as ``cfg`` says on the records of ``runner.replay_from``; the run's summary."""
    recorded, iterations = records_of(Path(cfg.runner.replay_from))
    check_apart(recorded / RECORDS, Path(cfg.runner.output_dir) / cfg.runner.name)
    first = read_record(recorded, iterations[0])
    recorded_cfg = record_config(first)
    cfg.env = recorded_cfg.env  # (the weights' environment, not the config's)
    spec = EnvSpec.from_dict(first.meta["spec"])
    task_of_env = torch.tensor(first.meta["task_of_env"], dtype=torch.long)
    run_dir = run_dir_for(cfg.runner, None)
    cfg.runner.record_rollouts = 0  # (this run's updates are the records' own)
    # an asynchronous run's updates weigh by the proximal policy: its learner's config says so
    # (cluster.max_staleness needs the cluster, and this run's own config is saved as given)
    staleness = recorded_cfg.cluster.max_staleness
    cluster = dataclasses.replace(cfg.cluster, max_staleness=staleness)
    learner_cfg = dataclasses.replace(cfg, cluster=cluster)
    with run_dir_held(run_dir):  # (left as it was if the records do not fit: nothing entered)
        learner = Learner(learner_cfg, spec, task_of_env, cfg.runner.torch_device("cpu"))
        try:
            if not same_reference(learner, first):
                print(
                    "note: the KL penalty's reference (from this config's runner.init_from or "
                    "seed) is not the recorded run's, so the updates' KL terms are not the "
                    "recorded ones"
                )
            if not cfg.runner.init_from:
                restore_fitting(learner, first, cfg)
            enter_run_dir(run_dir, cfg, None, False)
            return _updates(cfg, learner, recorded, iterations, run_dir, spec)
        finally:
            learner.close()


def check_apart(records: Path, run_dir: Path) -> None:
    """``UserError`` when the run directory this run makes (``runner.output_dir/name``) holds
    the records it trains on, before anything is touched: ``runner.overwrite`` would delete
    them before they are read, and the run would write its metrics over the recorded run's.
    (The default ``runner.name`` of the recorded run's own config is that directory.)"""
    if run_dir.resolve() in (records.resolve(), *records.resolve().parents):
        raise UserError(
            f"runner.replay_from: {records} is in {run_dir}, this run's own directory "
            "(runner.output_dir/runner.name): the run would delete or write among the records "
            "it reads; choose another runner.name"
        )


def restore_fitting(learner: Learner, record: Record, cfg) -> None:
    """``restore_before``, or one line (``UserError``) where the record's state does not fit
    the learner this config builds: the policy keys that differ from the recorded run's."""
    try:
        restore_before(learner, record)
    except (RuntimeError, ValueError, KeyError) as error:
        here = flatten(dataclasses.asdict(cfg.policy), "policy.")
        there = flatten(record.meta["config"]["policy"], "policy.")
        differ = [
            f"{k} is {here.get(k)!r} here, {there.get(k)!r} in the records"
            for k in sorted(set(here) | set(there))
            if here.get(k) != there.get(k)
        ]
        # all of them: the first few by name may change no weight's shape (activation)
        more = f"; and {len(differ) - 8} more" if len(differ) > 8 else ""
        why = "; ".join(differ[:8]) + more or str(error).strip().splitlines()[0]
        raise UserError(
            f"runner.replay_from: the records' learner state does not fit this config ({why}); "
            "train with the recorded run's policy and algorithm"
        ) from None


def _updates(cfg, learner: Learner, recorded: Path, iterations: list[int], run_dir, spec) -> dict:
    """One update per record, in order, each logged; the checkpoint at the end, or at a stop."""
    state = RunState()
    logger = RunLogger(run_dir)
    events = EventLog(run_dir)  # (the report's status: a replay's end, stop or failure)
    events.add("start", 0, 0)
    same = None  # whether the first update equals the recorded one
    off_policy = []  # the records replayed from weights other than the recorded run's
    try:
        with StopSignals() as stop:
            for index, iteration in enumerate(iterations):
                record = read_record(recorded, iteration, learner.device)
                if not _from_recorded_weights(learner, record):
                    off_policy.append(iteration)
                metrics = _update(learner, record, state)
                if index == 0 and not cfg.runner.init_from:  # (the weights after it too)
                    digest = weights_digest(learner.engine.torch_policy)
                    same = differences(
                        record.meta["metrics"],
                        metrics,
                        weights=(record.meta["digest_after"], digest),
                    )
                    print(_first_update_note(iteration, same))
                logger.log(metrics, state.env_steps, iteration=state.iteration, replayed=iteration)
                if bad := not_finite(metrics):  # (its weights are not usable: unsaved)
                    raise NonFiniteUpdate(iteration, bad, None, None, unit="replayed iteration")
                if stop.requested and index + 1 < len(iterations):  # (after the last: it ends)
                    _save(cfg, learner, state, run_dir, spec)
                    done = f"stopped after {state.iteration} of {len(iterations)} records"
                    events.add("stop", state.iteration, state.env_steps, done)
                    report_at_end(run_dir, cfg.runner.report)
                    raise Stopped(stop.signum, f"{done}; checkpoint: {run_dir / 'last'}")
        # (each update's weights are compared at the next one's start: the last one's here)
        last_equal = weights_digest(learner.engine.torch_policy) == record.meta["digest_after"]
        print(_closing_line(iterations, off_policy, last_equal))
        _save(cfg, learner, state, run_dir, spec)  # (a failing one is the run's failure event)
        events.add("end", state.iteration, state.env_steps)
    except BaseException as error:
        _failed(error, events, state, lambda: _save(cfg, learner, state, run_dir, spec), run_dir)
        raise
    finally:
        logger.close()
    report_at_end(run_dir, cfg.runner.report)
    return {
        "run_dir": str(run_dir),
        "updates": state.iteration,
        "replayed": iterations,
        "first_update_matches": None if same is None else not same,
        "off_policy": off_policy,
    }


def _failed(error: BaseException, events: EventLog, state: RunState, save_done, run_dir) -> None:
    """The event of a replay that ``error`` ended (a stop logged its own), at the last update
    that completed; a record damaged inside keeps the updates before it (``save_done``)."""
    if isinstance(error, Stopped):
        return
    if isinstance(error, NonFiniteUpdate):  # (its update counted, not completed)
        events.add("failure", state.iteration - 1, None, f"NonFiniteUpdate: {error}")
        return
    if isinstance(error, RecordError) and state.iteration:
        save_done()
        error.add_note(f"the {state.iteration} updates before it are saved: {run_dir}/last")
    events.add("failure", state.iteration, state.env_steps, type(error).__name__)


def _closing_line(iterations: list[int], off_policy: list[int], last_equal: bool) -> str:
    """How many updates started from the recorded weights, and whether the run reproduces the
    recording (every update on-policy and the last one's weights the recorded ones)."""
    if off_policy:
        verdict = (
            f"off-policy: records {off_policy} (their ratios use the stored behaviour "
            "log-probabilities)"
        )
    elif last_equal:
        verdict = "the run reproduces the recorded one"
    else:
        verdict = f"the weights after record {iterations[-1]}'s update differ from the recording"
    on_policy = len(iterations) - len(off_policy)
    return (
        f"{on_policy} of {len(iterations)} updates started from the recorded run's own weights "
        f"(on-policy); {verdict}"
    )


def _from_recorded_weights(learner: Learner, record: Record) -> bool:
    """Whether the learner's weights are the recorded run's before this record's update: those
    that acted, or a bf16 run's float32 main weights (what a learner of float32 weights took)."""
    mine = state_digest(learner.engine.torch_policy.state_dict())
    if mine == state_digest(record.model):
        return True
    return bool(record.main_weights) and mine == state_digest(
        {**record.model, **record.main_weights}
    )


def _update(learner: Learner, record: Record, state: RunState) -> dict[str, float]:
    """The record's rounds, at its learning rate, as one update: its metrics."""
    learner.engine.set_lr(record.meta["lr"])
    for batch in record.rounds:
        learner.add_round(batch)
        state.env_steps += batch.valid.numel()  # (B x K per chunk, as collected)
    metrics = {k: float(v) for k, v in learner.update().items()}
    state.iteration += 1
    return metrics


def _save(cfg, learner: Learner, state: RunState, run_dir: Path, spec) -> None:
    # (the learner's save: its precision and KL reference in the meta, as a run's)
    learner.save(run_dir, state.iteration, counters=state.counters(), meta=run_meta(cfg, spec))


def _first_update_note(iteration: int, differs: list[str]) -> str:
    if not differs:
        return f"the first update (iteration {iteration} of the records) equals the recorded one"
    found = "; ".join(differs)
    return f"the first update differs from iteration {iteration}'s recorded one: {found}"
