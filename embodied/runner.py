"""The runner: one loop for PPO and GRPO.

    collect (rounds of chunks) -> advantages -> epochs of minibatch updates -> log -> evaluate
    -> checkpoint

It drives three roles through small interfaces (embodied/env_group.py, inference.py,
learner.py), which a distributed runner places in separate processes, and an algorithm object
(embodied/ppo.py, grpo.py). Ctrl-C and SIGTERM stop it at a consistent point: during collection
or evaluation it saves the last completed iteration (its weights, counters and RNG state); during
an update it finishes the iteration first.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from embodied import numerics
from embodied.checkpoint import CheckpointWriteError, checkpoint_dir
from embodied.cluster.config import ignored_in_one_process
from embodied.config import to_dict
from embodied.episode_stats import EpisodeStats
from embodied.evaluations import Evaluations
from embodied.events import EventLog
from embodied.logger import RunLogger
from embodied.multitask import check_tasks, make_env
from embodied.recording import RunRecords, not_finite, record_dir
from embodied.report import report_at_end
from embodied.resume import check_rl_resume, logged_again_from, skipped_as_last, unsaved_evaluation
from embodied.roles import (
    Roles,
    WorkerLost,
    build_algorithm,
    init_policy,  # noqa: F401  (benchmarks import it from here)
    load_checkpoint_for,
    local_roles,
)
from embodied.run import (
    Clock,
    Interrupted,
    NonFiniteUpdate,
    Stopped,
    StopSignals,
    bar_interval,
    bar_postfix,
    enter_run_dir,
    run_dir_for,
    run_dir_held,
    run_dir_keys,
    write_trace,
)
from embodied.run_state import Collected, Progress, RunState, SavePoints, UpdateInFlight
from embodied.seeds import check_training_seeds, largest_training_seed
from embodied.stages import StageTuner
from embodied.streams import saved_streams
from embodied.train_config import TrainConfig, run_meta


def train(cfg: TrainConfig) -> dict:
    """Train as ``cfg`` says; returns the run's summary (also written to metrics.json)."""
    if cfg.runner.deterministic:  # first: before a torch op chooses a code path or a worker starts
        numerics.pin()
    numerics.setup(cfg.runner.torch_threads)
    if cfg.runner.replay_from:  # recorded rounds, no simulator (embodied/from_records.py)
        from embodied.from_records import train_from_records

        return train_from_records(cfg)
    resume = load_checkpoint_for(cfg.runner.resume, "runner.resume") if cfg.runner.resume else None
    if resume is not None:
        check_rl_resume(resume, to_dict(cfg), cfg.runner.resume_force)
        if saved_streams(resume["rng"]) is None:
            print(
                f"resuming {resume['path']}: written before random streams per worker, so the "
                "run's random streams restart here (derived afresh at its iteration)"
            )
    run_dir = run_dir_for(cfg.runner, resume)
    with run_dir_held(run_dir, run_dir_keys(resume)):  # (a second process: refused here)
        return _train_in(run_dir, cfg, resume)


def _train_in(run_dir: Path, cfg: TrainConfig, resume: dict | None) -> dict:
    """``train``'s roles built, then its run in ``run_dir`` (held by this process)."""
    # a bad checkpoint or task fails before the run directory and the environments are made
    if cfg.runner.init_from and (resume is None or cfg.algorithm.keeps_reference()):
        load_checkpoint_for(cfg.runner.init_from, "runner.init_from", trainer_state=False)
    check_tasks(cfg.env)
    # the roles first: a simulator or a placement that fails leaves no run directory behind
    torch.manual_seed(cfg.seed)
    if cfg.cluster.enabled:
        from embodied.cluster import ray_roles  # Ray is imported for cluster runs only

        roles = ray_roles(cfg, resume, run_dir)
    else:
        if note := ignored_in_one_process(cfg.cluster):
            print(note, file=sys.stderr)
        env = make_env(cfg.env)
        try:
            roles = local_roles(cfg, env, resume)
        except BaseException:
            env.close()
            raise
    try:
        check_reset_seeds(cfg, roles)  # (before the run directory: a config error)
        enter_run_dir(run_dir, cfg, resume, roles.evaluates_beside)
        return Runner(cfg, roles, run_dir, resume).run()
    finally:
        roles.close()


