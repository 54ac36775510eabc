"""A training run's life as its user sees it: where it ends, what a resume keeps, what its run
directory holds afterwards. Runs of the scripted push env (tests/scripted_envs.py)."""

import json

import torch
from scripted_envs import PPO, TINY_VLA, PushRightEnv, run_on

from embodied.checkpoint import load_checkpoint

STEPS = 8 * PPO["num_steps"]  # an iteration's env steps (8 environments)
RUN = dict(algorithm=PPO, policy={**TINY_VLA, "value_head": True})


def test_a_clock_that_runs_out_during_an_evaluation_still_saves_the_last_iteration(
    tmp_path, monkeypatch
):
    """``runner.max_minutes`` reached in step 5 of iteration 2 (its evaluation, when one is due;
    none here, so that no new best saves it): the run ends after it, and its last checkpoint
    holds iteration 2. It used to end with no checkpoint of it."""
    from embodied.evaluations import Evaluations
    from embodied.run import Clock

    periodic = Evaluations.periodic
    evaluated = []

    def evaluate_then_out_of_time(self, iteration, last):
        periodic(self, iteration, last)
        evaluated.append(iteration)

    monkeypatch.setattr(Evaluations, "periodic", evaluate_then_out_of_time)
    monkeypatch.setattr(Clock, "out_of_time", property(lambda self: 2 in evaluated))
    run = tmp_path / "run"
    torch.manual_seed(0)
    summary = run_on(PushRightEnv(8), run, total_env_steps=5 * STEPS, max_minutes=60, **RUN)
    assert evaluated == [1, 2] and summary["final"]["iteration"] == 2
    assert load_checkpoint(run)["counters"]["iteration"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows if "policy/loss" in row] == [1, 2]


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_ends_with_one_final_evaluation_and_no_stale_result(tmp_path):
    """The final evaluation's rows are tagged; a resume drops them and the earlier process's
    metrics.json (a resumed run that stopped showed that result as its own), and its own final
    evaluation is logged once (a finished run resumed had two)."""
    from embodied.run import rewind

    run = tmp_path / "run"
    kw = dict(save_every=1, **RUN)

    def finals() -> list[int]:
        return [row["iteration"] for row in _rows(run) if row.get("final")]

    torch.manual_seed(0)
    run_on(PushRightEnv(8), run, total_env_steps=2 * STEPS, **kw)
    assert finals() == [2] and (run / "metrics.json").is_file()
    rewind(run, load_checkpoint(run), cfg=None, evaluates_beside=False)  # a resume's first step
    assert finals() == [] and not (run / "metrics.json").exists()
    assert [row["iteration"] for row in _rows(run) if "policy/loss" in row] == [1, 2]
    torch.manual_seed(0)
    run_on(PushRightEnv(8), run, total_env_steps=2 * STEPS, resume=str(run / "last"), **kw)
    assert finals() == [2]  # a finished run resumed: straight to its final evaluation, once
    run_on(PushRightEnv(8), run, total_env_steps=3 * STEPS, resume=str(run / "last"), **kw)
    assert finals() == [3]
    assert json.loads((run / "metrics.json").read_text())["final"]["iteration"] == 3
