"""An evaluation on env workers pooled per task (``pool_by_task``): each task's episodes over the
workers that ran them, and in every task's summary the whole evaluation's timing, each worker
counted once (a task's own workers alone understated it when workers held different tasks)."""

import pytest

from embodied.cluster.roles import pool_by_task


def summary(rate: float, episodes: int, steps_per_s: float, policy_ms: float) -> dict:
    return {
        "eval/success_rate": rate,
        "eval/episodes": episodes,
        "eval/success_ci95": [0.0, 1.0],
        "eval/success_at_end": rate,
        "eval/return": 1.0,
        "eval/length": 10.0,
        "eval/env_steps_per_s": steps_per_s,
        "eval/policy_ms": policy_ms,
    }


def test_workers_holding_one_task_each_give_every_task_the_whole_evaluations_timing():
    first = {"a": {**summary(0.5, 4, 100.0, 2.0), "eval/video": "worker0/eval.mp4"}}
    second = {"b": summary(0.25, 4, 100.0, 4.0)}
    pooled = pool_by_task(["a", "b"], [first, second])
    for task in ("a", "b"):  # two workers at 100 steps/s each: the evaluation ran at 200
        assert pooled[task]["eval/env_steps_per_s"] == 200.0
        assert pooled[task]["eval/policy_ms"] == 3.0
        assert "eval/video" not in pooled[task]  # (a worker's own file)
    assert (pooled["a"]["eval/success_rate"], pooled["b"]["eval/success_rate"]) == (0.5, 0.25)


def test_a_worker_holding_every_task_counts_once():
    shares = [
        {"a": summary(1.0, 2, 100.0, 2.0), "b": summary(0.5, 2, 100.0, 2.0)},
        {"a": summary(0.5, 2, 50.0, 4.0), "b": summary(0.0, 2, 50.0, 4.0)},
    ]
    pooled = pool_by_task(["a", "b"], shares)
    assert pooled["a"]["eval/env_steps_per_s"] == 150.0  # (not 300: a worker's tasks share it)
    assert pooled["b"]["eval/policy_ms"] == 3.0
    assert pooled["a"]["eval/success_rate"] == pytest.approx(0.75)  # 3 of 4
    assert pooled["a"]["eval/episodes"] == 4
