"""A training run's life as its user sees it: where it ends, what a resume keeps, what its run
directory holds afterwards. Runs of the scripted push env (tests/scripted_envs.py)."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
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
    seconds = Clock.seconds  # (the evaluation takes an hour on the run's clock)
    monkeypatch.setattr(
        Clock, "seconds", property(lambda self: seconds.fget(self) + 3600 * (2 in evaluated))
    )
    run = tmp_path / "run"
    torch.manual_seed(0)
    summary = run_on(PushRightEnv(8), run, total_env_steps=5 * STEPS, max_minutes=60, **RUN)
    assert evaluated == [1, 2] and summary["final"]["iteration"] == 2
    counters = load_checkpoint(run)["counters"]
    # its training time counts the evaluation: a resume would train past the limit otherwise
    assert counters["iteration"] == 2 and counters["train_seconds"] >= 3600
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows if "policy/loss" in row] == [1, 2]


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def tensorboard_points(run) -> dict[str, list[tuple[int, float]]]:
    """Each TensorBoard scalar's (step, value) points, as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def metrics_points(run) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (env_steps, value) points in metrics.jsonl."""
    points: dict[str, list[tuple[int, float]]] = {}
    for row in _rows(run):
        for key, value in row.items():
            if "/" in key:
                points.setdefault(key, []).append((row["env_steps"], value))
    return points


def test_a_resumed_run_ends_with_one_final_evaluation_and_no_stale_result(tmp_path):
    """The final evaluation's rows are tagged; a resume drops them and the earlier process's
    metrics.json (a resumed run that stopped showed that result as its own), and its own final
    evaluation is logged once (a finished run resumed had two). TensorBoard shows what
    metrics.jsonl holds: it kept the first process's final evaluation beside the second's."""
    from embodied.resume import rewind

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
    shown = tensorboard_points(run)
    logged = metrics_points(run)
    assert sorted(shown) == sorted(logged) and "eval/success_rate" in logged
    for tag, points in logged.items():
        assert [step for step, _ in shown[tag]] == [step for step, _ in points], tag
        values = [value for _, value in shown[tag]]
        assert values == pytest.approx([value for _, value in points], rel=1e-6), tag


def test_a_checkpoint_that_cannot_be_written_is_one_error_line_and_the_last_one_stands(
    tmp_path, monkeypatch, capsys
):
    """A full disk while iteration 2 is saved: torch.save raises a RuntimeError (what a full disk
    gives). The run ends with exit code 1 and one line naming the checkpoint, the free space and
    the checkpoint that stands; no staging directory is left. It used to be two tracebacks (the
    failed save was tried again while the first was handled)."""
    from tiny_runs import TINY_REACH

    from embodied.cli import main

    torch_save = torch.save
    saves = []

    def full_at_the_second(obj, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64")
        return torch_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_the_second)
    argv = ["train", "configs/mujoco/reach_ppo.yaml", f"runner.output_dir={tmp_path}"]
    steps = ["runner.total_env_steps=96", "runner.save_every=1", "runner.report=false"]
    assert main([*argv, "runner.name=full", *TINY_REACH, *steps]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    run = tmp_path / "full"
    assert line.startswith(f"embodied: error: checkpoint {run}/checkpoints/iter_000002 not")
    assert "unexpected pos 64" in line and "MiB free there" in line
    assert line.endswith(f"the last complete checkpoint is {run}/checkpoints/iter_000001")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001"]


def test_a_run_directory_that_cannot_be_written_is_refused_before_anything_is_built(
    tmp_path, monkeypatch, capsys
):
    """A read-only (or another user's) folder: one line naming it, before the environment is
    built (it used to be an OSError traceback after that, writing config.yaml). A test machine's
    root user may write anywhere, so the folder's access is what the run is told."""
    from tiny_runs import TINY_REACH

    import embodied.runner
    from embodied.cli import main

    locked = tmp_path / "locked"
    (locked / "run").mkdir(parents=True)
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and access(p, mode))

    def not_built(cfg):
        raise AssertionError("the environment was built")

    monkeypatch.setattr(embodied.runner, "make_env", not_built)
    base = ["train", "configs/mujoco/reach_ppo.yaml", *TINY_REACH]
    for place in (f"runner.output_dir={locked}", f"runner.output_dir={locked}/deeper"):
        assert main([*base, place, "runner.name=new"]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"embodied: error: runner.output_dir, runner.name: cannot write in {locked} "
            "(read-only, or not yours)\n"
        )
    assert sorted(p.name for p in locked.iterdir()) == ["run"]


