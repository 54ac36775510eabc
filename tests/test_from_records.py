"""``runner.replay_from`` (embodied/from_records.py) where it can go wrong: a run directory that
holds the records it would train on, a config whose policy the records' state does not fit, and
a first update that differs from the recorded one in its weights only."""

import json
import re
import shutil
import signal

import pytest
import torch
import yaml
from scripted_envs import PPO, PushRightEnv, run_on

from embodied.checkpoint import load_checkpoint
from embodied.cli import main
from embodied.events import read_events
from embodied.record_files import recorded_iterations
from embodied.recording import read_record
from embodied.report_data import read_run

MLP = {"name": "actor_critic", "hidden_sizes": [16], "use_images": False}
# one epoch of one minibatch: every metric is taken before the step, so a change that acts on
# the step alone (the clipping) leaves the metrics as recorded and changes only the weights
ONE_STEP = {**PPO, "update_epochs": 1, "num_minibatches": 1}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A PPO run of 3 iterations on the test task, each recorded, with its config.yaml."""
    torch.manual_seed(0)
    run_dir = tmp_path_factory.mktemp("from_records") / "recorded"
    run_on(
        PushRightEnv(8),
        run_dir,
        total_env_steps=8 * 6 * 3,
        record_rollouts=1,
        policy=MLP,
        algorithm=ONE_STEP,
    )
    config = json.loads((run_dir / "rollouts" / "iter_000001" / "record.json").read_text())[
        "config"
    ]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))  # (as a run writes it first)
    return run_dir


def train(tmp_path, capsys, *overrides: str, policy=MLP) -> tuple[int, str, str]:
    """``embodied train`` on a config of this test's policy and algorithm, with ``overrides``:
    (exit code, stdout, stderr)."""
    config = tmp_path / "config.yaml"
    source = {"seed": 0, "policy": policy, "algorithm": ONE_STEP, "env": {"simulator": "mujoco"}}
    source["runner"] = {"progress": False, "report": False}
    config.write_text(yaml.safe_dump(source))
    capsys.readouterr()
    code = main(["train", str(config), *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_run_directory_that_holds_the_records_is_refused_before_anything_is_deleted(
    recorded, tmp_path, capsys
):
    """The recorded run's own directory, with runner.overwrite=true (what the refusal without it
    used to advise) or not, given as the run or its rollouts folder: one line, exit 2, and the
    records are all still there."""
    before = recorded_iterations(recorded)
    where = [f"runner.output_dir={recorded.parent}", f"runner.name={recorded.name}"]
    for source in (recorded / "rollouts", recorded):
        for overwrite in ("true", "false"):
            replay = f"runner.replay_from={source}"
            code, _, err = train(tmp_path, capsys, replay, *where, f"runner.overwrite={overwrite}")
            assert code == 2 and len(err.strip().splitlines()) == 1, err
            assert "runner.replay_from" in err and "choose another runner.name" in err
            assert recorded_iterations(recorded) == before == [1, 2, 3]
    assert (recorded / "metrics.jsonl").is_file() and (recorded / "last").exists()


def test_records_that_do_not_fit_the_config_are_one_line_and_leave_no_run_directory(
    recorded, tmp_path, capsys
):
    replay = [f"runner.replay_from={recorded / 'rollouts'}", f"runner.output_dir={tmp_path}"]
    wider = {**MLP, "hidden_sizes": [64]}
    code, _, err = train(tmp_path, capsys, *replay, "runner.name=wide", policy=wider)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "policy.hidden_sizes is [64] here, [16] in the records" in err
    assert not (tmp_path / "wide").exists()
    # keys that change no weight's shape named before it (by name) do not hide it
    named_first = {"activation": "relu", "compile_act": True, "chunk_size": 1, "init_log_std": -1}
    policy = {**wider, **named_first, "chunk_size": 2}
    code, _, err = train(tmp_path, capsys, *replay, "runner.name=wide", policy=policy)
    assert code == 2 and "policy.hidden_sizes is [64] here" in err, err
    # an earlier run in the way with runner.overwrite=true: untouched by the refusal
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "config.yaml").write_text("{}")
    (tmp_path / "kept" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    overwrite = ["runner.name=kept", "runner.overwrite=true"]
    code, _, err = train(tmp_path, capsys, *replay, *overwrite, policy=wider)
    assert code == 2 and (tmp_path / "kept" / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    kept = sorted(p.name for p in (tmp_path / "kept").iterdir() if p.name != ".lock")
    assert kept == ["config.yaml", "metrics.jsonl"]


def test_the_first_update_is_compared_with_the_recorded_one_in_its_weights_too(
    recorded, tmp_path, capsys
):
    """A clipping of the gradient that the recorded update did not have: the metrics are the
    recorded ones (taken before the step), the weights after it are not."""
    replay = [f"runner.replay_from={recorded / 'rollouts'}", f"runner.output_dir={tmp_path}"]
    code, out, _ = train(tmp_path, capsys, *replay, "runner.name=same", "runner.report=true")
    assert code == 0 and "the first update (iteration 1 of the records) equals" in out
    report = (tmp_path / "same" / "report.html").read_text()
    assert "No iteration was logged" not in report
    # its end is logged (it read "running, stopped or cut off"), and why it has no evaluation
    assert [e.kind for e in read_events(tmp_path / "same")] == ["start", "end"]
    cells = re.findall(r"<td>(.*?)</td>", report)
    assert cells[cells.index("status") + 1] == "end"
    assert "No evaluation was logged (runner.replay_from simulates nothing)" in report
    assert "3 of 3 updates" in out
    code, out, _ = train(
        tmp_path, capsys, *replay, "runner.name=clip", "algorithm.max_grad_norm=0.05"
    )
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("the first update"))
    assert "differs from iteration 1's recorded one: weights after the update differ" in line
    assert "policy/" not in line  # (the metrics are as recorded)
    assert "off-policy: records [2, 3]" in out
    rows = [json.loads(x) for x in (tmp_path / "clip" / "metrics.jsonl").read_text().splitlines()]
    assert [r["replayed"] for r in rows] == [1, 2, 3]
    assert [len(read_run(tmp_path / n).iterations) for n in ("same", "clip")] == [3, 3]
    # the run's environment is the records' (what an evaluation of its checkpoint builds)
    records_env = read_record(recorded, 1).meta["config"]["env"]
    assert (
        load_checkpoint(tmp_path / "same")["meta"]["config"]["env"]
        == records_env
        != {"simulator": "mujoco"}
    )


def test_an_update_that_is_not_finite_stops_the_run_unsaved(recorded, tmp_path, capsys):
    """Records whose second update ran at a learning rate of 1e30: the third is not finite. The
    run stops there with one line naming it and its record, saving nothing (it trained on and
    saved the weights it stepped). Replayed from the second, the line names the third record
    (it named the replay's second update "iteration 2")."""
    records = tmp_path / "blown" / "rollouts"
    shutil.copytree(recorded / "rollouts", records)
    shutil.rmtree(records / "iter_000001")
    meta_path = records / "iter_000002" / "record.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "lr": 1e30}))
    replay = [f"runner.replay_from={records}", f"runner.output_dir={tmp_path}", "runner.name=nan"]
    code, _, err = train(tmp_path, capsys, *replay)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "error: replayed iteration 3: the update is not finite (" in err
    assert "no checkpoint was saved before it" in err and "holds the weights" not in err
    assert not (tmp_path / "nan" / "checkpoints").exists()
    failure = read_events(tmp_path / "nan")[-1]
    assert (failure.kind, failure.iteration) == ("failure", 1)  # (the update that completed)


def test_a_replay_says_it_reproduces_the_recording_only_where_its_last_weights_are_recorded(
    recorded, tmp_path, capsys
):
    """Only the weights before each update were compared: a replay whose last update differed
    said "the first update differs" and then "the run reproduces the recorded one"."""
    records = tmp_path / "last" / "rollouts"
    shutil.copytree(recorded / "rollouts" / "iter_000003", records / "iter_000003")
    replay = [f"runner.replay_from={records}", f"runner.output_dir={tmp_path}"]
    code, out, _ = train(tmp_path, capsys, *replay, "runner.name=same")
    assert code == 0 and "1 of 1 updates" in out and "the run reproduces the recorded one" in out
    clipped = ["runner.name=clip", "algorithm.max_grad_norm=0.05"]
    code, out, _ = train(tmp_path, capsys, *replay, *clipped)
    assert code == 0 and "reproduces" not in out
    assert "the weights after record 3's update differ from the recording" in out


def test_a_record_cut_short_fails_before_any_update_and_a_damaged_one_keeps_those_done(
    recorded, tmp_path, capsys
):
    """Only record.json was read up front: a later record's missing or damaged file ended the
    run after the updates before it, and they were lost (no checkpoint)."""
    records = tmp_path / "damaged" / "rollouts"
    shutil.copytree(recorded / "rollouts", records)
    optimizer = records / "iter_000003" / "optimizer.pt"
    optimizer.unlink()
    replay = [f"runner.replay_from={records}", f"runner.output_dir={tmp_path}"]
    code, _, err = train(tmp_path, capsys, *replay, "runner.name=missing")
    assert code == 2 and f"{optimizer}: missing from the record" in err
    assert not (tmp_path / "missing").exists()
    optimizer.write_bytes(b"cut short")
    code, _, err = train(tmp_path, capsys, *replay, "runner.name=cut")
    assert code == 2 and f"{optimizer}: damaged" in err, err
    assert f"the 2 updates before it are saved: {tmp_path / 'cut'}/last" in err
    assert load_checkpoint(tmp_path / "cut" / "last")["counters"]["iteration"] == 2


@pytest.mark.parametrize("during", [2, 3])
def test_a_stop_signal_saves_the_updates_done(recorded, tmp_path, capsys, monkeypatch, during):
    """SIGTERM during the second update: it finishes, is saved, and the run stops with the line
    saying where (it ran on, or Ctrl-C's KeyboardInterrupt lost every update). During the last
    one the run ends as it would have, exit 0."""
    from embodied.roles import Learner

    update = Learner.update
    calls = []

    def signalled(self):
        calls.append(1)
        if len(calls) == during:
            signal.raise_signal(signal.SIGTERM)
        return update(self)

    monkeypatch.setattr(Learner, "update", signalled)
    replay = [f"runner.replay_from={recorded}", f"runner.output_dir={tmp_path}", "runner.name=s"]
    code, _, err = train(tmp_path, capsys, *replay)
    if during == 2:
        assert code == 128 + signal.SIGTERM and "stopped after 2 of 3 records" in err
    else:
        assert code == 0 and "stopped" not in err
    assert load_checkpoint(tmp_path / "s" / "last")["counters"]["iteration"] == during
    events = [(e.kind, e.iteration) for e in read_events(tmp_path / "s")]
    assert events == [("start", 0), ("stop", 2) if during == 2 else ("end", 3)]


def test_a_final_checkpoint_that_cannot_be_written_is_the_runs_failure(
    recorded, tmp_path, capsys, monkeypatch
):
    """The save after the last update was outside what records a failure: a full disk there
    left the run "running or cut off" (only its start event), every update done."""
    import embodied.from_records
    from embodied.checkpoint import CheckpointWriteError

    def full_disk(*args):
        raise CheckpointWriteError("disk full")

    monkeypatch.setattr(embodied.from_records, "_save", full_disk)
    replay = [f"runner.replay_from={recorded}", f"runner.output_dir={tmp_path}", "runner.name=f"]
    code, _, err = train(tmp_path, capsys, *replay)
    assert code != 0 and "disk full" in err
    events = [(e.kind, e.iteration) for e in read_events(tmp_path / "f")]
    assert events == [("start", 0), ("failure", 3)]


def test_the_records_of_an_asynchronous_run_are_replayed_as_it_updated(recorded, tmp_path, capsys):
    """A run with cluster.max_staleness 1 weighs its updates by the proximal policy; replayed
    from its records (cluster.enabled false, which cannot take max_staleness 1) the update was
    plain PPO and "differed". Here a record rewritten as an asynchronous run's, its update
    and weights after it as ``embodied replay`` gives them from its config."""
    from embodied.replay import replay

    records = tmp_path / "async" / "rollouts"
    shutil.copytree(recorded / "rollouts" / "iter_000001", records / "iter_000001")
    meta_path = records / "iter_000001" / "record.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["cluster"] = {**meta["config"].get("cluster", {}), "max_staleness": 1}
    meta["config"]["cluster"]["enabled"] = True
    meta_path.write_text(json.dumps(meta))
    _, metrics, digest = replay(records.parent, 1)
    assert "policy/behaviour_weight" in metrics  # (the proximal policy's update)
    meta_path.write_text(json.dumps({**meta, "metrics": metrics, "digest_after": digest}))
    source = [f"runner.replay_from={records}", f"runner.output_dir={tmp_path}", "runner.name=a"]
    code, out, _ = train(tmp_path, capsys, *source)
    assert code == 0 and "the first update (iteration 1 of the records) equals" in out, out
    # its own config is as given (max_staleness 1 needs the cluster: it could not run again),
    # and its checkpoint's meta is a run's (the precision, the KL reference's digest)
    from embodied.config import load_config
    from embodied.train_config import TrainConfig

    assert load_config(TrainConfig, tmp_path / "a" / "config.yaml")[0].cluster.max_staleness == 0
    meta = json.loads((tmp_path / "a" / "last" / "meta.json").read_text())
    assert {"precision", "reference_digest"} <= meta.keys()
