"""The roles a run drives, and how one process builds them.

The runner (embodied/runner.py) talks to an environment group (env_group.py), an inference
policy (inference.py) and a ``Learner`` through ``Roles``. ``local_roles`` builds them in this
process (``LocalRoles``): inference shares the learner's module, so a weight sync only records
the version, and the run's random streams are this process's. ``embodied.cluster.ray_roles``
builds the same roles as Ray actors behind the same protocol; the runner cannot tell them
apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from embodied.algorithm import proximal_logprob, update
from embodied.checkpoint import load_policy_checkpoint, save_checkpoint
from embodied.config import ConfigError, to_dict
from embodied.env_group import EnvGroup
from embodied.evaluate import evaluate_by_task
from embodied.inference import InferencePolicy
from embodied.learner import TorchEngine, TrainerConfig
from embodied.models import build_policy
from embodied.recording import Pending, state_digest, weights_digest
from embodied.resume import check_reference, check_weights_fit, load_resumed, trained_in
from embodied.rollout import CollectPlan, EpisodeStats, RolloutBatch, Samples, collect
from embodied.schema import EnvSpec, Observation, UserError
from embodied.stages import stage_candidates
from embodied.streams import Stream, resumed


class WorkerLost(RuntimeError):
    """A worker process of a role died (a crash, ``kill -9``, out of memory). What it was doing
    is lost; the cluster restarts the worker, and the runner collects the round again.
    ``worker`` names it where that is known ("env worker 1 (pid 4242 on node-a; tasks ...)")."""

    def __init__(self, role: str, detail: str, worker: str | None = None):
        super().__init__(f"{worker or role + ' worker'} lost: {detail}")
        self.role = role
        self.detail = detail
        self.worker = worker


class WorkerNotStarted(RuntimeError):
    """A cluster worker's constructor raised (at the run's start, or when the cluster restarted
    the worker): it is not tried again, so the run cannot go on. ``str()`` is one line naming
    the worker and the error."""


def load_checkpoint_for(path: str, key: str, trainer_state: bool = True) -> dict:
    """A checkpoint named by config key ``key``; a missing or damaged one is a ``ConfigError``."""
    try:
        return load_policy_checkpoint(path, with_trainer_state=trainer_state)
    except (FileNotFoundError, UserError) as e:
        raise ConfigError(f"{key}: {e}") from None


def init_policy(cfg, spec: EnvSpec, device) -> torch.nn.Module:
    """The policy for ``spec``, with weights (and normalization) from ``runner.init_from``; a
    resume's own replace them, and it reads init_from only for a reference made of them."""
    policy = build_policy(spec, cfg.policy).to(device)
    resumed = cfg.runner.resume and not cfg.algorithm.keeps_reference()
    if cfg.runner.init_from and not resumed:
        checkpoint = load_checkpoint_for(cfg.runner.init_from, "runner.init_from", False)
        changes = EnvSpec.from_dict(checkpoint["meta"]["spec"]).input_changes(spec)
        if changes:  # (weights of equal shapes would load, and act on other numbers)
            raise ConfigError(
                f"runner.init_from: {cfg.runner.init_from} was trained with other inputs or "
                f"actions than this environment's ({'; '.join(changes)})"
            )
        # a critic may be added (PPO after SFT: fresh value head) or dropped (GRPO)
        state = checkpoint["model"]
        check_weights_fit(state, policy, "runner.init_from", cfg.runner.init_from, "value_mlp.")
        # an SFT checkpoint's flow noise std (log_sigma: the VLA head's, SmolVLA's) is its
        # initial one, never trained: this config's instead (an RL checkpoint's is trained)
        fresh = policy.state_dict().items() if "sft" in checkpoint["meta"] else ()
        noise = {k: v.clone() for k, v in fresh if k.rpartition(".")[2] == "log_sigma"}
        policy.load_state_dict({**state, **noise}, strict=False)
    return policy


def build_algorithm(cfg, spec: EnvSpec, task_of_env: torch.Tensor, policy=None):
    """PPO or GRPO as ``cfg.algorithm`` says. The runner's copy plans rounds and computes
    advantages (``policy`` None); the learner's copy scores minibatches (GRPO's KL reference is
    taken from ``policy``)."""
    return cfg.algorithm.build(cfg, spec, task_of_env, policy)


