"""Rollout bookkeeping against hand-computed numbers: chunks of K = 4 actions whose episodes end
at different steps (twice in one chunk, exactly at the chunk's end, by truncation mid-chunk and
on the chunk's last action), the valid mask, chunk rewards and discounts, the critic's bootstrap,
episode ids, statistics and GAE; pipelined collection equals lockstep."""

import json

import pytest
import torch
from scripted_envs import PPO as PPO_CONFIG
from scripted_envs import ScriptedEnv, ScriptedPolicy, run_on

from embodied.contract import check_env, check_policy
from embodied.env_group import EnvGroup, strided_stages
from embodied.episode_stats import EpisodeStats
from embodied.inference import InferencePolicy
from embodied.multitask import MultiTaskEnv
from embodied.ppo import PPO, PPOConfig
from embodied.rollout import (
    CollectPlan,
    RolloutBatch,
    collect,
)
from embodied.stages import StageTuner, stage_candidates

# env 0 terminates every 2 steps (twice per chunk), env 1 is truncated after 7 steps (mid-chunk,
# then again on a chunk's last action... after the rollout), env 2 terminates every 4 steps (on a
# chunk's last action), env 3 terminates every 3 steps (drifting through the chunks)
TERM_AT = [2, 0, 4, 3]
K = 4
T = 3


def run_rollout(
    term_at=TERM_AT,
    chunk=K,
    chunks=T,
    stages=1,
    subsets=False,
    env=None,
    in_thread=False,
    policy=None,
):
    if env is None:
        env = ScriptedEnv(term_at, max_episode_steps=7, can_step_subsets=subsets)
    envs = EnvGroup(env, chunks_in_thread=in_thread)
    policy = policy or InferencePolicy(ScriptedPolicy(chunk))
    stats = EpisodeStats(envs.task_names, torch.device("cpu"))
    plan = CollectPlan(
        seeds=0,
        group_of_env=torch.full((env.num_envs,), -1),
        num_chunks=chunks,
        episode_base=0,
    )
    obs = envs.reset(seed=plan.seeds)
    batch, last = collect(envs, policy, obs, plan, stats, stages=stages, chunk_size=chunk)
    envs.close()
    return batch, last, stats


def test_the_scripted_env_and_policy_pass_the_contract():
    env = ScriptedEnv([2, 0, 3], max_episode_steps=5)
    check_env(env, deterministic=False)
    check_policy(ScriptedPolicy(2), env.spec)


def test_observation_rows_by_index_mask_and_slice_and_where_by_row():
    from dataclasses import replace

    from embodied.schema import Observation

    obs = Observation(
        state=torch.arange(6.0).view(3, 2),
        instruction=["a", "b", "c"],
        privileged={"goal": torch.tensor([10.0, 20.0, 30.0])},
    )
    by_mask = obs.index(torch.tensor([False, True, True]))
    by_rows = obs.index(torch.tensor([1, 2]))
    for picked in (by_mask, by_rows, obs.index(slice(1, 3))):
        assert picked.instruction == ["b", "c"]
        assert picked.state.tolist() == [[2.0, 3.0], [4.0, 5.0]]
        assert picked.privileged["goal"].tolist() == [20.0, 30.0]
    other = Observation(
        state=-obs.state, instruction=["x", "y", "z"], privileged={"goal": -obs.privileged["goal"]}
    )
    mixed = obs.where(torch.tensor([True, False, True]), other)
    assert mixed.instruction == ["a", "y", "c"]
    assert mixed.state[:, 0].tolist() == [0.0, -2.0, 4.0]
    assert mixed.privileged["goal"].tolist() == [10.0, -20.0, 30.0]
    same_task = replace(other, instruction=["a", "b", "c"])
    assert obs.where(torch.tensor([False, True, False]), same_task).instruction == ["a", "b", "c"]