def test_a_run_stopped_before_its_first_checkpoint_is_not_offered_a_resume(tmp_path):
    """The message for a name already used offers ``runner.resume`` only where there is a
    checkpoint to resume from (a run killed in its first iteration has none)."""
    from embodied.config import ConfigError
    from embodied.run import check_fresh

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError) as refused:
        check_fresh(run, overwrite=False)
    assert "runner.overwrite=true" in str(refused.value)
    assert "runner.resume" not in str(refused.value)
    (run / "checkpoints" / "iter_000001").mkdir(parents=True)
    (run / "checkpoints" / "iter_000001" / "meta.json").write_text("{}")
    (run / "last").symlink_to("checkpoints/iter_000001")
    with pytest.raises(ConfigError, match="continue it with runner.resume=.*, start over"):
        check_fresh(run, overwrite=False)


def test_a_file_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """metrics.json and config.yaml: a write that fails (a full disk, a kill) leaves the old
    file as it was and no temporary file; one that succeeds replaces it."""
    from embodied.logger import write_atomic

    path = tmp_path / "metrics.json"
    write_atomic(path, '{"final": 1}')
    assert path.read_text() == '{"final": 1}'

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", disk_full)
        with pytest.raises(OSError, match="No space left"):
            write_atomic(path, '{"final": 2, "and more": "than fits"}')
    assert path.read_text() == '{"final": 1}' and [p.name for p in tmp_path.iterdir()] == [
        "metrics.json"
    ]
    write_atomic(path, '{"final": 2}')
    assert path.read_text() == '{"final": 2}'


def test_a_second_process_on_a_run_directory_in_use_is_refused(tmp_path, capsys):
    """Another process holds RUN/.lock (a run in progress, here held the way a run holds it):
    a run, fresh or resumed, into that directory is one line naming its process and leaves the
    directory as it was; once it is free, the run goes ahead and the lock goes with it."""
    import fcntl

    from tiny_runs import TINY_REACH

    from embodied.cli import main

    run = tmp_path / "run"
    run.mkdir()
    holder = open(run / ".lock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.write("4242\n")
    holder.flush()
    argv = ["train", "configs/mujoco/reach_ppo.yaml", *TINY_REACH, "runner.report=false"]
    argv += [f"runner.output_dir={tmp_path}", "runner.name=run"]
    with pytest.MonkeyPatch.context() as m:  # refused before it builds anything
        m.setattr("embodied.runner.make_env", lambda cfg: pytest.fail("the env was built"))
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"embodied: error: runner.name: {run} is in use by another run (process 4242); wait for "
        "it to end, or choose another runner.name\n"
    )
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
    holder.close()
    assert main(argv) == 0
    assert (run / ".lock").read_text() == f"{os.getpid()}\n"  # (the process that ran last)
    with open(run / ".lock") as lock:  # released at the run's end
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder = open(run / ".lock", "w")  # a resume of it, another process holding it again
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert main([*argv, f"runner.resume={run}"]) == 2
    assert capsys.readouterr().err.startswith(  # (another runner.name would not resume it)
        f"embodied: error: runner.resume: {run} is in use by another run (process ?); wait for "
        "it to end\n"
    )
    holder.close()


