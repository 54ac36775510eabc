"""``embodied sft``: supervised fine-tuning (behaviour cloning) of a policy on LeRobot datasets.

Reads one or more demonstration datasets (one task each, or mixed), installs their
normalization statistics in the policy (state mean/std, action 1st/99th percentiles), trains the
policy's own ``bc_loss`` on random frames with the next K actions as the target chunk, evaluates
success per task in the simulator, and writes a checkpoint that ``embodied eval`` and RL
fine-tuning (``runner.init_from``) load. With a frozen image encoder the image features of every
frame are computed once and reused (the encoder is deterministic: BatchNorm in eval mode).

The update runs on the configured backend (``trainer.backend``, ``trainer.tensor_parallel``) as
RL's does: ``BCLearner`` holds the policy and its ``TrainEngine`` (AdamW with the config's weight
decay, clipping by the global norm); with TP ranks in processes, rank 0's follows the others in
lockstep (embodied/megatron/lockstep.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from embodied import numerics
from embodied.config import ConfigError, to_dict
from embodied.evaluate import evaluate_by_task, per_task
from embodied.logger import RunLogger, write_atomic
from embodied.models import build_policy
from embodied.multitask import make_env
from embodied.report import report_at_end
from embodied.resume import check_resume, load_resumed
from embodied.roles import load_checkpoint_for, make_engine, save_engine
from embodied.run import (
    Clock,
    NonFiniteUpdate,
    Stopped,
    StopSignals,
    bar_interval,
    enter_run_dir,
    run_dir_for,
    run_dir_held,
    run_dir_keys,
)
from embodied.schema import SimulatorConfig
from embodied.seeds import eval_seed
from embodied.sft_config import SFTConfig, lr_at
from embodied.sft_data import (
    Frames,
    batch_of,
    cached_features,
    check_fits,
    load_frames,
    norm_data,
    set_norm_stats,
    task_configs,
)
from embodied.streams import Stream, resumed


class BCLearner:
    """SFT's update: the policy with the datasets' normalisation statistics, and its
    ``TrainEngine`` on ``cfg.trainer.backend`` (AdamW, eps 1e-8, ``cfg.weight_decay`` on every
    trainable weight; clipping at ``cfg.max_grad_norm``). ``lockstep_calls``: what TP rank 0
    sends its helper ranks."""

    lockstep_calls = ("bc_step", "refresh", "load")

    def __init__(self, cfg: SFTConfig, spec, norm_data: dict, device):
        self.cfg = cfg
        # the batches' frames and any dropout draw from it (rank 0's: helpers get its state)
        self.stream = Stream.derived(cfg.seed, "sft", 0)
        self.policy = build_policy(spec, cfg.policy).to(device)
        set_norm_stats(self.policy, norm_data)
        if cfg.trainer.backend == "megatron":
            from embodied.megatron.engine import join_ranks

            join_ranks(self.policy, cfg)
        self.engine = make_engine(
            self.policy,
            cfg.trainer,
            learning_rate=cfg.learning_rate,
            max_grad_norm=cfg.max_grad_norm,
            weight_decay=cfg.weight_decay,
            adam_eps=1e-8,
            with_value=False,
        )

    def bc_step(self, obs, chunk, mask, features, lr: float) -> dict[str, torch.Tensor]:
        """One clipped AdamW step of ``policy.bc_loss`` at ``lr``: its metrics, the loss and
        the gradient norm (0-dim tensors)."""
        self.engine.set_lr(lr)
        self.policy.train()
        loss, metrics = self.policy.bc_loss(obs, chunk, mask, features=features)
        self.engine.backward(loss)
        grad_norm = self.engine.step()
        return {**metrics, "sft/loss": loss.detach(), "sft/grad_norm": grad_norm}

    def refresh(self) -> None:
        """The torch-layout policy (evaluation, checkpoints) gets the current weights."""
        self.engine.refresh()

    def load(self, checkpoint: dict) -> None:
        """A resumed run's weights, optimizer state and stream."""
        load_resumed(self.engine, checkpoint, self.cfg.runner.resume_force)
        step = (checkpoint.get("counters") or {}).get("iteration", 0)
        resumed(self.stream, checkpoint.get("rng"), self.cfg.seed, step)

    def save(self, run_dir: Path, step: int, **kw) -> Path:
        return save_engine(self.engine, run_dir, step, **kw)

    def close(self) -> None:
        self.engine.close()