def check_reset_seeds(cfg: TrainConfig, roles: Roles) -> None:
    """A UserError where the run's training resets (its algorithm's seeding rule, over the
    budget's iterations) would reach the evaluation seeds."""
    algorithm = build_algorithm(cfg, roles.spec, roles.envs.task_of_env)
    round_steps = roles.envs.num_envs * cfg.policy.chunk_size * algorithm.num_chunks
    check_training_seeds(largest_training_seed(algorithm, round_steps, cfg.runner.total_env_steps))


def first_iteration_note(budget: int, num_envs: int, round_steps: int, max_rounds: int) -> str:
    """A note where the first iteration spends the step budget (or may: GRPO collects up to
    ``max_rounds`` rounds of ``num_envs`` x ``round_steps`` env steps an iteration), else ""."""
    per_round = num_envs * round_steps
    if budget > per_round * max_rounds:
        return ""
    spent = "is spent" if budget <= per_round else "may be spent"
    rounds = "whose round is" if max_rounds == 1 else f"which collects up to {max_rounds} rounds of"
    return (
        f"note: runner.total_env_steps={budget:,} {spent} by the first iteration, {rounds} "
        f"{per_round:,} env steps ({num_envs} environments x {round_steps} steps)"
    )


class Runner:
    def __init__(self, cfg: TrainConfig, roles: Roles, run_dir: Path, resume: dict | None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.roles = roles
        self.envs = roles.envs
        self.learner = roles.learner
        # the runner's copy of the algorithm plans rounds (the learner's computes advantages)
        self.algorithm = build_algorithm(cfg, roles.spec, self.envs.task_of_env)
        for note in self.algorithm.notes():
            print(note)
        K = cfg.policy.chunk_size
        self.steps_per_round = self.envs.num_envs * K * self.algorithm.num_chunks
        self.fresh = resume is None
        note = first_iteration_note(
            cfg.runner.total_env_steps,
            self.envs.num_envs,
            K * self.algorithm.num_chunks,
            self.algorithm.max_rounds,
        )
        if self.fresh and note:  # (a budget sized for a few CPU environments, run with thousands)
            print(note)
        self.needs_normalizer = self.fresh and not cfg.runner.init_from  # (the first round's)
        self.state = RunState() if self.fresh else RunState.from_counters(resume["counters"])
        if not self.fresh:
            print(
                f"resuming {run_dir} from iteration {self.state.iteration} "
                f"({self.state.env_steps} env steps)"
            )
        self.collected = Progress.of(self.state)  # ahead by the iteration whose update runs
        # the environment group says whether it can pipeline chunks of K (stage_split)
        self.stages = cfg.runner.pipeline_stages
        self.tuner = None
        if self.stages == "auto":
            candidates = roles.stage_candidates(K)
            self.tuner = StageTuner(candidates, self.state.pipeline_stages)
        roles.sync(self.state.policy_version)
        self.phase = "start"
        self.pending: UpdateInFlight | None = None
        meta = run_meta(cfg, roles.spec)
        self.points = SavePoints(self.state, roles, run_dir, meta, cfg.runner.keep_checkpoints)
        counters = self.state.counters()
        beside = roles.evaluates_beside
        resumed_at = None if self.fresh else logged_again_from(cfg, beside, run_dir, counters)
        self.logger = RunLogger(run_dir, resumed_at=resumed_at)
        self.events = EventLog(run_dir)
        self._event("start" if self.fresh else "resume")
        recording = cfg.runner.record_rollouts > 0  # (embodied/recording.py)
        self.records = (
            RunRecords(cfg.runner, run_dir, self.learner, self._event) if recording else None
        )

    def run(self) -> dict:
        run = self.cfg.runner
        self.bar = tqdm(
            total=run.total_env_steps,
            initial=min(self.state.env_steps, run.total_env_steps),
            unit="step",
            unit_scale=True,
            desc=run.name,
            disable=not run.progress,
            dynamic_ncols=True,
            mininterval=bar_interval(),
        )
        try:
            with StopSignals() as self.stop:
                self.evaluations = Evaluations(
                    self.cfg, self.roles, self.state, self.points, self.logger, self.bar, self.stop
                )
                try:
                    self._loop()
                except Interrupted:
                    self._stopped_between_iterations()
                except Exception as error:
                    # a failure outside the update (a simulator worker that hung, a worker lost
                    # once too often, in a round or a sync): the weights are still the last
                    # completed iteration's, so keep them (unless keeping them is what failed)
                    # (or a TP rank lost: no checkpoint can be written without its shard)
                    unsaved = isinstance(error, CheckpointWriteError)
                    unsaved = unsaved or getattr(error, "shard_lost", False)
                    if self.phase not in ("collect", "updated", "evaluate") or unsaved:
                        raise
                    if self.stop.requested:  # a signal to the process group ended a worker too
                        self._stopped_between_iterations()
                    self._drain()
                    self._save_completed()
                    raise
                final = self.evaluations.final()
        except Stopped as stopped:
            self._event("stop", str(stopped))
            self.bar.close()
            report_at_end(self.run_dir, self.cfg.runner.report)
            raise
        except BaseException as error:
            self._event("failure", f"{type(error).__name__}: {error}".strip())
            raise
        finally:
            self.bar.close()
            self.logger.close()
        self._event("end")
        report_at_end(self.run_dir, self.cfg.runner.report)
        return final

    def _event(self, kind: str, detail: str = "") -> None:
        """An event of the run (embodied/events.py) at its last completed iteration; one that
        cannot be written (a full disk) is said, not raised over what the run was doing."""
        try:
            self.events.add(kind, self.state.iteration, self.state.env_steps, detail)
        except OSError as error:
            print(f"event {kind} not written to {self.events.path}: {error}")

    # --- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        """Each iteration: 1 collect, 2 advantages (the learner's, as each round arrives),
        3 update; once the update is done (at once, or after the next iteration is collected
        with cluster.max_staleness 1), 4 log and 5 evaluate and checkpoint (``_finish``)."""
        run = self.cfg.runner
        self.evaluations.before_rl(self.algorithm.evaluates_before)
        self.clock = Clock(self.state.train_seconds, run.max_minutes)
        self.points.clock = self.clock
        # a resumed checkpoint's evaluation: one it left unfinished, or one it skipped as last
        unfinished = unsaved_evaluation(counters := self.state.counters())
        if unfinished is None and skipped_as_last(run, counters, self.clock):
            unfinished = self.evaluations.mark_in_flight(self.state.at())  # (a stop: still owed)
        if unfinished is not None:
            self.evaluations.again(unfinished)
        self.first_iteration = self.state.iteration + 1
        asynchronous = self.cfg.cluster.max_staleness > 0
        for iteration in itertools.count(self.state.iteration + 1):
            if self.collected.env_steps >= run.total_env_steps or self.clock.out_of_time:
                break  # (a run resumed after its last iteration goes straight to its evaluation)
            self._anneal_lr()
            collected = self._collect(iteration)  # 1, 2
            if self.pending is not None and self._finish(self._take_pending()):
                # out of time: this iteration's collection is dropped, uncounted
                self.collected = Progress.of(self.state)
                break
            self.phase = "update"  # 3
            start = time.time()  # (an update in this process runs inside start_update)
            lr = self.learner.lr
            self.pending = UpdateInFlight(collected, start, lr, self.learner.start_update())
            if not asynchronous and self._finish(self._take_pending()):  # 4, 5
                break
        if self.pending is not None:
            self._finish(self._take_pending(), last=True)

    def _take_pending(self) -> UpdateInFlight:
        pending, self.pending = self.pending, None
        return pending

    def _anneal_lr(self) -> None:
        alg = self.cfg.algorithm
        if alg.anneal_lr:
            spent = self.collected.env_steps / self.cfg.runner.total_env_steps
            self.learner.set_lr(alg.learning_rate * (1 - spent))

    def _finish(self, done: UpdateInFlight, last: bool | None = None, stopping=False) -> bool:
        """Wait for an iteration's update, sync the weights, log, evaluate, checkpoint; whether
        the loop stops (out of time). ``last``: whether no iteration follows (None: as the budget
        says). ``stopping``: the run stops after this (a signal, a failure): only wait, sync and
        log; the stop saves."""
        run = self.cfg.runner
        state = self.state
        collected = done.collected
        self.phase = "update"  # a failure while waiting for it leaves the weights unsaved
        metrics = collected.metrics
        updated = done.update.result()
        update_seconds = time.time() - done.start  # (not the record's writing, below)
        metrics.update(updated)
        record = self._record(collected, updated)  # (the learner writes it, or drops it)
        state.policy_version += 1
        # the iteration's own progress (the next one may be collected already)
        state.iteration = collected.iteration
        state.train_seconds = self.clock.seconds
        state.env_steps = collected.progress.env_steps
        state.rounds = collected.progress.rounds
        episodes = collected.stats.summary()
        state.episodes += int(episodes.get("episode/count", 0))
        metrics.update(episodes)
        if bad := not_finite(updated):  # the weights it stepped are not usable: stop, unsaved
            self._log(metrics, done, update_seconds)
            self.state = self.points.state.copy()  # (the failure event's: the last completed)
            saved = self.points.saved and checkpoint_dir(self.run_dir, self.points.saved)
            raise NonFiniteUpdate(collected.iteration, bad, record, saved or None)
        self.points.complete(state)
        self.phase = "updated"  # the actor holds the iteration: a failure from here saves it
        try:
            if not stopping:  # (a stop after a lost worker: only what the checkpoint needs)
                metrics.update(self.roles.sync(state.policy_version))
                role_metrics, spans = self.roles.metrics()
                metrics.update(role_metrics)
                self._trace(spans, done, update_seconds)
        finally:  # 4. log (without the sync's numbers where the sync failed)
            self._log(metrics, done, update_seconds)
        if stopping:
            return True
        if last is None:
            last = state.env_steps >= run.total_env_steps or self.clock.out_of_time
        # 5. evaluate (the best evaluation's weights are kept as a checkpoint), checkpoint
        self.phase = "evaluate"
        self.evaluations.periodic(state.iteration, last)
        # (the clock may have run out during that evaluation: the run ends here, saved)
        ends = last or self.clock.out_of_time
        if ends or (run.save_every and state.iteration % run.save_every == 0):
            self.points.save(self.evaluations.in_flight_iteration())
        if self.stop.requested:
            raise Interrupted
        if self.clock.out_of_time:
            self._event("out_of_time", f"runner.max_minutes={run.max_minutes}")
            self.bar.write(
                f"stopping after {self.clock.seconds / 60:.1f} min "
                f"(runner.max_minutes={run.max_minutes})"
            )
            return True
        return False

    def _record(self, collected, updated: dict) -> Path | None:
        """The rollout record of ``collected``'s iteration, kept or dropped as its update says
        (embodied/recording.py); a kept one's reason is an event. The record written for a
        non-finite update, or None."""
        if self.records is None:
            return None
        counters = {
            "iteration": collected.iteration,
            "env_steps": collected.progress.env_steps,
            "rounds": collected.progress.rounds,
            "policy_version": self.state.policy_version + 1,  # (the update's weights)
        }
        reason = self.records.after_update(collected.iteration, updated, counters)
        if reason in ("non-finite", "spike"):
            self._event("record", f"iteration {collected.iteration}: {reason}")
        return record_dir(self.run_dir, collected.iteration) if reason == "non-finite" else None

    def _log(self, metrics: dict, done: UpdateInFlight, update_seconds: float) -> None:
        collected = done.collected
        budget = self.cfg.runner.total_env_steps
        env_steps = collected.progress.env_steps
        steps = env_steps - collected.steps_before
        metrics.update(
            {
                "time/rollout_s": collected.seconds,
                "time/update_s": update_seconds,
                "time/env_steps_per_s": steps / collected.seconds,
                "time/minutes": self.state.train_seconds / 60,
                "train/lr": done.lr,
            }
        )
        self.logger.log(metrics, step=env_steps, iteration=collected.iteration)
        self.bar.update(min(env_steps, budget) - min(collected.steps_before, budget))
        seconds = collected.seconds + update_seconds
        self.bar.set_postfix(bar_postfix(metrics, steps, seconds, self.clock))

    def _trace(self, spans: list, done: UpdateInFlight, update_seconds: float) -> None:
        """runner.trace: the first two iterations' spans (the second overwrites the first)."""
        collected = done.collected
        if not (self.cfg.runner.trace and spans and collected.iteration - self.first_iteration < 2):
            return
        start = collected.start
        spans.append(("collect", "runner", 0, start, start + collected.seconds))
        spans.append(("update", "runner", 0, done.start, done.start + update_seconds))
        write_trace(self.run_dir / "trace.json", spans)

    def _tune_stages(self, metrics: dict, seconds: float, env_steps: int) -> None:
        """``runner.pipeline_stages: auto``: time this collection; once every candidate has
        had its iteration, the fastest stays (a resumed run keeps it: it is in the state)."""
        metrics["rollout/pipeline_stages"] = float(self.stages)
        if self.tuner.record(self.stages, seconds, env_steps):
            self.state.pipeline_stages = self.tuner.chosen
            self.bar.write(self.tuner.report())

    def _drain(self) -> None:
        """Finish the update in flight (cluster.max_staleness 1) before the run stops: the weights
        a stop saves are then a completed iteration's."""
        if self.pending is None:
            return
        self._finish(self._take_pending(), last=True, stopping=True)
        self.collected = Progress.of(self.state)

    def _collect(self, iteration: int) -> Collected:
        """Rounds of chunks until the algorithm has enough (PPO: one), each added to the
        learner, which computes its advantages."""
        start = time.time()
        stats = EpisodeStats(self.envs.task_names, self.roles.inference.device)
        self.phase = "collect"
        steps_before = self.collected.env_steps
        if self.tuner is not None:
            self.stages = self.tuner.next()
        round_metrics: list[dict[str, torch.Tensor]] = []
        for round_index in range(self.algorithm.max_rounds):
            plan = self.algorithm.plan(iteration, round_index, self._episode_base())
            round_metrics.append(self._collect_round(iteration, round_index, plan, stats))
            self.collected.env_steps += self.steps_per_round
            self.collected.rounds += 1
            if self.algorithm.enough(round_metrics):
                break
        metrics = self.algorithm.collected(round_metrics)
        seconds = time.time() - start
        if self.tuner is not None:
            self._tune_stages(metrics, seconds, self.collected.env_steps - steps_before)
        progress = Progress(self.collected.env_steps, self.collected.rounds)
        return Collected(iteration, metrics, stats, start, seconds, steps_before, progress)

    def _collect_round(self, iteration: int, round_index: int, plan, stats: EpisodeStats):
        """One round of chunks from its seeded reset, added to the learner -> its advantages'
        metrics. A worker lost midway (a cluster run), or before the learner has the round,
        loses the round: nothing of it enters the batch or the episode statistics; the round
        is collected again from its reset once the cluster has replaced the worker."""
        failures = 0
        while True:
            totals = stats.totals.clone()  # the episodes of the rounds before this one
            try:
                obs = self.envs.reset(seed=plan.seeds)
                if self.needs_normalizer:
                    # normalisation statistics from the first observations, before anything acts
                    self.learner.init_normalizer(obs)
                    self.roles.sync(0)
                    self.needs_normalizer = False
                batch = self.roles.collect(
                    obs,
                    plan,
                    stats,
                    stages=self.stages,
                    chunk_size=self.cfg.policy.chunk_size,
                    should_stop=lambda: self.stop.requested,
                )
                return self.learner.add_round(batch)
            except WorkerLost as lost:
                failures += 1
                stats.totals.copy_(totals)
                # (a loss that stops the run, a lost actor's or one too many, raises here: the
                # run's failure says so, and no round is collected again)
                self.roles.recover(lost, failures)
                self.state.discarded_rounds += 1
                self._event("discarded_round", f"iteration {iteration}: {lost}")
                self.bar.write(
                    f"iteration {iteration}: {lost}; its round is discarded and collected again "
                    f"(failure {failures} in a row)"
                )
                self.logger.log(
                    {"cluster/discarded_rounds": self.state.discarded_rounds},
                    step=self.collected.env_steps,
                    iteration=iteration,
                )

    def _episode_base(self) -> int:
        """Episode ids of the next round start here: a round of T chunks of K actions ends at
        most T * K episodes per environment, so ids never repeat within a run."""
        B = self.envs.num_envs
        per_round = B * (self.steps_per_round // B + 1)
        return self.collected.rounds * per_round

    # --- a stop --------------------------------------------------------------------------------
    def _save_completed(self) -> None:
        """Save the last completed iteration unless it is saved already (collection and
        evaluation do not change the weights, so they are still that iteration's)."""
        self.points.save(self.evaluations.in_flight_iteration())

    def _stopped_between_iterations(self) -> None:
        """A stop during collection or evaluation: save the last completed iteration, stop."""
        self._drain()
        self._save_completed()
        done = self.points.state.iteration
        where = self.run_dir / "last" if done else "nothing to save yet"
        raise Stopped(self.stop.signum, f"stopped after iteration {done}; checkpoint: {where}")
