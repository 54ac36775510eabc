"""GRPO bookkeeping against hand-computed numbers: groups formed within each task of a multi-task
environment whose task sizes are not multiples of the group size, a non-informative group in the
middle dropped, outcomes and advantages mapped back to every chunk of the right episode through
the rollout's episode and group ids."""

import math

import pytest
import torch
from scripted_envs import PushRightEnv, ScriptedEnv, ScriptedPolicy, metric_rows, run_on

from embodied.env_group import EnvGroup
from embodied.episode_stats import EpisodeStats
from embodied.grpo import GRPO, GRPOConfig, groups_by_task
from embodied.inference import InferencePolicy
from embodied.learner import TorchEngine
from embodied.models import ActorCritic, ActorCriticConfig
from embodied.multitask import MultiTaskEnv
from embodied.rollout import collect

K = 2
MAX_STEPS = 5  # T = ceil(5 / 2) = 3 chunks; truncation at step 5 = chunk 2, action 0


def make_env():
    # task a: envs 0-6 -> groups {0, 1, 2}, {3, 4, 5}, env 6 left over
    # task b: envs 7-10 -> group {7, 8, 9}, env 10 left over
    task_a = ScriptedEnv(
        [0, 3, 0, 0, 0, 0, 0],  # env 1 terminates after 3 steps: inside chunk 1
        success_at=[2, 0, 0, 0, 0, 0, 1],
        max_episode_steps=MAX_STEPS,
        instruction="task a",
    )
    task_b = ScriptedEnv(
        [0, 0, 0, 0],
        success_at=[4, 1, 0, 3],
        max_episode_steps=MAX_STEPS,
        instruction="task b",
    )
    return MultiTaskEnv([task_a, task_b], ["a", "b"])


def grpo(env, **cfg):
    envs = EnvGroup(env)
    config = GRPOConfig(group_size=3, **cfg)
    algorithm = GRPO(
        config, seed=100, task_of_env=envs.task_of_env, chunk_size=K, max_episode_steps=MAX_STEPS
    )
    return envs, algorithm


def collect_round(envs, algorithm, iteration=1, round_index=0):
    plan = algorithm.plan(iteration, round_index, episode_base=0)
    stats = EpisodeStats(envs.task_names, torch.device("cpu"))
    obs = envs.reset(seed=plan.seeds)
    batch, _ = collect(envs, InferencePolicy(ScriptedPolicy(K)), obs, plan, stats)
    return plan, batch, obs, stats


def test_groups_stay_within_their_task():
    task_of_env = torch.tensor([0] * 7 + [1] * 4)
    groups = groups_by_task(task_of_env, 3)
    assert groups.tolist() == [0, 0, 0, 1, 1, 1, -1, 2, 2, 2, -1]
    # per-task counts that are multiples: every env in a group, none spanning two tasks
    assert groups_by_task(torch.tensor([0, 0, 1, 1]), 2).tolist() == [0, 0, 1, 1]
    assert groups_by_task(torch.tensor([0, 0, 0, 1, 1, 1]), 2).tolist() == [0, 0, -1, 1, 1, -1]


def test_plan_gives_group_members_one_seed_and_fresh_seeds_every_round():
    envs, algorithm = grpo(make_env())
    plan, _, obs, _ = collect_round(envs, algorithm)
    seeds = plan.seeds
    assert seeds[0] == seeds[1] == seeds[2] and seeds[3] == seeds[4] == seeds[5]
    assert seeds[7] == seeds[8] == seeds[9]
    assert len({seeds[0], seeds[3], seeds[6], seeds[7], seeds[10]}) == 5
    assert obs.state[:, 2].tolist() == [float(s) for s in seeds]  # the envs got them
    later = algorithm.plan(1, 1, episode_base=0)
    assert not set(later.seeds) & set(seeds)
    assert later.group_of_env.tolist() == [3, 3, 3, 4, 4, 4, -1, 5, 5, 5, -1]


