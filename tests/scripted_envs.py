"""Scripted environments and a scripted policy: the inputs of the bookkeeping tests, not the things
under test. Both pass the contract checks themselves (tests/test_rollout.py).

``ScriptedEnv``: the state of env b is [steps since its reset, b, its last reset seed]. Step k of
an episode pays reward k (1, 2, 3, ...), env b terminates after ``term_at[b]`` steps (0: never),
succeeds from step ``success_at[b]`` on (0: never), and every episode is truncated after
``max_episode_steps``. The episode number is not part of the state: a new episode looks like the
first one.

``PushRightEnv``: episodes of 3 steps; success once the first action dimension exceeds a
threshold; the camera image is noise drawn from the reset seed.

Both keep their tensors on ``device`` and count steps on the host as well, so a step finds its
ended episodes without reading the device (as ManiSkill's GPU backend does).

``ScriptedPolicy``: deterministic; every action of a chunk is the env's index b (in one action
dimension), its value is V(s) = 0.5 * steps + 0.25, and its log-probabilities are zeros (or a
function of the state, to tell samples apart).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from embodied.episode_stats import EpisodeStats
from embodied.inference import InferencePolicy
from embodied.multitask import MultiTaskEnv
from embodied.rollout import collect
from embodied.schema import (
    ActionSpec,
    CameraSpec,
    EnvSpec,
    Observation,
    ObsSpec,
    PolicyOutput,
    StepOutput,
    reset_seeds,
)


class ScriptedEnv:
    def __init__(
        self,
        term_at,
        *,
        success_at=None,
        max_episode_steps: int = 5,
        instruction: str = "count",
        can_step_subsets: bool = False,
        device: str = "cpu",
    ):
        self.num_envs = len(term_at)
        self.device = torch.device(device)
        self.term_at = torch.tensor(term_at, device=self.device)
        self.success_at = torch.tensor(success_at or [0] * self.num_envs, device=self.device)
        self._term_at = np.array(term_at)  # the same on the host
        self._t = np.zeros(self.num_envs, dtype=np.int64)
        self.instruction = instruction
        self.spec = EnvSpec(
            obs=ObsSpec(state_names=("t", "env", "seed")),
            action=ActionSpec("joint_pos", ("a",), (-100.0,), (100.0,)),
            max_episode_steps=max_episode_steps,
            instructions=(instruction,),
        )
        self.t = torch.zeros(self.num_envs, device=self.device)
        self.seed = torch.zeros(self.num_envs, device=self.device)
        self.can_step_subsets = can_step_subsets
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.resets = 0
        # per step: its environments (long [n] on the CPU) and their actions (f32 [n], a copy)
        self.actions_log: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _obs(self, rows=slice(None)) -> Observation:
        index = torch.arange(self.num_envs, dtype=torch.float32, device=self.device)
        state = torch.stack([self.t, index, self.seed], 1)[rows].clone()  # f32 [n, 3]
        return Observation(state=state, instruction=[self.instruction] * len(state))

    def reset(self, *, seed=None, env_ids=None):
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in env_ids]
        for i, s in zip(ids, reset_seeds(seed, ids)):
            self.t[i] = 0
            self.seed[i] = -1 if s is None else s
            self._t[i] = 0
        self.resets += 1
        return self._obs()

    def _advance(self, rows: torch.Tensor | None) -> StepOutput:
        """Step environments ``rows`` (long [n] on the CPU; None: all of them)."""
        host_rows = slice(None) if rows is None else rows.numpy()
        at = slice(None) if rows is None else rows.to(self.device)  # no copy for a full step
        self._t[host_rows] += 1
        t_host = self._t[host_rows]
        term_host = self._term_at[host_rows]
        terminated_host = (term_host > 0) & (t_host == term_host)
        done_host = terminated_host | (t_host >= self.spec.max_episode_steps)
        self.t[at] += 1
        t = self.t[at]
        term_at = self.term_at[at]
        success_at = self.success_at[at]
        terminated = (term_at > 0) & (t == term_at)
        truncated = (t >= self.spec.max_episode_steps) & ~terminated
        success = (success_at > 0) & (t >= success_at)
        reward = t.clone()
        ended = torch.from_numpy(np.flatnonzero(done_host)) if done_host.any() else None
        final = self._obs(at) if ended is not None else None
        if ended is not None:
            global_ended = ended if rows is None else rows[ended]
            self.t[global_ended.to(self.device)] = 0
            self._t[global_ended.numpy()] = 0
        return StepOutput(
            obs=self._obs(at),
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            success=success,
            final_obs=final,
            ended=ended,
        )

    def step(self, actions):
        assert actions.shape == (self.num_envs, 1) and actions.device.type == self.device.type
        self.actions_log.append((torch.arange(self.num_envs), actions[:, 0].clone()))
        return self._advance(None)

    # --- the pipelining interface (a subset of environments, answered in order) ---------------
    def step_async(self, actions, env_ids):
        assert actions.shape == (len(env_ids), 1)
        self.pending.append((env_ids, actions[:, 0].clone()))

    def step_wait(self, env_ids):
        sent_ids, actions = self.pending.pop(0)
        assert torch.equal(env_ids, sent_ids)
        self.actions_log.append((env_ids, actions))
        return self._advance(env_ids)

    def render(self, env_ids=None):
        return None

    def close(self):
        pass


class PushRightEnv:
    def __init__(self, num_envs: int, threshold: float = 0.5, device: str = "cpu", privileged=()):
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.threshold = threshold
        self.privileged = privileged  # simulator-only keys, observed as zeros f32 [B, 1]
        cameras = (CameraSpec("cam", 32, 32),)
        self.spec = EnvSpec(
            obs=ObsSpec(cameras, ("t",), {key: (1,) for key in privileged}),
            action=ActionSpec("joint_delta", ("x", "y"), (-1.0, -1.0), (1.0, 1.0)),
            max_episode_steps=3,
            instructions=("push right",),
        )
        self.t = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self._t = np.zeros(num_envs, dtype=np.int64)  # the same on the host
        self.images = torch.zeros(num_envs, 32, 32, 3, dtype=torch.uint8, device=self.device)
        # unseeded resets draw from the env's own generator, as a simulator's do: never from
        # torch's global one, which the policy samples from
        self._rng = torch.Generator().manual_seed(0)

    def _obs(self):
        return Observation(
            state=self.t.float()[:, None],
            instruction=["push right"] * self.num_envs,
            images={"cam": self.images.clone()},
            privileged={
                k: torch.zeros(self.num_envs, 1, device=self.device) for k in self.privileged
            },
        )

    def reset(self, *, seed=None, env_ids=None):
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in env_ids]
        for i, s in zip(ids, reset_seeds(seed, ids)):
            if s is None:
                s = int(torch.randint(1 << 30, (), generator=self._rng))
            g = torch.Generator().manual_seed(s)
            image = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8)
            self.images[i] = image.to(self.device)
            self.t[i] = 0
            self._t[i] = 0
        return self._obs()

    def step(self, actions):
        self.t += 1
        self._t += 1
        success = actions[:, 0] > self.threshold
        truncated = self.t >= 3
        over = np.flatnonzero(self._t >= 3)
        ended = torch.from_numpy(over) if len(over) else None
        final = self._obs() if ended is not None else None
        if ended is not None:
            self.reset(env_ids=ended)
        return StepOutput(
            obs=self._obs(),
            reward=success.float(),
            terminated=torch.zeros_like(success),
            truncated=truncated,
            success=success,
            final_obs=final,
            ended=ended,
        )

    def render(self, env_ids=None):
        return self.images.clone() if env_ids is None else self.images[env_ids]

    def close(self):
        pass


class ScriptedPolicy(nn.Module):
    """Acts with the env's index (from the state), K actions per chunk; V(s) = 0.5 t + 0.25."""

    def __init__(self, chunk_size: int = 1):
        super().__init__()
        self.K = chunk_size
        self.scale = nn.Parameter(torch.ones(()))  # something for an optimizer to hold
        self.has_critic = True
        self.calls = 0

    def _value(self, obs: Observation) -> torch.Tensor:
        return 0.5 * obs.state[:, 0] + 0.25  # f32 [B]

    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        self.calls += 1
        B = obs.batch_size
        actions = obs.state[:, 1, None, None].expand(B, self.K, 1).clone()  # f32 [B, K, 1]
        logp = torch.zeros(B, self.K, 1)
        return PolicyOutput(
            actions=actions,
            logprob=logp.sum((1, 2)),
            value=self._value(obs),
            extras={"logp_token": logp},
        )

    def evaluate(self, obs: Observation, output: PolicyOutput, *, level: str = "chunk"):
        # zero at scale = 1 (as act() says) with a gradient: an optimizer has something to move
        logp = (self.scale - 1.0) * output.actions  # f32 [B, K, 1]
        B = obs.batch_size
        at_level = {"chunk": logp.sum((1, 2)), "action": logp.sum(2), "token": logp}[level]
        return at_level, torch.zeros(B), self._value(obs)

    def value(self, obs: Observation) -> torch.Tensor:
        return self._value(obs)

    def update_normalizer(self, obs: Observation) -> None:
        pass


