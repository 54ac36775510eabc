"""The evaluations of a training run: before RL, every ``runner.eval_every`` iterations (in the
loop, or beside training on an evaluation worker while the next iterations run) and the final
one. Each is recorded in the run's state, logged, and the best periodic one's weights are kept
as a checkpoint (``RUN/best``); the one before RL has no checkpoint to keep, so where it scored
higher than that best the final summary says so (``start_beats_best``). An evaluation beside
training is marked in flight in the state that checkpoints save until one holds its result, so a
stop or a crash does not lose it: a resume runs it again.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from embodied.checkpoint import checkpoint_dir, load_checkpoint, mark_best
from embodied.evaluate import overall, per_task
from embodied.logger import RunLogger, write_atomic
from embodied.resume import why_not_again
from embodied.roles import Roles, WorkerLost
from embodied.run import Interrupted, Stopped, StopSignals, bar_interval
from embodied.run_state import RunState, SavePoints
from embodied.seeds import eval_seed
from embodied.train_config import TrainConfig


class Evaluations:
    def __init__(
        self,
        cfg: TrainConfig,
        roles: Roles,
        state: RunState,
        points: SavePoints,
        logger: RunLogger,
        bar: tqdm,
        stop: StopSignals,
    ):
        self.cfg = cfg
        self.roles = roles
        self.state = state  # the runner's, updated in place
        self.points = points
        self.run_dir = points.run_dir
        self.logger = logger
        self.bar = bar
        self.stop = stop
        self.beside = None  # (handle, the evaluated iteration's EVALUATED_AT): running beside
        self.starting = None  # EVALUATED_AT of an evaluation beside training about to start

    def in_flight_iteration(self) -> int | None:
        """The iteration an evaluation beside training is running for (its checkpoint stays)."""
        return None if self.beside is None else self.beside[1]["iteration"]

    def run(self, episodes: int, *, held_out: bool, video: Path | None = None) -> dict[str, dict]:
        """Evaluate the current weights in the loop -> task -> summary; ``held_out``: on the
        held-out seeds (the final evaluation), else on the selection seeds."""
        names = self.roles.envs.task_names
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
                seed=eval_seed(self.cfg.seed, held_out=held_out),
                video_path=video,
                progress=progress,
                should_stop=lambda: self.stop.requested,
            )

    def before_rl(self, evaluates_before: bool) -> None:
        """Success before RL, on the evaluation seeds (a fresh run whose algorithm asks for it,
        or one that starts from a checkpoint)."""
        if self.state.iteration == 0 and (evaluates_before or self.cfg.runner.init_from):
            self.state.before = self.run(self.cfg.runner.eval_episodes, held_out=False)
            self.log(self.state.before, "before RL")
            self.points.state = self.state.copy()  # (no checkpoint at iteration 0: no streams)

    def periodic(self, iteration: int, last: bool) -> None:
        """Step 4 of an iteration: take an evaluation beside training that is done (the last
        iteration waits for it), and evaluate this iteration if it is due."""
        due = self.cfg.runner.eval_every and iteration % self.cfg.runner.eval_every == 0
        due = due and not last
        self.starting = None
        if due and self.roles.evaluates_beside:
            # (the checkpoint an earlier evaluation's new best saves below names it in flight)
            self.starting = self.points.state.at()
        self.take(wait=last)
        if not due:
            return
        if self.starting is None:
            # in the loop: a stop before or during it saves this iteration naming it, and the
            # resumed run runs it first (``again``)
            self.mark_in_flight(self.state.at())
        if self.stop.requested:
            raise Interrupted
        self.take(wait=True)  # (one at a time)
        if self.starting is None:
            self.record(self.run(self.cfg.runner.eval_episodes, held_out=False), self.state.at())
            return
        # its checkpoint first, in case it is the best; it names the evaluation in flight
        at = self.mark_in_flight(self.starting)
        self.points.save(self.in_flight_iteration())
        self.start(at)
        self.starting = None

    def mark_in_flight(self, at: dict) -> dict:
        """Mark the evaluation of the iteration whose counters are ``at`` as in flight in the
        state checkpoints save, until one holds its result."""
        for state in (self.state, self.points.state):
            state.evaluating = dict(at)
        return at

    def landed(self, iteration: int) -> None:
        """The evaluation of ``iteration`` is no longer in flight (recorded, or lost)."""
        for state in (self.state, self.points.state):
            if state.evaluating is not None and state.evaluating["iteration"] == iteration:
                state.evaluating = None

    def start(self, at: dict, weights: dict | None = None) -> None:
        """An evaluation beside training of the iteration whose counters are ``at``: of the
        current weights, or ``weights`` (its checkpoint's)."""
        episodes = self.cfg.runner.eval_episodes
        seed = eval_seed(self.cfg.seed, held_out=False)  # (it may pick the best)
        handle = self.roles.start_evaluation(episodes=episodes, seed=seed, weights=weights)
        self.beside = (handle, at)

    def again(self, at: dict) -> None:
        """Run again the evaluation that was running (or due) when the run stopped, on its
        iteration's weights: beside training from its checkpoint (kept for it), or in the loop
        now where the resumed checkpoint is its iteration's. Its result is recorded at that
        iteration as it would have been. Where it cannot run again, say so once."""
        iteration = at["iteration"]
        counters = self.state.counters()
        why = why_not_again(self.cfg, self.roles.evaluates_beside, self.run_dir, counters, at)
        if why is None and not self.roles.evaluates_beside:  # (the weights are its iteration's)
            self.bar.write(f"evaluating iteration {iteration} (unfinished when the run stopped)")
            self.record(self.run(self.cfg.runner.eval_episodes, held_out=False), at)
            return
        if why is not None:
            self.landed(iteration)
            self.bar.write(
                f"the evaluation of iteration {iteration} was unfinished: {why} "
                "(rows it logged before the stop, if any, are kept)"
            )
            return
        path = checkpoint_dir(self.run_dir, iteration)
        weights = load_checkpoint(path, with_trainer_state=False)["model"]
        self.start(at, weights)
        self.bar.write(f"evaluating iteration {iteration} again (unfinished when the run stopped)")

    def take(self, wait: bool) -> None:
        """Record the evaluation running beside training once it is done (``wait``: wait for
        it). A lost evaluation worker loses that evaluation only."""
        if self.beside is None:
            return
        handle, at = self.beside
        if not wait and not handle.ready():
            return
        self.beside = None
        try:
            results = handle.result()
        except WorkerLost as lost:
            self.bar.write(f"evaluation of iteration {at['iteration']}: {lost}; skipped")
            self.landed(at["iteration"])
            return
        self.record(results, at)

    def log(self, results: dict[str, dict], label: str, at: dict | None = None) -> None:
        """Log ``results`` at the counters ``at`` (the evaluated iteration's; None: now). The
        final evaluation's rows say so: a resume drops them (the run gets a final one again)."""
        at = self.state.at() if at is None else at
        step = at["env_steps"]
        where = {"iteration": at["iteration"], **({"final": True} if label == "final" else {})}
        self.logger.log(overall(results), step=step, **where)
        if len(results) > 1:
            for task, summary in results.items():
                self.logger.log(per_task(task, summary), step=step, **where)
        for task, r in results.items():
            self.bar.write(
                f"{label} {task}: success {r['eval/success_rate']:.2f} "
                f"over {r['eval/episodes']} episodes"
            )

    def record(self, results: dict[str, dict], at: dict) -> None:
        """Record the evaluation of the iteration whose counters are ``at`` (this one's, or an
        earlier one's evaluated beside training: its checkpoint is saved already)."""
        iteration = at["iteration"]
        self.landed(iteration)  # (its result goes into the state: a resume keeps it)
        if self.starting is not None:
            # this iteration's evaluation starts next, from the checkpoint a new best saves below
            self.mark_in_flight(self.starting)
        state = self.state
        success = overall(results)["eval/success_rate"]
        minutes = at["train_seconds"] / 60
        state.evals.append(
            {
                "iteration": iteration,
                "env_steps": at["env_steps"],
                "minutes": minutes,
                "success_rate": success,
                "tasks": results,
            }
        )
        self.log(results, f"iter {iteration}", at)
        new_best = state.best is None or success > state.best["success_rate"]
        if new_best:
            state.best = {"iteration": iteration, "success_rate": success}
        self.points.complete(state)
        if new_best:
            # this iteration's checkpoint holds the new best (one evaluated beside training was
            # saved when its evaluation started, and the best link points there)
            self.points.save(self.in_flight_iteration())
            mark_best(self.run_dir, iteration)

    def final(self) -> dict:
        """The final evaluation -> the run's summary (also written to metrics.json)."""
        run = self.cfg.runner
        state = self.state
        video = self.run_dir / "videos" / "final_eval.mp4" if run.video else None
        self.take(wait=True)  # (the last iteration took it, unless it stopped early)
        try:
            results = self.run(run.final_eval_episodes, held_out=True, video=video)
        except Interrupted:
            raise Stopped(self.stop.signum, "stopped during the final evaluation") from None
        self.log(results, "final")
        final = overall(results)
        minutes = state.train_seconds / 60
        final.update(env_steps=state.env_steps, minutes=minutes, iteration=state.iteration)
        not_held_out = getattr(self.cfg.env, "no_held_out", "")  # (LIBERO: the same states)
        summary = {
            "run_dir": str(self.run_dir),
            "final": final,
            "held_out": not not_held_out,  # on episodes no selection evaluation ran
            "tasks": results,
            "before": state.before,
            "evals": state.evals,
            "best": state.best,
            "env_steps": state.env_steps,
            "episodes": state.episodes,
            "minutes": minutes,
        }
        beaten = start_beats_best(state.before, state.best)
        summary["best_below_before"] = beaten is not None
        write_atomic(self.run_dir / "metrics.json", json.dumps(summary, indent=2))
        if beaten is not None:
            print(beaten)
        ci = final["eval/success_ci95"]
        if not_held_out:
            print(f"final evaluation, not held out: {not_held_out}")
        print(
            f"final evaluation: success {final['eval/success_rate']:.3f} over "
            f"{final['eval/episodes']} episodes (95% CI {ci[0]:.2f}-{ci[1]:.2f}); "
            f"run in {self.run_dir}"
        )
        return summary


def start_beats_best(before: dict | None, best: dict | None) -> str | None:
    """A line saying that the policy the run started from scored higher before RL than the best
    periodic evaluation (the same selection episodes), or None: ``RUN/best`` is then worse than
    that start (``runner.init_from``), which has no checkpoint in the run."""
    if not before or not best:
        return None
    start = overall(before)["eval/success_rate"]
    if start <= best["success_rate"]:
        return None
    return (
        f"the best checkpoint (iteration {best['iteration']}, success "
        f"{best['success_rate']:.3f}) scored below the policy the run started from ({start:.3f} "
        "before RL, on the same selection episodes): RUN/best is not an improvement on it"
    )
