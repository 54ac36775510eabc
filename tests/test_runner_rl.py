"""The runner with a VLA end to end: on a task where success needs a positive first action, GRPO
(no critic, also through SmolVLA's stochastic flow) and PPO (value head) raise the success rate;
per-task evaluation equals each task alone."""

import pytest
import torch
from scripted_envs import PPO, TINY_VLA, PushRightEnv, metric_rows, run_on

from embodied.cluster.envs import episode_shares
from embodied.contract import check_env
from embodied.evaluate import (
    evaluate,
    evaluate_by_task,
    evaluate_shares,
    pooled_summary,
    split_episodes,
    wilson_interval,
)
from embodied.multitask import MultiTaskEnv
from embodied.schema import (
    PolicyOutput,
)
from embodied.seeds import eval_seed


def test_the_test_env_passes_the_contract():
    check_env(PushRightEnv(4), seed=1)


def test_grpo_raises_success(tmp_path):
    torch.manual_seed(0)
    summary = run_on(PushRightEnv(8), tmp_path / "grpo", total_env_steps=8 * 3 * 30)
    before = summary["before"]["all"]["eval/success_rate"]
    after = summary["tasks"]["all"]["eval/success_rate"]
    train_success = metric_rows(tmp_path / "grpo", "episode/success_once")
    assert sum(train_success[:3]) / 3 < 0.85 and sum(train_success[-3:]) / 3 > 0.95, train_success
    assert before < 0.5 and after == 1.0  # deterministic (mean) actions, 16 evaluation episodes
    assert summary["best"] is None and summary["best_below_before"] is False  # (no periodic one)
    assert max(metric_rows(tmp_path / "grpo", "grpo/kept_groups")) >= 1
    assert (tmp_path / "grpo" / "last" / "model.safetensors").exists()


def test_grpo_through_smolvlas_stochastic_flow_raises_success(tmp_path):
    from tiny_vlms import smolvlm

    torch.manual_seed(0)
    policy = {
        "name": "smolvla",
        "vlm_path": str(smolvlm(tmp_path / "smolvlm")),
        "chunk_size": 1,
        "flow_steps": 3,
        "flow_noise_std": 0.3,
    }
    # A budget of 20 rounds raised success to 1.0 on 4 of 4 seeds on an AMD EPYC VM, but on 3 of
    # seeds 0-4 on an Intel Xeon with AVX-512 (seed 0 among the failures); 30 on 5 of 5 there, and
    # 40 (this test's, for a margin) on 5 of 5.
    summary = run_on(PushRightEnv(8), tmp_path / "grpo", total_env_steps=8 * 3 * 40, policy=policy)
    before = summary["before"]["all"]["eval/success_rate"]
    after = summary["tasks"]["all"]["eval/success_rate"]
    assert before < 0.5 and after == 1.0, (before, after)  # deterministic flow, 16 episodes


class PixelPolicy:
    """Deterministic: pushes right by the first pixel's red value (success depends on the seed)."""

    def act(self, obs, *, deterministic=True):
        x = obs.images["cam"][:, 0, 0, 0].float() / 127.5 - 1.0  # f32 [B]
        actions = torch.stack([x, torch.zeros_like(x)], -1)[:, None]  # f32 [B, 1, 2]
        return PolicyOutput(actions=actions, logprob=torch.zeros(len(x)))


def test_evaluation_by_task_equals_each_task_alone():
    env = MultiTaskEnv([PushRightEnv(4), PushRightEnv(3, threshold=0.0)], ["a", "b"])
    together = evaluate_by_task(
        env, PixelPolicy(), episodes=10, seed=3
    )  # 3 rounds, the last one partial
    for name, sub in zip(env.names, env.envs):
        alone = evaluate(sub, PixelPolicy(), episodes=10, seed=3)
        timing = ("eval/env_steps_per_s", "eval/policy_ms")  # measured, not reproducible
        assert {k: v for k, v in together[name].items() if k not in timing} == {
            k: v for k, v in alone.items() if k not in timing
        }
        assert alone["eval/episodes"] == 10 and all(together[name][k] > 0 for k in timing)
    assert 0 < together["a"]["eval/success_rate"] < together["b"]["eval/success_rate"] < 1