def test_chunk_fields_by_hand():
    batch, last, _ = run_rollout()
    v = [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]  # chunk 0, envs 0..3
    valid = torch.tensor(
        [
            v,
            [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]],
            [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]],
        ],
        dtype=torch.bool,
    )  # bool [T, B, K]
    assert torch.equal(batch.valid, valid)
    assert batch.executed.tolist() == [[2, 4, 4, 3], [2, 3, 4, 2], [2, 4, 4, 1]]
    # rewards are the step's index in its episode; env 1 restarts after its 7th step
    assert batch.rewards[:, 1].tolist() == [[1, 2, 3, 4], [5, 6, 7, 1], [2, 3, 4, 5]]
    assert batch.rewards[:, 3].tolist() == [[1, 2, 3, 1], [2, 3, 1, 2], [3, 1, 2, 3]]
    terminated, truncated = batch.chunk_done
    assert terminated.tolist() == [[1, 0, 1, 1], [1, 0, 1, 1], [1, 0, 1, 1]]
    assert truncated.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    # the chunk's episode: episodes ended before the chunk * B + env
    assert batch.episode_id.tolist() == [[0, 1, 2, 3], [8, 1, 6, 7], [16, 5, 10, 11]]
    assert batch.group_id.eq(-1).all() and batch.policy_version.eq(0).all()
    # V(s) = 0.5 t + 0.25 at the chunk's first observation
    starts = torch.tensor([[0, 0, 0, 0], [0, 4, 0, 1], [0, 1, 0, 2.0]])
    torch.testing.assert_close(batch.values, 0.5 * starts + 0.25)
    # next value: V(last obs) where the chunk's episode ended (env 1: t = 7), else V(s_{t+1})
    # (env 1 after the rollout: t = 5)
    expected_next = torch.tensor(
        [[1.25, 2.25, 2.25, 1.75], [1.25, 3.75, 2.25, 1.75], [1.25, 2.75, 2.25, 1.75]]
    )
    torch.testing.assert_close(batch.next_values, expected_next)
    assert last.state[:, 0].tolist() == [0, 5, 0, 0]
    # every env's actions are its index: the chunks belong to the right columns
    assert torch.equal(batch.actions[..., 0, 0], torch.arange(4.0).expand(3, 4))


def test_a_policy_without_a_critic_is_asked_for_no_value():
    """GRPO's policy has no critic, so every value is 0: the final observations of ended
    episodes and the round's last one were copied to its device only to get zeros back (on a GPU,
    images through pageable memory, a wait each)."""
    scripted = ScriptedPolicy(K)
    scripted.has_critic = False
    policy = InferencePolicy(scripted)
    asked = []
    policy.value = lambda obs: asked.append(obs.batch_size) or torch.zeros(obs.batch_size)
    batch, _, _ = run_rollout(policy=policy)
    assert asked == []
    # 0 where the chunk's episode ended and after the round; env 1's chunk 0 ran on: V(s_1)
    expected = torch.zeros(T, 4)
    expected[0, 1] = 0.5 * 4 + 0.25  # (the act's value of chunk 1, t = 4, by the script)
    torch.testing.assert_close(batch.next_values, expected)
    critic = InferencePolicy(ScriptedPolicy(K))
    valued = []
    critic.value = lambda obs: valued.append(obs.batch_size) or scripted._value(obs)
    run_rollout(policy=critic)
    assert valued == [3, 4, 3, 4]  # the ended rows of the 3 chunks, then the last observation


def test_chunk_discounting_and_gae_by_hand():
    batch, _, _ = run_rollout()
    PPO(PPOConfig(gamma=0.5, gae_lambda=0.5), seed=0, num_envs=4).advantages(batch)
    # R = sum_k 0.5^k r_k over the valid actions; the bootstrap is discounted by 0.5^n
    # env 1, chunk 1: 5 + 0.5 * 6 + 0.25 * 7 = 9.75, truncated after 3 actions -> 0.125 * V(t=7)
    # env 1, chunk 0: 3.25 + 0.0625 * 2.25 - 0.25 + 0.0625 * 0.5 * A_1
    a1 = 9.75 + 0.125 * 3.75 - 2.25
    a0 = 3.25 + 0.0625 * 2.25 - 0.25 + 0.0625 * 0.5 * a1
    a2 = 5.125 + 0.0625 * 2.75 - 0.75  # the rollout's end: bootstrap from V(s_T), gamma^4
    expected = torch.tensor(
        [
            [2.0 - 0.25, a0, 3.0, 2.75 - 0.25],
            [2.0 - 0.25, a1, 3.0, 3.5 - 0.75],
            [2.0 - 0.25, a2, 3.0, 3.0 - 1.25],
        ]
    )
    torch.testing.assert_close(batch.advantages, expected)
    torch.testing.assert_close(batch.returns, expected + batch.values)
    assert batch.sample_mask.all()