# --- the runner over a scripted environment ---------------------------------------------------
TINY_VLA = dict(
    name="vla",
    head="gaussian",
    chunk_size=1,
    d_model=32,
    layers=1,
    heads=2,
    vision_pretrained=False,
    vision_width=0.25,
    vision_depth=0.25,
    text_pretrained=False,
    text_hidden=32,
    text_layers=1,
    freeze_vision=True,
    value_head=False,
    init_log_std=-0.5,
)
GRPO = dict(
    name="grpo",
    group_size=4,
    groups_per_batch=2,
    max_rounds=3,
    learning_rate=3e-3,
    update_epochs=2,
    num_minibatches=2,
)
PPO = dict(
    name="ppo",
    num_steps=6,
    gamma=0.8,
    learning_rate=3e-3,
    update_epochs=4,
    num_minibatches=2,
    target_kl=None,
)


def prepared_samples(envs, policy, algorithm):
    """The samples of the algorithm's first round on ``envs`` with ``policy``, advantages set
    and prepared (as the learner gets them)."""
    plan = algorithm.plan(1, 0, episode_base=0)
    stats = EpisodeStats(envs.task_names, torch.device("cpu"))
    obs = envs.reset(seed=plan.seeds)
    batch, _ = collect(envs, InferencePolicy(policy), obs, plan, stats)
    algorithm.advantages(batch)
    samples = batch.samples()
    algorithm.prepare(samples)
    return samples