def test_a_filesystem_without_locks_runs_unlocked_and_says_so(tmp_path, monkeypatch, capsys):
    """flock on some network filesystems raises ENOLCK: the run goes on, saying that a second
    run into its directory would not be refused (it was a traceback, and no run could start)."""
    import errno
    import fcntl

    from tiny_runs import TINY_REACH

    from embodied.cli import main

    def no_locks(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    argv = ["train", "configs/mujoco/reach_ppo.yaml", *TINY_REACH, "runner.report=false"]
    assert main([*argv, f"runner.output_dir={tmp_path}", "runner.name=run"]) == 0
    said = f"{tmp_path}/run: not locked (No locks available): a second run into it would not"
    assert said in capsys.readouterr().out
    assert (tmp_path / "run" / "last").is_symlink()


def test_overwrite_removes_a_runs_files_only_from_a_runs_directory(tmp_path):
    """``runner.overwrite=true`` on a folder that is no run's (no config.yaml, which every run
    writes first) removes nothing: a user's own checkpoints/ there stays. A run's directory is
    cleared, its exported episodes/ too, and what is not a run's file stays."""
    from embodied.config import ConfigError
    from embodied.run import check_fresh, clear_run

    folder = tmp_path / "mine"
    (folder / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no config.yaml, so it is not a run's directory"):
        check_fresh(folder, overwrite=True)
    assert (folder / "checkpoints").is_dir()
    run = tmp_path / "run"
    for name in ("checkpoints", "episodes/episode_0000", "notes"):
        (run / name).mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    check_fresh(run, overwrite=True)
    clear_run(run)
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "notes"]


def test_a_lost_workers_resume_hint_names_the_directory_the_run_writes_to(tmp_path):
    """A run resumed from a checkpoint elsewhere writes there, not to output_dir/name: the hint
    after a lost worker names that run (it used to name output_dir/name)."""
    from types import SimpleNamespace

    from embodied.cli import _run_dir

    run = tmp_path / "elsewhere"
    (run / "checkpoints" / "iter_000003").mkdir(parents=True)
    (run / "checkpoints" / "iter_000003" / "meta.json").write_text("{}")
    (run / "last").symlink_to("checkpoints/iter_000003")

    def runner(resume):
        return SimpleNamespace(runner=SimpleNamespace(output_dir="runs", name="a", resume=resume))

    assert _run_dir(runner(None)) == Path("runs/a")
    for given in (run, run / "last", run / "checkpoints" / "iter_000003"):
        assert _run_dir(runner(str(given))) == run


def test_a_checkpoint_to_start_from_with_weights_of_other_shapes_is_one_line(tmp_path, capsys):
    """runner.init_from with a policy of another size: one line naming a weight and both shapes
    (it was load_state_dict's RuntimeError, a traceback), and no run directory."""
    from tiny_runs import TINY_REACH

    from embodied.cli import main

    argv = ["train", "configs/mujoco/reach_ppo.yaml", *TINY_REACH, f"runner.output_dir={tmp_path}"]
    assert main([*argv, "runner.name=small", "policy.hidden_sizes=[8]"]) == 0
    capsys.readouterr()
    start = f"runner.init_from={tmp_path}/small/last"
    assert main([*argv, "runner.name=big", "policy.hidden_sizes=[16]", start]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"embodied: error: runner.init_from: {tmp_path}/small/last does not ")
    assert "weights of other shapes, e.g. actor.0.bias (8,) here (16,)" in line
    assert not (tmp_path / "big").exists()
    # a forced resume of the small run at another size: the same line, the run left as it was
    rows = (tmp_path / "small" / "metrics.jsonl").read_text()
    forced = [f"runner.resume={tmp_path}/small", "runner.resume_force=true"]
    assert main([*argv, "policy.hidden_sizes=[16]", *forced]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"embodied: error: runner.resume: {tmp_path}/small/checkpoints/")
    assert "weights of other shapes, e.g. actor.0.bias (8,) here (16,)" in line
    assert (tmp_path / "small" / "metrics.jsonl").read_text() == rows


def test_a_resumed_optimizer_state_for_other_trainable_weights_is_one_line():
    """A forced resume whose policy trains fewer weights than the checkpoint's optimizer state
    holds (a part frozen since): a ConfigError counting both, not torch's ValueError."""
    from types import SimpleNamespace

    from embodied.config import ConfigError
    from embodied.resume import load_resumed

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(net.parameters())
    state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
    checkpoint = {"path": "ck", "meta": {}, **state}
    loaded = []
    engine = SimpleNamespace(torch_policy=net, load_state_dict=loaded.append)
    load_resumed(engine, checkpoint, False)
    assert loaded == [checkpoint]
    net[0].requires_grad_(False)
    said = "runner.resume: ck's optimizer state holds 4 weights but this run trains 2 "
    with pytest.raises(ConfigError, match=said):
        load_resumed(engine, checkpoint, False)
    assert len(loaded) == 1  # (refused before the engine took anything)


def test_a_checkpoint_to_start_from_that_acts_otherwise_is_refused(tmp_path, capsys):
    """runner.init_from a policy whose weights fit but that was trained on other actions (its
    joint deltas, here started as joint positions): refused, naming what differs; it loaded in
    silence and acted on other numbers."""
    from dataclasses import replace

    from tiny_runs import TINY_REACH

    from embodied.checkpoint import load_checkpoint
    from embodied.cli import main
    from embodied.config import ConfigError, compose
    from embodied.roles import init_policy
    from embodied.schema import EnvSpec
    from embodied.train_config import TrainConfig

    argv = ["train", "configs/mujoco/reach_ppo.yaml", *TINY_REACH, f"runner.output_dir={tmp_path}"]
    assert main([*argv, "runner.name=deltas"]) == 0
    saved = load_checkpoint(tmp_path / "deltas", with_trainer_state=False)["meta"]
    cfg = compose(TrainConfig, [("the run's", saved["config"])])
    cfg.runner.init_from = str(tmp_path / "deltas" / "last")
    spec = EnvSpec.from_dict(saved["spec"])
    assert init_policy(cfg, spec, "cpu") is not None  # (its own spec: it fits)
    absolute = replace(spec, action=replace(spec.action, space="joint_pos"))
    with pytest.raises(
        ConfigError,
        match="other inputs or actions than this environment's "
        r"\(action space joint_delta -> joint_pos\)",
    ):
        init_policy(cfg, absolute, "cpu")


def test_a_failed_save_frees_what_it_wrote_and_only_a_write_error_is_called_one(
    tmp_path, monkeypatch
):
    """A save that fails removes its staging directory and the frozen weights' temporary file
    (the largest, what a full disk needs back); torch's writer errors become CheckpointWriteError,
    any other RuntimeError (a CUDA fault, say) stays itself, with its traceback."""
    from embodied import checkpoint as ck

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    net[0].requires_grad_(False)  # (its weights go to a frozen-<digest> file of their own)

    def save():
        ck.save_checkpoint(tmp_path, 1, model=net, optimizer=None, counters={}, meta={})

    def full(tensors, path, **kwargs):  # (safetensors' own error: not an OSError)
        Path(path).write_bytes(b"\0" * 64)  # part of the file
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    def torch_full(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 64)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64")

    for module, name, broken, said in (
        (ck, "save_file", full, "No space left on device"),
        (torch, "save", torch_full, "unexpected pos 64"),
    ):
        with monkeypatch.context() as m:
            m.setattr(module, name, broken)
            with pytest.raises(ck.CheckpointWriteError, match=said):
                save()
        # (nothing but the frozen weights, when they were written whole before)
        left = [p.name for p in (tmp_path / "checkpoints").iterdir()]
        assert [name for name in left if not name.startswith("frozen-")] == []

    def cuda_fault(obj, path, *args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", cuda_fault)
        with pytest.raises(RuntimeError, match="illegal memory access") as raised:
            save()
    assert not isinstance(raised.value, ck.CheckpointWriteError)
    frozen = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert len(frozen) == 1 and frozen[0].startswith("frozen-")  # (written whole, before)


def test_a_runs_numbers_do_not_depend_on_the_thread_count_left_by_an_earlier_test(tmp_path):
    """``run_on`` sets runner.torch_threads as ``train`` does: two runs entered with 2 and with 1
    torch threads write the same metrics (another count sums apart, and changes what trains)."""
    rows = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        run_on(PushRightEnv(8), tmp_path / f"t{threads}", total_env_steps=3 * STEPS, **RUN)
        timed = ("time/", "eval/env_steps_per_s", "eval/policy_ms")  # measured, not reproducible
        rows[threads] = [
            {k: v for k, v in row.items() if not k.startswith(timed)}
            for row in _rows(tmp_path / f"t{threads}")
        ]
    assert rows[2] == rows[1]


def test_a_run_continued_past_its_end_evaluates_the_iteration_it_ended_at(tmp_path):
    """Iteration 2 was the run's last: its due evaluation was skipped for the final one. Given
    more env steps and resumed, the run evaluates it first, as a run given the larger budget
    from its start did (it went on to iteration 3: iteration 2 was never a candidate for best)."""
    run = tmp_path / "run"
    torch.manual_seed(0)
    first = run_on(PushRightEnv(8), run, total_env_steps=2 * STEPS, eval_every=2, **RUN)
    assert first["evals"] == []
    longer = dict(total_env_steps=4 * STEPS, eval_every=2, resume=str(run / "last"), **RUN)
    summary = run_on(PushRightEnv(8), run, **longer)
    assert [e["iteration"] for e in summary["evals"]] == [2]
    assert summary["final"]["iteration"] == 4


def test_a_resume_whose_kl_reference_is_not_the_runs_is_one_line(tmp_path):
    """GRPO's KL reference is the policy as it started (from runner.init_from, read again by a
    resume: that run may have trained on since). The checkpoint keeps its digest, and a resume
    that rebuilds another reference is refused instead of penalising against other weights."""
    from scripted_envs import GRPO

    from embodied.config import ConfigError

    run = tmp_path / "run"
    torch.manual_seed(0)
    kl = dict(algorithm={**GRPO, "kl_coef": 0.1}, policy=TINY_VLA)
    first = run_on(PushRightEnv(8), run, total_env_steps=8 * 3 * 4, save_every=1, **kl)
    more = dict(total_env_steps=8 * 3 * 8, resume=str(run / "last"), **kl)
    resumed = run_on(PushRightEnv(8), run, **more)  # (its own reference: it resumes)
    assert resumed["final"]["iteration"] > first["final"]["iteration"]
    meta_path = run / "last" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["reference_digest"] is not None  # (the policy's weights as the run started)
    meta_path.write_text(json.dumps({**meta, "reference_digest": "another"}))
    with pytest.raises(ConfigError, match="gives other weights than the KL penalty's reference"):
        run_on(PushRightEnv(8), run, total_env_steps=8 * 3 * 8, resume=str(run / "last"), **kl)