def test_each_environments_first_episode_counts_in_the_statistics():
    _, _, stats = run_rollout()
    summary = stats.summary()
    # first episodes: env 0 of return 3 (1 + 2), env 1 of 28 (truncated at 7), env 2 of 10,
    # env 3 of 6; the episodes after them in the round (env 0's five more, ...) do not count
    assert summary["episode/count"] == 4
    assert summary["episode/unfinished"] == 0
    assert summary["episode/return"] == pytest.approx((3 + 28 + 10 + 6) / 4)
    assert summary["episode/length"] == pytest.approx((2 + 7 + 4 + 3) / 4)
    assert summary["episode/success_once"] == 0.0


def test_quick_successes_do_not_inflate_the_training_success():
    # success ends env 0's episodes at step 30; the other three fail until their 220-step time
    # limit, beyond the round's 64 steps (LIBERO's shape): 1 of 4 succeeded within the round
    env = ScriptedEnv([30, 0, 0, 0], success_at=[30, 0, 0, 0], max_episode_steps=220)
    _, _, stats = run_rollout(env=env, chunk=1, chunks=64)
    summary = stats.summary()
    assert summary["episode/success_once"] == 0.25
    assert summary["episode/unfinished"] == 3
    assert summary["episode/count"] == 1
    assert summary["episode/length"] == 30


def test_a_round_of_one_chunk_of_several_actions_by_hand():
    # (GRPO with chunk_size >= max_episode_steps: the round's time order is a strided view)
    batch, _, stats = run_rollout(chunks=1)
    assert batch.valid[0].long().tolist() == [
        [1, 1, 0, 0],
        [1, 1, 1, 1],
        [1, 1, 1, 1],
        [1, 1, 1, 0],
    ]
    assert batch.episode_id.tolist() == [[0, 1, 2, 3]]
    # first episodes: env 0's of return 3, env 2's of 10, env 3's of 6; env 1's runs on
    summary = stats.summary()
    assert summary["episode/count"] == 3
    assert summary["episode/unfinished"] == 1
    assert summary["episode/return"] == pytest.approx((3 + 10 + 6) / 3)


def test_statistics_of_two_rounds_by_hand():
    stats = EpisodeStats(["a", "b"], torch.device("cpu"))
    tasks = torch.tensor([0, 1, 1])
    # round 1, 3 steps: env 0 ends at step 1 (succeeded at step 0) and runs on; env 1 ends at
    # steps 0 and 2 and succeeds at step 2, in its second episode; env 2 never ends, and
    # succeeded at step 1
    reward = torch.tensor([[1.0, 10.0, 100.0], [2.0, 20.0, 200.0], [4.0, 40.0, 400.0]])
    done = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 1, 0]], dtype=torch.bool)
    success = torch.tensor([[1, 0, 0], [0, 0, 1], [0, 1, 0]], dtype=torch.bool)
    stats.record(tasks, reward, done, success)
    # rows: started, ended, return and length of the ended, succeeded within the round
    assert stats.totals.tolist() == [[1, 2], [1, 1], [3, 10], [2, 1], [1, 1]]
    # round 2 (after a reset), 1 step: env 0's and env 2's episodes end, env 1's runs on
    stats.record(
        tasks,
        torch.tensor([[8.0, 80.0, 800.0]]),
        torch.tensor([[1, 0, 1]]) > 0,
        torch.zeros(1, 3, dtype=torch.bool),
    )
    assert stats.totals.tolist() == [[2, 4], [2, 2], [11, 810], [3, 2], [1, 1]]
    summary = stats.summary()
    assert summary["episode/success_once"] == 2 / 6
    assert summary["episode/unfinished"] == 2
    assert summary["episode/count"] == 4
    assert summary["episode/return"] == (11 + 810) / 4
    assert summary["episode/length"] == 5 / 4
    assert summary["episode/a/success_once"] == 0.5 and summary["episode/b/return"] == 405
    assert summary["episode/b/unfinished"] == 2


