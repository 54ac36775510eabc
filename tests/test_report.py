"""The run's events and its report (embodied/events.py, report_data.py, report.py): hand-built
logs read back to their numbers, and a run's own report loaded in real headless Chromium."""

import io
import json
import re

import numpy as np
import pytest
import torch
from headless_chromium import check_page, chromium
from PIL import Image
from scripted_envs import GRPO, TINY_VLA, PushRightEnv, run_on

from embodied.cli import main
from embodied.events import EventLog, read_events
from embodied.multitask import MultiTaskEnv
from embodied.report import write_report
from embodied.report_data import evaluations_of, phase_seconds, read_run


def test_events_are_appended_and_read_back_and_a_cut_line_is_left_out(tmp_path):
    log = EventLog(tmp_path)
    log.add("start", 0, 0)
    log.add("fault", None, None, "env: worker 1 died")
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"time": 1.0, "kind": "end", "itera')  # a crash mid-line
    events = read_events(tmp_path)
    assert [e.kind for e in events] == ["start", "fault"]
    assert (events[0].iteration, events[0].env_steps) == (0, 0)
    assert events[1].iteration is None and events[1].detail == "env: worker 1 died"
    log.add("resume", 2, 20)  # the resumed run's first event is not glued to the cut line
    assert [e.kind for e in read_events(tmp_path)] == ["start", "fault", "resume"]
    with pytest.raises(ValueError, match="'resumed': not one of"):
        log.add("resumed", 3, 30)
    assert EventLog(tmp_path / "absent").add("fault", None, None).kind == "fault"  # (not written)
    assert not (tmp_path / "absent").exists()


def _iteration(i: int, rollout_s: float, update_s: float) -> dict:
    return {
        "env_steps": 100 * i,
        "iteration": i,
        "episode/success_once": 0.25 * i,
        "time/rollout_s": rollout_s,
        "time/update_s": update_s,
        "time/env_steps_per_s": 100 / (rollout_s + update_s),
        "time/minutes": 0.05 * i,
    }


def _evaluation(i: int, prefix: str, once: float, at_end: float, episodes: int) -> dict:
    return {
        "env_steps": 100 * i,
        "iteration": i,
        f"{prefix}success_rate": once,
        f"{prefix}episodes": float(episodes),
        f"{prefix}success_at_end": at_end,
        f"{prefix}return": 2.0,
        f"{prefix}length": 9.0,
    }


HAND_BUILT = [
    _iteration(1, 1.5, 0.5),
    _evaluation(1, "eval/", 0.7, 0.5, 10),
    _evaluation(1, "eval/a/", 1.0, 0.8, 5),
    _evaluation(1, "eval/b/", 0.4, 0.2, 5),
    _iteration(2, 1.0, 0.3),
    {"env_steps": 200, "iteration": 2, "cluster/discarded_rounds": 1.0},
]
# an iteration in which no episode ended logs no success, an evaluation without success_at_end
NOT_LOGGED = [
    {k: v for k, v in _iteration(3, 1.0, 0.2).items() if k != "episode/success_once"},
    {k: v for k, v in _evaluation(3, "eval/", 0.5, 0.0, 4).items() if k != "eval/success_at_end"},
]


def test_evaluations_are_read_per_task_with_their_wilson_intervals():
    (evaluation,) = evaluations_of(HAND_BUILT)
    assert (evaluation.iteration, evaluation.env_steps) == (1, 100)
    once = evaluation.pooled.success_once
    # 7 of 10: the Wilson interval worked by hand (centre 0.6445, half-width 0.2477)
    assert (once.rate, once.episodes) == (0.7, 10)
    assert once.low == pytest.approx(0.39677, abs=1e-5)
    assert once.high == pytest.approx(0.89221, abs=1e-5)
    assert evaluation.pooled.success_at_end.rate == 0.5
    assert sorted(evaluation.tasks) == ["a", "b"]
    b = evaluation.tasks["b"].success_once  # 2 of 5
    assert (b.low, b.high) == (pytest.approx(0.11762, abs=1e-5), pytest.approx(0.76928, abs=1e-5))
    a = evaluation.tasks["a"].success_once  # 5 of 5
    assert (a.low, a.high) == (pytest.approx(0.56551, abs=1e-5), 1.0)
    iterations = [r for r in HAND_BUILT if "time/env_steps_per_s" in r]
    assert phase_seconds(iterations) == {"rollout": 2.5, "update": pytest.approx(0.8)}