def bc_learner_for(cfg: SFTConfig, spec, norm_data: dict) -> BCLearner:
    """SFT's learner in this process, its TP ranks 1.. in helper processes when
    ``trainer.tensor_parallel`` > 1."""
    device = torch.device("cpu")
    if cfg.trainer.tensor_parallel > 1:
        from embodied.megatron.lockstep import Lockstep, start_ranks

        helpers = start_ranks(cfg, device, BCLearner, spec, norm_data)
        return Lockstep(BCLearner(cfg, spec, norm_data, device), helpers)
    return BCLearner(cfg, spec, norm_data, device)


def sft(cfg: SFTConfig) -> dict:
    """Train as ``cfg`` says; returns the run's summary (also written to metrics.json)."""
    if cfg.runner.deterministic:  # first: before a torch op chooses a code path or a worker starts
        numerics.pin()
    numerics.setup(cfg.runner.torch_threads)
    torch.manual_seed(cfg.seed)  # the policy's initial weights
    frames = load_frames(cfg.datasets, cfg.episodes_per_dataset)  # (a bad dataset fails first)
    resume = _resume_of(cfg)
    default_task = cfg.env.task_name()
    env_cfgs = task_configs(cfg.env, [t or default_task for t in frames.tasks])
    run_dir = run_dir_for(cfg.runner, resume)  # (refused before an environment is built)
    # one environment for the spec and every evaluation: a simulator's start can take seconds
    with make_env(_eval_env_config(env_cfgs)) as env:
        spec = env.spec
        cameras = spec.obs.cameras if getattr(cfg.policy, "use_images", True) else ()
        any_size = cfg.policy.name == "smolvla"  # (it resizes and pads what it is given)
        check_fits(frames, spec, cfg.policy.read_privileged(spec), cameras, any_size)
        with run_dir_held(run_dir, run_dir_keys(resume)):
            learner = bc_learner_for(cfg, spec, norm_data(frames))
            try:  # (TP ranks in processes end with the learner)
                if resume is not None:  # (before the run directory is taken back: it may refuse)
                    learner.load(resume)
                enter_run_dir(run_dir, cfg, resume, evaluates_beside=False)
                run = SFTRun(cfg, learner, frames, env_cfgs, env, run_dir, resume)
                run.train()
            except Stopped:
                report_at_end(run_dir, cfg.runner.report)
                raise
            finally:
                learner.close()
            summary = run.finish()
    report_at_end(run_dir, cfg.runner.report)
    return summary


def _resume_of(cfg: SFTConfig) -> dict | None:
    """The checkpoint ``runner.resume`` names, checked against this config; None for a new run."""
    if not cfg.runner.resume:
        return None
    resume = load_checkpoint_for(cfg.runner.resume, "runner.resume")
    saved = resume["meta"].get("sft")
    if saved is None:
        raise ConfigError(f"runner.resume: {resume['path']} is not a checkpoint of embodied sft")
    force = cfg.runner.resume_force
    check_resume(saved, to_dict(cfg), resume["path"], force, resume["meta"].get("precision"))
    return resume


