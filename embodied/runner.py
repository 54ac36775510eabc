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
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from embodied import numerics
from embodied.checkpoint import (
    checkpoint_dir,
    load_checkpoint,
    mark_best,
)
from embodied.config import save_config, to_dict
from embodied.evaluate import overall, per_task
from embodied.logger import RunLogger
from embodied.multitask import check_tasks, make_env
from embodied.roles import (
    Roles,
    WorkerLost,
    build_algorithm,
    init_policy,  # noqa: F401  (benchmarks import it from here)
    load_checkpoint_for,
    local_roles,
)
from embodied.rollout import EpisodeStats, StageTuner
from embodied.run import (
    EVALUATED_AT,
    Clock,
    Interrupted,
    Stopped,
    StopSignals,
    bar_interval,
    check_fresh,
    check_resume,
    clear_run,
    rewind,
    run_dir_of,
    unsaved_evaluation,
    why_not_again,
    write_trace,
)
from embodied.streams import saved_streams
from embodied.train_config import TrainConfig, run_meta


def train(cfg: TrainConfig) -> dict:
    """Train as ``cfg`` says; returns the run's summary (also written to metrics.json)."""
    if cfg.runner.deterministic:  # first: before a torch op chooses a code path or a worker starts
        numerics.pin()
    numerics.setup(cfg.runner.torch_threads)
    resume = load_checkpoint_for(cfg.runner.resume, "runner.resume") if cfg.runner.resume else None
    if resume is not None:
        check_resume(
            resume["meta"]["config"], to_dict(cfg), resume["path"], cfg.runner.resume_force
        )
        run_dir = run_dir_of(resume["path"], cfg.runner.resume)
        if saved_streams(resume["rng"]) is None:
            print(
                f"resuming {resume['path']}: written before random streams per worker, so the "
                "run's random streams restart here (derived afresh at its iteration)"
            )
    else:
        run_dir = Path(cfg.runner.output_dir) / cfg.runner.name
        check_fresh(run_dir, cfg.runner.overwrite)
    # a bad checkpoint or task fails before the run directory and the environments are made
    if cfg.runner.init_from:
        load_checkpoint_for(cfg.runner.init_from, "runner.init_from", trainer_state=False)
    check_tasks(cfg.env)
    # the roles first: a simulator or a placement that fails leaves no run directory behind
    torch.manual_seed(cfg.seed)
    if cfg.cluster.enabled:
        from embodied.cluster import ray_roles  # Ray is imported for cluster runs only

        roles = ray_roles(cfg, resume, run_dir)
    else:
        env = make_env(cfg.env)
        try:
            roles = local_roles(cfg, env, resume)
        except BaseException:
            env.close()
            raise
    try:
        if resume is not None:
            rewind(run_dir, resume, cfg, roles.evaluates_beside)
        elif cfg.runner.overwrite:
            clear_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        start = 0 if resume is None else resume["counters"]["iteration"]
        numerics.record(run_dir, iteration=start, deterministic=cfg.runner.deterministic)
        return Runner(cfg, roles, run_dir, resume).run()
    finally:
        roles.close()