def test_an_evaluation_split_between_workers_pools_to_the_whole_one():
    """Episodes 0-9 from seed 3, run as parts of 3, 3 and 4 (cluster.eval.workers 3), pool to
    the whole evaluation: each episode's reset seed is the seed plus its index."""
    shares = split_episodes(10, 3, 3)
    assert shares == [(3, 3), (3, 6), (4, 9)]
    assert split_episodes(2, 0, 4) == [(1, 0), (1, 1)]  # more workers than episodes
    env = PushRightEnv(4, threshold=0.0)
    whole = evaluate(env, PixelPolicy(), episodes=10, seed=3)
    parts = [evaluate(env, PixelPolicy(), episodes=n, seed=seed) for n, seed in shares]
    pooled = pooled_summary(parts)
    timing = ("eval/env_steps_per_s", "eval/policy_ms")
    for key, value in whole.items():
        if key not in timing:
            assert pooled[key] == pytest.approx(value, rel=1e-12), key
    assert 0 < whole["eval/success_rate"] < 1
    # a wrong seed for a part (each part from the evaluation's seed) changes the result
    unshifted = pooled_summary(
        [evaluate(env, PixelPolicy(), episodes=n, seed=3) for n, _ in shares]
    )
    assert unshifted["eval/return"] != pytest.approx(whole["eval/return"], rel=1e-12)


def test_an_evaluation_split_among_env_workers_by_task_pools_to_the_whole_one():
    """Env worker 0 holds task a, worker 1 tasks a and b (``cluster.env.workers`` 2): each
    evaluates its share of each task's episodes (``episode_shares``), and the parts pool per
    task to the one-process evaluation of both tasks."""
    whole_env = MultiTaskEnv([PushRightEnv(4), PushRightEnv(3, threshold=0.0)], ["a", "b"])
    seed = eval_seed(3, held_out=False)  # (a training run's: 2e9 + 3)
    whole = evaluate_by_task(whole_env, PixelPolicy(), episodes=5, seed=seed)
    shares = episode_shares([[0], [0, 1]], tasks=2, episodes=5, seed=seed)
    assert shares == [[(2, seed)], [(3, seed + 2), (5, seed)]]
    assert episode_shares([[0], [0]], tasks=1, episodes=1, seed=0) == [[(1, 0)], [(0, 0)]]
    workers = [
        MultiTaskEnv([PushRightEnv(2)], ["a"]),
        MultiTaskEnv([PushRightEnv(2), PushRightEnv(3, threshold=0.0)], ["a", "b"]),
    ]
    parts = [
        evaluate_shares(env, PixelPolicy(), shares=share) for env, share in zip(workers, shares)
    ]
    assert [sorted(part) for part in parts] == [["a"], ["a", "b"]]
    pooled = {
        "a": pooled_summary([parts[0]["a"], parts[1]["a"]]),
        "b": pooled_summary([parts[1]["b"]]),
    }
    assert whole["a"]["eval/episodes"] == 5 and 0 < whole["a"]["eval/success_rate"] < 1
    for task in ("a", "b"):
        for key, value in whole[task].items():
            if key not in ("eval/env_steps_per_s", "eval/policy_ms"):
                assert pooled[task][key] == pytest.approx(value, rel=1e-12), (task, key)
    # a worker with no episodes of any task evaluates nothing
    assert evaluate_shares(workers[0], PixelPolicy(), shares=[(0, 0)]) == {}


def test_wilson_interval_golden():
    lo, hi = wilson_interval(92, 100)
    assert abs(lo - 0.8501) < 1e-3 and abs(hi - 0.9589) < 1e-3


def test_the_wilson_interval_holds_its_rate_at_none_and_all():
    """The formula's bounds at 0/n and n/n missed the rate by a rounding for some n (100/100
    gave 1 - 1e-16): the bench's plot refused the negative error bar and the suite stopped."""
    for n in range(1, 501):
        assert wilson_interval(n, n)[1] == 1.0 and wilson_interval(0, n)[0] == 0.0
    lo, hi = wilson_interval(100, 100)
    assert abs(lo - 0.9630) < 1e-4