class NonFiniteWatch:
    """The first step at which any of ``keys`` of a step's metrics (0-dim tensors) was not
    finite, kept on their device: read where the numbers are read anyway (logs, checkpoints),
    not with a host sync per step."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys
        self.found: torch.Tensor | None = None  # bool [], whether a step was not finite
        self.step: torch.Tensor | None = None  # long [], the first such step
        self.values: torch.Tensor | None = None  # f32 [len(keys)], its metrics

    def see(self, step: int, metrics: dict[str, torch.Tensor]) -> None:
        values = torch.stack([metrics[key].float() for key in self.keys])  # f32 [K]
        bad = ~torch.isfinite(values).all()
        if self.found is None:
            self.found, self.step, self.values = bad, torch.full_like(bad, step, dtype=int), values
            return
        first = bad & ~self.found
        self.step = torch.where(first, step, self.step)
        self.values = torch.where(first, values, self.values)
        self.found = self.found | bad

    def first(self) -> tuple[int, dict[str, float]] | None:
        """(the first non-finite step, its metrics), or None where every step was finite."""
        if self.found is None or not bool(self.found):
            return None
        return int(self.step), dict(zip(self.keys, self.values.tolist()))


class SFTRun:
    """The steps of one SFT run: batches of frames, evaluations, checkpoints, a stop."""

    def __init__(self, cfg, learner, frames: Frames, env_cfgs: dict, env, run_dir, resume):
        self.cfg = cfg
        self.learner = learner
        self.frames = frames
        self.env_cfgs = env_cfgs
        self.env = env  # (every evaluation's: it holds every task)
        self.run_dir = run_dir
        self.policy = learner.engine.torch_policy  # (evaluation, the cached image features)
        counters = {} if resume is None else resume["counters"]
        self.step = counters.get("iteration", 0)
        self.evals: list[dict] = counters.get("evals", [])
        # the step of the last of them (None: none, or a checkpoint from before it was kept)
        self.evaluated_at: int | None = counters.get("evaluated_at")
        self.saved = None if resume is None else resume["path"]  # (the newest checkpoint)
        self.watch = NonFiniteWatch(("sft/loss", "sft/grad_norm"))
        self.clock = Clock(counters.get("train_seconds", 0.0), cfg.runner.max_minutes)
        self.logger = RunLogger(run_dir, resumed_at=None if resume is None else self.step)
        self.meta = _meta(cfg, env_cfgs, env.spec)
        if resume is not None:
            print(f"resuming {run_dir} from step {self.step}")

    def save(self) -> Path:
        self._check_finite()
        counters = {
            "iteration": self.step,
            "env_steps": 0,
            "train_seconds": self.clock.seconds,
            "evals": self.evals,
            "evaluated_at": self.evaluated_at,
        }
        rng = {"streams": {self.learner.stream.key: self.learner.stream.state()}}
        self.learner.refresh()
        keep = self.cfg.runner.keep_checkpoints
        self.saved = self.learner.save(
            self.run_dir, self.step, counters=counters, meta=self.meta, rng=rng, keep=keep
        )
        return self.saved

    def _check_finite(self) -> None:
        """Stop, unsaved, where a step so far had a non-finite loss or gradient norm: its
        weights are not usable (one NaN made them all NaN, and SFT saved them)."""
        if found := self.watch.first():
            raise NonFiniteUpdate(*found, None, self.saved, unit="step")

    def train(self) -> None:
        cfg = self.cfg
        frames = self.frames
        trainable = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        print(
            f"sft: {len(frames.data)} frames from {len(cfg.datasets)} dataset(s), tasks "
            f"{sorted(self.env_cfgs)}; {trainable / 1e6:.1f}M trainable parameters"
        )
        cached = getattr(self.policy, "caches_image_features", False)
        self.features = cached_features(self.policy, frames) if cached else None
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            desc=cfg.runner.name,
            disable=not cfg.runner.progress,
            dynamic_ncols=True,
            mininterval=bar_interval(),
        )
        self.policy.train()
        if self._unevaluated():  # (a stop came between its step and its evaluation)
            self._evaluate()
        with StopSignals() as stop:
            while self.step < cfg.steps:
                if self.clock.out_of_time:  # (before a step: a resumed run may be out already)
                    bar.write(f"stopping after {self.step} steps ({cfg.runner.max_minutes} min)")
                    break
                self.step += 1
                metrics = self._bc_step()
                bar.update(1)
                if self.step % 10 == 0 or self.step == cfg.steps:
                    self._log(metrics, bar)
                if stop.requested:  # between steps the weights and optimizer are consistent
                    self.save()
                    bar.close()
                    self.logger.close()
                    where = f"{self.run_dir}/last"
                    message = f"stopped after step {self.step}; checkpoint: {where}"
                    raise Stopped(stop.signum, message)
                self._evaluate_or_save()
        bar.close()
        self.checkpoint = self.save()

    def _bc_step(self) -> dict:
        """One update on a batch of random frames, the next K actions as each one's target."""
        cfg = self.cfg
        with self.learner.stream.drawing():
            idx = torch.randint(len(self.frames.data), (cfg.batch_size,))
            chunk, mask = self.frames.data.action_chunks(idx, cfg.policy.chunk_size)
            # f32 [C*B, P, F], cameras outermost
            feats = None if self.features is None else self.features[:, idx].flatten(0, 1)
            obs = batch_of(self.frames, idx)
            metrics = self.learner.bc_step(obs, chunk, mask, feats, lr_at(cfg, self.step - 1))
        self.watch.see(self.step, metrics)
        return metrics

    def _log(self, metrics: dict, bar: tqdm) -> None:
        self._check_finite()
        metrics = {k: float(v) for k, v in metrics.items()}
        lr = lr_at(self.cfg, self.step - 1)
        metrics.update({"train/lr": lr, "time/minutes": self.clock.seconds / 60})
        self.logger.log(metrics, step=self.step, iteration=self.step)
        bar.set_postfix(loss=f"{metrics['sft/loss']:.4f}")

    def _evaluate_or_save(self) -> None:
        """The evaluation due at this step, then the checkpoint due (which then holds it)."""
        run = self.cfg.runner
        if self.step >= self.cfg.steps:
            return  # (the end saves and evaluates)
        if run.eval_every and self.step % run.eval_every == 0 and not self.clock.out_of_time:
            self._evaluate()
        if run.save_every and self.step % run.save_every == 0:
            self.save()

    def _unevaluated(self) -> bool:
        """Whether the step a run resumes at was due an evaluation its checkpoint lacks (one a
        run out of time skipped is not: it ends there). ``runner.eval_every`` may differ from
        the stopped run's: the step of its last evaluation decides, not their count."""
        every = self.cfg.runner.eval_every
        due = every and 0 < self.step < self.cfg.steps and self.step % every == 0
        if not due or self.clock.out_of_time:
            return False
        if self.evaluated_at is None:  # (none yet, or an older checkpoint's: by their count)
            return len(self.evals) < self.step // every
        return self.evaluated_at != self.step

    def _evaluate(self) -> None:
        """An evaluation of this step's weights on the selection seeds, recorded and logged."""
        self._check_finite()  # (NaN weights' actions: a simulator's error, or a 0 logged)
        self.learner.refresh()
        results = evaluate_tasks(
            self.policy,
            self.env,
            list(self.env_cfgs),
            self.cfg.runner.eval_episodes,
            eval_seed(self.cfg.seed, held_out=False),
            self.step,
            self.logger,
        )
        self.evals.append(results)
        self.evaluated_at = self.step
        self.policy.train()

    def finish(self) -> dict:
        """The final evaluation (with its video) -> the run's summary, also metrics.json."""
        run = self.cfg.runner
        video_dir = self.run_dir / "videos"
        final = evaluate_tasks(
            self.policy,
            self.env,
            list(self.env_cfgs),
            run.eval_episodes,
            eval_seed(self.cfg.seed, held_out=True),  # as `embodied eval` of its checkpoint
            self.step,
            self.logger,
            video_dir=video_dir,
            final=True,
        )
        summary = {
            "run_dir": str(self.run_dir),
            "checkpoint": str(self.checkpoint),
            "steps": self.step,
            "minutes": self.clock.seconds / 60,
            "final": final,
            "evals": self.evals,
        }
        write_atomic(self.run_dir / "metrics.json", json.dumps(summary, indent=2))
        self.logger.close()
        for task, r in final.items():
            ci = r["eval/success_ci95"]
            print(
                f"{task}: success {r['eval/success_rate']:.3f} over {r['eval/episodes']} "
                f"episodes (95% CI {ci[0]:.2f}-{ci[1]:.2f})"
            )
        return summary