class Done:
    """An update that has run: ``result()`` is its metrics."""

    def __init__(self, value: dict):
        self.value = value

    def result(self) -> dict:
        return self.value


class Learner:
    """The learner role: epochs of minibatch updates of the algorithm through a ``TrainEngine``,
    the observation normaliser, the optimizer, checkpoints, and the weights inference copies.
    ``lockstep_calls``: what TP rank 0 sends its helper ranks too (megatron/lockstep.py)."""

    lockstep_calls = ("restore_record",)

    def __init__(self, cfg, spec: EnvSpec, task_of_env: torch.Tensor, device):
        # the learner's stream (every data-parallel or TP rank derives the same one): the
        # policy's initial weights and the minibatch shuffles
        self.stream = Stream.derived(cfg.seed, "actor", 0)
        with self.stream.drawing(device):
            self._build(cfg, spec, task_of_env, device)
        self.rounds: list[RolloutBatch] = []  # the rounds collected for the next update
        # records (runner.record_rollouts): one rank keeps the iteration in progress (Pending),
        # then each updated one until the runner says whether it is written
        self.context = {
            "config": to_dict(cfg),
            "spec": spec.to_dict(),
            "task_of_env": task_of_env.tolist(),
            "reference_digest": reference_digest(self),  # (None: no KL reference)
            "precision": trained_in(self.engine),  # (trainer.precision auto: by the device)
        }
        self.pending: Pending | None = None  # (TP rank 0's; the others gather it with it)
        self.started = False  # the iteration in progress has its state before it taken
        self.updated: list[Pending] = []

    def _build(self, cfg, spec: EnvSpec, task_of_env: torch.Tensor, device) -> None:
        alg = cfg.algorithm
        self.cfg = cfg
        # acting in eval mode from the first chunk, as after every update (a transformer's
        # fast path in eval mode sums in another order than in train mode)
        self.policy = init_policy(cfg, spec, device).eval()
        try:
            alg.fit_policy(self.policy)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if cfg.trainer.backend == "megatron":
            from embodied.megatron.engine import join_ranks

            join_ranks(self.policy, cfg)
        self.algorithm = build_algorithm(cfg, spec, task_of_env, policy=self.policy)
        self.engine = make_engine(
            self.policy,
            cfg.trainer,
            learning_rate=alg.learning_rate,
            max_grad_norm=alg.max_grad_norm,
            with_value=self.algorithm.has_critic,
        )

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def distribute(self, process_group) -> None:
        """Share every update with the other ranks of ``process_group`` (data-parallel actor
        workers: each takes its share of every minibatch, gradients are averaged)."""
        self.engine.distribute(process_group, with_value=self.algorithm.has_critic)

    def init_normalizer(self, obs: Observation) -> None:
        """Normalisation statistics from the first observations, before anything acts."""
        self.policy.update_normalizer(obs.to(self.device))
        self.engine.refresh()

    def add_round(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """A collected round for the next update, its advantages computed here, where the
        update runs (the algorithm's ``advantages``); returns their 0-dim metrics."""
        if self.records and not self.started:  # (the first round: the state before it)
            self._take_state_before()
        if self.pending is not None:
            self.pending.add(batch)
        metrics = self.algorithm.advantages(batch)
        self.rounds.append(batch)
        return metrics

    @property
    def records(self) -> bool:
        """Whether this learner takes part in records: recording is on and it is data-parallel
        rank 0 (asked when used: data-parallel ranks learn their rank after they are built).
        Every TP rank takes part (the state is gathered from all); TP rank 0 keeps it."""
        return self.cfg.runner.record_rollouts > 0 and self.engine.rank == 0

    def _take_state_before(self) -> None:
        pending = Pending.before(self.engine, self.stream)  # (a collective across TP ranks)
        self.pending = pending if self.engine.tp_rank == 0 else None
        self.started = True

    def restore_record(self, model: dict, optimizer: dict, lr: float, stream: dict) -> None:
        """The state a record kept before its update: weights, optimizer, learning rate and
        random stream (embodied/recording.py)."""
        self.engine.load_state_dict({"model": model, "optimizer": optimizer})
        self.engine.set_lr(lr)
        self.stream.load(stream)

    def drop_last_round(self) -> None:
        """Forget the round added last (lost elsewhere: it is collected again), in the record
        in progress too."""
        self.rounds.pop()
        if self.pending is not None:
            self.pending.rounds.pop()
            self.pending.instructions.pop()

    def update(self) -> dict:
        """The algorithm's epochs over the rounds added since the last update (no samples in
        them: no update), then their observations folded into the normaliser; returns the
        update's metrics."""
        rounds, self.rounds = self.rounds, []
        parts = [part for part in (batch.samples() for batch in rounds) if len(part)]
        samples = Samples.cat(parts) if parts else None
        if samples is not None and self.cfg.trainer.backend != "megatron":
            check_minibatch(len(samples), self.cfg.algorithm.num_minibatches, self.engine)
        with self.stream.drawing(self.device):
            metrics = self._update(samples, [batch.obs for batch in rounds])
        if self.records:
            if not self.started:  # (no rounds)
                self._take_state_before()
            if self.pending is not None:
                self.pending.digest_after = weights_digest(self.engine.torch_policy)
                self.updated.append(self.pending)
            self.pending = None
            self.started = False
        return metrics

    def keep_record(
        self, run_dir: Path, iteration: int, reason: str | None, metrics: dict, counters: dict
    ) -> str | None:
        """Write the oldest updated iteration's record as ``iteration`` where ``reason`` says
        why, else drop it (embodied/recording.py); ``counters``: the run's at that iteration.
        Returns why the record could not be written, in one line (None: written or dropped): a
        full disk loses the record, not the run."""
        if not self.updated:
            return None
        pending = self.updated.pop(0)
        if reason is None:
            return None
        context = {**self.context, "counters": counters}
        try:
            pending.write(run_dir, iteration, reason, metrics, context)
        except Exception as error:  # (OSError, torch.save's RuntimeError, SafetensorError)
            return " ".join(f"{type(error).__name__}: {error}".split())[:300]
        return None

    def _update(self, samples: Samples | None, observations: list[Observation]) -> dict:
        metrics = {}
        if samples is not None and len(samples):
            alg = self.cfg.algorithm
            offload = self.cfg.cluster.offload_optimizer
            if offload:
                self.engine.restore_optimizer()
            self.policy.train()
            self.algorithm.prepare(samples, self.engine)
            if self.cfg.cluster.max_staleness > 0:  # data from older weights: decoupled PPO
                samples.prox_logprob = proximal_logprob(
                    self.engine,
                    samples,
                    level=alg.logprob_level,
                    num_minibatches=alg.num_minibatches,
                )
            metrics = update(
                self.engine,
                self.algorithm,
                samples,
                epochs=alg.update_epochs,
                num_minibatches=alg.num_minibatches,
            )
            self.policy.eval()
            if offload:  # the device is the rollout's until the next update
                metrics["optimizer/offloaded_mb"] = self.engine.offload_optimizer() / 2**20
        for obs in observations:
            self.policy.update_normalizer(obs)
        self.engine.refresh()
        return metrics

    def start_update(self) -> Done:
        """``update`` (here it runs now); the handle's ``result()`` is its metrics."""
        return Done(self.update())

    def set_lr(self, lr: float) -> None:
        self.engine.set_lr(lr)

    @property
    def lr(self) -> float:
        return self.engine.lr

    def load(self, checkpoint: dict) -> None:
        """Weights, optimizer state and random stream of a resumed run, at the configured
        learning rate (a forced resume may have changed it); its KL reference the run's own."""
        check_reference(checkpoint, self.context["reference_digest"], self.cfg.runner)
        load_resumed(self.engine, checkpoint, self.cfg.runner.resume_force)
        iteration = (checkpoint.get("counters") or {}).get("iteration", 0)
        resumed(self.stream, checkpoint.get("rng"), self.cfg.seed, iteration)
        self.engine.set_lr(self.cfg.algorithm.learning_rate)
        if self.cfg.cluster.offload_optimizer:  # (loaded beside the parameters)
            self.engine.offload_optimizer()

    def close(self) -> None:
        self.engine.close()

    def save(self, run_dir: Path, iteration: int, meta: dict | None = None, **kw) -> Path:
        meta = {**(meta or {}), "reference_digest": self.context["reference_digest"]}
        return save_engine(self.engine, run_dir, iteration, meta=meta, **kw)


def reference_digest(learner) -> str | None:
    """A digest of the learner's KL reference (GRPO's ``kl_coef > 0``: the policy's weights as
    they started, from ``runner.init_from`` or the seed), which records and checkpoints do not
    hold: a replay or a resume compares it with the recorded run's. None without one."""
    reference = getattr(learner.algorithm, "reference", None)
    if reference is None:
        return None
    # (tensors only: megatron's layers keep extra state of other kinds in theirs)
    return state_digest({k: v for k, v in reference.state_dict().items() if torch.is_tensor(v)})


def check_minibatch(samples: int, num_minibatches: int, engine) -> None:
    """Data-parallel ranks share every minibatch: each needs a sample of it at least (megatron's
    TP ranks score the same rows, and are not checked)."""
    ranks = getattr(engine, "world_size", 1)
    minibatch = max(1, samples // num_minibatches)
    if minibatch < ranks:  # (as update() cuts minibatches)
        raise ConfigError(
            f"cluster.actor.workers: a minibatch of {minibatch} samples cannot be shared by "
            f"{ranks} actor workers; use fewer actor workers or algorithm.num_minibatches"
        )


def make_engine(policy: torch.nn.Module, trainer: TrainerConfig, **options):
    """The ``TrainEngine`` of ``trainer.backend`` for ``policy`` (RL's learner and SFT's):
    ``options`` are the optimizer's (learning_rate, max_grad_norm, weight_decay, adam_eps) and,
    for megatron, ``with_value``. A megatron policy has joined its TP ranks (``join_ranks``)."""
    if trainer.backend == "megatron":
        from embodied.megatron.engine import MegatronEngine

        device = next(policy.parameters()).device
        return MegatronEngine(
            policy, recompute=trainer.recompute, dtype=trainer.dtype(device), **options
        )
    options.pop("with_value", None)  # (the torch engine trains whatever the policy holds)
    return TorchEngine(policy, **options)


def save_engine(engine, run_dir: Path, iteration: int, **kw) -> Path:
    """``save_checkpoint`` of an engine's policy and optimizer (``kw``: counters, meta, rng,
    keep, protect); every TP rank calls this (each writes its shard). Returns the checkpoint.
    Its meta.json records the precision the engine trains in (``auto`` resolved)."""
    meta = {**kw.pop("meta", {}), "precision": trained_in(engine)}
    return save_checkpoint(
        run_dir,
        iteration,
        model=engine.torch_policy,
        optimizer=engine.checkpoint_optimizer,
        shards=engine.checkpoint_shards,
        meta=meta,
        **kw,
    )


def learner_for(cfg, spec: EnvSpec, task_of_env: torch.Tensor, device) -> Learner:
    """The learner of a run in this process; with ``trainer.tensor_parallel`` > 1 its other TP
    ranks are started as processes that follow it in lockstep (embodied/megatron/lockstep.py)."""
    if cfg.trainer.backend == "megatron" and cfg.trainer.tensor_parallel > 1:
        from embodied.megatron.lockstep import Lockstep, start_ranks

        helpers = start_ranks(cfg, device, Learner, spec, task_of_env)
        return Lockstep(Learner(cfg, spec, task_of_env, device), helpers)
    return Learner(cfg, spec, task_of_env, device)


@runtime_checkable
class Roles(Protocol):
    """What the runner drives: the roles of one run, in this process (``LocalRoles``) or as
    Ray actors (``embodied.cluster.roles.RayRoles``); the runner cannot tell them apart."""

    envs: Any  # the environment group (on Ray, the driver's view of the env workers)
    spec: EnvSpec
    learner: Any  # the ``Learner`` (on Ray, the driver's view of the actor workers)
    inference: Any  # the inference policy (on Ray, the driver's view of the rollout workers)
    evaluates_beside: bool  # whether ``start_evaluation`` evaluates beside training

    def sync(self, version: int) -> dict[str, float]:
        """The learner's weights to inference, as ``version``; the sync's metrics."""

    def stage_candidates(self, chunk_size: int) -> list[int]:
        """The stage counts ``runner.pipeline_stages: auto`` may try."""

    def collect(self, obs, plan: CollectPlan, stats: EpisodeStats, **kw):
        """A round from ``obs`` (after ``envs.reset``) -> what ``learner.add_round`` takes."""

    def evaluate(self, **kw) -> dict[str, dict]:
        """An evaluation of the current weights, waited for -> task -> summary."""

    def start_evaluation(self, *, episodes: int, seed: int, weights=None):
        """An evaluation beside training -> a handle (``ready()``, ``result()``)."""

    def metrics(self) -> tuple[dict[str, float], list[tuple]]:
        """Per-role timing since the last call, and the spans of the roles' calls."""

    def rng_state(self) -> dict:
        """The run's random streams, as a checkpoint stores them."""

    def recover(self, error: WorkerLost, failures: int) -> None:
        """Replace the lost worker (``failures``: rounds lost in a row), or raise."""

    def close(self) -> None: ...


class LocalRoles:
    """The roles of one run in this process: the environment group, inference sharing the
    learner's module, the learner."""

    def __init__(self, cfg, env, resume: dict | None = None):
        self.envs = EnvGroup(env)
        self.spec: EnvSpec = env.spec
        device = cfg.runner.torch_device(env.device)
        self.learner = learner_for(cfg, env.spec, self.envs.task_of_env, device)
        try:
            self._start(cfg, resume)
        except BaseException:  # (a refused resume: megatron's groups left for a later run)
            self.learner.close()
            raise

    def _start(self, cfg, resume: dict | None) -> None:
        # the one inference shard's stream: rollout worker 0's on Ray
        stream = Stream.derived(cfg.seed, "rollout", 0)
        self.inference = InferencePolicy(
            self.learner.engine.torch_policy, stream=stream, compile_act=cfg.policy.compile_act
        )
        if resume is not None:
            self.learner.load(resume)
            resumed(stream, resume["rng"], cfg.seed, resume["counters"]["iteration"])

    def sync(self, version: int) -> dict[str, float]:
        """The learner's weights to inference (shared here: only the version); sync metrics."""
        self.inference.sync(None, version)
        return {}

    def stage_candidates(self, chunk_size: int) -> list[int]:
        """The stage counts ``runner.pipeline_stages: auto`` may try."""
        return stage_candidates(self.envs, chunk_size)

    def collect(
        self,
        obs: Observation,
        plan: CollectPlan,
        stats: EpisodeStats,
        *,
        stages: int = 1,
        chunk_size: int = 1,
        should_stop=None,
    ) -> RolloutBatch:
        """A round from ``obs`` (after ``envs.reset``): ``rollout.collect`` here."""
        batch, _ = collect(
            self.envs,
            self.inference,
            obs,
            plan,
            stats,
            stages=stages,
            chunk_size=chunk_size,
            should_stop=should_stop,
        )
        return batch

    def evaluate(self, **kw) -> dict[str, dict]:
        """``evaluate_by_task`` of the inference policy on the environment group's envs."""
        return evaluate_by_task(self.envs.env, self.inference.policy, **kw)

    # evaluations beside training: not in one process; the runner calls ``evaluate``, and
    # training waits for it
    evaluates_beside = False

    def start_evaluation(self, *, episodes: int, seed: int, weights=None):
        raise NotImplementedError("evaluations beside training need cluster.eval.workers")

    def metrics(self) -> tuple[dict[str, float], list[tuple]]:
        """Per-role timing since the last call, and the spans of the roles' calls: nothing here
        (one process: the runner's own timings say it all)."""
        return {}, []

    def rng_state(self) -> dict:
        """The run's random streams, as a checkpoint stores them."""
        streams = (self.learner.stream, self.inference.stream)
        return {"streams": {stream.key: stream.state() for stream in streams}}

    def recover(self, error: WorkerLost, failures: int) -> None:
        """Replace the lost worker (``failures``: how many rounds in a row were lost). Nothing
        runs in another process here, so nothing is lost that could be replaced."""
        raise error

    def close(self) -> None:
        try:
            self.envs.close()  # (may raise: MuJoCo Warp's last buffer check)
        finally:
            self.learner.close()


def local_roles(cfg, env, resume: dict | None = None) -> LocalRoles:
    return LocalRoles(cfg, env, resume)