def push_right_envs(env_cfg) -> PushRightEnv:
    """A cluster env worker's environments: ``env_cfg.num_envs`` of the test task."""
    return PushRightEnv(env_cfg.num_envs)


class BrokenOnceFlagged:
    """A cluster's ``env_factory``: the test task's environments, until the test creates the file
    ``flag``; a worker built after that (one Ray restarted) fails in its constructor."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __call__(self, env_cfg) -> PushRightEnv:
        if Path(self.flag).exists():
            raise RuntimeError("the simulator did not start")
        return PushRightEnv(env_cfg.num_envs)


PUSH_RIGHT_TASKS = {"near": 0.0, "far": 0.5}  # test tasks by name: their success thresholds


def push_right_tasks(env_cfg) -> MultiTaskEnv:
    """A cluster env worker's environments: ``env_cfg.tasks`` of ``PUSH_RIGHT_TASKS``, an even
    share of ``env_cfg.num_envs`` each."""
    each = env_cfg.num_envs // len(env_cfg.tasks)
    envs = [PushRightEnv(each, threshold=PUSH_RIGHT_TASKS[task]) for task in env_cfg.tasks]
    return MultiTaskEnv(envs, list(env_cfg.tasks))


# the test tasks' privileged keys where they differ (as PickCube's ``is_grasped`` in the README's
# multi-task set): a run of both observes the keys both have
PRIVILEGED = {"near": ("goal",), "far": ("goal", "extra")}


def push_right_tasks_with_goals(env_cfg) -> MultiTaskEnv:
    """``push_right_tasks``, each task observing its ``PRIVILEGED`` keys."""
    each = env_cfg.num_envs // len(env_cfg.tasks)
    envs = [
        PushRightEnv(each, threshold=PUSH_RIGHT_TASKS[task], privileged=PRIVILEGED[task])
        for task in env_cfg.tasks
    ]
    return MultiTaskEnv(envs, list(env_cfg.tasks))


def subset_stepping_envs(env_cfg) -> ScriptedEnv:
    """A cluster env worker's environments that step subsets (pipeline stages of their own)."""
    return ScriptedEnv([0] * env_cfg.num_envs, max_episode_steps=3, can_step_subsets=True)


