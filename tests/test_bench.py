"""``embodied bench``: report contents for a fixed policy on a deterministic MuJoCo task,
reproducibility from the seed, resume of a killed run, baseline policies through the policy
contract, and clear errors for a bad suite."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from clocks import wait_until

pytest.importorskip("mujoco")

from tiny_runs import TINY_REACH  # noqa: E402

from embodied.bench import BenchConfig, run_bench  # noqa: E402
from embodied.cli import main  # noqa: E402
from embodied.config import ConfigError, load_config  # noqa: E402
from embodied.contract import (
    check_policy,  # noqa: E402
    random_observation,  # noqa: E402
)
from embodied.evaluate import evaluate, wilson_interval  # noqa: E402
from embodied.models.baselines import RandomPolicy, ZeroPolicy  # noqa: E402
from embodied.seeds import eval_seed  # noqa: E402
from embodied.simulators.mujoco import MuJoCoConfig, MuJoCoEnv  # noqa: E402

REACH = {"simulator": "mujoco", "task": "reach", "num_envs": 2, "render_size": 32}


def suite(tmp_path: Path, tasks: list[dict], **top) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "seed": 0,
                "episodes": 4,
                "output_dir": str(tmp_path / "out"),
                **top,
                "tasks": tasks,
            }
        )
    )
    return path


def bench(path: Path, **kw) -> dict:
    cfg, _ = load_config(BenchConfig, path)
    return run_bench(cfg, str(path), progress=False, **kw)


def test_report_of_the_zero_policy_on_reach(tmp_path):
    report = bench(suite(tmp_path, [{"env": REACH}]), policy="zero")
    out = tmp_path / "out" / "t" / "zero"
    (r,) = report["tasks"]
    assert (r["task"], r["episodes"], r["successes"]) == (
        "mujoco/reach",
        4,
        0,
    )  # the arm stays home: no goal is reached
    assert r["mean_length"] == 50.0 and r["success_ci95"] == pytest.approx(
        list(wilson_interval(0, 4))
    )
    assert r["env_steps_per_s"] > 0 and r["policy_ms"] > 0 and r["held_out"] is True
    # the same episodes evaluated directly give the same return: the bench adds nothing to them
    with MuJoCoEnv(MuJoCoConfig(task="reach", num_envs=2, render_size=32)) as env:
        seed = eval_seed(0, held_out=True)  # (as `embodied eval`: the held-out seeds)
        direct = evaluate(env, ZeroPolicy(env.spec), episodes=4, seed=seed)
    assert r["mean_return"] == pytest.approx(direct["eval/return"], rel=1e-6)
    saved = json.loads((out / "results.json").read_text())
    assert saved["tasks"][0]["mean_return"] == r["mean_return"] and saved["policy"] == "zero"
    table = (out / "report.md").read_text()
    assert "| mujoco/reach | 4 | 0.00 (0/4) | 0.00-0.49 | 50.0 |" in table
    assert (out / "success.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / r["video"]).stat().st_size > 1000
    # a task's results kept from a bench before rows said whether they are held out: now they do
    task_file = out / "tasks" / "mujoco_reach.json"
    kept = json.loads(task_file.read_text())
    del kept["results"][0]["held_out"]
    task_file.write_text(json.dumps(kept))
    again = bench(suite(tmp_path, [{"env": REACH}]), policy="zero")
    assert again["tasks"][0]["held_out"] is True


def test_same_seed_same_results(tmp_path):
    path = suite(tmp_path, [{"env": REACH}], videos=False)
    first = bench(path, out=str(tmp_path / "a"))["tasks"][0]
    second = bench(path, out=str(tmp_path / "b"))["tasks"][0]
    for key in ("successes", "mean_return", "mean_length", "success_at_end"):
        assert first[key] == second[key]
    # seed 4: four other episodes (seed 1 shared three of seed 0's four)
    apart = suite(tmp_path, [{"env": REACH}], videos=False, seed=4)
    other = bench(apart, out=str(tmp_path / "c"))["tasks"][0]
    assert other["mean_return"] != first["mean_return"]  # other goals, other random actions


def test_sweep_and_names(tmp_path):
    report = bench(
        suite(
            tmp_path,
            [{"env": {**REACH, "max_episode_steps": 5}, "sweep": {"task": ["reach", "push"]}}],
            episodes=2,
            videos=False,
        ),
        policy="zero",
    )
    assert [r["task"] for r in report["tasks"]] == ["mujoco/reach", "mujoco/push"]
    assert [r["mean_length"] for r in report["tasks"]] == [5.0, 5.0]


def test_killed_run_resumes_without_redoing_finished_tasks(tmp_path):
    slow = {
        **REACH,
        "task": "push",
        "obs_mode": "rgb",
        "image_size": 32,
    }  # rendering: seconds, time to be killed
    path = suite(tmp_path, [{"env": REACH}, {"env": slow, "episodes": 2}], videos=False)
    out = tmp_path / "out" / "t" / "random"
    first = out / "tasks" / "mujoco_reach.json"
    cmd = [sys.executable, "-m", "embodied.cli", "bench", str(path), "--policy", "random"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_until(first.exists, f"{first}", gone=lambda: proc.poll() is not None)
        os.killpg(proc.pid, signal.SIGKILL)  # killed in the middle of the second task
    finally:
        proc.wait()
    assert not (out / "tasks" / "mujoco_push.json").exists()
    stamp = first.stat().st_mtime_ns
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "mujoco/reach: finished in an earlier run, kept" in done.stdout
    assert first.stat().st_mtime_ns == stamp  # not redone
    report = json.loads((out / "results.json").read_text())
    assert [r["task"] for r in report["tasks"]] == ["mujoco/reach", "mujoco/push"]
    assert all(r["hardware"] == report["hardware"] for r in report["tasks"])  # (one machine)
    assert "earlier process" not in (out / "report.md").read_text()


def test_a_kept_task_file_that_cannot_be_read_is_run_again(tmp_path, capsys):
    """A task's file of results cut short (or edited by hand) is said so and run again, to the
    same numbers; not a traceback that stops the suite."""
    path = suite(tmp_path, [{"env": REACH}], videos=False)
    first = bench(path, policy="zero")["tasks"][0]
    kept = tmp_path / "out" / "t" / "zero" / "tasks" / "mujoco_reach.json"
    key = json.loads(kept.read_text())["key"]
    for damaged in ('{"key": "', "[]", json.dumps({"key": key, "results": {"a": 1}})):
        kept.write_text(damaged)
        capsys.readouterr()
        again = bench(path, policy="zero")["tasks"][0]
        said = capsys.readouterr().out.splitlines()
        assert said[0].startswith(f"[1/1] mujoco/reach: its results in {kept} cannot be read (")
        assert said[0].endswith("): run again")
        for key in ("successes", "mean_return", "mean_length"):
            assert again[key] == first[key]
        assert json.loads(kept.read_text())["results"][0]["mean_return"] == first["mean_return"]


@pytest.mark.parametrize("cls", [RandomPolicy, ZeroPolicy])
def test_baselines_pass_the_policy_contract(cls):
    with MuJoCoEnv(MuJoCoConfig(task="reach", num_envs=1)) as env:
        spec = env.spec
    policy = cls(spec)
    check_policy(policy, spec)
    out = policy.act(random_observation(spec, 64, "cpu"))
    low, high = spec.action.bounds()
    if cls is RandomPolicy:  # uniform over the bounds: spread over most of each range
        span = (out.actions.amax((0, 1)) - out.actions.amin((0, 1))) / (high - low)
        assert bool((span > 0.8).all())
    else:
        assert torch.equal(out.actions, torch.zeros_like(out.actions))
    # on the device its simulator's bench moves it to ("meta" standing in for CUDA: the random
    # one drew on the CPU and added its bounds' device, an error)
    on_device = cls(spec).to("meta")
    for deterministic in (False, True):
        out = on_device.act(random_observation(spec, 4, "meta"), deterministic=deterministic)
        assert out.actions.device.type == "meta" and out.actions.shape == (4, 1, len(low))


def test_bad_suites_are_clear_errors(tmp_path, capsys):
    with pytest.raises(
        ConfigError, match=r"tasks\[0\]\.env\.simulator: unknown simulator 'gazebo'"
    ):
        bench(suite(tmp_path, [{"env": {"simulator": "gazebo"}}]))
    with pytest.raises(ConfigError, match=r"tasks\[0\]\.env\.task_id"):
        bench(suite(tmp_path, [{"env": {**REACH, "task_id": 3}}]))
    with pytest.raises(ConfigError, match=r"tasks\[0\]\.env\.task: unknown MuJoCo task 'fly'"):
        bench(suite(tmp_path, [{"env": {**REACH, "task": "fly"}}]))
    assert main(["bench", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    # LIBERO's 51st episode would repeat its first: counted, it narrowed the interval
    libero = [{"env": {"simulator": "libero"}, "episodes": 51}]
    with pytest.raises(ConfigError, match=r"tasks\[0\]: libero/libero_spatial/0: episodes: 51,"):
        bench(suite(tmp_path, libero))


@pytest.mark.slow  # two minutes; the bench path runs by default in the tests around it
def test_smoke_suite_covers_three_simulators(tmp_path):
    pytest.importorskip("mani_skill")
    pytest.importorskip("libero")
    rc = main(
        [
            "bench",
            "configs/bench/smoke.yaml",
            "--policy",
            "zero",
            "--out",
            str(tmp_path),
            "episodes=1",
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert [r["simulator"] for r in report["tasks"]] == ["maniskill", "mujoco", "libero"]
    assert all(r["episodes"] >= 1 and r["env_steps_per_s"] > 0 for r in report["tasks"])
    assert report["tasks"][2]["instruction"].startswith("pick up the black bowl")
    for name in ("report.md", "success.png"):
        assert (tmp_path / name).stat().st_size > 100
    assert len(list((tmp_path / "videos").glob("*.mp4"))) == 3


def test_checkpoint_policy_and_a_task_it_cannot_act_in(tmp_path):
    pytest.importorskip("mani_skill")
    assert (
        main(
            [
                "train",
                "configs/mujoco/reach_ppo.yaml",
                f"runner.output_dir={tmp_path}",
                *TINY_REACH,
            ]
        )
        == 0
    )
    ckpt = tmp_path / "mujoco_reach_ppo" / "last"
    cube = {
        "simulator": "maniskill",
        "task": "PushCube-v1",
        "obs_mode": "state",
        "num_envs": 2,
        "num_workers": 1,
    }
    path = suite(tmp_path, [{"env": REACH}, {"env": cube}], episodes=2, videos=False)
    report = bench(path, checkpoint=str(ckpt))
    assert [r["task"] for r in report["tasks"]] == ["mujoco/reach"] and report["policy"].startswith(
        "checkpoint:"
    )
    (skipped,) = report["skipped"]
    assert skipped["task"] == "maniskill/PushCube-v1" and "actions" in skipped["reason"]
    out = tmp_path / "out" / "t" / f"mujoco_reach_ppo_{ckpt.resolve().name}"
    assert "Skipped `maniskill/PushCube-v1`" in (out / "report.md").read_text()


def test_a_checkpoint_rewritten_at_the_same_path_is_evaluated_again(tmp_path, capsys):
    """The resume key holds the checkpoint's contents (meta.json, each file's size and mtime):
    an untouched checkpoint's task is kept (``embodied eval`` writing eval.json beside it
    changes nothing); a retrain into the same run directory (runner.overwrite) runs it again."""
    train = ["train", "configs/mujoco/reach_ppo.yaml", f"runner.output_dir={tmp_path}"]
    train += [*TINY_REACH, "runner.name=run"]
    assert main(train) == 0
    ckpt = str(tmp_path / "run" / "last")
    path = suite(tmp_path, [{"env": REACH}], episodes=2, videos=False)
    bench(path, checkpoint=ckpt)
    assert main(["eval", ckpt, "--episodes", "1"]) == 0
    capsys.readouterr()
    bench(path, checkpoint=ckpt)
    assert "finished in an earlier run, kept" in capsys.readouterr().out
    # the run directory: its last checkpoint, named and keyed as that one (it was "run")
    bench(path, checkpoint=str(tmp_path / "run"))
    assert "finished in an earlier run, kept" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "out" / "t").iterdir()] == ["run_iter_000001"]
    # rows made without videos are not kept where videos are asked for now
    bench(suite(tmp_path, [{"env": REACH}], episodes=2, videos=True), checkpoint=ckpt)
    assert "its earlier results have no video; run again" in capsys.readouterr().out
    assert (tmp_path / "out" / "t" / "run_iter_000001" / "videos").is_dir()
    bench(suite(tmp_path, [{"env": REACH}], episodes=2, videos=False), checkpoint=ckpt)
    assert "finished in an earlier run, kept" in capsys.readouterr().out  # (videos serve it)
    suite(tmp_path, [{"env": REACH}], episodes=2, videos=True)
    assert main([*train, "runner.overwrite=true", "seed=1"]) == 0  # the same checkpoints/iter_1
    capsys.readouterr()
    bench(path, checkpoint=ckpt)
    out = capsys.readouterr().out
    assert "kept" not in out and "mujoco/reach: success" in out


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_deterministic_checkpoint_is_benched_with_pinned_numerics(
    tmp_path, monkeypatch, deterministic
):
    """As ``embodied eval``: a checkpoint trained with runner.deterministic pins the process
    (restarting it pinned from a command line) before the bench acts; another does not."""
    import embodied.numerics

    calls = []
    monkeypatch.setattr(embodied.numerics, "restart_pinned", lambda *a: calls.append(a))
    monkeypatch.setattr(embodied.numerics, "pin", lambda: calls.append("pin"))
    train = ["train", "configs/mujoco/reach_ppo.yaml", f"runner.output_dir={tmp_path}"]
    assert main([*train, *TINY_REACH, "runner.name=run"]) == 0
    meta_path = tmp_path / "run" / "last" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["runner"]["deterministic"] = deterministic  # (in process: not started pinned)
    meta_path.write_text(json.dumps(meta))
    calls.clear()
    path = suite(tmp_path, [{"env": REACH}], episodes=1, videos=False)
    assert main(["bench", str(path), "--checkpoint", str(tmp_path / "run" / "last")]) == 0
    assert calls == ([(True, False), "pin"] if deterministic else [])


def test_the_report_averages_task_success_rates_with_tasks_weighted_equally(tmp_path):
    """0.5 over 2 episodes and 1.0 over 8: the suite's row is 0.75 (pooled episodes: 0.9)."""
    from embodied.bench_report import write_report

    def row(task: str, episodes: int, successes: int) -> dict:
        rate = successes / episodes
        return {
            "task": task,
            "episodes": episodes,
            "successes": successes,
            "success_rate": rate,
            "success_ci95": list(wilson_interval(successes, episodes)),
            "mean_length": 10.0,
            "env_steps_per_s": 100.0,
            "policy_ms": 1.0,
            "video": None,
        }

    hw = {"cpus": 2, "processor": "x86_64", "gpu": None, "torch": "2", "python": "3"}
    meta = {"suite": "s", "policy": "zero", "seed": 0, "hardware": hw}
    rows = [{**row("a", 2, 1), "hardware": hw}, {**row("b", 8, 8), "hardware": hw}]
    report = write_report(tmp_path, meta, rows)
    assert report["mean_task_success"] == 0.75
    assert json.loads((tmp_path / "results.json").read_text())["mean_task_success"] == 0.75
    table = (tmp_path / "report.md").read_text().splitlines()
    assert "| mean of task success rates (2 tasks weighted equally) | 10 | 0.75 |" in table[-1]
    # a task kept from a process on a 64-core machine: its timings are said to be that one's
    rows[1]["hardware"] = {**hw, "cpus": 64}
    write_report(tmp_path, meta, rows)
    page = (tmp_path / "report.md").read_text()
    assert "The timings (env steps/s, policy ms) of b were measured by an earlier" in page
    # LIBERO's episodes are its 50 initial states, which a checkpoint's selection ran too
    rows[0].update(simulator="libero", held_out=False)
    write_report(tmp_path, meta, rows)
    page = (tmp_path / "report.md").read_text()
    assert "Not held out: a. Their episodes are the ones a training run's evaluations" in page
    # 100 of 100, kept from a results file whose bound missed the rate by a rounding
    rows.append({**row("c", 100, 100), "success_ci95": [0.963, 0.9999999999999999]})
    assert write_report(tmp_path, meta, rows)["mean_task_success"] == 2.5 / 3
    assert (tmp_path / "success.png").stat().st_size > 0


