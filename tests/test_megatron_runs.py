"""The runner on the megatron backend: runs at TP=1 and TP=2 follow the torch run and resume at
any TP size or on torch, their updates replay bit for bit, a VLA on a Qwen2.5-VL, the discrete
head and bf16 train as on torch, and a rank's failure ends the run with its error."""

import pytest
import torch
from megatron_cases import assert_same_checkpoint, convert_cli, tiny_qwen2_5_vl

# --- the runner on the megatron backend ---------------------------------------------------------
E2E_POLICY = {"layers": 2}  # (over the tests' tiny VLA)


E2E_ITERATIONS = 3


def e2e_run(
    run_dir,
    trainer: dict | None,
    resume: str | None = None,
    *,
    policy: dict | None = None,
    iterations: int = E2E_ITERATIONS,
    save_every: int = 1,
) -> dict:
    """GRPO on the test task, one round per update, a checkpoint per iteration (``save_every``);
    ``policy`` over the tiny VLA's config."""
    from scripted_envs import GRPO, TINY_VLA, PushRightEnv, run_on

    torch.manual_seed(0)  # (as ``train`` seeds before it builds the roles)
    return run_on(
        PushRightEnv(8),
        run_dir,
        total_env_steps=8 * 3 * iterations,
        policy={**TINY_VLA, **E2E_POLICY, **(policy or {})},
        algorithm={**GRPO, "max_rounds": 1, "dynamic_sampling": False},
        save_every=save_every,
        trainer=trainer,
        resume=resume,
    )


def resume_copy(tmp_path, source: str, name: str, iteration: int = 2) -> str:
    """A copy of the run ``source`` as ``name``, its rows after ``iteration`` dropped (as
    ``train`` does when it resumes); the checkpoint of that iteration to resume from."""
    import shutil

    from embodied.resume import trim_metrics

    shutil.copytree(tmp_path / source, tmp_path / name, symlinks=True)
    trim_metrics(tmp_path / name, iteration)
    return str(tmp_path / name / "checkpoints" / f"iter_{iteration:06d}")


def e2e_child(rank: int, tmp_path) -> None:
    """In a process of their own (the backend makes this process a process group): the
    megatron run at TP=1, the run at TP=2 (its second rank a process the runner starts), and
    the TP=2 run resumed at TP=1 after iteration 2."""
    torch.set_num_threads(1)
    e2e_run(tmp_path / "megatron", {"backend": "megatron"})
    e2e_run(tmp_path / "megatron_tp2", {"backend": "megatron", "tensor_parallel": 2})
    again = resume_copy(tmp_path, "megatron_tp2", "tp2_then_tp1")
    e2e_run(tmp_path / "tp2_then_tp1", {"backend": "megatron"}, resume=again)


def metric_table(run_dir) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def assert_rows_close(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b):
        assert row_a.keys() == row_b.keys()
        for key in row_a:
            if key in ("minutes", "eval/policy_ms", "eval/env_steps_per_s"):
                continue
            assert row_a[key] == pytest.approx(row_b[key], rel=1e-5, abs=1e-6), key