def test_a_hand_built_run_reports_its_tables_events_and_nothing_from_outside(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 0\nrunner:\n  name: hand <built>\n")
    lines = [json.dumps(row) for row in HAND_BUILT]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    log = EventLog(tmp_path)
    log.add("start", 0, 0)
    log.add("discarded_round", 1, 100, "iteration 2: env worker 0 lost")
    log.add("stop", 2, 200, "stopped after iteration 2")
    page = write_report(tmp_path).read_text()
    cells = re.findall(r"<td>(.*?)</td>", page)
    # the last evaluation per task (no metrics.json: the run did not end)
    i = cells.index("a")
    once, at_end = "1.000 [0.57, 1.00] over 5", "0.800 [0.38, 0.96] over 5"
    assert cells[i : i + 6] == ["a", "5", once, at_end, "2.000", "9.0"]
    i = cells.index("rollout")
    assert cells[i : i + 3] == ["rollout", "2.5", "42%"]  # of 6 s
    i = cells.index("other: logging, checkpoints, evaluations during training")
    assert cells[i + 1] == "2.7"  # 6 - 2.5 - 0.8
    assert "1 start, 1 discarded_round, 1 stop." in page
    assert "iteration 2: env worker 0 lost" in cells
    assert cells[cells.index("status") + 1] == "stop"
    assert "name: hand &lt;built&gt;" in page  # the config, escaped
    assert "<b>Success at end</b>" in page  # defined in words
    sources = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert sources and all(s.startswith("data:") for s in sources)  # no file, no network
    assert "<script" not in page


def test_what_was_not_logged_is_reported_as_not_logged(tmp_path):
    lines = [json.dumps(row) for row in HAND_BUILT + NOT_LOGGED]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    page = write_report(tmp_path).read_text()
    cells = re.findall(r"<td>(.*?)</td>", page)
    i = cells.index("all")  # (the last evaluation, pooled: one task)
    assert cells[i : i + 4] == ["all", "4", "0.500 [0.15, 0.85] over 4", "n/a"]
    assert "(no config.yaml)" in page


def test_not_a_run_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"embodied: error: {tmp_path / 'none'}: no such run directory"
    )
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"embodied: error: {tmp_path}: not a training run (no metrics.jsonl)"


def test_a_report_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    """A colleague's run directory, a read-only mount or a full disk: a PermissionError
    traceback before."""
    import embodied.report

    lines = [json.dumps(row) for row in HAND_BUILT]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    target = tmp_path / "report.html"

    def refused(path, text):
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(embodied.report, "write_atomic", refused)
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"embodied: error: {target}: Permission denied"


def test_events_are_on_disk_when_added(tmp_path, monkeypatch):
    """Synced as each metrics row is: after a machine's crash the report's status read an
    earlier stop where the resume after it was lost."""
    import os

    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    EventLog(tmp_path).add("resume", 3, 300)
    assert synced == [str(tmp_path / "events.jsonl")]


def _pixels(png: bytes, box: dict) -> np.ndarray:
    """uint8 [H, W, 3] of the screenshot inside an element's box."""
    shot = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    x, y = int(box["x"]), int(box["y"])
    return shot[y : y + int(box["height"]), x : x + int(box["width"])]


def test_a_runs_report_renders_in_headless_chromium(tmp_path, capsys):
    """Two tasks, an evaluation each iteration, every iteration recorded: the page the run
    writes loads without errors, each video decodes to a picture, the plots draw."""
    assert chromium() is not None, "no chromium: scripts/setup.sh installs it (apt)"
    torch.manual_seed(0)
    env = MultiTaskEnv([PushRightEnv(4), PushRightEnv(4, threshold=0.0)], ["far", "near"])
    run_dir = tmp_path / "run"
    kw = dict(policy=TINY_VLA, algorithm=GRPO, eval_every=1, video=True, record_rollouts=1)
    run_on(env, run_dir, total_env_steps=3 * 24, report=True, **kw)  # 3 iterations
    assert f"report: {run_dir / 'report.html'}" in capsys.readouterr().out
    assert [e.kind for e in read_events(run_dir)] == ["start", "end"]
    data = read_run(run_dir)
    assert [e.iteration for e in data.evaluations] == [0, 1, 2, 3]  # (before RL, each, final)
    assert sorted(data.final.tasks) == ["far", "near"]

    check = check_page(run_dir / "report.html")
    assert check.errors == []
    # the final evaluation, and the best 2 and worst 2 episodes of iteration 3's record
    assert len(check.videos) == 5
    for video in check.videos:
        assert video["error"] is None and video["ready"] >= 2 and video["width"] > 0
        assert video["colours"] > 1  # a decoded picture, not a blank frame
    plots = [i for i in check.images if i["alt"] == "success over training"]
    assert len(plots) == 1 and all(i["complete"] and i["natural_width"] > 0 for i in check.images)
    plot = _pixels(check.screenshot, plots[0])
    drawn = (plot < 250).any(axis=-1).mean()
    assert drawn > 0.05  # axes, ticks, lines and bands
    blue = np.abs(plot.astype(int) - [31, 119, 180]).sum(axis=-1) < 30  # success once's line
    assert blue.sum() > 50


def _sft_step(step: int, loss: float) -> dict:  # (an SFT run's row: its step twice)
    keys = ("sft/l1", "sft/loss", "sft/grad_norm", "train/lr")
    row = {"env_steps": step, "iteration": step, **dict.fromkeys(keys, loss)}
    return {**row, "time/minutes": 0.02 * step}