def spec(space="joint_delta", size=64, privileged=None):
    from embodied.schema import ActionSpec, CameraSpec, EnvSpec, ObsSpec

    cameras = (CameraSpec("front", size, size),)
    obs = ObsSpec(cameras=cameras, state_names=("q",), privileged=privileged or {})
    action = ActionSpec(space=space, names=("j",), low=(-1.0,), high=(1.0,))
    return EnvSpec(obs, action, max_episode_steps=10)


def test_a_checkpoint_is_skipped_where_its_actions_mean_other_units_or_its_cameras_differ():
    """Same joint names in another action space (a delta policy on position control) or the
    same camera at another size: the task is skipped with the reason, not run."""
    from embodied.bench import SpecMismatch, _PolicySource

    source = _PolicySource.__new__(_PolicySource)
    source.loaded, source.spec = "the policy", spec()
    assert source.for_env(spec()) == "the policy"
    with pytest.raises(SpecMismatch, match="action space joint_delta -> joint_pos"):
        source.for_env(spec(space="joint_pos"))
    with pytest.raises(SpecMismatch, match=r"camera sizes \[\('front', 64, 64\)\] -> "):
        source.for_env(spec(size=128))


def test_a_checkpoint_needs_only_the_privileged_state_its_policy_reads():
    """A multi-task VLA trained beside tasks that gave obj_pose reads goal_pos only: a task
    without obj_pose was skipped ("privileged state ['obj_pose'] missing")."""
    from embodied.bench import SpecMismatch, _PolicySource

    class ReadsTheGoal:
        privileged_inputs = ("goal_pos",)

    source = _PolicySource.__new__(_PolicySource)
    source.loaded = ReadsTheGoal()
    source.spec = spec(privileged={"goal_pos": (3,), "obj_pose": (7,)})
    assert source.for_env(spec(privileged={"goal_pos": (3,)})) is source.loaded
    with pytest.raises(SpecMismatch, match=r"privileged state \['goal_pos'\] missing"):
        source.for_env(spec(privileged={"obj_pose": (7,), "goal_pos": (2,)}))
    source.loaded = "a policy that does not say"  # (every trained key, as before)
    with pytest.raises(SpecMismatch, match=r"privileged state \['obj_pose'\] missing"):
        source.for_env(spec(privileged={"goal_pos": (3,)}))


