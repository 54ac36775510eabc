"""Rollout records when things go wrong (embodied/recording.py): a write that fails (a full disk),
a run resumed from an earlier checkpoint, an update that is not finite, gradient norms of 0."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from scripted_envs import GRPO, PPO, TINY_VLA, PushRightEnv, run_on
from tiny_runs import TINY_REACH

import embodied.record_files as record_files
import embodied.recording as recording
from embodied.cli import main
from embodied.events import read_events
from embodied.record_files import recorded_iterations
from embodied.recording import Pending, RecordPolicy, record_dir, record_meta, spikes

ROOT = Path(__file__).resolve().parents[1]
MLP = {"name": "actor_critic", "hidden_sizes": [16], "use_images": False}

pytestmark = pytest.mark.usefixtures("one_thread")


def pending() -> Pending:
    """A small record in progress: weights, optimizer, learning rate, stream, one round."""
    optimizer = {"state": {}, "param_groups": []}
    rounds = [{"r0/x": torch.arange(3)}]
    return Pending({"w": torch.ones(2)}, optimizer, 1e-3, {"seed": 0}, {}, rounds, [("push",)])


def full_disk(error: Exception):
    def write(*args, **kw):
        raise error

    return write


@pytest.mark.parametrize(
    "name, error",
    [
        ("save", OSError(28, "No space left on device")),  # (the rounds: the first file)
        ("save_file", SafetensorError("Error while serializing: IoError(No space left)")),
        ("torch", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")),
    ],
)
def test_a_record_whose_write_fails_leaves_nothing_on_disk(tmp_path, monkeypatch, name, error):
    """Whichever file the disk fills at (each one's own error), the staged files go."""
    if name == "torch":
        monkeypatch.setattr(recording.torch, "save", full_disk(error))
    else:
        monkeypatch.setattr(recording, name, full_disk(error))
    with pytest.raises(type(error)):
        pending().write(tmp_path, 3, "every", {"loss": 0.5}, {})
    assert list((tmp_path / "rollouts").iterdir()) == []


def test_a_full_disk_while_a_record_is_written_loses_that_record_not_the_run(
    tmp_path, monkeypatch, capsys
):
    """torch.save's own error (what a full disk gives it) at iteration 2's record: one line and
    an event say so, the run trains to its end, the other records are whole."""
    save = torch.save

    def full_at_iteration_2(obj, path, *args, **kw):
        if "iter_000002.tmp" in str(path):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64")
        return save(obj, path, *args, **kw)

    monkeypatch.setattr(recording.torch, "save", full_at_iteration_2)
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    kw = dict(total_env_steps=8 * 6 * 3, record_rollouts=1, policy=MLP, algorithm=PPO)
    run_on(PushRightEnv(8), run_dir, **kw)
    lines = [x for x in capsys.readouterr().out.splitlines() if "not written" in x]
    assert lines == [
        "the record of iteration 2 (every) was not written: RuntimeError: [enforce fail at "
        "inline_container.cc:672] . unexpected pos 64"
    ]
    assert recorded_iterations(run_dir) == [1, 3]
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == [
        "iter_000001",
        "iter_000003",
    ]
    failed = [e for e in read_events(run_dir) if e.kind == "record_failed"]
    assert [e.detail.split(":")[0] for e in failed] == ["iteration 2 (every)"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "policy/loss" in r] == [1, 2, 3]
    assert (run_dir / "last").resolve().name == "iter_000003"
    assert json.loads((record_dir(run_dir, 3) / "record.json").read_text())["iteration"] == 3


def test_a_run_resumed_from_an_earlier_checkpoint_removes_the_later_records(tmp_path, capsys):
    """Records of iterations after the checkpoint are of a timeline the run no longer has, as
    its later checkpoints and metrics rows: they go, and what the resumed run records stays. A
    spike's record (never pruned; what its line pointed at) is moved aside, not removed."""
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    kw = dict(record_rollouts=1, keep_rollouts=2, policy=MLP, algorithm=PPO, save_every=2)
    run_on(PushRightEnv(8), run_dir, total_env_steps=8 * 6 * 4, **kw)
    assert recorded_iterations(run_dir) == [3, 4]
    (run_dir / "rollouts" / "iter_000005.tmp").mkdir()  # (a write cut short)
    spike = record_dir(run_dir, 4) / "record.json"
    spike.write_text(json.dumps({**json.loads(spike.read_text()), "reason": "spike"}))
    resume = str(run_dir / "checkpoints" / "iter_000002")
    capsys.readouterr()
    run_on(PushRightEnv(8), run_dir, total_env_steps=8 * 6 * 3, resume=resume, **kw)
    # the resumed run's iteration 3, not pruned in favour of the abandoned 4
    listed = sorted(p.name for p in (run_dir / "rollouts").iterdir())
    assert listed == ["abandoned", "iter_000003"] and recorded_iterations(run_dir) == [3]
    out = capsys.readouterr().out
    assert "resuming from iteration 2: removed the later rollout records [3]" in out
    assert "the later non-finite and spike records [4] moved to " in out
    assert (
        json.loads(
            (run_dir / "rollouts" / "abandoned" / "iter_000004-1" / "record.json").read_text()
        )["reason"]
        == "spike"
    )
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["iteration"] for r in rows) == 3


