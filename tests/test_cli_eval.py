"""``embodied eval``: each task of a multi-task checkpoint evaluated apart, and an eval.json that
says what produced it."""

import json
from dataclasses import replace

import pytest
from tiny_runs import TINY_REACH

from embodied.cli import main
from embodied.schema import reset_seeds

pytest.importorskip("mujoco")

HELD_OUT = 3_000_000_000


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A MuJoCo reach checkpoint (4 environments)."""
    root = tmp_path_factory.mktemp("cli_eval")
    train = ["train", "configs/mujoco/reach_ppo.yaml", f"runner.output_dir={root}", *TINY_REACH]
    assert main([*train, "runner.name=run"]) == 0
    return root / "run" / "last"


def test_eval_json_says_what_produced_it(checkpoint, capsys):
    argv = ["eval", str(checkpoint), "--episodes", "3", "--seed", "5", "--num-envs", "2"]
    assert main([*argv, "env.home_noise=0.05"]) == 0
    record = json.loads((checkpoint / "eval.json").read_text())
    made_from = record["made_from"]
    assert made_from["seed"] == 5 and made_from["first_reset_seed"] == HELD_OUT + 5
    assert made_from["held_out"] is True  # (LIBERO's are not: tests/test_libero.py)
    assert made_from["episodes"] == 3 and made_from["overrides"] == ["env.home_noise=0.05"]
    env = made_from["env"]
    assert (env["simulator"], env["backend"], env["task"]) == ("mujoco", "rollout", "reach")
    assert env["num_envs"] == 2 and env["home_noise"] == 0.05
    assert record["eval/episodes"] == 3 and "tasks" not in record  # one task
    assert made_from["checkpoint"] == str(checkpoint.resolve())  # (RUN/last: which iteration)
    assert json.loads(capsys.readouterr().out) == record


def test_a_checkpoint_whose_environment_changed_since_is_refused(checkpoint, tmp_path, capsys):
    """Without overrides too (only they were checked: a simulator that now orders its state
    otherwise, same sizes, was evaluated with the columns swapped)."""
    import shutil

    copy = tmp_path / "older"
    shutil.copytree(checkpoint.resolve(), copy)
    (copy / "eval.json").unlink(missing_ok=True)  # (the tests before evaluated it)
    meta = json.loads((copy / "meta.json").read_text())
    names = meta["spec"]["obs"]["state_names"]
    meta["spec"]["obs"]["state_names"] = names[::-1]
    (copy / "meta.json").write_text(json.dumps(meta))
    assert main(["eval", str(copy), "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert "the policy was trained with other inputs or actions than its environment gives" in err
    assert not (copy / "eval.json").exists()


def test_a_result_the_checkpoint_cannot_keep_is_printed_and_said(checkpoint, monkeypatch, capsys):
    """A run that trains on pruned the checkpoint while it was evaluated: the result was lost in
    a FileNotFoundError traceback (with --video, an iter_N of one video and eval.json was made)."""
    import shutil

    import embodied.cli_eval

    pruned = checkpoint.parent / "pruned"
    shutil.copytree(checkpoint.resolve(), pruned)
    evaluate = embodied.cli_eval._evaluate

    def then_pruned(*args):
        record = evaluate(*args)
        shutil.rmtree(pruned)  # (as --video's writer then made it again, holding the video)
        pruned.mkdir()
        (pruned / "eval_1.mp4").write_bytes(b"mp4")
        return record

    monkeypatch.setattr(embodied.cli_eval, "_evaluate", then_pruned)
    assert main(["eval", str(pruned), "--episodes", "1"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["eval/episodes"] == 1
    said = f"embodied: error: {pruned} is gone (its run pruned it?): the result above is not kept"
    assert out.err.strip().splitlines()[-1] == said and not pruned.exists()


def test_a_multi_task_checkpoint_runs_each_tasks_episodes(checkpoint, monkeypatch, capsys):
    """Two tasks of two rows each, ``--episodes 2``: pooled rows ran task a's rows only; each
    task now runs its 2 episodes, rows 0-1 and 2-3 both reset with the held-out seeds 3e9 + i,
    and the overall line is their mean."""
    import embodied.multitask
    from embodied.simulators.mujoco import make_env as make_mujoco

    resets = []

    class Logged(embodied.multitask.MultiTaskEnv):
        def reset(self, *, seed=None, env_ids=None):
            if env_ids is None:
                resets.append(reset_seeds(seed, range(self.num_envs)))
            return super().reset(seed=seed, env_ids=env_ids)

    def two_tasks(cfg):
        cfg = replace(cfg, num_envs=2)
        return Logged([make_mujoco(cfg), make_mujoco(cfg)], ["a", "b"])

    monkeypatch.setattr(embodied.multitask, "make_env", two_tasks)
    assert main(["eval", str(checkpoint), "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    record = json.loads((checkpoint / "eval.json").read_text())
    assert resets == [[HELD_OUT, HELD_OUT + 1, HELD_OUT, HELD_OUT + 1]]
    assert sorted(record["tasks"]) == ["a", "b"]
    assert [record["tasks"][t]["eval/episodes"] for t in "ab"] == [2, 2]
    assert record["eval/episodes"] == 4
    mean = sum(record["tasks"][t]["eval/success_rate"] for t in "ab") / 2
    assert record["eval/success_rate"] == pytest.approx(mean)
    lines = out[: out.index("{")].splitlines()
    assert [line.split(":")[0] for line in lines] == ["a", "b", "overall (mean over 2 tasks)"]


def test_weights_that_do_not_fit_their_policy_are_one_line(checkpoint, tmp_path, capsys):
    """A config that no longer builds the saved weights' policy (a file it names changed since),
    no overrides given: a RuntimeError traceback, as bench and demos said it in one line."""
    import shutil

    copy = tmp_path / "wider"
    shutil.copytree(checkpoint.resolve(), copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["config"]["policy"]["hidden_sizes"] = [24, 24]  # (the spec, as saved)
    (copy / "meta.json").write_text(json.dumps(meta))
    assert main(["eval", str(copy), "--episodes", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"embodied: error: {copy}: its weights do not fit its policy (")


def test_a_video_that_cannot_be_written_leaves_the_result(checkpoint, monkeypatch, capsys):
    """A full disk under --video: the OSError escaped before the result was printed (all its
    episodes lost); the result is printed and kept, the video said not written, none left."""
    import imageio.v2 as imageio

    def disk_full(path, *args, **kwargs):
        open(path, "wb").write(b"half a video")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(imageio, "mimwrite", disk_full)
    assert main(["eval", str(checkpoint), "--episodes", "1", "--video"]) == 0
    out = capsys.readouterr()
    record = json.loads(out.out)
    assert record["eval/episodes"] == 1 and "eval/video" not in record
    video = checkpoint.resolve() / "eval_1.mp4"
    assert out.err.strip().splitlines()[-1] == (
        f"note: video {video} not written (No space left on device)"
    )
    assert list(checkpoint.glob("eval_1*")) == []


def test_a_recorded_video_the_disk_refuses_is_said_and_leaves_no_file(tmp_path, capsys):
    """On Ray the driver writes the env worker's recording: a full disk there lost the final
    evaluation's result in an OSError, with half a video left."""
    from embodied.evaluate import write_recorded_video

    (tmp_path / "file").write_text("not a directory")
    refused = tmp_path / "file" / "final_eval.mp4"
    assert not write_recorded_video(refused, b"mp4 bytes")
    assert capsys.readouterr().err.startswith(f"note: video {refused} not written (")
    assert write_recorded_video(tmp_path / "videos" / "v.mp4", b"mp4 bytes")
    assert [p.name for p in (tmp_path / "videos").iterdir()] == ["v.mp4"]