def test_rounds_take_consecutive_seeds_so_every_initial_state_of_a_finite_set_is_met():
    """LIBERO has 50 initial states (seed % 50): 10 envs in groups of 5 use 2 seeds a round,
    and 25 rounds meet all 50 (steps of B = 10 met 10 of them)."""

    def single_task(num_envs, seed):
        tasks = torch.zeros(num_envs, dtype=torch.long)
        config = GRPOConfig(group_size=5, max_rounds=5)
        return GRPO(config, seed=seed, task_of_env=tasks, chunk_size=1, max_episode_steps=4)

    algorithm = single_task(10, seed=7)
    plans = [algorithm.plan(i, r, episode_base=0) for i in (1, 2, 3, 4, 5) for r in range(5)]
    assert plans[0].seeds == [7] * 5 + [8] * 5 and plans[1].seeds == [9] * 5 + [10] * 5
    assert plans[5].seeds[0] == 7 + 10  # iteration 2's first round follows iteration 1's last
    assert sorted({s % 50 for plan in plans for s in plan.seeds}) == list(range(50))
    # with an idle environment (11 envs): 3 seeds a round, the idle one's own
    algorithm = single_task(11, seed=0)
    assert algorithm.plan(1, 1, episode_base=0).seeds == [3] * 5 + [4] * 5 + [5]


def test_advantages_map_back_to_every_chunk_of_the_right_episode():
    envs, algorithm = grpo(make_env())
    _, batch, _, stats = collect_round(envs, algorithm)
    metrics = algorithm.advantages(batch)
    hi = 2 / math.sqrt(2)  # (2/3) / sqrt(2/9): the lone success (failure) in a group of 3
    lo = -hi / 2
    expected_adv = {0: hi, 1: lo, 2: lo, 7: -lo, 8: -lo, 9: -hi}
    # chunks of each env's counted episode: all 3, but env 1's ended in chunk 1
    chunks = {b: [0, 1, 2] for b in range(11)}
    chunks[1] = [0, 1]
    for b in range(11):
        for t in range(3):
            counted = t in chunks[b] and b in expected_adv
            assert bool(batch.sample_mask[t, b]) == counted, (t, b)
            want = expected_adv[b] if counted else 0.0
            assert batch.advantages[t, b].item() == pytest.approx(want, abs=1e-5), (t, b)
    assert batch.group_id[2, 1].item() == -1  # env 1's second episode is in no group
    assert batch.group_id[:, 6].eq(-1).all() and batch.group_id[:, 10].eq(-1).all()
    assert metrics["grpo/kept_groups"].item() == 2  # group {3, 4, 5}: all failed, dropped
    # the update's samples: each one's action names its env within its task (the instruction
    # says which), and the sample carries that env's advantage
    samples = batch.samples()
    assert len(samples) == 3 + 2 + 3 + 3 * 3
    local = samples.output.actions[:, 0, 0].long().tolist()
    offset = [{"task a": 0, "task b": 7}[text] for text in samples.obs.instruction]
    for b, o, adv in zip(local, offset, samples.advantages.tolist()):
        assert adv == pytest.approx(expected_adv[b + o], abs=1e-5)
    # per-task statistics count each env's first episode: the idle envs 6 and 10 too, and not
    # env 1's second one (steps 4-6, terminated again at the round's last step)
    summary = stats.summary()
    assert summary["episode/a/count"] == 7 and summary["episode/b/count"] == 4
    assert summary["episode/a/success_once"] == pytest.approx(2 / 7)
    assert summary["episode/b/success_once"] == pytest.approx(3 / 4)
    assert summary["episode/unfinished"] == 0
    # (the group members' outcomes, idle envs 6 and 10 left out: envs 0, 7 and 8 of 9)
    assert metrics["grpo/episode_success"].item() == pytest.approx(3 / 9)


def test_without_dynamic_sampling_uninformative_groups_stay_with_zero_advantage():
    envs, algorithm = grpo(make_env(), dynamic_sampling=False)
    _, batch, _, _ = collect_round(envs, algorithm)
    algorithm.advantages(batch)
    assert batch.sample_mask[:, 3:6].all()
    assert batch.advantages[:, 3:6].eq(0).all()


def test_enough_counts_informative_groups_over_rounds():
    envs, algorithm = grpo(make_env(), groups_per_batch=3)
    _, batch, _, _ = collect_round(envs, algorithm)
    first = algorithm.advantages(batch)
    assert not algorithm.enough([first])
    assert algorithm.enough([first, first])