def run_on(
    env,
    run_dir,
    *,
    total_env_steps: int,
    policy=TINY_VLA,
    algorithm=GRPO,
    cluster: dict | None = None,
    env_factory=None,
    pipeline_stages: int | str = 1,
    trace: bool = False,
    save_every: int = 0,
    eval_every: int = 0,
    resume: str | None = None,
    trainer: dict | None = None,
    max_minutes: float | None = None,
    env_cfg: dict | None = None,
    video: bool = False,
    record_rollouts: int = 0,
    keep_rollouts: int = 5,
    report: bool = False,
) -> dict:
    """The runner over ``env`` with a config written here (16 evaluation episodes, a video if
    ``video``); returns its summary. The metrics are in ``run_dir/metrics.jsonl``. With ``cluster``
    (the config block) the roles run on Ray and the env workers build ``env_factory(env_cfg)`` with
    8 environments in all (``env_cfg``: more of the env config). ``resume``: a checkpoint of the run
    to go on from. ``report``: write RUN/report.html at the end (RUN/config.yaml too)."""
    from embodied import numerics
    from embodied.config import compose, save_config
    from embodied.resume import rewind
    from embodied.roles import Roles, load_checkpoint_for, local_roles
    from embodied.runner import Runner
    from embodied.train_config import TrainConfig

    runner = {
        "name": "run",
        "output_dir": str(run_dir.parent),
        "total_env_steps": total_env_steps,
        "eval_every": eval_every,
        "eval_episodes": 16,
        "final_eval_episodes": 16,
        "save_every": save_every,
        "progress": False,
        "video": video,
        "pipeline_stages": pipeline_stages,
        "trace": trace,
        "max_minutes": max_minutes,
        "record_rollouts": record_rollouts,
        "keep_rollouts": keep_rollouts,
        "report": report,
    }
    source = {"seed": 0, "policy": policy, "algorithm": algorithm, "runner": runner}
    if trainer is not None:
        source["trainer"] = trainer
    if cluster is not None:
        source.update(cluster=cluster, env={"num_envs": 8, **(env_cfg or {})})
    cfg = compose(TrainConfig, [("test", source)])
    numerics.setup(cfg.runner.torch_threads)  # (as ``train`` does: another count sums apart)
    run_dir.mkdir(parents=True, exist_ok=True)
    if report:
        save_config(cfg, run_dir / "config.yaml")  # (as ``enter_run_dir`` does)
    checkpoint = None if resume is None else load_checkpoint_for(resume, "runner.resume")
    if cluster is None:
        roles = local_roles(cfg, env, checkpoint)
        assert isinstance(roles, Roles)  # every member of the protocol the runner drives
    else:
        from embodied.cluster import ray_roles

        roles = ray_roles(cfg, checkpoint, run_dir, env_factory=env_factory)
    try:
        if checkpoint is not None:
            rewind(run_dir, checkpoint, cfg, roles.evaluates_beside)  # (as ``train`` does)
        return Runner(cfg, roles, run_dir, checkpoint).run()
    finally:
        if cluster is not None:
            roles.close()
        else:
            roles.learner.close()  # (the caller's environments stay open)


def metric_rows(run_dir, key: str) -> list[float]:
    """The values of ``key`` in the run's metrics.jsonl, in order."""
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row[key] for row in map(json.loads, lines) if key in row]