def test_a_run_on_megatron_follows_the_torch_run_and_resumes_at_any_tp_or_on_torch(tmp_path):
    """GRPO on the tiny VLA, 3 iterations: every logged number of the megatron runs at TP=1
    and TP=2 equals the torch run's to 1e-5. Their checkpoints hold the fusion as one shard per
    TP rank, which loading joins into the torch layout: the weights and Adam's state equal the
    torch run's, the TP=2 run resumed after iteration 2 at TP=1, and the TP=1 run resumed on
    torch, run the third iteration the same again."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from embodied.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    e2e_run(tmp_path / "torch", None)
    torch.multiprocessing.spawn(e2e_child, args=(tmp_path,), nprocs=1)
    want = metric_table(tmp_path / "torch")
    assert len([r for r in want if "policy/loss" in r]) == E2E_ITERATIONS
    assert_rows_close(metric_table(tmp_path / "megatron"), want)
    # the checkpoint: the torch layout's weights and Adam state, as the torch run's
    saved = load_checkpoint(tmp_path / "megatron" / "checkpoints" / "iter_000002")
    reference = load_checkpoint(tmp_path / "torch" / "checkpoints" / "iter_000002")
    assert saved["model"].keys() == reference["model"].keys()
    for key, value in reference["model"].items():
        torch.testing.assert_close(saved["model"][key], value, rtol=1e-5, atol=1e-5)
    moments = saved["optimizer"]["state"]
    assert moments.keys() == reference["optimizer"]["state"].keys()
    for index, entry in reference["optimizer"]["state"].items():
        assert moments[index]["step"] == entry["step"] == 8  # 2 iterations of 2 x 2 minibatches
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(moments[index][key], entry[key], rtol=1e-4, atol=1e-8)
    # TP=2: the fusion in one file per rank, the rest whole; the same numbers once joined
    sharded = tmp_path / "megatron_tp2" / "checkpoints" / "iter_000002"
    assert sorted(p.name for p in sharded.glob("model*")) == [
        "model-tp00-of-02.safetensors",
        "model-tp01-of-02.safetensors",
        "model.safetensors",
    ]
    assert not [k for k in load_file(sharded / "model.safetensors") if k.startswith("fusion.")]
    joined = load_checkpoint(sharded)
    for key, value in saved["model"].items():
        torch.testing.assert_close(joined["model"][key], value, rtol=1e-5, atol=1e-6)
    # resumed at TP=1, and on torch, the same again
    again = resume_copy(tmp_path, "megatron", "again_torch")
    e2e_run(tmp_path / "again_torch", None, resume=again)
    for name in ("megatron_tp2", "tp2_then_tp1", "again_torch"):
        assert_rows_close(metric_table(tmp_path / name), want)


def records_child(rank: int, tmp_path) -> None:
    """In a process of its own: GRPO and PPO on megatron at TP=1 and TP=2, every iteration
    recorded, then the recorded updates replayed at their run's TP size (at TP=2 the second
    iteration's); by run and iteration, what differs (nothing, bit for bit) and how many
    metrics were compared, in replays.json."""
    import json

    from scripted_envs import GRPO, PPO, TINY_VLA, PushRightEnv, run_on

    from embodied.replay import differences, replay

    torch.set_num_threads(1)
    algorithms = {
        "grpo": ({**GRPO, "max_rounds": 1, "dynamic_sampling": False}, {}),
        "ppo": ({**PPO, "num_steps": 3}, {"value_head": True}),
    }
    found = {}
    # (bf16: GRPO at TP=1; its record keeps the float32 main weights the update goes on from)
    runs = [(name, tp, "fp32") for name in algorithms for tp in (1, 2)] + [("grpo", 1, "bf16")]
    for name, tp, precision in runs:
        algorithm, policy = algorithms[name]
        run_dir = tmp_path / f"{name}_tp{tp}{'_bf16' * (precision == 'bf16')}"
        torch.manual_seed(0)
        run_on(
            PushRightEnv(8),
            run_dir,
            total_env_steps=8 * 3 * 2,
            policy={**TINY_VLA, **E2E_POLICY, **policy},
            algorithm=algorithm,
            trainer={"backend": "megatron", "tensor_parallel": tp, "precision": precision},
            record_rollouts=1,
        )
        if precision == "bf16":  # (its config as a GPU run's says it: auto, bf16 there)
            for record_json in run_dir.glob("rollouts/*/record.json"):
                meta = json.loads(record_json.read_text())
                meta["config"]["trainer"]["precision"] = "auto"
                record_json.write_text(json.dumps(meta))
        # (a TP=2 replay starts its helper rank, 10 s: its second iteration, whose record
        # holds Adam's moments, is the harder case)
        for iteration in (1, 2) if tp == 1 else (2,):
            record, metrics, digest = replay(run_dir, iteration)
            weights = (record.meta["digest_after"], digest)
            differ = differences(record.meta["metrics"], metrics, 0.0, weights)
            found[f"{run_dir.name}_{iteration}"] = {"differ": differ, "metrics": len(metrics)}
    (tmp_path / "replays.json").write_text(json.dumps(found))


@pytest.mark.slow  # (48-65 s; the torch backend's replay, test_recording.py, is in the suite)
def test_megatron_updates_replay_bit_for_bit_from_their_records_at_tp_1_and_2(tmp_path):
    """record -> replay on the megatron backend (PPO and GRPO, TP=1 and TP=2, CPU; GRPO in bf16
    at TP=1, from the float32 main weights its records keep, its config's precision "auto" as a
    GPU run's: the replay on the CPU ran it in float32): the
    losses, KL, clip fraction, gradient norm and the weights after the update as the run's. A
    TP=2 record holds the whole state in the torch layout, the fusion's Adam moments gathered
    from both ranks: they equal the TP=1 run's."""
    pytest.importorskip("megatron.core")
    import json

    from embodied.recording import read_record

    torch.multiprocessing.spawn(records_child, args=(tmp_path,), nprocs=1)
    found = json.loads((tmp_path / "replays.json").read_text())
    fp32 = [f"{a}_tp{tp}_{i}" for a in ("grpo", "ppo") for tp, i in ((1, 1), (1, 2), (2, 2))]
    assert sorted(found) == sorted([*fp32, "grpo_tp1_bf16_1", "grpo_tp1_bf16_2"])
    assert all(r["differ"] == [] and r["metrics"] >= 7 for r in found.values()), found
    whole = read_record(tmp_path / "grpo_tp1", 2)
    sharded = read_record(tmp_path / "grpo_tp2", 2)
    assert whole.main_weights == {}
    mains = read_record(tmp_path / "grpo_tp1_bf16", 2).main_weights
    assert mains and {k.split(".")[0] for k in mains} == {"fusion"}
    assert any(k.startswith("fusion.") for k in sharded.model)
    assert sharded.model.keys() == whole.model.keys()
    state = sharded.optimizer["state"]
    assert state.keys() == whole.optimizer["state"].keys() and len(state) > 0
    for index, entry in whole.optimizer["state"].items():
        assert state[index]["step"] == entry["step"] == 4  # 1 iteration of 2 epochs x 2 minibatches
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[index][key].shape == entry[key].shape
            torch.testing.assert_close(state[index][key], entry[key], rtol=1e-4, atol=1e-8)


def vlm_e2e_child(rank: int, tmp_path) -> None:
    """The VLA on a Qwen2.5-VL, trained and frozen, at TP=2; the trained run resumed at TP=1."""
    torch.set_num_threads(1)
    for frozen in (False, True):
        policy = {"vlm_path": str(tmp_path / "vlm"), "freeze_vlm": frozen}
        trainer = {"backend": "megatron", "tensor_parallel": 2}
        e2e_run(tmp_path / f"megatron{frozen}", trainer, policy=policy, iterations=2)
    again = resume_copy(tmp_path, "megatronFalse", "again", iteration=1)
    policy = {"vlm_path": str(tmp_path / "vlm"), "freeze_vlm": False}
    e2e_run(tmp_path / "again", {"backend": "megatron"}, again, policy=policy, iterations=2)


@pytest.mark.slow  # (31 s; the update's parity with the language model sharded is in the suite)
def test_a_vla_on_a_qwen2_5_vl_trains_on_megatron_as_on_torch(tmp_path):
    """GRPO of the VLA on a tiny Qwen2.5-VL, 2 iterations at TP=2, its VLM trained and frozen:
    every logged number equals the torch run's to 1e-5. Trained, the checkpoint's shard files
    hold the fusion and the language model (model.safetensors neither); frozen, the language
    model is saved whole with the frozen weights. Joined, the weights equal the torch run's; the
    trained run resumed at TP=1 after iteration 1 gives iteration 2 again."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from embodied.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    tiny_qwen2_5_vl(tmp_path / "vlm")
    for frozen in (False, True):
        policy = {"vlm_path": str(tmp_path / "vlm"), "freeze_vlm": frozen}
        e2e_run(tmp_path / f"torch{frozen}", None, policy=policy, iterations=2)
    torch.multiprocessing.spawn(vlm_e2e_child, args=(tmp_path,), nprocs=1)
    for frozen in (False, True):
        want = metric_table(tmp_path / f"torch{frozen}")
        assert_rows_close(metric_table(tmp_path / f"megatron{frozen}"), want)
        last = tmp_path / f"megatron{frozen}" / "checkpoints" / "iter_000002"
        shard = load_file(last / "model-tp01-of-02.safetensors")
        text = "weight/vlm.model.language_model/decoder.layers.1.mlp.linear_fc2.weight"
        assert (text in shard) == (not frozen)
        assert "weight/fusion/layers.1.mlp.linear_fc2.weight" in shard
        whole = load_file(last / "model.safetensors")
        assert not [k for k in whole if k.startswith(("fusion.", "vlm.model.language_model."))]
        saved = load_checkpoint(last)["model"]
        reference = load_checkpoint(tmp_path / f"torch{frozen}" / "last")["model"]
        assert saved.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-5)
    assert_rows_close(metric_table(tmp_path / "again"), metric_table(tmp_path / "torchFalse"))


def discrete_e2e_child(rank: int, tmp_path) -> None:
    """The VLA with the discrete head at TP=2, and resumed at TP=1 after iteration 1."""
    torch.set_num_threads(1)
    policy = {"head": "discrete"}
    trainer = {"backend": "megatron", "tensor_parallel": 2}
    e2e_run(tmp_path / "megatron", trainer, policy=policy, iterations=2)
    again = resume_copy(tmp_path, "megatron", "again", iteration=1)
    e2e_run(tmp_path / "again", {"backend": "megatron"}, again, policy=policy, iterations=2)


@pytest.mark.slow  # (19 s; the discrete head's update parity is in the suite)
def test_a_vla_with_the_discrete_head_trains_on_megatron_as_on_torch(tmp_path):
    """GRPO of the VLA with the discrete head, 2 iterations at TP=2: every logged number equals
    the torch run's to 1e-5; each rank's shard file holds half of every dimension's bins, and
    joined, the weights equal the torch run's; resumed at TP=1 after iteration 1, iteration 2
    again."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from embodied.checkpoint import load_checkpoint
    from embodied.convert import ConvertError, _check_module_split

    torch.set_num_threads(1)
    e2e_run(tmp_path / "torch", None, policy={"head": "discrete"}, iterations=2)
    torch.multiprocessing.spawn(discrete_e2e_child, args=(tmp_path,), nprocs=1)
    want = metric_table(tmp_path / "torch")
    assert_rows_close(metric_table(tmp_path / "megatron"), want)
    last = tmp_path / "megatron" / "checkpoints" / "iter_000002"
    reference = load_checkpoint(tmp_path / "torch" / "last")["model"]
    whole = reference["head.logits.weight"]  # [2 dimensions x 256 bins, d]
    shard = load_file(last / "model-tp01-of-02.safetensors")["weight/head/logits.weight"]
    assert shard.shape == (2 * 128, whole.shape[1])
    torch.testing.assert_close(shard[:128], whole[128:256], rtol=1e-5, atol=1e-5)
    assert not [k for k in load_file(last / "model.safetensors") if k.startswith("head.")]
    saved = load_checkpoint(last)["model"]
    assert saved.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-5)
    assert_rows_close(metric_table(tmp_path / "again"), want)
    # the torch run's checkpoint -> TP=2 shards: the run's files' layout; joined, bit-exact
    source = tmp_path / "torch" / "last"
    assert convert_cli(source, "--to", "megatron", "--tensor-parallel", 2, tmp_path / "mg")[0] == 0
    converted = load_file(tmp_path / "mg" / "model-tp01-of-02.safetensors")
    torch.testing.assert_close(converted["weight/head/logits.weight"][:128], whole[128:256])
    assert_same_checkpoint(load_checkpoint(tmp_path / "mg"), load_checkpoint(source))
    # (the fusion's 2 heads split over no TP size that 256 bins do not: the check alone)
    head = {"module": "head", "layout": "discrete_head", "actions": 2, "bins": 256}
    with pytest.raises(ConvertError, match="^--tensor-parallel 3: the discrete head's 256 bins"):
        _check_module_split(head, 3, {})


