"""Rollout semantics on a scripted VecEnv: chunk rewards, mid-chunk ends, final_obs bootstrapping.

The scripted environment is the test's input, not the thing under test: its state is the number
of steps since reset, every step pays 1, env b terminates after ``term_at[b]`` steps (0: never)
and every episode is truncated after ``max_episode_steps``. It passes ``check_env`` itself.
"""

import torch

from embodied.models import ActorCritic, ActorCriticConfig
from embodied.rollout import EpisodeStats, collect, execute_chunk
from embodied.schema import (
    ActionSpec,
    EnvSpec,
    Observation,
    ObsSpec,
    StepOutput,
    check_env,
    ended_rows,
)


class ScriptedEnv:
    def __init__(self, term_at, max_episode_steps=5):
        self.num_envs, self.device = len(term_at), torch.device("cpu")
        self.term_at = torch.tensor(term_at)
        self.spec = EnvSpec(
            obs=ObsSpec(state_names=("t",)),
            action=ActionSpec("joint_pos", ("a",), (-1.0,), (1.0,)),
            max_episode_steps=max_episode_steps,
            instructions=("count",),
        )
        self.t = torch.zeros(self.num_envs)

    def _obs(self, t):
        return Observation(state=t.clone().unsqueeze(1), instruction=["count"] * self.num_envs)

    def reset(self, *, seed=None, env_ids=None):
        if env_ids is None:
            self.t.zero_()
        else:
            self.t[env_ids] = 0
        return self._obs(self.t)

    def step(self, actions):
        assert actions.shape == (self.num_envs, 1)
        self.t += 1
        terminated = (self.term_at > 0) & (self.t == self.term_at)
        truncated = (self.t >= self.spec.max_episode_steps) & ~terminated
        done = terminated | truncated
        final = self._obs(self.t) if done.any() else None
        self.t[done] = 0
        return StepOutput(
            obs=self._obs(self.t),
            reward=torch.ones(self.num_envs),
            terminated=terminated,
            truncated=truncated,
            success=terminated.clone(),
            final_obs=final,
            ended=ended_rows(terminated | truncated),
        )

    def render(self):
        return None

    def close(self):
        pass


def test_scripted_env_satisfies_the_contract():
    check_env(ScriptedEnv([2, 0, 3]), deterministic=False)


def test_chunk_reward_is_discounted_and_stops_at_the_episode_end():
    env = ScriptedEnv([2, 0])
    env.reset()
    stats = EpisodeStats.zeros(2, "cpu")
    obs, reward, term, trunc, final = execute_chunk(
        env, torch.zeros(2, 3, 1), gamma=0.5, stats=stats
    )
    torch.testing.assert_close(
        reward, torch.tensor([1.0 + 0.5, 1.0 + 0.5 + 0.25])
    )  # env 0 ended at k=1
    assert term.tolist() == [True, False] and trunc.tolist() == [False, False]
    assert final.state[0, 0] == 2  # the last observation of the ended episode
    assert obs.state[:, 0].tolist() == [1.0, 3.0]  # env 0 reset, then ran the chunk's last action
    assert stats.finished == [{"return": 2.0, "length": 2, "success": True, "env": 0}]


def test_collect_bootstraps_from_final_obs_and_next_obs():
    torch.manual_seed(0)
    env = ScriptedEnv([3, 0], max_episode_steps=4)
    policy = ActorCritic(env.spec, ActorCriticConfig(hidden_sizes=[8], normalize_obs=False))
    obs = env.reset()
    rollout, last_obs = collect(
        env, policy, obs, num_steps=6, gamma=0.9, stats=EpisodeStats.zeros(2, "cpu")
    )

    def v(t):
        return policy.value(
            Observation(state=torch.tensor([[float(t)]]), instruction=["count"])
        ).item()

    # env 0: t = 0,1,2 | terminates after 3 steps | 0,1,2 | terminated again ; env 1: truncated after 4
    assert rollout.terminated[:, 0].tolist() == [False, False, True, False, False, True]
    assert rollout.truncated[:, 1].tolist() == [False, False, False, True, False, False]
    torch.testing.assert_close(
        rollout.obs.state[:, :, 0], torch.tensor([[0, 0], [1, 1], [2, 2], [0, 3], [1, 0], [2, 1.0]])
    )
    expected_next = torch.tensor(
        [[v(1), v(1)], [v(2), v(2)], [v(3), v(3)], [v(1), v(4)], [v(2), v(1)], [v(3), v(2)]]
    )
    torch.testing.assert_close(
        rollout.next_values, expected_next
    )  # V(final_obs) at ends, V(s_{t+1}) elsewhere
    assert last_obs.state[:, 0].tolist() == [0.0, 2.0]
    torch.testing.assert_close(
        rollout.values[1:],
        torch.where(
            rollout.terminated[:-1] | rollout.truncated[:-1],
            rollout.values[1:],
            rollout.next_values[:-1],
        ),
    )