def test_only_the_first_non_finite_update_of_a_streak_is_recorded():
    """Those after it replay nothing new (their weights before are not finite already), and a
    record of each would fill the disk; a finite update ends the streak."""
    policy = RecordPolicy(every=0, spike_factor=10.0)
    nan, inf = math.nan, math.inf
    losses = [0.5, nan, nan, inf, 0.5, nan]
    reasons = [policy.reason(i + 1, {"policy/loss": v}) for i, v in enumerate(losses)]
    assert reasons == [None, "non-finite", None, None, None, "non-finite"]
    every = RecordPolicy(every=2, spike_factor=10.0)  # (every Nth stays every Nth: pruned)
    norms = [1.0, inf, inf, inf, 1.0]
    reasons = [every.reason(i + 1, {"policy/grad_norm": n}) for i, n in enumerate(norms)]
    assert reasons == [None, "non-finite", None, "every", None]


def test_a_non_finite_update_stops_the_run_with_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """MuJoCo reach at a learning rate of 1e25, one step per update: iteration 1's step makes
    the weights huge, iteration 2's update is NaN. The run stops there (exit 1) instead of
    training on to its end on NaN weights; the line names the iteration, its record (the
    weights before it) and the last checkpoint, which stays the newest."""
    run = [f"runner.output_dir={tmp_path}", "runner.name=nan", "runner.report=false"]
    big = ["algorithm.learning_rate=1e25", "algorithm.update_epochs=1"]
    big += ["algorithm.num_minibatches=1", "runner.total_env_steps=160"]
    record = ["runner.record_rollouts=100", "runner.save_every=1"]
    config = str(ROOT / "configs" / "mujoco" / "reach_ppo.yaml")
    monkeypatch.chdir(tmp_path)  # (MuJoCo writes MUJOCO_LOG.TXT where it runs, on NaN controls)
    capsys.readouterr()
    assert main(["train", config, *TINY_REACH, *run, *big, *record]) == 1
    err = capsys.readouterr().err.strip()
    run_dir = tmp_path / "nan"
    assert len(err.splitlines()) == 1 and err.startswith("embodied: error: iteration 2: ")
    assert f"its record {record_dir(run_dir, 2)} holds the weights before it" in err
    assert err.endswith(f"the last checkpoint is {run_dir / 'checkpoints' / 'iter_000001'}")
    assert recorded_iterations(run_dir) == [2]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter_000001"]
    assert (run_dir / "last").resolve().name == "iter_000001"
    text = (run_dir / "metrics.jsonl").read_text()
    rows = [json.loads(x) for x in text.splitlines()]
    # strict JSON (jq, JSON.parse): the non-finite loss is null, not Python's NaN token
    assert [r["iteration"] for r in rows] == [1, 2] and rows[1]["policy/loss"] is None
    assert "NaN" not in text and "Infinity" not in text
    # and so is the record's: the loss as text that float() reads back (a replay compares it)
    recorded = (record_dir(run_dir, 2) / "record.json").read_text()
    assert "NaN" not in recorded and "Infinity" not in recorded
    assert math.isnan(record_meta(run_dir, 2)["metrics"]["policy/loss"])
    events = [(e.kind, e.detail.split(":")[0]) for e in read_events(run_dir)]
    assert events[-2:] == [("record", "iteration 2"), ("failure", "NonFiniteUpdate")]
    # at the last completed iteration (it named the one that failed, as if done)
    failure = read_events(run_dir)[-1]
    assert (failure.iteration, failure.env_steps) == (1, rows[0]["env_steps"])