def test_ppo_with_a_value_head_raises_success(tmp_path):
    torch.manual_seed(0)
    policy = {**TINY_VLA, "value_head": True}
    run = tmp_path / "ppo"
    summary = run_on(PushRightEnv(8), run, total_env_steps=8 * 6 * 15, policy=policy, algorithm=PPO)
    train_success = metric_rows(run, "episode/success_once")
    assert sum(train_success[:2]) / 2 < 0.85, train_success
    assert summary["final"]["eval/success_rate"] == 1.0
    explained = metric_rows(run, "value/explained_variance")
    assert explained[0] < 0.1 and max(explained) > 0.5, explained  # the critic learns the returns


def test_the_update_is_timed_around_the_update(tmp_path, monkeypatch):
    """``time/update_s`` spans the update, which in one process runs inside ``start_update``.
    The runner's clock is a counter here (each reading adds 1 s) and the update adds 100 s, so
    a timer started before the update reads at least 100 s, one started after it about 1 s;
    writing the iteration's rollout record (50 s) after the update is not in it."""
    import types

    import embodied.runner
    from embodied.recording import Pending
    from embodied.roles import Learner

    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    update = Learner.update

    def slow_update(learner):
        now[0] += 100.0
        return update(learner)

    write = Pending.write

    def slow_write(*args, **kwargs):  # (a record's compression and fsync: not the update's)
        now[0] += 50.0
        return write(*args, **kwargs)

    monkeypatch.setattr(embodied.runner, "time", types.SimpleNamespace(time=clock))
    monkeypatch.setattr(Learner, "update", slow_update)
    monkeypatch.setattr(Pending, "write", slow_write)
    run_on(PushRightEnv(8), tmp_path / "run", total_env_steps=8 * 3 * 2, record_rollouts=1)
    update_s = metric_rows(tmp_path / "run", "time/update_s")
    assert len(update_s) == 2 and all(100 < s < 110 for s in update_s), update_s


def _part(episodes: int, wins: int, steps_per_s: float, policy_ms: float) -> dict:
    """A hand-built evaluation summary."""
    return {
        "eval/success_rate": wins / episodes,
        "eval/episodes": episodes,
        "eval/success_ci95": list(wilson_interval(wins, episodes)),
        "eval/success_at_end": wins / episodes,
        "eval/return": float(wins),
        "eval/length": 10.0,
        "eval/env_steps_per_s": steps_per_s,
        "eval/policy_ms": policy_ms,
    }


def test_parts_side_by_side_report_their_rates_together_and_tasks_their_shared_one():
    """Two evaluation workers at 100 and 300 env steps/s ran together at 400; two tasks of one
    evaluation share its timing (its 100), as each task's summary holds it."""
    parts = [_part(4, 1, 100.0, 2.0), _part(4, 3, 300.0, 4.0)]
    together = pooled_summary(parts, side_by_side=True)
    assert together["eval/env_steps_per_s"] == 400.0 and together["eval/policy_ms"] == 3.0
    assert together["eval/success_rate"] == 0.5 and together["eval/episodes"] == 8
    tasks = pooled_summary([_part(4, 1, 100.0, 2.0), _part(4, 3, 100.0, 2.0)])
    assert tasks["eval/env_steps_per_s"] == 100.0 and tasks["eval/policy_ms"] == 2.0


def test_pooling_nothing_is_a_clear_error():
    from embodied.evaluate import overall

    with pytest.raises(ValueError, match="overall: no task's summary to pool"):
        overall({})
    with pytest.raises(ValueError, match="pooled_summary: no summaries to pool"):
        pooled_summary([])


