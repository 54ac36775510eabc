"""``MultiTaskEnv``: several VecEnvs (one per task) seen as one, environments concatenated in order.

The tasks must share cameras, proprioception and action space (e.g. ManiSkill tabletop tasks with
the same robot and controller); each environment's observation carries its own task's
instruction. Privileged keys are those every task has. Sub-environments that can step
asynchronously (CPU workers) are all started before any is waited for, so their workers run at
the same time.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import replace

import torch

from embodied.schema import EnvSpec, Observation, StepOutput, UserError, reset_seeds


def _compatible(specs: list[EnvSpec], names: list[str]) -> None:
    """The tasks can step side by side in one batch: a UserError naming the first two that
    cannot (they are the user's env.tasks)."""
    first = specs[0]
    for s, name in zip(specs[1:], names[1:], strict=True):
        pair = f"env.tasks: {names[0]} and {name}"
        if s.obs.cameras != first.obs.cameras or s.obs.state_names != first.obs.state_names:
            raise UserError(f"{pair} observe different cameras or proprioception")
        if (s.action.names, s.action.low, s.action.high) != (
            first.action.names,
            first.action.low,
            first.action.high,
        ):
            raise UserError(f"{pair} act in different action spaces or bounds")
        # (the joined spec says the first's: deploy's rate, a dataset's fps, videos')
        for what in ("space", "gripper", "control_hz"):
            mine, theirs = getattr(s.action, what), getattr(first.action, what)
            if mine != theirs:
                raise UserError(f"{pair} differ in action {what}: {theirs} and {mine}")
        if s.max_episode_steps != first.max_episode_steps:
            raise UserError(
                f"{pair} end episodes at {first.max_episode_steps} and {s.max_episode_steps} "
                "steps; set env.max_episode_steps for both"
            )


def shared_privileged(specs: list[EnvSpec]) -> list[str]:
    """The privileged keys every task observes (a multi-task observation keeps only those)."""
    return sorted(set.intersection(*[set(spec.obs.privileged) for spec in specs]))


def joined_spec(specs: list[EnvSpec], privileged: list[str]) -> EnvSpec:
    """The spec of the tasks ``specs`` side by side: the first's, with the privileged keys
    ``privileged`` and every task's instructions."""
    first = specs[0]
    kept = {k: first.obs.privileged[k] for k in privileged}
    return replace(
        first,
        obs=replace(first.obs, privileged=kept),
        instructions=tuple(i for spec in specs for i in spec.instructions),
    )


class MultiTaskEnv:
    def __init__(self, envs: list, names: list[str]):
        if not envs:
            raise ValueError("MultiTaskEnv needs at least one environment")
        _compatible([e.spec for e in envs], list(names))
        self.envs = envs
        self.names = list(names)
        self.num_envs = sum(e.num_envs for e in envs)
        self.device = envs[0].device
        self._keys = shared_privileged([e.spec for e in envs])
        self.spec = joined_spec([e.spec for e in envs], self._keys)
        bounds = torch.tensor([0] + [e.num_envs for e in envs]).cumsum(0).tolist()
        self.task_ranges = list(zip(bounds[:-1], bounds[1:]))  # env rows of each task
        self.task_of_env = [name for name, e in zip(self.names, envs) for _ in range(e.num_envs)]
        self._last: list[Observation] | None = None  # each task's latest observation
        self._copied = [False] * len(envs)  # whether it is a copy of ours (rows written in place)
        # subsets step where every task's environments can (a cluster env worker's stages)
        self.can_step_subsets = all(getattr(e, "can_step_subsets", False) for e in envs)

    def keep_privileged(self, keys: list[str]) -> None:
        """Observe only the privileged ``keys`` (a cluster env worker: those every worker's
        tasks have)."""
        self._keys = sorted(keys)
        self.spec = joined_spec([e.spec for e in self.envs], self._keys)

    def _join(self, parts: list[Observation]) -> Observation:
        for p in parts:
            p.privileged = {k: p.privileged[k] for k in self._keys}
        return Observation.cat(parts)

    def reset(
        self, *, seed: int | Sequence[int] | None = None, env_ids: torch.Tensor | None = None
    ) -> Observation:
        if env_ids is not None and self._last is None:
            raise RuntimeError(
                "MultiTaskEnv: reset all environments once before resetting some (env_ids)"
            )
        ids = torch.arange(self.num_envs) if env_ids is None else env_ids.cpu()
        # an int for all stays one, from each task's first row: ManiSkill's GPU batch resets once
        whole = isinstance(seed, numbers.Integral) and env_ids is None
        seeds = None if seed is None or whole else reset_seeds(seed, ids.tolist())
        parts = []
        for (lo, hi), env in zip(self.task_ranges, self.envs):
            mine = ((ids >= lo) & (ids < hi)).nonzero().squeeze(1)
            if len(mine) == 0 and env_ids is not None:
                parts.append(None)
                continue
            local = ids[mine] - lo
            sub_seed = None if seeds is None else [seeds[j] for j in mine.tolist()]
            if whole:
                sub_seed = int(seed) + lo
            parts.append(
                env.reset(seed=sub_seed, env_ids=None if env_ids is None else local.to(env.device))
            )
        if any(p is None for p in parts):  # untouched tasks report their current observation
            self._last = [p if p is not None else last for p, last in zip(parts, self._last)]
            self._copied = [c and p is None for p, c in zip(parts, self._copied)]
        else:
            self._last = parts
            self._copied = [False] * len(parts)
        return self._join(list(self._last))

    def step(self, actions: torch.Tensor) -> StepOutput:
        """actions: f32 [B, A] physical units, rows in task order."""
        if self.can_step_subsets:  # every task's workers step at the same time
            everyone = torch.arange(self.num_envs)
            self.step_async(actions, everyone)
            return self.step_wait(everyone)
        outs = [e.step(actions[lo:hi]) for e, (lo, hi) in zip(self.envs, self.task_ranges)]
        self._last = [o.obs for o in outs]
        self._copied = [False] * len(outs)
        return join_steps(outs, [lo for lo, _ in self.task_ranges], self._join)

    def _by_task(self, env_ids: torch.Tensor) -> list[tuple[int, torch.Tensor, slice]]:
        """(task, its local ids, their positions in ``env_ids``) for each task that holds some of
        ``env_ids`` (long [N], ascending, on the CPU)."""
        bounds = torch.tensor([lo for lo, _ in self.task_ranges] + [self.num_envs])
        cuts = torch.searchsorted(env_ids, bounds).tolist()
        return [
            (task, env_ids[start:stop] - lo, slice(start, stop))
            for task, ((lo, _), start, stop) in enumerate(zip(self.task_ranges, cuts, cuts[1:]))
            if stop > start
        ]

    def step_async(self, actions: torch.Tensor, env_ids: torch.Tensor) -> None:
        """Start stepping environments ``env_ids`` (long [N], ascending) with actions f32 [N, A];
        each task's share goes to its own environments."""
        for task, local, at in self._by_task(env_ids):
            self.envs[task].step_async(actions[at], local)

    def step_wait(self, env_ids: torch.Tensor) -> StepOutput:
        """Finish the ``step_async`` of ``env_ids``: every tensor has N rows."""
        parts = self._by_task(env_ids)
        outs = [self.envs[task].step_wait(local) for task, local, _ in parts]
        if self._last is not None:
            for (task, local, _), out in zip(parts, outs):
                self._remember(task, local, out.obs)
        return join_steps(outs, [at.start for _, _, at in parts], self._join)

    def _remember(self, task: int, rows: torch.Tensor, obs: Observation) -> None:
        """Keep ``obs`` as the latest observation of the task's rows ``rows`` (long [n])."""
        last = self._last[task]
        if len(rows) == last.batch_size:
            self._last[task] = obs
            self._copied[task] = False
            return
        if not self._copied[task]:  # (the environment's own tensors are not ours to write)
            last = self._last[task] = last.map(torch.clone)
            self._copied[task] = True
        fresh = obs.tensors()
        for name, tensor in last.tensors().items():
            tensor[rows.to(tensor.device)] = fresh[name]

    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [B or N, H, W, 3]: each task renders only its own rows of ``env_ids``."""
        if env_ids is None:
            return torch.cat([e.render() for e in self.envs])
        order = torch.argsort(env_ids.cpu())  # (a task's share is found among ascending ids)
        parts = self._by_task(env_ids.cpu()[order])
        frames = torch.cat([self.envs[task].render(local) for task, local, _ in parts])
        return frames[torch.argsort(order).to(frames.device)]  # back in env_ids' order

    def close(self) -> None:
        for e in self.envs:
            e.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def join_steps(outs: list[StepOutput], offsets: list[int], join=Observation.cat) -> StepOutput:
    """One ``StepOutput`` from the steps of consecutive row blocks starting at ``offsets``
    (``join`` concatenates their observations)."""
    final = None
    ended = None
    if any(o.final_obs is not None for o in outs):
        final = join([o.final_obs if o.final_obs is not None else o.obs for o in outs])
        ended = torch.cat([o.ended + lo for o, lo in zip(outs, offsets) if o.ended is not None])
    return StepOutput(
        obs=join([o.obs for o in outs]),
        reward=torch.cat([o.reward for o in outs]),
        terminated=torch.cat([o.terminated for o in outs]),
        truncated=torch.cat([o.truncated for o in outs]),
        success=torch.cat([o.success for o in outs]),
        final_obs=final,
        ended=ended,
    )


SIMULATOR_CONFIGS: dict[str, type] = {}  # simulator name -> config dataclass, filled below


def check_tasks(cfg) -> None:
    """What the simulator itself must say about a config, before anything is built: every
    ManiSkill task known, its assets installed, its reward mode computed and its robot's
    controller named by ``control_mode``; LIBERO and its assets installed (``UserError`` naming
    what is missing). MuJoCo's tasks and LIBERO's are checked by their configs' ``validate()``."""
    if cfg.simulator == "libero":
        from embodied.simulators.libero.paths import check_installed

        check_installed()
    if cfg.simulator != "maniskill":
        return
    from embodied.simulators.maniskill import check_assets, check_control_mode, check_reward_mode

    for task in cfg.tasks or [cfg.task]:
        check_assets(task)
        check_reward_mode(task, cfg.reward_mode)
        check_control_mode(task, cfg.control_mode)


def make_env(cfg):
    """The environment a simulator config describes: one task, or (ManiSkill) a MultiTaskEnv over
    ``cfg.tasks``."""
    if cfg.simulator == "mujoco":
        from embodied.simulators.mujoco import make_env as make_mujoco

        return make_mujoco(cfg)
    if cfg.simulator == "libero":
        from functools import partial

        from embodied.simulators.libero import LiberoCore
        from embodied.simulators.libero.paths import prepare
        from embodied.simulators.workers import WorkerVecEnv

        cfg.validate()
        prepare()  # a missing asset fails here, before any worker starts
        return WorkerVecEnv(
            partial(LiberoCore, cfg),
            cfg.num_envs,
            cfg.num_workers,
            name="LIBERO",
            task=f"{cfg.suite} task {cfg.task_id}",
            step_timeout_s=cfg.step_timeout_s,
        )
    from embodied.simulators.maniskill import make_env as make_maniskill

    check_tasks(cfg)  # all of them before the first task's workers start
    if not cfg.tasks:
        return make_maniskill(cfg)
    n = cfg.num_envs // len(cfg.tasks)
    envs = []
    try:
        for task in cfg.tasks:
            envs.append(
                make_maniskill(
                    cfg,
                    task=task,
                    tasks=[],
                    num_envs=n,
                    num_workers=min(cfg.num_workers, max(1, cfg.num_workers // len(cfg.tasks))),
                )
            )
        return MultiTaskEnv(envs, list(cfg.tasks))
    except BaseException:  # (its workers too, when the tasks cannot run side by side)
        for e in envs:
            e.close()
        raise


def _register() -> None:
    from embodied.simulators.libero import LiberoConfig
    from embodied.simulators.maniskill import ManiSkillConfig
    from embodied.simulators.mujoco import MuJoCoConfig

    SIMULATOR_CONFIGS.update(maniskill=ManiSkillConfig, mujoco=MuJoCoConfig, libero=LiberoConfig)


_register()