def test_only_folders_named_as_records_are_records(tmp_path):
    """A user's copy beside the records: iter_000005.bak stopped the run's next record (its
    number did not parse), iter_000005_orig counted iteration 5 twice (its episodes went into a
    dataset twice, a replay replayed it twice)."""
    rollouts = tmp_path / "rollouts"
    copies = ("iter_000005.bak", "iter_000005_orig", "iter_5", "iter_0000005", "iter_000007.tmp")
    for name in ("iter_000005", *copies):
        (rollouts / name).mkdir(parents=True)
    (rollouts / "iter_000005" / "record.json").write_text('{"reason": "every"}')
    (rollouts / "iter_000009").write_text("a file")
    assert recorded_iterations(tmp_path) == [5]
    assert record_files.prune_records(tmp_path, 0) == [5]
    assert recorded_iterations(tmp_path) == [] and (rollouts / "iter_000005.bak").is_dir()
    assert recorded_iterations(tmp_path / "no_run") == []


def test_gradient_norms_of_zero_set_no_scale_for_a_spike():
    """The median is over the window's positive norms, at least two of them: after five updates
    without a gradient, the first ones with a tiny gradient are no spikes (each was, against a
    median of 0), and a spike is measured against the positive ones."""
    policy = RecordPolicy(every=0, spike_factor=10.0)
    norms = [0.0] * 5 + [1e-7, 1e-7, 5e-7, 2e-6, 0.0, 2.5e-6, 6e-6]
    reasons = [policy.reason(i + 1, {"policy/grad_norm": n}) for i, n in enumerate(norms)]
    # 9: 2e-6 > 10 x median(1e-7, 1e-7, 5e-7); 11: 2.5e-6 < 10 x median(.., 2e-6) = 3e-6;
    # 12: 6e-6 > 10 x median(1e-7, 1e-7, 5e-7, 2e-6, 2.5e-6) = 5e-6
    assert reasons == [None] * 8 + ["spike", None, None, "spike"]
    assert policy.grad_norms == norms  # (the zeros stay in the window: the last 20 updates)
    assert not spikes(1.0, [0.0, 0.0, 0.0], 10.0) and spikes(1.0, [0.0, 0.05, 0.05], 10.0)
    assert not spikes(1.0, [0.01, 0.01], 0.0)  # (runner.spike_factor 0: off)


def test_a_replay_compares_no_bookkeeping_and_names_what_it_cannot_replay(
    tmp_path, capsys, monkeypatch
):
    """A GPU run's record replayed on the CPU: the offloaded optimizer's megabytes (0 here) are
    bookkeeping, not compared (no --rtol passed them). An update that data-parallel actor
    workers shared is said to be one when it differs; a megatron record where megatron-core is
    not installed is one line naming the extra."""
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    run_on(PushRightEnv(8), run_dir, total_env_steps=8 * 6, record_rollouts=1, policy=MLP)
    meta_path = record_dir(run_dir, 1) / "record.json"
    meta = json.loads(meta_path.read_text())
    meta["metrics"]["optimizer/offloaded_mb"] = 12.5  # (what a GPU run logs)
    meta["config"]["cluster"]["offload_optimizer"] = True
    meta_path.write_text(json.dumps(meta))
    argv = ["replay", str(run_dir), "--iteration", "1"]
    capsys.readouterr()
    assert main(argv) == 0 and "bit for bit" in capsys.readouterr().out
    meta["metrics"]["policy/loss"] += 1.0
    meta["config"]["cluster"].update(enabled=True, actor={"workers": 2})
    meta_path.write_text(json.dumps(meta))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "differs (recorded by 2 data-parallel actor workers, " in err and "--rtol" in err
    meta["config"]["trainer"] = {"backend": "megatron"}
    meta_path.write_text(json.dumps(meta))
    monkeypatch.setitem(sys.modules, "megatron", None)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'embodied[megatron]'" in err


