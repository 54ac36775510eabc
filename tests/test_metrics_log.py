"""metrics.jsonl is strict JSON: a number that is not finite is written as null, TensorBoard
still gets the float, and every reader in the code reads a null back as NaN. A resumed run's
TensorBoard file is read after the earlier ones."""

import json
import math

import pytest

from embodied import logger as metrics_log
from embodied.recording import logged_grad_norms
from embodied.report_data import read_run
from embodied.resume import trim_metrics


def strict(line: str) -> dict:
    """A line as a strict parser (jq, JSON.parse) reads it: NaN and Infinity are errors."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(line, parse_constant=refuse)


class Board:
    """TensorBoard's writer, as far as the logger uses it."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def close(self):
        pass


def test_a_non_finite_update_is_logged_as_null_and_read_back_as_nan(tmp_path):
    logger = metrics_log.RunLogger(tmp_path, enabled_tb=False)
    logger.tb = Board()
    update = {"policy/loss": math.nan, "policy/grad_norm": math.inf, "value/loss": 0.5}
    logger.log({**update, "time/env_steps_per_s": 10.0}, 20, iteration=2)
    logger.log({"policy/grad_norm": -math.inf}, 30, iteration=3)
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [strict(line) for line in lines] == [
        {"env_steps": 20, "iteration": 2, "policy/loss": None, "policy/grad_norm": None}
        | {"value/loss": 0.5, "time/env_steps_per_s": 10.0},
        {"env_steps": 30, "iteration": 3, "policy/grad_norm": None},
    ]
    logged = {key: value for key, value, _ in logger.tb.scalars[:3]}
    assert math.isnan(logged["policy/loss"]) and logged["policy/grad_norm"] == math.inf
    rows = metrics_log.read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(rows[0]["policy/loss"]) and rows[0]["value/loss"] == 0.5
    assert math.isnan(rows[1]["policy/grad_norm"])
    assert math.isnan(read_run(tmp_path).iterations[0]["policy/grad_norm"])  # (the report's)


def test_readers_take_null_as_not_finite_and_a_trim_writes_strict_json(tmp_path):
    """The spike window skips a null norm, as it skipped NaN; a resume's trim rewrites an older
    file's NaN and Infinity tokens as null."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"iteration": i, "policy/grad_norm": float(i)} for i in range(1, 4)]
    rows[1]["policy/grad_norm"] = math.inf  # (an older run's file: an Infinity token)
    lines = [json.dumps(row) for row in rows] + ['{"iteration": 4, "policy/grad_norm": null}']
    path.write_text("\n".join(lines) + "\n")
    assert logged_grad_norms(tmp_path) == [1.0, 3.0]
    trim_metrics(tmp_path, 4)
    kept = [strict(line) for line in path.read_text().splitlines()]
    assert [row["policy/grad_norm"] for row in kept] == [1.0, None, 3.0, None]
    with pytest.raises(ValueError, match="not JSON: Infinity"):
        strict(json.dumps(rows[1]))  # (what the file held before)


def test_a_resumed_runs_event_file_sorts_after_the_last_ones(tmp_path):
    """TensorBoard reads a run's event files in name order, and a name starts with the second it
    was made: a resumed process's file made within the same second sorted before the last one
    (its counter is not padded), and that file's purge hid the new points (a flaky test)."""
    import time

    from embodied.logger import RunLogger

    tb = tmp_path / "tb"
    tb.mkdir()
    last = tb / f"events.out.tfevents.{int(time.time()) + 1:010d}.host.1.99"  # (a second ahead)
    last.write_bytes(b"")
    RunLogger(tmp_path, resumed_at=0).close()
    names = sorted(p.name for p in tb.iterdir())
    assert len(names) == 2 and names[0] == last.name  # the new file is read after it


def tensorboard_points(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Each TensorBoard scalar's (step, value) points, as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_a_resume_that_evaluates_an_earlier_iteration_again_shows_each_point_once(tmp_path):
    """Iteration 2's checkpoint was saved while iteration 1's evaluation ran beside training;
    its result was logged (at iteration 1's step, 10) after that save. The resumed run evaluates
    iteration 1 again: TensorBoard showed both results at step 10, since it hid the first
    process's points from the checkpoint's step (20) on only."""
    from embodied.logger import RunLogger

    first = RunLogger(tmp_path)
    first.log({"policy/loss": 1.0}, 10, iteration=1)
    first.log({"policy/loss": 2.0}, 20, iteration=2)
    first.log({"eval/success_rate": 0.5}, 10, iteration=1)
    first.log({"policy/loss": 9.0}, 30, iteration=3)  # (after the checkpoint: trimmed)
    first.close()
    trim_metrics(tmp_path, 2, evaluated=1)
    again = RunLogger(tmp_path, resumed_at=10)
    again.log({"eval/success_rate": 0.75}, 10, iteration=1)
    again.log({"policy/loss": 3.0}, 30, iteration=3)
    again.close()
    shown = tensorboard_points(tmp_path)
    assert shown["eval/success_rate"] == [(10, 0.75)]
    assert shown["policy/loss"] == [(10, 1.0), (20, 2.0), (30, 3.0)]


def test_a_resume_logs_anew_from_the_evaluation_it_runs_again(tmp_path):
    from types import SimpleNamespace

    from embodied.checkpoint import META, checkpoint_dir
    from embodied.resume import logged_again_from

    cfg = SimpleNamespace(runner=SimpleNamespace(total_env_steps=100, max_minutes=None))
    counters = {"iteration": 2, "env_steps": 20, "train_seconds": 5.0, "evals": []}
    assert logged_again_from(cfg, True, tmp_path, counters) == 20  # nothing in flight
    counters["evaluating"] = {"iteration": 1, "env_steps": 10, "train_seconds": 2.0}
    assert logged_again_from(cfg, True, tmp_path, counters) == 20  # its checkpoint is gone
    kept = checkpoint_dir(tmp_path, 1)
    kept.mkdir(parents=True)
    (kept / META).write_text("{}")
    assert logged_again_from(cfg, True, tmp_path, counters) == 10
    assert logged_again_from(cfg, False, tmp_path, counters) == 20  # no evaluation workers
    counters["evals"] = [{"iteration": 1}]  # (its result was saved: nothing runs again)
    assert logged_again_from(cfg, True, tmp_path, counters) == 20