def _sft_result(once: float, at_end: float, ret: float) -> dict:  # (metrics.json's, per task)
    keys = ("success_rate", "episodes", "success_ci95", "success_at_end", "return", "length")
    values = (once, 4, [0.0, 1.0], at_end, ret, 50.0)
    return {f"eval/{k}": v for k, v in zip(keys, values)}


def _sft_rows(step: int, results: dict, **tag) -> list[dict]:
    return [
        {"env_steps": step, "iteration": step, **tag}
        | {f"eval/{task}/{k[5:]}": v for k, v in r.items() if k != "eval/success_ci95"}
        for task, r in results.items()
    ]


def test_an_sft_runs_report_has_its_steps_and_each_tasks_final_evaluation(tmp_path, capsys):
    """SFT's metrics.json has ``final: {task: summary}`` and ``steps``, no iteration; its rows
    have steps and an evaluation per task, no pooled row: ``embodied report`` was a KeyError."""
    middle = {"push": _sft_result(0.25, 0.0, 1.0), "pull": _sft_result(0.5, 0.25, 3.0)}
    final = {"push": _sft_result(0.75, 0.5, 2.0), "pull": _sft_result(0.25, 0.0, 4.0)}
    rows = [_sft_step(10, 0.5), _sft_step(20, 0.4), *_sft_rows(20, middle)]
    rows += [_sft_step(30, 0.3), _sft_step(40, 0.2), *_sft_rows(40, final, final=True)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"run_dir": str(tmp_path), "steps": 40, "minutes": 0.8, "final": final}
    (tmp_path / "metrics.json").write_text(json.dumps({**summary, "evals": [middle]}))
    (tmp_path / "config.yaml").write_text("seed: 0\ndatasets: [demos/a]\nsteps: 40\n")
    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "eval.mp4").write_bytes(b"an mp4")  # (SFT names its final one so)
    data = read_run(tmp_path)
    assert data.sft and [r["iteration"] for r in data.iterations] == [10, 20, 30, 40]
    assert [(e.iteration, sorted(e.tasks)) for e in data.evaluations] == [
        (20, ["pull", "push"]),
        (40, ["pull", "push"]),
    ]
    pooled = data.evaluations[0].pooled  # 1 + 2 of 8 episodes; returns 1 and 3 over 4 each
    assert (pooled.success_once.rate, pooled.success_once.episodes, pooled.ret) == (0.375, 8, 2.0)
    assert (data.final.iteration, data.final.pooled.success_once.rate) == (40, 0.5)
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    cells = re.findall(r"<td>(.*?)</td>", page)
    assert cells[cells.index("status") : cells.index("status") + 6] == [
        "status", "end", "steps", "40", "training minutes", "0.8",
    ]  # fmt: skip
    assert "env steps" not in cells and "Throughput" not in page  # (SFT logs neither)
    i = cells.index("push")  # 3 of 4, the final evaluation's
    once, at_end = "0.750 [0.30, 0.95] over 4", "0.500 [0.15, 0.85] over 4"
    assert cells[i : i + 6] == ["push", "4", once, at_end, "2.000", "50.0"]
    assert "final evaluation: success once 0.500 [0.22, 0.78] over 8" in page
    assert 'alt="training metrics per step"' in page and 'alt="success once per task"' in page
    assert 'title="final evaluation" src="data:video/mp4;base64,YW4gbXA0"' in page


@pytest.mark.parametrize(
    "kinds, status",
    [
        (["start", "stop", "resume"], "running or cut off (no end event)"),  # (still running)
        (["start", "stop", "resume", "fault"], "running or cut off (no end event)"),
        (["start", "stop", "resume", "resume", "end"], "end"),  # (a kill -9, resumed)
        (["start", "end", "resume", "failure"], "failure"),
        (["start", "stop", "resume", "stop"], "stop"),
        ([], "running, stopped or cut off (no events logged)"),
    ],
)
def test_the_status_is_the_last_processs_outcome(kinds, status):
    """The report took the last end, stop or failure event of any process: a run stopped,
    resumed and then killed (or still running) said "stop"."""
    from embodied.events import Event
    from embodied.report_data import run_status

    events = [Event(float(t), kind, t, 10 * t) for t, kind in enumerate(kinds)]
    assert run_status(events, ended=False) == status


def test_a_resumed_run_cut_off_after_a_stop_is_not_reported_stopped(tmp_path):
    lines = [json.dumps(row) for row in HAND_BUILT]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    log = EventLog(tmp_path)
    log.add("start", 0, 0)
    log.add("stop", 1, 100, "stopped after iteration 1")
    log.add("resume", 1, 100)  # (then kill -9 at iteration 2: no event)
    cells = re.findall(r"<td>(.*?)</td>", write_report(tmp_path).read_text())
    i = cells.index("status")
    assert cells[i : i + 4] == ["status", "running or cut off (no end event)", "iterations", "2"]
