"""A latency-bound test simulator: each step sleeps ``step_s`` and computes almost nothing, as an
environment waiting on a remote renderer, a real robot or a slow physics server would. On a
machine with few cores it shows how orchestration scales with env workers, free of the cores'
limit (benchmarks/scaling.py ``--latency``).

The state is [steps since the reset]; episodes last ``episode_steps`` steps; the
reward is the first action dimension; success never comes. It passes the contract checks
(tests/test_benchmarks.py).
"""

from __future__ import annotations

import time

import torch

from embodied.schema import ActionSpec, EnvSpec, Observation, ObsSpec, StepOutput

INSTRUCTION = "wait"


class SleepingEnv:
    def __init__(self, num_envs: int, step_s: float, episode_steps: int = 50):
        self.num_envs = num_envs
        self.device = torch.device("cpu")
        self.step_s = step_s
        self.episode_steps = episode_steps
        self.spec = EnvSpec(
            obs=ObsSpec(cameras=(), state_names=("t",)),
            action=ActionSpec("joint_delta", ("x", "y"), (-1.0, -1.0), (1.0, 1.0)),
            max_episode_steps=episode_steps,
            instructions=(INSTRUCTION,),
        )
        self.t = torch.zeros(num_envs, dtype=torch.long)

    def _obs(self) -> Observation:
        state = self.t.float()[:, None]  # f32 [B, 1]
        return Observation(state=state, instruction=[INSTRUCTION] * self.num_envs)

    def reset(self, *, seed=None, env_ids=None) -> Observation:
        if env_ids is None:
            self.t.zero_()
        else:
            self.t[torch.as_tensor(env_ids, dtype=torch.long)] = 0
        return self._obs()

    def step(self, actions: torch.Tensor) -> StepOutput:
        time.sleep(self.step_s)  # (the latency: no CPU)
        self.t += 1
        truncated = self.t >= self.episode_steps  # bool [B]
        ended = torch.nonzero(truncated).squeeze(1)  # long [m]
        final = self._obs() if len(ended) else None
        if len(ended):
            self.t[ended] = 0
        return StepOutput(
            obs=self._obs(),
            reward=actions[:, 0].float().clone(),
            terminated=torch.zeros(self.num_envs, dtype=torch.bool),
            truncated=truncated,
            success=torch.zeros(self.num_envs, dtype=torch.bool),
            final_obs=final,
            ended=ended if len(ended) else None,
        )

    def render(self, env_ids=None):
        return None

    def close(self) -> None:
        pass


class SleepingEnvs:
    """An env worker's factory (``env_factory``): ``env_cfg.num_envs`` sleeping environments."""

    def __init__(self, step_s: float, episode_steps: int = 50):
        self.step_s = step_s
        self.episode_steps = episode_steps

    def __call__(self, env_cfg) -> SleepingEnv:
        return SleepingEnv(env_cfg.num_envs, self.step_s, self.episode_steps)