class Runner:
    def __init__(self, cfg: TrainConfig, roles: Roles, run_dir: Path, resume: dict | None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.roles = roles
        self.envs = roles.envs
        self.inference = roles.inference
        self.learner = roles.learner
        B = self.envs.num_envs
        K = cfg.policy.chunk_size
        # the runner's copy of the algorithm plans rounds (the learner's computes advantages)
        self.algorithm = build_algorithm(cfg, roles.spec, self.envs.task_of_env)
        for note in self.algorithm.notes():
            print(note)
        self.steps_per_round = B * K * self.algorithm.num_chunks
        # the environment group says whether it can pipeline chunks of K (stage_split)
        self.stages = cfg.runner.pipeline_stages
        self.tuner = None
        if self.stages == "auto":
            candidates = roles.stage_candidates(cfg.policy.chunk_size)
            chosen = (resume or {}).get("counters", {}).get("pipeline_stages")
            self.tuner = StageTuner(candidates, chosen)
        self.counters = {
            "iteration": 0,
            "env_steps": 0,
            "episodes": 0,
            "train_seconds": 0.0,
            "policy_version": 0,
            "rounds": 0,
            "evals": [],
            "before": None,
            "best": None,  # {"iteration", "success_rate"} of the best evaluation so far
        }
        if resume is not None:
            self.counters.update(resume["counters"])
            print(
                f"resuming {run_dir} from iteration {self.counters['iteration']} "
                f"({self.counters['env_steps']} env steps)"
            )
        roles.sync(self.counters["policy_version"])
        self.fresh = resume is None
        self.phase = "start"
        self.pending = None  # an iteration whose update runs while the next one is collected
        self.evaluating = None  # (handle, the iteration's counters): an evaluation beside training
        self.starting = None  # the counters of an evaluation beside training about to start
        self.saved = self.counters["iteration"]  # the newest checkpoint's iteration
        self.end_rng = roles.rng_state()  # the RNG as the last completed iteration left it
        self.end_counters = json.loads(json.dumps(self.counters))
        self.logger = RunLogger(run_dir, purge_step=None if self.fresh else self._purge_step())
        self.meta = run_meta(cfg, roles.spec)

    def _purge_step(self) -> int:
        return self.counters["env_steps"] + 1

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        run = cfg.runner
        counters = self.counters
        self.bar = tqdm(
            total=run.total_env_steps,
            initial=min(counters["env_steps"], run.total_env_steps),
            unit="step",
            unit_scale=True,
            desc=run.name,
            disable=not run.progress,
            dynamic_ncols=True,
            mininterval=bar_interval(),
        )
        try:
            with StopSignals() as self.stop:
                try:
                    self._loop()
                except Interrupted:
                    self._stopped_between_iterations()
                except Exception:
                    # a failure outside the update (a simulator worker that hung, say): the
                    # weights are still the last completed iteration's, so keep them
                    if self.phase not in ("collect", "evaluate"):
                        raise
                    if self.stop.requested:  # a signal to the process group ended a worker too
                        self._stopped_between_iterations()
                    self._drain()
                    self._save_completed()
                    raise
                final = self._final_evaluation()
        finally:
            self.bar.close()
            self.logger.close()
        return final

    def _loop(self) -> None:
        cfg = self.cfg
        run = cfg.runner
        alg = cfg.algorithm
        counters = self.counters
        if counters["iteration"] == 0 and (self.algorithm.evaluates_before or run.init_from):
            # success before RL, on the evaluation seeds
            counters["before"] = self._evaluate(run.eval_episodes)
            self._log_evaluation(counters["before"], "before RL")
            self.end_counters = json.loads(json.dumps(counters))
        self.clock = Clock(counters["train_seconds"], run.max_minutes)
        budget = run.total_env_steps
        unfinished = unsaved_evaluation(counters)  # (a resumed checkpoint's; none when fresh)
        if unfinished is not None:
            self._evaluate_again(unfinished)
        self.first_iteration = counters["iteration"] + 1
        # cluster.max_staleness 1: the next iteration is collected while the update runs
        asynchronous = cfg.cluster.max_staleness > 0
        for iteration in itertools.count(counters["iteration"] + 1):
            if counters["env_steps"] >= budget or self.clock.out_of_time:
                break  # (a run resumed after its last iteration goes straight to its evaluation)
            if alg.anneal_lr:
                self.learner.set_lr(alg.learning_rate * (1 - counters["env_steps"] / budget))
            # 1. collect: rounds until the algorithm has enough for an update
            t0 = time.time()
            stats = EpisodeStats(self.envs.num_envs, self.envs.task_names, self.inference.device)
            self.phase = "collect"
            steps_before = counters["env_steps"]
            if self.tuner is not None:
                self.stages = self.tuner.next()
            metrics = self._collect(iteration, stats)
            rollout_time = time.time() - t0
            if self.tuner is not None:
                self._tune_stages(metrics, rollout_time, counters["env_steps"] - steps_before)
            collected = {
                "iteration": iteration,
                "metrics": metrics,
                "stats": stats,
                "t0": t0,
                "rollout_time": rollout_time,
                "steps_before": steps_before,
                "env_steps": counters["env_steps"],
                "rounds": counters["rounds"],
            }
            if self.pending is not None:  # the previous iteration's update ran meanwhile
                previous, self.pending = self.pending, None
                if self._finish(previous, last=None):
                    # out of time: this iteration's collection is dropped, uncounted
                    counters.update({k: self.end_counters[k] for k in ("env_steps", "rounds")})
                    break
            # 2. update (the learner holds the rounds), then fold their observations into the
            # normalizer
            self.phase = "update"
            collected["t1"] = time.time()
            collected["lr"] = self.learner.lr
            collected["update"] = self.learner.start_update()
            self.pending = collected
            if not asynchronous:
                self.pending = None
                if self._finish(collected, last=None):
                    break
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._finish(pending, last=True)

    def _tune_stages(self, metrics: dict, seconds: float, env_steps: int) -> None:
        """``runner.pipeline_stages: auto``: time this collection; once every candidate has
        had its iteration, the fastest stays (a resumed run keeps it: it is in the counters)."""
        metrics["rollout/pipeline_stages"] = float(self.stages)
        if self.tuner.record(self.stages, seconds, env_steps):
            self.counters["pipeline_stages"] = self.tuner.chosen
            self.bar.write(self.tuner.report())

    def _finish(self, done: dict, last: bool | None, stopping: bool = False) -> bool:
        """Wait for an iteration's update, sync the weights, log, evaluate, checkpoint; whether
        the loop stops (out of time). ``last``: whether no iteration follows (None: as the budget
        says). The counters of a checkpoint are the iteration's own, also when the next one was
        collected meanwhile (cluster.max_staleness 1). ``stopping``: the run stops after this
        (a signal, a failure): only wait, sync and log; the stop saves."""
        # the iteration's own counters while it is finished (evaluation, checkpoints), also
        # when the next iteration's collection has moved them on (cluster.max_staleness 1)
        later = {k: self.counters[k] for k in ("env_steps", "rounds")}
        self.counters.update(env_steps=done["env_steps"], rounds=done["rounds"])
        try:
            return self._finish_iteration(done, last, stopping)
        finally:
            self.counters.update(later)

    def _finish_iteration(self, done: dict, last: bool | None, stopping: bool) -> bool:
        run = self.cfg.runner
        counters = self.counters
        clock = self.clock
        budget = run.total_env_steps
        iteration = done["iteration"]
        self.phase = "update"  # a failure while waiting for it leaves the weights unsaved
        metrics = done["metrics"]
        t0, t1, rollout_time = done["t0"], done["t1"], done["rollout_time"]
        metrics.update(done["update"].result())
        update_time = time.time() - t1
        counters["policy_version"] += 1
        spans = []
        if not stopping:  # (a stop after a lost worker: only what the checkpoint needs)
            metrics.update(self.roles.sync(counters["policy_version"]))
            role_metrics, spans = self.roles.metrics()
            metrics.update(role_metrics)
        if run.trace and spans and iteration - self.first_iteration < 2:  # the second overwrites
            spans.append(("collect", "runner", 0, t0, t0 + rollout_time))
            spans.append(("update", "runner", 0, t1, t1 + update_time))
            write_trace(self.run_dir / "trace.json", spans)
        # 3. log
        counters["iteration"] = iteration
        counters["train_seconds"] = clock.seconds
        episodes = done["stats"].summary()
        counters["episodes"] += int(episodes.get("episode/count", 0))
        metrics.update(episodes)
        env_steps = done["env_steps"]
        steps = env_steps - done["steps_before"]
        metrics.update(
            {
                "time/rollout_s": rollout_time,
                "time/update_s": update_time,
                "time/env_steps_per_s": steps / rollout_time,
                "time/minutes": counters["train_seconds"] / 60,
                "train/lr": done["lr"],
            }
        )
        self.logger.log(metrics, step=env_steps, iteration=iteration)
        self.bar.update(min(env_steps, budget) - min(done["steps_before"], budget))
        self.bar.set_postfix(self._postfix(metrics, steps, rollout_time + update_time, clock))
        self._completed()
        if stopping:
            return True
        if last is None:
            last = env_steps >= budget or clock.out_of_time
        self.phase = "evaluate"
        # 4. evaluate (the best evaluation's weights are kept as a checkpoint)
        due = run.eval_every and iteration % run.eval_every == 0 and not last
        self.starting = None
        if due and self.roles.evaluates_beside:
            # (the checkpoint an earlier evaluation's new best saves below names it in flight)
            self.starting = {key: self.end_counters[key] for key in EVALUATED_AT}
        # one that ran beside training, if it is done (the last iteration's checkpoint waits
        # for it: it holds the evaluations)
        self._take_evaluation(wait=last)
        if due:
            if self.stop.requested:
                raise Interrupted
            self._take_evaluation(wait=True)  # (one at a time)
            if self.starting is not None:
                # its checkpoint first, in case it is the best; it names the evaluation in flight
                at = self._in_flight(self.starting)
                if self.saved != iteration:
                    self._save()
                self._start_evaluation(at)
                self.starting = None
            else:
                results = self._evaluate(run.eval_episodes)
                self._record_evaluation(results, self.counters)
        # 5. checkpoint (unless a new best evaluation just saved this iteration)
        due = last or (run.save_every and iteration % run.save_every == 0)
        if due and self.saved != iteration:
            self._save()
        if self.stop.requested:
            raise Interrupted
        if clock.out_of_time:
            self.bar.write(
                f"stopping after {counters['train_seconds'] / 60:.1f} min "
                f"(runner.max_minutes={run.max_minutes})"
            )
            return True
        return False

    def _drain(self) -> None:
        """Finish the update in flight (cluster.max_staleness 1) before the run stops: the weights
        a stop saves are then a completed iteration's."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        self._finish(pending, last=True, stopping=True)
        self.counters.update({k: self.end_counters[k] for k in ("env_steps", "rounds")})

    def _collect(self, iteration: int, stats: EpisodeStats) -> dict[str, float]:
        """Rounds of chunks until the algorithm has enough (PPO: one), each added to the
        learner, which computes its advantages -> the rounds' metrics."""
        counters = self.counters
        round_metrics: list[dict[str, torch.Tensor]] = []
        for round_index in range(self.algorithm.max_rounds):
            plan = self.algorithm.plan(iteration, round_index, self._episode_base())
            round_metrics.append(self._collect_round(iteration, round_index, plan, stats))
            counters["env_steps"] += self.steps_per_round
            counters["rounds"] += 1
            if self.algorithm.enough(round_metrics):
                break
        return self.algorithm.collected(round_metrics)

    def _collect_round(self, iteration: int, round_index: int, plan, stats: EpisodeStats):
        """One round of chunks from its seeded reset, added to the learner -> its advantages'
        metrics. A worker lost midway (a cluster run), or before the learner has the round,
        loses the round: nothing of it enters the batch or the episode statistics; the round
        is collected again from its reset once the cluster has replaced the worker."""
        failures = 0
        while True:
            totals = stats.totals.clone()  # the finished episodes before this round
            try:
                obs = self.envs.reset(seed=plan.seeds)
                stats.restart()  # every episode starts afresh: nothing carries over from a round
                first = self.fresh and iteration == 1 and round_index == 0 and failures == 0
                if first and not self.cfg.runner.init_from:
                    # normalisation statistics from the first observations, before anything acts
                    self.learner.init_normalizer(obs)
                    self.roles.sync(0)
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
                self.counters["discarded_rounds"] = self.counters.get("discarded_rounds", 0) + 1
                self.bar.write(
                    f"iteration {iteration}: {lost}; its round is discarded and collected again "
                    f"(failure {failures} in a row)"
                )
                self.logger.log(
                    {"cluster/discarded_rounds": self.counters["discarded_rounds"]},
                    step=self.counters["env_steps"],
                    iteration=iteration,
                )
                self.roles.recover(lost, failures)

    def _episode_base(self) -> int:
        """Episode ids of the next round start here: a round of T chunks of K actions ends at
        most T * K episodes per environment, so ids never repeat within a run."""
        B = self.envs.num_envs
        per_round = B * (self.steps_per_round // B + 1)
        return self.counters["rounds"] * per_round

    def _postfix(self, metrics: dict, steps: int, seconds: float, clock: Clock) -> dict:
        postfix = {"sps": f"{steps / seconds:.0f}"}
        if "episode/return" in metrics:
            postfix["ret"] = f"{metrics['episode/return']:.2f}"
        if "episode/success_once" in metrics:
            postfix["succ"] = f"{metrics['episode/success_once']:.2f}"
        if "grpo/kept_groups" in metrics:
            postfix["kept"] = f"{metrics['grpo/kept_groups']:.0f}"
        if "cluster/env_idle" in metrics:  # how busy each role's busiest worker was
            busy = [1 - metrics[f"cluster/{role}_idle"] for role in ("env", "rollout", "actor")]
            postfix["busy"] = "env {:.0%} roll {:.0%} act {:.0%}".format(*busy)
        return {**postfix, **clock.left()}

    # --- consistent points --------------------------------------------------------------------
    def _completed(self) -> None:
        """Remember the state a completed iteration leaves: what a stop saves."""
        self.end_rng = self.roles.rng_state()
        self.end_counters = json.loads(json.dumps(self.counters))

    def _save(self) -> None:
        iteration = self.end_counters["iteration"]
        if iteration == 0:
            return
        best = self.end_counters.get("best") or {}
        protect = [best["iteration"]] if best else []
        if self.evaluating is not None:  # (it may become the best)
            protect.append(self.evaluating[1]["iteration"])
        self.learner.save(
            self.run_dir,
            iteration,
            counters=self.end_counters,
            meta=self.meta,
            rng=self.end_rng,
            keep=self.cfg.runner.keep_checkpoints,
            protect=protect,
        )
        self.saved = iteration

    def _save_completed(self) -> None:
        """Save the last completed iteration unless it is saved already (collection and
        evaluation do not change the weights, so they are still that iteration's)."""
        self.counters = self.end_counters
        if self.end_counters["iteration"] > self.saved:
            self._save()

    def _stopped_between_iterations(self) -> None:
        """A stop during collection or evaluation: save the last completed iteration, stop."""
        self._drain()
        self._save_completed()
        done = self.end_counters["iteration"]
        signum = self.stop.signum
        where = self.run_dir / "last" if done else "nothing to save yet"
        raise Stopped(signum, f"stopped after iteration {done}; checkpoint: {where}")

    # --- evaluation ---------------------------------------------------------------------------
    def _evaluate(self, episodes: int, video: Path | None = None) -> dict[str, dict]:
        names = self.envs.task_names
        with tqdm(
            total=episodes * len(names),
            desc="evaluating",
            unit="ep",
            leave=False,
            disable=not self.cfg.runner.progress,
            mininterval=bar_interval(),
        ) as progress:
            return self.roles.evaluate(
                episodes=episodes,
                seed=self.cfg.seed,
                video_path=video,
                progress=progress,
                should_stop=lambda: self.stop.requested,
            )

    def _in_flight(self, at: dict) -> dict:
        """Mark the evaluation of the iteration whose counters are ``at`` as in flight in the
        counters that checkpoints save, until one holds its result: a stop or a crash before
        then does not lose it, since a resume from any of them runs it again."""
        for counters in (self.counters, self.end_counters):
            counters["evaluating"] = dict(at)
        return at

    def _landed(self, iteration: int) -> None:
        """The evaluation of ``iteration`` is no longer in flight (recorded, or lost)."""
        for counters in (self.counters, self.end_counters):
            if counters.get("evaluating", {}).get("iteration") == iteration:
                del counters["evaluating"]

    def _start_evaluation(self, at: dict, weights: dict | None = None) -> None:
        """An evaluation beside training of the iteration whose counters are ``at``: of the
        current weights, or ``weights`` (its checkpoint's)."""
        run = self.cfg.runner
        self.evaluating = (
            self.roles.start_evaluation(
                episodes=run.eval_episodes, seed=self.cfg.seed, weights=weights
            ),
            at,
        )

    def _evaluate_again(self, at: dict) -> None:
        """Start again, beside training, the evaluation that was running when the run stopped,
        on its iteration's weights (that checkpoint was kept for it); its result is recorded
        at that iteration as it would have been. Where it cannot run again, say so once."""
        iteration = at["iteration"]
        why = why_not_again(self.cfg, self.roles.evaluates_beside, self.run_dir, self.counters, at)
        if why is not None:
            self._landed(iteration)
            self.bar.write(
                f"the evaluation of iteration {iteration} was unfinished: {why} "
                "(rows it logged before the stop, if any, are kept)"
            )
            return
        path = checkpoint_dir(self.run_dir, iteration)
        weights = load_checkpoint(path, with_trainer_state=False)["model"]
        self._start_evaluation(at, weights)
        self.bar.write(f"evaluating iteration {iteration} again (unfinished when the run stopped)")

    def _take_evaluation(self, wait: bool) -> None:
        """Record the evaluation running beside training once it is done (``wait``: wait for
        it). A lost evaluation worker loses that evaluation only."""
        if self.evaluating is None:
            return
        handle, at = self.evaluating
        if not wait and not handle.ready():
            return
        self.evaluating = None
        try:
            results = handle.result()
        except WorkerLost as lost:
            self.bar.write(f"evaluation of iteration {at['iteration']}: {lost}; skipped")
            self._landed(at["iteration"])
            return
        self._record_evaluation(results, at)

    def _log_evaluation(self, results: dict[str, dict], label: str, at: dict | None = None) -> None:
        """Log ``results`` at the counters ``at`` (the evaluated iteration's; None: now)."""
        at = self.counters if at is None else at
        step = at["env_steps"]
        iteration = at["iteration"]
        self.logger.log(overall(results), step=step, iteration=iteration)
        if len(results) > 1:
            for task, summary in results.items():
                self.logger.log(per_task(task, summary), step=step, iteration=iteration)
        for task, r in results.items():
            self.bar.write(
                f"{label} {task}: success {r['eval/success_rate']:.2f} "
                f"over {r['eval/episodes']} episodes"
            )

    def _record_evaluation(self, results: dict[str, dict], at: dict) -> None:
        """Record the evaluation of the iteration whose counters are ``at`` (this one's, or an
        earlier one's evaluated beside training: its checkpoint is saved already)."""
        iteration = at["iteration"]
        self._landed(iteration)  # (its result goes into the counters: a resume keeps it)
        if self.starting is not None:
            # this iteration's evaluation starts next, from the checkpoint a new best saves below
            self._in_flight(self.starting)
        counters = self.counters
        success = overall(results)["eval/success_rate"]
        counters["evals"].append(
            {
                "iteration": iteration,
                "env_steps": at["env_steps"],
                "minutes": at["train_seconds"] / 60,
                "success_rate": success,
                "tasks": results,
            }
        )
        self._log_evaluation(results, f"iter {iteration}", at)
        best = counters["best"]
        if best is None or success > best["success_rate"]:
            counters["best"] = {"iteration": iteration, "success_rate": success}
            self._completed()
            # this iteration's checkpoint holds the new best (one evaluated beside training was
            # saved when its evaluation started, and the best link points there)
            if self.saved != counters["iteration"]:
                self._save()
            mark_best(self.run_dir, iteration)
        else:
            self._completed()

    def _final_evaluation(self) -> dict:
        run = self.cfg.runner
        counters = self.counters
        video = self.run_dir / "videos" / "final_eval.mp4" if run.video else None
        self._take_evaluation(wait=True)  # (the last iteration took it, unless it stopped early)
        try:
            results = self._evaluate(run.final_eval_episodes, video)
        except Interrupted:
            raise Stopped(self.stop.signum, "stopped during the final evaluation") from None
        self._log_evaluation(results, "final")
        final = overall(results)
        final.update(
            {
                "env_steps": counters["env_steps"],
                "minutes": counters["train_seconds"] / 60,
                "iteration": counters["iteration"],
            }
        )
        summary = {
            "run_dir": str(self.run_dir),
            "final": final,
            "tasks": results,
            "before": counters["before"],
            "evals": counters["evals"],
            "best": counters["best"],
            "env_steps": counters["env_steps"],
            "episodes": counters["episodes"],
            "minutes": counters["train_seconds"] / 60,
        }
        (self.run_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
        ci = final["eval/success_ci95"]
        print(
            f"final evaluation: success {final['eval/success_rate']:.3f} over "
            f"{final['eval/episodes']} episodes (95% CI {ci[0]:.2f}-{ci[1]:.2f}); "
            f"run in {self.run_dir}"
        )
        return summary