def test_a_multi_task_items_video_is_checked_by_the_rows_that_name_it(tmp_path):
    """Five tasks: the video shows (and names) the first four; the fifth row's None made every
    resume run the whole item again."""
    from embodied.bench import _have_videos

    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "item.mp4").write_bytes(b"mp4")
    rows = [{"task": f"item/{t}", "video": "videos/item.mp4"} for t in "abcd"]
    assert _have_videos([*rows, {"task": "item/e", "video": None}], tmp_path)
    assert not _have_videos([{**r, "video": None} for r in rows], tmp_path)  # (videos: false)
    assert not _have_videos([*rows, {"task": "x", "video": "videos/gone.mp4"}], tmp_path)


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f.txt").write_text("a file")
    path = suite(tmp_path, [{"env": REACH}], videos=False)
    assert main(["bench", str(path), "--policy", "zero", f"output_dir={tmp_path / 'f.txt'}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    where = tmp_path / "f.txt" / "t" / "zero"
    assert line == (
        f"embodied: error: output_dir: {where} is inside {tmp_path / 'f.txt'}, a file; "
        "give a directory for the report"
    )


def test_a_checkpoint_acts_on_its_runs_device_as_in_eval(monkeypatch, capsys, tmp_path):
    """A run trained with runner.device=cuda on a CPU simulator: the bench acted on the
    simulator's CPU (``embodied eval`` on cuda, so other kernels and other numbers); on a machine
    without the run's device, on the simulator's, said so. Baselines act on the simulator's."""
    from embodied.bench import BenchItem, _acts_on, _PolicySource, _task_key
    from embodied.train_config import RunnerConfig

    source = _PolicySource.__new__(_PolicySource)
    source.key = "checkpoint:run"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    source.acts_on = _acts_on(RunnerConfig(device="cuda:1"))
    assert source.device(torch.device("cpu")) == torch.device("cuda:1")
    cfg, _ = load_config(BenchConfig, suite(Path(tmp_path), [{"env": REACH}]))
    item = BenchItem("reach", MuJoCoConfig(), 4)
    on_cuda = _task_key(item, cfg, source)
    # a machine without cuda:1: the simulator's device, said once, and the task's key another
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    source.acts_on = _acts_on(RunnerConfig(device="cuda:1"))
    assert source.acts_on is None and source.device(torch.device("cpu")) == torch.device("cpu")
    assert capsys.readouterr().err.count("note: the run acted on runner.device=cuda:1") == 1
    assert _task_key(item, cfg, source) != on_cuda
    for device in ("auto", "cpu"):
        want = None if device == "auto" else torch.device("cpu")
        assert _acts_on(RunnerConfig(device=device)) == want