def test_an_episode_that_does_not_end_is_refused():
    env = ScriptedEnv([0, 0, 0], max_episode_steps=MAX_STEPS)
    envs, algorithm = grpo(env)
    algorithm.num_chunks = 2  # 4 steps: short of the time limit
    _, batch, _, _ = collect_round(envs, algorithm)
    with pytest.raises(RuntimeError, match="3 environments did not finish an episode in 2 chunks"):
        algorithm.advantages(batch)


def test_statistics_over_two_rounds_count_each_rounds_first_episodes():
    # the runner's rounds share one EpisodeStats; each round resets every env, and the episode
    # each env began at the round's last step (after its truncation at step 5) never counts
    envs, algorithm = grpo(make_env())
    stats = EpisodeStats(envs.task_names, torch.device("cpu"))
    policy = InferencePolicy(ScriptedPolicy(K))
    for round_index in range(2):
        plan = algorithm.plan(1, round_index, episode_base=0)
        obs = envs.reset(seed=plan.seeds)
        collect(envs, policy, obs, plan, stats)
    summary = stats.summary()
    # per round, task a: six episodes truncated at 5 steps and env 1's first, of 3 steps
    assert summary["episode/a/count"] == 14
    assert summary["episode/a/length"] == pytest.approx(2 * (6 * 5 + 3) / 14)
    # task b: four episodes of 5 steps per round
    assert summary["episode/b/count"] == 8
    assert summary["episode/b/length"] == pytest.approx(5.0)


def test_the_kl_reference_sees_observations_through_the_live_normalisation():
    # the reference keeps its starting weights; its observation statistics follow the policy's,
    # so at unchanged weights its log-probabilities are the policy's and the KL term is zero
    env = make_env()
    policy = ActorCritic(env.spec, ActorCriticConfig(hidden_sizes=[16]))
    envs = EnvGroup(env)
    config = GRPOConfig(group_size=3, kl_coef=0.1, logprob_level="action")
    algorithm = GRPO(
        config,
        seed=100,
        task_of_env=envs.task_of_env,
        chunk_size=1,
        max_episode_steps=MAX_STEPS,
        policy=policy,
    )
    plan = algorithm.plan(1, 0, episode_base=0)
    obs = envs.reset(seed=plan.seeds)
    policy.update_normalizer(obs)  # statistics move away from the initial mean 0 / std 1
    stats = EpisodeStats(envs.task_names, torch.device("cpu"))
    batch, _ = collect(envs, InferencePolicy(policy), obs, plan, stats)
    algorithm.advantages(batch)
    samples = batch.samples()
    algorithm.prepare(samples)
    engine = TorchEngine(policy, learning_rate=1e-3, max_grad_norm=1.0)
    with torch.no_grad():
        logprob, _, _ = engine.logprob(samples, "action")
    torch.testing.assert_close(samples.ref_logprob, logprob)
    _, metrics = algorithm.loss(engine, samples)
    assert metrics["policy/kl_ref"].item() == pytest.approx(0.0, abs=1e-6)


def test_exploration_log_std_sets_the_actor_critics_own_log_std():
    # (it looked for a VLA's head only, and refused the actor-critic, whose Gaussian is its own)
    policy = ActorCritic(make_env().spec, ActorCriticConfig(hidden_sizes=[16], init_log_std=-0.5))
    GRPOConfig(exploration_log_std=-1.25).fit_policy(policy)
    assert policy.log_std.tolist() == [-1.25] * policy.log_std.numel()
    with pytest.raises(ValueError, match="no Gaussian head with a log_std"):
        GRPOConfig(exploration_log_std=-1.25).fit_policy(torch.nn.Linear(2, 2))


def test_a_run_with_an_idle_environment_prints_its_note_once(tmp_path, capsys):
    """9 environments in groups of 4: one fills no group and is not trained on; a run of
    several iterations says so once."""
    run = tmp_path / "run"
    run_on(PushRightEnv(9), run, total_env_steps=9 * 3 * 4)
    assert metric_rows(run, "iteration")[-1] >= 2
    note = "GRPO: 1 environment(s) fill no group of 4 within their task and are not trained on"
    assert capsys.readouterr().out.count(note) == 1