def test_collect_with_action_chunks():
    env = ScriptedEnv([0, 0], max_episode_steps=4)
    policy = ActorCritic(env.spec, ActorCriticConfig(hidden_sizes=[8], chunk_size=2))
    rollout, _ = collect(
        env, policy, env.reset(), num_steps=3, gamma=1.0, stats=EpisodeStats.zeros(2, "cpu")
    )
    assert rollout.actions.shape == (3, 2, 2, 1) and rollout.logprobs.shape == (3, 2)
    torch.testing.assert_close(rollout.rewards, torch.full((3, 2), 2.0))  # two steps per chunk
    assert rollout.truncated[:, 0].tolist() == [False, True, False]  # 4 steps = the end of chunk 2


class PipelinedScriptedEnv(ScriptedEnv):
    """ScriptedEnv that can step a subset of its environments (the pipelining interface)."""

    def step_async(self, actions, env_ids):
        assert actions.shape == (len(env_ids), 1)
        self.__dict__.setdefault("pending", []).append(env_ids)  # several requests may be in flight

    def step_wait(self, env_ids):
        assert torch.equal(env_ids, self.pending.pop(0))  # answered in the order they were sent
        t = self.t[env_ids] + 1
        term_at = self.term_at[env_ids]
        terminated = (term_at > 0) & (t == term_at)
        truncated = (t >= self.spec.max_episode_steps) & ~terminated
        done = terminated | truncated
        obs = lambda x: Observation(
            state=x.clone().unsqueeze(1), instruction=["count"] * len(env_ids)
        )  # noqa: E731
        final = obs(t) if done.any() else None
        t[done] = 0
        self.t[env_ids] = t
        return StepOutput(
            obs=obs(t),
            reward=torch.ones(len(env_ids)),
            terminated=terminated,
            truncated=truncated,
            success=terminated.clone(),
            final_obs=final,
            ended=ended_rows(terminated | truncated),
        )


def test_pipelined_collect_matches_lockstep():
    torch.manual_seed(0)
    policy = ActorCritic(
        ScriptedEnv([3, 0, 2]).spec, ActorCriticConfig(hidden_sizes=[8], normalize_obs=False)
    )
    results = {}
    for stages in (1, 2, 3):
        env = PipelinedScriptedEnv([3, 0, 2], max_episode_steps=4)
        stats = EpisodeStats.zeros(3, "cpu")
        results[stages] = (
            *collect(env, policy, env.reset(), num_steps=7, gamma=0.9, stats=stats, stages=stages),
            stats,
        )
    ref, ref_last, ref_stats = results[1]
    for stages in (2, 3):
        got, last, stats = results[stages]
        torch.testing.assert_close(got.obs.state, ref.obs.state)
        for name in ("rewards", "terminated", "truncated", "values", "next_values"):
            torch.testing.assert_close(
                getattr(got, name), getattr(ref, name), msg=f"{name}, {stages} stages"
            )
        torch.testing.assert_close(last.state, ref_last.state)
        assert sorted(map(str, stats.finished)) == sorted(map(str, ref_stats.finished))
    # the log-probabilities belong to the actions actually sampled in each run
    got = results[2][0]
    obs, out = got.flat(torch.arange(21))
    logprob, _, _ = policy.evaluate(obs, out)
    torch.testing.assert_close(logprob, got.logprobs.reshape(-1))