def test_a_record_json_without_what_readers_need_is_one_line_naming_it(tmp_path, capsys):
    """record.json without its iteration or environments' tasks, of another format, or listing
    more rounds than the file holds: one line naming it (tracebacks: KeyError, or the round's
    missing 'state'), from `embodied replay` and `embodied episodes` alike."""
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    run_on(PushRightEnv(8), run_dir, total_env_steps=8 * 6, record_rollouts=1, policy=MLP)
    meta_path = record_dir(run_dir, 1) / "record.json"
    meta = json.loads(meta_path.read_text())
    damaged = [
        ({k: v for k, v in meta.items() if k != "task_of_env"}, "damaged (no task_of_env)"),
        ({k: v for k, v in meta.items() if k != "iteration"}, "damaged (no iteration)"),
        ({**meta, "format": "embodied-rollout-record-v9"}, "format 'embodied-rollout-record-v9'"),
        ({**meta, "instructions": meta["instructions"] * 2}, "lists 2 rounds, "),
    ]
    capsys.readouterr()
    for written, said in damaged:
        meta_path.write_text(json.dumps(written))
        for argv in (["replay", str(run_dir), "--iteration", "1"], ["episodes", str(run_dir)]):
            assert main(argv) == 2, (argv, said)
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and said in err and "record" in err, err


def test_records_that_cannot_be_pruned_stay_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """Removing an older record fails (busy on NFS, say): one line, an event, and the run goes
    on (it died with a traceback after a completed update). A removal renames the record out of
    the listing first, so one cut short leaves no half record among them."""
    calls = []

    def busy(path):
        calls.append(path.name)
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(record_files, "remove_record", busy)
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    kw = dict(record_rollouts=1, keep_rollouts=1, policy=MLP, algorithm=PPO)
    run_on(PushRightEnv(8), run_dir, total_env_steps=8 * 6 * 3, **kw)
    assert calls and recorded_iterations(run_dir) == [1, 2, 3]
    assert "older rollout records were not pruned: [Errno 16] Device or resource busy" in (
        capsys.readouterr().out
    )
    assert any(e.kind == "record_failed" for e in read_events(run_dir))
    monkeypatch.undo()
    (run_dir / "rollouts" / ".iter_000009.removed").mkdir()  # (a removal cut short)
    assert record_files.prune_records(run_dir, keep=1) == [1, 2]
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == ["iter_000003"]


def test_a_replay_whose_kl_reference_is_not_the_recorded_runs_is_one_line(tmp_path, capsys):
    """GRPO with a KL penalty: its reference (the initial weights, a record does not hold them)
    is recorded as a digest; the replay builds the same and matches bit for bit, and one built
    from other weights (runner.init_from's checkpoint changed since) is refused with one line,
    where the update differed with nothing to say why."""
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    algorithm = {**GRPO, "kl_coef": 0.1}
    run_on(
        PushRightEnv(8),
        run_dir,
        total_env_steps=48,
        record_rollouts=1,
        policy=TINY_VLA,
        algorithm=algorithm,
    )
    argv = ["replay", str(run_dir), "--iteration", "1"]
    capsys.readouterr()
    assert main(argv) == 0 and "bit for bit" in capsys.readouterr().out
    meta_path = record_dir(run_dir, 1) / "record.json"
    meta = json.loads(meta_path.read_text())
    assert len(meta["reference_digest"]) == 64
    meta_path.write_text(json.dumps({**meta, "reference_digest": "0" * 64}))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "the KL penalty's reference (the seed's initial weights) is not the recorded" in err