def _meta(cfg: SFTConfig, env_cfgs: dict, spec) -> dict:
    """What the checkpoints say about the run: `embodied eval` builds its environment and acts
    with this many threads and pins, as this run's evaluations did (another count or code path
    rounds otherwise)."""
    return {
        "config": {
            "seed": cfg.seed,
            "env": to_dict(_eval_env_config(env_cfgs)),  # (every task: eval scores each)
            "policy": to_dict(cfg.policy),
            "runner": {
                "torch_threads": cfg.runner.torch_threads,
                "deterministic": cfg.runner.deterministic,
            },
        },
        "sft": to_dict(cfg),
        "spec": spec.to_dict(),
        "format": "embodied-checkpoint-v1",
    }


@torch.no_grad()
def evaluate_tasks(
    policy,
    env,
    tasks: list[str],
    episodes: int,
    seed: int,
    step: int,
    logger,
    video_dir: Path | None = None,
    final: bool = False,
) -> dict:
    """Deterministic evaluation of ``policy`` on each task, all tasks at once in ``env`` (one
    MultiTaskEnv, ``env.num_envs`` environments per task) -> {task: evaluate() summary}.
    ``final``: the run's final evaluation, whose rows say so (a resume drops them)."""
    policy.eval()
    video = video_dir / "eval.mp4" if video_dir is not None else None
    with tqdm(
        total=episodes * len(tasks),
        desc="evaluating",
        unit="ep",
        leave=False,
        mininterval=bar_interval(),
    ) as progress:
        out = evaluate_by_task(
            env, policy, episodes=episodes, seed=seed, video_path=video, progress=progress
        )
    if len(tasks) == 1:
        out = {tasks[0]: out["all"]}
    tag = {"final": True} if final else {}
    for task, summary in out.items():
        logger.log(per_task(task, summary), step=step, iteration=step, **tag)
    return out


def _eval_env_config(env_cfgs: dict[str, SimulatorConfig]) -> SimulatorConfig:
    """One task's config, or a multi-task one with each task's ``num_envs`` and at least a worker
    per task."""
    first = next(iter(env_cfgs.values()))
    if len(env_cfgs) == 1:
        return first
    n = len(env_cfgs)
    return replace(
        first,
        tasks=list(env_cfgs),
        num_envs=n * first.num_envs,
        num_workers=max(n, first.num_workers) if first.num_workers else 0,
    )  # 0: in process