def bf16_e2e_child(rank: int, tmp_path) -> None:
    """A bf16 run at TP=2, and the same resumed at TP=2 after iteration 1."""
    torch.set_num_threads(1)
    trainer = {"backend": "megatron", "tensor_parallel": 2, "precision": "bf16"}
    e2e_run(tmp_path / "bf16", trainer, iterations=2)
    again = resume_copy(tmp_path, "bf16", "again", iteration=1)
    e2e_run(tmp_path / "again", trainer, again, iterations=2)


@pytest.mark.slow  # (22 s; bf16's update is in the suite)
def test_a_bf16_run_saves_what_acted_and_its_main_weights_and_resumes_to_the_same_numbers(
    tmp_path,
):
    """`trainer.precision=bf16` at TP=2: the shard files hold the weights that acted (bf16's,
    as float32: what an evaluation loads) and the float32 main weights (not bf16-representable)
    beside them, and the run resumed after iteration 1 logs iteration 2 again to 1e-5: the main
    weights come back exact (resumed from their bf16 rounding, it would not)."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from embodied.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    torch.multiprocessing.spawn(bf16_e2e_child, args=(tmp_path,), nprocs=1)
    last = tmp_path / "bf16" / "checkpoints" / "iter_000002"
    shard = load_file(last / "model-tp01-of-02.safetensors")
    name = "fusion/layers.0.self_attention.linear_qkv.weight"
    acted, main = shard[f"weight/{name}"], shard[f"main/{name}"]
    assert acted.dtype == main.dtype == torch.float32
    assert torch.equal(acted, main.to(torch.bfloat16).float())
    assert (main != acted).float().mean() > 0.9
    assert "main_weights" not in load_checkpoint(last, with_trainer_state=False)
    mains = load_checkpoint(last)["main_weights"]
    assert {key.split(".")[0] for key in mains} == {"fusion"}
    # converted to the torch layout, the main weights stay with the trainer state
    assert convert_cli(last, "--to", "torch", tmp_path / "converted")[0] == 0
    converted = load_checkpoint(tmp_path / "converted")
    assert converted["main_weights"].keys() == mains.keys()
    assert all(torch.equal(converted["main_weights"][k], v) for k, v in mains.items())
    assert_rows_close(metric_table(tmp_path / "again"), metric_table(tmp_path / "bf16"))


def failing_child(rank: int, tmp_path) -> None:
    """A TP=2 run whose rank 0 fails inside its second update, while its helper rank waits in
    a collective; writes the error it ended with and how many child processes are left."""
    torch.set_num_threads(1)
    import multiprocessing

    from embodied.grpo import GRPO

    calls = []
    loss = GRPO.loss

    def failing(self, learner, minibatch):
        calls.append(1)
        if len(calls) == 5:  # (4 minibatch steps an update)
            raise RuntimeError("rank 0 fails")
        return loss(self, learner, minibatch)

    GRPO.loss = failing
    try:
        e2e_run(tmp_path / "fails", {"backend": "megatron", "tensor_parallel": 2})
    except RuntimeError as error:
        (tmp_path / "fails" / "error.txt").write_text(str(error))
    finally:
        GRPO.loss = loss
    (tmp_path / "fails" / "left.txt").write_text(str(len(multiprocessing.active_children())))


def helper_killed_in_a_run(rank: int, tmp_path) -> None:
    """A TP=2 run (no checkpoint but the last's) whose helper rank is SIGKILLed as its second
    round is added; writes the error the run ended with and how many processes are left."""
    torch.set_num_threads(1)
    import multiprocessing
    import os
    import signal

    from embodied.megatron import RankLost
    from embodied.megatron.lockstep import Lockstep

    add_round = Lockstep.add_round
    calls = []

    def killing(self, batch):
        calls.append(1)
        if len(calls) == 2:
            (helper, _) = self.helpers[0]
            os.kill(helper.pid, signal.SIGKILL)
            helper.join()
        return add_round(self, batch)

    Lockstep.add_round = killing
    try:
        trainer = {"backend": "megatron", "tensor_parallel": 2}
        e2e_run(tmp_path / "run", trainer, save_every=0)  # (iteration 1 unsaved at the loss)
    except RankLost as error:
        (tmp_path / "error.txt").write_text(str(error))
    finally:
        Lockstep.add_round = add_round
    (tmp_path / "left.txt").write_text(str(len(multiprocessing.active_children())))


@pytest.mark.slow  # (a failure path, as the ones below)
def test_a_helper_rank_killed_while_a_round_is_added_ends_the_run_naming_it(tmp_path):
    """The runner keeps the last completed iteration when a round fails, unless nothing can be
    saved: with a TP rank gone, its shard cannot be, and the run ends with the rank's line (it
    ended with a broken pipe's 'checkpoint not written' as it tried to save iteration 1)."""
    pytest.importorskip("megatron.core")
    torch.multiprocessing.spawn(helper_killed_in_a_run, args=(tmp_path,), nprocs=1)
    error = (tmp_path / "error.txt").read_text()
    assert error.startswith("TP rank 1 (pid ") and error.endswith("code -9 during add_round")
    assert (tmp_path / "left.txt").read_text() == "0"
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not [p for p in checkpoints.iterdir() if p.is_dir()]


@pytest.mark.slow  # (13 s: the failure path; the parity runs above are in the default suite)
def test_a_tp2_run_that_fails_on_rank_0_ends_with_its_error_and_no_rank_left(tmp_path):
    pytest.importorskip("megatron.core")
    torch.multiprocessing.spawn(failing_child, args=(tmp_path,), nprocs=1)
    assert (tmp_path / "fails" / "error.txt").read_text() == "rank 0 fails"
    assert (tmp_path / "fails" / "left.txt").read_text() == "0"


@pytest.mark.slow  # (17 s: a failure path, as the one above)
def test_a_helper_rank_that_cannot_write_its_shard_fails_the_save_as_a_full_disk(tmp_path):
    """TP=2 (rank 1 a helper process): rank 1's shard write fails (no space). The save ends
    with CheckpointWriteError's line, rank 1's error in it and what stands (a BrokenPipeError
    from a second save hid it); nothing is half-written and no process is left."""
    pytest.importorskip("megatron.core")
    from megatron_resume import shard_write_fails

    torch.multiprocessing.spawn(shard_write_fails, args=(tmp_path,), nprocs=1)
    error = (tmp_path / "error.txt").read_text()
    assert error.startswith(f"checkpoint {tmp_path}/run/checkpoints/iter_000001 not written ")
    assert "(TP rank 1: OSError: [Errno 28] No space left on device; " in error
    assert error.endswith("MiB free there); no checkpoint was saved")
    assert [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir()] == []
    assert (tmp_path / "left.txt").read_text() == "0"


@pytest.mark.slow  # (a failure path, as the ones above)
@pytest.mark.parametrize("how", ["killed", "bad_batch"])
def test_a_helper_rank_lost_between_two_steps_is_one_line_naming_it(tmp_path, how):
    """TP=2: rank 1's process SIGKILLed (the OOM killer, say) between two SFT steps, or ended by
    an error every rank meets (a batch of another action size): the next step ends with one
    line naming the rank, its process and how it ended (a BrokenPipeError or gloo's error from
    inside torch before), with rank 0's own error where the helper's was its own, and no
    process is left."""
    pytest.importorskip("megatron.core")
    from megatron_resume import helper_killed

    torch.multiprocessing.spawn(helper_killed, args=(tmp_path, how), nprocs=1)
    error, pid = (tmp_path / "error.txt").read_text().split(" / ")
    if how == "killed":
        assert error == f"TP rank 1 (pid {pid}) exited with code -9 during bc_step"
    else:
        assert error.startswith(f"TP rank 1 (pid {pid}) exited with code 1 during bc_step; ")
        assert "rank 0: RuntimeError: " in error and "\n" not in error
    assert (tmp_path / "left.txt").read_text() == "0"


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_backend_without_megatron_core_installed_is_one_line(
    command, tmp_path, monkeypatch, capsys
):
    """An extra like Ray or Warp: its absence names the install, before any run directory (it
    was a ModuleNotFoundError traceback, SFT's after the run directory was made)."""
    import sys

    from one_line import one_line_error, run_cli

    config = {
        "train": "configs/maniskill/multitask_vla_grpo.yaml",
        "sft": "configs/maniskill/multitask_vla_sft.yaml",
    }[command]
    monkeypatch.setitem(sys.modules, "megatron", None)  # (as where it is not installed)
    argv = [command, config, "trainer.backend=megatron", f"runner.output_dir={tmp_path}"]
    argv += ["runner.init_from=null"] if command == "train" else []  # (no SFT run to start from)
    rc, err = run_cli(argv, capsys)
    one_line_error(rc, err, "trainer.backend", "pip install 'embodied[megatron]'")
    assert not any(tmp_path.iterdir())