class RecordsRenders(PushRightEnv):
    """PushRightEnv that keeps the rows each ``render`` call was asked for (None: every row)."""

    def __init__(self, num_envs: int, **kw):
        super().__init__(num_envs, **kw)
        self.asked: list[list[int] | None] = []

    def render(self, env_ids=None):
        self.asked.append(None if env_ids is None else env_ids.tolist())
        return super().render(env_ids)


def test_a_video_renders_only_the_rows_it_shows(tmp_path):
    """The video shows the first 4 of 8 environments (of two tasks, each task's first): only
    those render, on every frame."""
    env = RecordsRenders(8)
    evaluate(env, PixelPolicy(), episodes=8, seed=3, video_path=tmp_path / "one.mp4")
    assert len(env.asked) == 4 and all(rows == [0, 1, 2, 3] for rows in env.asked), env.asked
    assert (tmp_path / "one.mp4").stat().st_size > 0
    tasks = [RecordsRenders(3), RecordsRenders(2, threshold=0.0)]
    env = MultiTaskEnv(tasks, ["a", "b"])
    evaluate_by_task(env, PixelPolicy(), episodes=3, seed=3, video_path=tmp_path / "two.mp4")
    for task in tasks:
        assert len(task.asked) == 4 and all(rows == [0] for rows in task.asked), task.asked


def test_a_video_names_only_the_tasks_it_shows(tmp_path):
    """Five tasks: the video shows the first four's first environments, and only their
    summaries name it (the fifth's named a video that never showed it)."""
    tasks = [RecordsRenders(1) for _ in range(5)]
    env = MultiTaskEnv(tasks, [f"t{i}" for i in range(5)])
    video = tmp_path / "five.mp4"
    summaries = evaluate_by_task(env, PixelPolicy(), episodes=1, seed=3, video_path=video)
    assert [summaries[f"t{i}"].get("eval/video") for i in range(5)] == [str(video)] * 4 + [None]
    assert tasks[4].asked == [] and all(task.asked for task in tasks[:4])


def test_a_resumes_kl_reference_is_checked_only_where_both_runs_have_one():
    """The digest a checkpoint keeps against the one a resume rebuilds: other weights are one
    line, or a note with runner.resume_force; a resumed run without a KL penalty (kl_coef 0,
    forced) has no reference to compare (it was refused, naming "None")."""
    from types import SimpleNamespace

    from embodied.config import ConfigError
    from embodied.resume import check_reference

    saved = {"meta": {"reference_digest": "abc"}, "path": "RUN/last"}
    runner = SimpleNamespace(init_from="SFT/last", resume_force=False)
    check_reference(saved, "abc", runner)
    check_reference(saved, None, runner)
    check_reference({"meta": {}, "path": "OLD/last"}, "xyz", runner)
    with pytest.raises(ConfigError, match="^runner.init_from: SFT/last gives other weights"):
        check_reference(saved, "xyz", runner)
    check_reference(saved, "xyz", SimpleNamespace(init_from=None, resume_force=True))


def test_a_resume_does_not_read_the_checkpoint_it_started_from_unless_it_keeps_a_reference(
    tmp_path, capsys
):
    """PPO from ``runner.init_from``: the resume's weights are its checkpoint's, so the start's
    checkpoint, deleted since (a large SFT run cleaned up), no longer stops the resume (the only
    way on was resume_force, which turns every other check off)."""
    import shutil

    from tiny_runs import TINY_REACH

    from embodied.checkpoint import load_checkpoint
    from embodied.cli import main

    base = ["train", "configs/mujoco/reach_ppo.yaml", *TINY_REACH, f"runner.output_dir={tmp_path}"]
    assert main([*base, "runner.name=start"]) == 0
    assert main([*base, "runner.name=rl", f"runner.init_from={tmp_path / 'start'}"]) == 0
    shutil.rmtree(tmp_path / "start")
    longer = ["runner.total_env_steps=64", f"runner.resume={tmp_path / 'rl'}"]
    init = f"runner.init_from={tmp_path / 'start'}"
    assert main([*base, "runner.name=rl", init, *longer]) == 0, capsys.readouterr().err
    assert load_checkpoint(tmp_path / "rl")["counters"]["iteration"] == 2