def test_behaviour_logprob_at_chunk_level_sums_the_valid_actions_only():
    batch, _, _ = run_rollout()
    batch.logprob_token = torch.arange(48.0).view(3, 4, 4, 1)
    batch.advantages = torch.zeros(3, 4)
    batch.sample_mask = torch.ones(3, 4, dtype=torch.bool)
    samples = batch.samples()
    chunk = samples.behaviour_logprob("chunk")  # f32 [12], rows in (t, b) order
    token = batch.logprob_token[..., 0].reshape(12, 4)
    valid = batch.valid.reshape(12, 4)
    torch.testing.assert_close(chunk, (token * valid).sum(1))
    assert chunk[0].item() == 0 + 1  # env 0 chunk 0: its two valid actions
    assert samples.mask("action").shape == (12, 4)
    assert samples.behaviour_logprob("token").shape == (12, 4, 1)


def assert_same_round(staged, lockstep) -> None:
    """Two ``run_rollout`` results (batch, last observation, statistics) hold the same round."""
    (got, last, stats), (ref, ref_last, ref_stats) = staged, lockstep
    for name in ("rewards", "terminated", "truncated", "valid", "values", "next_values"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), msg=name)
    for name in ("episode_id", "task_id", "actions"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    torch.testing.assert_close(got.obs.state, ref.obs.state)
    torch.testing.assert_close(last.state, ref_last.state)
    assert stats.summary() == ref_stats.summary()


def test_pipelined_collection_equals_lockstep():
    term_at = [3, 0, 2, 4, 0]
    lockstep = run_rollout(term_at, chunk=1, chunks=9)
    for stages in (2, 3):
        staged = run_rollout(term_at, chunk=1, chunks=9, stages=stages, subsets=True)
        assert_same_round(staged, lockstep)


def test_chunks_run_in_a_thread_pipeline_into_the_lockstep_round():
    """A cluster env worker's stages of chunks of K actions: each stage's chunk runs in a thread
    while the policy acts for another; episodes end mid-chunk and on a chunk's last action."""
    term_at = [3, 0, 2, 4, 0]
    lockstep = run_rollout(term_at, chunk=K, chunks=5)
    for stages in (2, 3):
        env = ScriptedEnv(term_at, can_step_subsets=True)
        assert len(EnvGroup(env).stage_split(stages, K)) == 1  # (K > 1: not without a thread)
        assert len(EnvGroup(env, chunks_in_thread=True).stage_split(stages, K)) == stages
        staged = run_rollout(
            term_at, chunk=K, chunks=5, stages=stages, subsets=True, in_thread=True
        )
        assert_same_round(staged, lockstep)


def test_a_round_that_failed_midway_leaves_nothing_for_the_next_one():
    """A cluster env worker whose round failed with stages' chunks still running (in its thread,
    K > 1) or stepping (K = 1): the next reset finishes and drops them, and the next round is
    the round a fresh group collects."""
    term_at = [3, 0, 2, 4, 0]
    for chunk in (1, K):
        fresh = run_rollout(term_at, chunk=chunk, chunks=4, stages=2, subsets=True, in_thread=True)
        env = ScriptedEnv(term_at, max_episode_steps=7, can_step_subsets=True)
        envs = EnvGroup(env, chunks_in_thread=True)
        envs.reset(seed=100)  # (the failed round's: its states hold that seed)
        for rows, _ in envs.stage_split(2, chunk):  # (sent, never received: the round failed)
            envs.send(torch.ones(len(rows), chunk, 1), rows)
        assert any(envs._running.values()) or any(envs._stepping.values())
        for running in envs._running.values():  # (done before the reset: seed 100's states)
            for chunk_future in running:
                chunk_future.result()
        policy = InferencePolicy(ScriptedPolicy(chunk))
        stats = EpisodeStats(envs.task_names, torch.device("cpu"))
        plan = CollectPlan(seeds=0, group_of_env=torch.full((5,), -1), num_chunks=4, episode_base=0)
        obs = envs.reset(seed=plan.seeds)
        batch, last = collect(envs, policy, obs, plan, stats, stages=2, chunk_size=chunk)
        envs.close()
        assert_same_round((batch, last, stats), fresh)


def test_a_chunk_for_some_rows_is_those_rows_of_the_chunk_for_all():
    """A cluster env worker runs a pipeline stage's chunk of K actions for its rows alone
    (``EnvGroup.execute``): every field is those rows of the chunk run for every environment,
    and an episode that ends in it (twice, mid-chunk or on its last action) is named by its
    position in the stage's rows, with its last observation."""
    whole = EnvGroup(ScriptedEnv(TERM_AT, max_episode_steps=7))
    staged = EnvGroup(ScriptedEnv(TERM_AT, max_episode_steps=7, can_step_subsets=True))
    whole.reset(seed=0)
    staged.reset(seed=0)
    actions = 10.0 * torch.arange(4.0)[:, None, None] + torch.arange(K)[None, :, None]  # [4, K, 1]
    # per chunk, per stage (envs 0, 2 and envs 1, 3): the positions of the episodes that ended
    # (envs 0 and 2 end in every chunk, env 3 too, and env 1 is truncated in the second)
    expected_ended = [[[0, 1], [1]], [[0, 1], [1, 0]], [[0, 1], [1]]]
    for chunk in range(T):
        ref = whole.execute(actions)
        ends = {int(e): ref.final_obs.state[j] for j, e in enumerate(ref.ended)}
        for (rows, at), expected in zip(strided_stages(4, 2), expected_ended[chunk]):
            got = staged.execute(actions[at], rows)
            sent = staged.env.actions_log[-K:]  # the chunk's K steps, for these rows only
            assert [ids.tolist() for ids, _ in sent] == [rows.tolist()] * K
            assert torch.equal(torch.stack([a for _, a in sent], 1), actions[at][..., 0])
            for name in ("reward", "terminated", "truncated", "success"):
                assert torch.equal(getattr(got, name), getattr(ref, name)[at]), name
            assert torch.equal(got.obs.state, ref.obs.state[at])
            assert got.ended.tolist() == expected
            for j, position in enumerate(got.ended.tolist()):
                assert torch.equal(got.final_obs.state[j], ends[int(rows[position])])
    with pytest.raises(ValueError, match="step all together"):
        whole.execute(actions[:2], torch.tensor([0, 1]))


def test_pipelined_collection_over_two_tasks_equals_lockstep():
    """A MultiTaskEnv whose tasks step subsets pipelines too: each stage holds rows of both."""

    def two_tasks(subsets: bool) -> MultiTaskEnv:
        tasks = [([3, 0, 2], "push"), ([4, 0], "pull")]
        envs = [
            ScriptedEnv(term_at, max_episode_steps=7, instruction=name, can_step_subsets=subsets)
            for term_at, name in tasks
        ]
        return MultiTaskEnv(envs, [name for _, name in tasks])

    assert len(EnvGroup(two_tasks(True)).stage_split(2, chunk_size=1)) == 2
    lockstep = run_rollout(chunk=1, chunks=9, env=two_tasks(False))
    for stages in (2, 3):
        assert_same_round(
            run_rollout(chunk=1, chunks=9, stages=stages, env=two_tasks(True)), lockstep
        )


def test_environments_collected_in_parts_join_into_the_whole_round():
    """Env workers that infer themselves (``cluster.rollout.workers: 0``) collect their rows
    apart (``CollectPlan.part``); joined (``RolloutBatch.cat_envs``), the parts are the round
    collected whole: episode ids count over all environments, groups and seeds follow the rows,
    the statistics add up."""

    def collect_rows(term_at, plan):
        env = ScriptedEnv(term_at, max_episode_steps=7)
        envs = EnvGroup(env)
        stats = EpisodeStats(envs.task_names, torch.device("cpu"))
        policy = InferencePolicy(ScriptedPolicy(K))
        batch, _ = collect(envs, policy, envs.reset(seed=plan.seeds), plan, stats)
        return batch, stats

    plan = CollectPlan(
        seeds=10, group_of_env=torch.tensor([0, 0, 1, -1]), num_chunks=T, episode_base=100
    )
    whole, whole_stats = collect_rows(TERM_AT, plan)
    cuts = [(0, 1), (1, 4)]  # one env, then three
    parts = [collect_rows(TERM_AT[lo:hi], plan.part(lo, hi)) for lo, hi in cuts]
    assert plan.part(1, 4).seeds == 11 and plan.part(1, 4).group_of_env.tolist() == [0, 1, -1]
    joined = RolloutBatch.cat_envs([batch for batch, _ in parts])
    # (test_chunk_fields_by_hand's ids, from episode_base 100)
    assert joined.episode_id.tolist() == [[100, 101, 102, 103], [108, 101, 106, 107]] + [
        [116, 105, 110, 111]
    ]
    assert joined.group_id.tolist() == [[0, 0, 1, -1], [-1, 0, -1, -1], [-1, -1, -1, -1]]
    for name in ("rewards", "terminated", "truncated", "valid", "values", "next_values"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    assert torch.equal(joined.obs.state[..., [0, 2]], whole.obs.state[..., [0, 2]])  # t, seed
    # the scripted policy acts with the env's index in its own env object
    assert joined.actions[..., 0, 0].tolist() == [[0, 0, 1, 2]] * T
    assert joined.obs.state.shape == (T, 4, 3) and joined.logprob_token.shape == (T, 4, K, 1)
    torch.testing.assert_close(parts[0][1].totals + parts[1][1].totals, whole_stats.totals)


@pytest.mark.parametrize(
    "num_envs, subsets, chunk, expected",
    [
        (8, True, 1, [1, 2, 4, 8]),
        (3, True, 1, [1, 2]),  # no more stages than environments
        (8, True, 2, [1]),  # strided stages step one action at a time
        (8, False, 1, [1]),  # an environment that cannot step subsets runs in lockstep
    ],
)
def test_stage_candidates_are_the_splits_the_environments_can_make(
    num_envs, subsets, chunk, expected
):
    envs = EnvGroup(ScriptedEnv([0] * num_envs, can_step_subsets=subsets))
    assert stage_candidates(envs, chunk) == expected


def test_the_stage_tuner_warms_up_tries_every_candidate_once_and_keeps_the_fastest():
    tuner = StageTuner([1, 2, 4])
    used = []
    # seconds per 1000 env steps: the warm-up (slowest, not counted), then 1, 2 and 4 stages
    for seconds in (9.0, 2.0, 1.5, 1.8, 1.0, 1.2):
        stages = tuner.next()
        used.append(stages)
        settled = tuner.record(stages, seconds, 1000)
        assert settled == (len(used) == 4)
    assert used == [1, 1, 2, 4, 2, 2]
    assert tuner.chosen == 2
    assert tuner.report() == (
        "pipeline_stages auto: 2 (collection per 1000 env steps: 1: 2000.0 ms, 2: 1500.0 ms, "
        "4: 1800.0 ms)"
    )


def test_the_stage_tuner_has_nothing_to_try_with_one_candidate_or_a_resumed_choice():
    assert [StageTuner([1]).next() for _ in range(2)] == [1, 1]
    resumed = StageTuner([1, 2], chosen=2)
    assert resumed.next() == 2
    assert not resumed.record(2, 1.0, 100)


def test_the_runner_with_auto_stages_times_every_split_then_keeps_the_fastest(tmp_path, capsys):
    """Eight environments that step subsets, one action per chunk: lockstep or 2, 4 or 8
    stages. The first iteration warms up, the next four try one split each, the fastest stays."""
    env = ScriptedEnv([0] * 8, max_episode_steps=3, can_step_subsets=True)
    run_on(
        env,
        tmp_path / "run",
        total_env_steps=8 * 3 * 7,
        policy=dict(name="actor_critic", hidden_sizes=[8]),
        algorithm={**PPO_CONFIG, "num_steps": 3},
        pipeline_stages="auto",
    )
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    table = [row for row in map(json.loads, lines) if "rollout/pipeline_stages" in row]
    used = [int(row["rollout/pipeline_stages"]) for row in table]
    speed = {used[i]: table[i]["time/env_steps_per_s"] for i in range(1, 5)}
    chosen = max(speed, key=speed.get)
    assert used == [1, 1, 2, 4, 8, chosen, chosen]
    assert f"pipeline_stages auto: {chosen} (collection per 1000 env steps: 1: " in (
        capsys.readouterr().out
    )
