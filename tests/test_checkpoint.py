"""Checkpoints: a round trip keeps every tensor; frozen weights are stored once and shared;
retention keeps the newest N plus the best; a crash at any point leaves ``last`` at a complete
checkpoint; checkpoints from before the frozen file still load."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from embodied import checkpoint as ck
from embodied import frozen_weights
from embodied.checkpoint import (
    best_iteration,
    load_checkpoint,
    mark_best,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from embodied.deploy_policy import contract
from embodied.schema import ActionSpec, EnvSpec, ObsSpec


class Net(nn.Module):
    """A frozen encoder with a BatchNorm, a trainable head and observation statistics."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 512), nn.BatchNorm1d(512), nn.ReLU())
        self.head = nn.Linear(512, 4)
        self.register_buffer("obs_mean", torch.zeros(64))
        self.encoder.requires_grad_(False)

    def forward(self, x):
        return self.head(self.encoder(x - self.obs_mean))


FROZEN = {
    "encoder.0.weight",
    "encoder.0.bias",
    "encoder.1.weight",
    "encoder.1.bias",
    "encoder.1.running_mean",
    "encoder.1.running_var",
    "encoder.1.num_batches_tracked",
}


def make(seed: int = 0):
    torch.manual_seed(seed)
    net = Net()
    net.encoder.train()
    with torch.no_grad():  # BatchNorm statistics that are not the initial ones
        net.encoder(torch.randn(32, 64))
    net.obs_mean.fill_(0.5)
    net.encoder.eval()
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    step(net, opt)
    return net, opt


def step(net, opt):
    opt.zero_grad()
    net(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()


def save(run, iteration, net, opt=None, **kw):
    counters = {"iteration": iteration}
    meta = {"note": "test"}
    return save_checkpoint(
        run, iteration, model=net, optimizer=opt, counters=counters, meta=meta, **kw
    )


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def state(net) -> dict:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def iter_dirs(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("iter_"))


def frozen_files(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("frozen-*"))


def hidden(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob(".*")) + [
        p.name for p in run.glob(".*")
    ]


def test_round_trip_keeps_every_tensor_and_the_trainer_state(tmp_path):
    net, opt = make()
    ckpt = save(tmp_path, 3, net, opt)
    assert ckpt == tmp_path / "checkpoints" / "iter_000003"
    loaded = load_checkpoint(tmp_path)
    assert loaded["path"] == ckpt.resolve() and loaded["counters"] == {"iteration": 3}
    assert loaded["meta"] == {"note": "test", "frozen": frozen_files(tmp_path)[0]}
    assert same_tensors(loaded["model"], state(net))
    fresh, fresh_opt = make(seed=1)
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optimizer"])
    assert same_tensors(state(fresh), state(net))
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x), net.eval()(x))
    a, b = fresh_opt.state_dict()["state"], opt.state_dict()["state"]
    assert a.keys() == b.keys() and all(same_tensors(a[i], b[i]) for i in a)
    assert (tmp_path / "last").resolve() == ckpt.resolve()
    assert load_checkpoint(ckpt, with_trainer_state=False).keys() == {"path", "meta", "model"}


def test_a_gpu_runs_trainer_state_resumes_on_a_machine_without_one(tmp_path, monkeypatch):
    """A run trained on a GPU saves its optimizer's moments as CUDA tensors; resumed on a CPU
    they load there (the optimizer moves them to its weights' device), not "damaged"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (a machine without one)
    net, opt = make()
    with monkeypatch.context() as patched:  # every tensor tagged as a GPU's, as torch.save does
        patched.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        ckpt = save(tmp_path, 3, net, opt)
    with pytest.raises(RuntimeError, match="CUDA"):  # (the file holds what the GPU's would)
        torch.load(ckpt / ck.STATE, weights_only=False)
    loaded = load_checkpoint(tmp_path)
    fresh, fresh_opt = make(seed=1)
    fresh_opt.load_state_dict(loaded["optimizer"])
    a, b = fresh_opt.state_dict()["state"], opt.state_dict()["state"]
    assert a.keys() == b.keys() and all(same_tensors(a[i], b[i]) for i in a)


def test_frozen_weights_are_written_once_and_hashed_once(tmp_path, monkeypatch):
    hashed = []
    digest = frozen_weights._digest
    monkeypatch.setattr(frozen_weights, "_digest", lambda t: hashed.append(1) or digest(t))
    net, opt = make()
    save(tmp_path, 1, net, opt)
    [name] = frozen_files(tmp_path)
    frozen = tmp_path / "checkpoints" / name
    before = frozen.stat()
    step(net, opt)  # the head changes, the encoder does not
    save(tmp_path, 2, net, opt)
    after = frozen.stat()
    assert frozen_files(tmp_path) == [name] and len(hashed) == 1
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    with safe_open(frozen, "pt") as f:
        assert set(f.keys()) == FROZEN
    for it in ("iter_000001", "iter_000002"):
        model = tmp_path / "checkpoints" / it / "model.safetensors"
        with safe_open(model, "pt") as f:
            assert set(f.keys()) == {"head.weight", "head.bias", "obs_mean"}
        assert model.stat().st_size * 10 < after.st_size
        meta = json.loads((tmp_path / "checkpoints" / it / "meta.json").read_text())
        assert meta["frozen"] == name
    assert same_tensors(load_checkpoint(tmp_path)["model"], state(net))
    with torch.no_grad():  # an in-place change counts up the version: hashed again
        net.encoder[0].weight.mul_(2)
    save(tmp_path, 3, net, opt)
    assert len(hashed) == 2 and len(frozen_files(tmp_path)) == 2
    assert same_tensors(load_checkpoint(tmp_path)["model"], state(net))


def test_keep_two_leaves_the_newest_two_the_best_and_the_protected(tmp_path):
    net, opt = make()
    assert best_iteration(tmp_path) is None
    for it in range(1, 6):
        step(net, opt)
        save(tmp_path, it, net, opt, keep=2)
        if it == 2:
            mark_best(tmp_path, 2)
    assert iter_dirs(tmp_path) == ["iter_000002", "iter_000004", "iter_000005"]
    assert best_iteration(tmp_path) == 2 and load_checkpoint(tmp_path / "best")["counters"] == {
        "iteration": 2
    }
    save(tmp_path, 6, net, opt, keep=2, protect=(4,))
    assert iter_dirs(tmp_path) == ["iter_000002", "iter_000004", "iter_000005", "iter_000006"]
    save(tmp_path, 7, net, opt, keep=1)
    assert iter_dirs(tmp_path) == ["iter_000002", "iter_000007"]
    assert len(frozen_files(tmp_path)) == 1 and hidden(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="iter_000003"):
        mark_best(tmp_path, 3)
    with pytest.raises(ValueError, match="keep"):
        save(tmp_path, 8, net, opt, keep=0)


def test_a_frozen_file_no_checkpoint_uses_is_deleted(tmp_path):
    net, opt = make()
    save(tmp_path, 1, net, opt, keep=2)
    save(tmp_path, 2, net, opt, keep=2)
    [first] = frozen_files(tmp_path)
    with torch.no_grad():  # other frozen weights: a second file, the first still in use
        net.encoder[0].bias.add_(1)
    save(tmp_path, 3, net, opt, keep=2)
    [second] = set(frozen_files(tmp_path)) - {first}
    save(tmp_path, 4, net, opt, keep=2)  # iter 2 goes, and with it the last use of the first
    assert frozen_files(tmp_path) == [second]
    net.encoder.requires_grad_(True)  # nothing frozen: everything in model.safetensors
    save(tmp_path, 5, net, opt, keep=2)
    assert json.loads((tmp_path / "last" / "meta.json").read_text())["frozen"] is None
    with safe_open(tmp_path / "last" / "model.safetensors", "pt") as f:
        assert set(f.keys()) >= FROZEN
    save(tmp_path, 6, net, opt, keep=2)
    assert frozen_files(tmp_path) == [] and iter_dirs(tmp_path) == ["iter_000005", "iter_000006"]
    assert same_tensors(load_checkpoint(tmp_path)["model"], state(net))


def test_saving_an_iteration_again_replaces_it(tmp_path):
    net, opt = make()
    save(tmp_path, 1, net, opt)
    save(tmp_path, 2, net, opt)
    mark_best(tmp_path, 2)
    step(net, opt)
    with torch.no_grad():
        net.encoder[0].weight.add_(1)
    save(tmp_path, 2, net, opt, keep=1)  # after resuming from 1: both links point at iter 2
    assert iter_dirs(tmp_path) == ["iter_000002"] and hidden(tmp_path) == []
    assert len(frozen_files(tmp_path)) == 1
    for link in ("last", "best"):
        assert (tmp_path / link).resolve() == (tmp_path / "checkpoints" / "iter_000002").resolve()
        assert same_tensors(load_checkpoint(tmp_path / link)["model"], state(net))


@pytest.mark.parametrize("again", [False, True], ids=["next", "same"])
def test_a_crash_at_any_point_leaves_last_at_a_complete_checkpoint(tmp_path, monkeypatch, again):
    """Each os.replace of a save fails in turn (then a write): ``last`` and ``best`` still load,
    each the checkpoint before or the one being saved, never a mix; the next save tidies up."""
    real_replace = os.replace
    failures = 0
    for fail_at in range(1, 100):
        run = tmp_path / str(fail_at)
        net, opt = make()
        save(run, 1, net, opt)
        mark_best(run, 1)
        before = state(net)
        step(net, opt)
        with torch.no_grad():  # new frozen weights too: a new frozen file
            net.encoder[0].weight.add_(1)
        after = state(net)
        calls = []

        def replace(src, dst, calls=calls, fail_at=fail_at):
            calls.append(dst)
            if len(calls) == fail_at:
                raise OSError("disk gone")
            return real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        try:
            save(run, 1 if again else 2, net, opt)
        except OSError:
            failures += 1
        else:
            break
        finally:
            monkeypatch.setattr(os, "replace", real_replace)
        for link in ("last", "best"):
            model = load_checkpoint(run / link)["model"]
            assert same_tensors(model, before) or same_tensors(model, after), (fail_at, link)
        save(run, 3, net, opt)  # the next save goes through and leaves nothing behind
        for it in (1, 3):  # an iteration renamed aside and not back is back
            model = load_checkpoint(run / "checkpoints" / f"iter_{it:06d}")["model"]
            assert same_tensors(model, before) or same_tensors(model, after), (fail_at, it)
        mark_best(run, 3)
        save(run, 4, net, opt, keep=1)
        assert hidden(run) == [] and iter_dirs(run)[-2:] == ["iter_000003", "iter_000004"]
        assert same_tensors(load_checkpoint(run)["model"], after)
    assert failures >= (6 if again else 3)
    assert same_tensors(load_checkpoint(run)["model"], after)


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    net, opt = make()
    save(tmp_path, 1, net, opt)
    before = state(net)
    step(net, opt)

    def half_written(tensors, path, **kw):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError("disk full")

    def fails(*args, **kw):
        raise OSError("disk full")

    for module, name, broken in ((ck, "save_file", half_written), (torch, "save", fails)):
        with monkeypatch.context() as m:
            m.setattr(module, name, broken)
            with pytest.raises(OSError, match="disk full"):
                save(tmp_path, 2, net, opt)
        assert same_tensors(load_checkpoint(tmp_path / "last")["model"], before)
    save(tmp_path, 2, net, opt)
    assert same_tensors(load_checkpoint(tmp_path)["model"], state(net)) and hidden(tmp_path) == []


def test_a_checkpoint_from_before_the_frozen_file_loads(tmp_path):
    net, opt = make()
    old = tmp_path / "checkpoints" / "iter_000001"
    old.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state(net).items()}, str(old / "model.safetensors"))
    torch.save(
        {"optimizer": opt.state_dict(), "rng": rng_state(), "counters": {}}, old / "trainer.pt"
    )
    (old / "meta.json").write_text(json.dumps({"note": "old"}))
    os.symlink("checkpoints/iter_000001", tmp_path / "last")
    loaded = load_checkpoint(tmp_path)
    assert same_tensors(loaded["model"], state(net)) and loaded["meta"] == {"note": "old"}
    save(tmp_path, 2, net, opt)  # a new save beside it leaves it alone
    assert same_tensors(load_checkpoint(old)["model"], state(net))
    save(tmp_path, 3, net, opt, keep=1)
    assert iter_dirs(tmp_path) == ["iter_000003"] and len(frozen_files(tmp_path)) == 1


def test_a_missing_frozen_file_is_named(tmp_path):
    net, _ = make()
    save(tmp_path, 1, net)
    [name] = frozen_files(tmp_path)
    (tmp_path / "checkpoints" / name).unlink()
    with pytest.raises(FileNotFoundError, match=name):
        load_checkpoint(tmp_path)


def test_the_given_rng_state_is_saved(tmp_path):
    net, _ = make()
    snapshot = rng_state()
    expected = (torch.rand(3), np.random.rand(3))
    save(tmp_path, 1, net, rng=snapshot)  # the RNGs have moved on since the snapshot
    set_rng_state(load_checkpoint(tmp_path)["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and np.array_equal(
        np.random.rand(3), expected[1]
    )
    save(tmp_path, 2, net)  # without rng=: the state at the time of the save
    now = (torch.rand(3), np.random.rand(3))
    set_rng_state(load_checkpoint(tmp_path)["rng"])
    assert torch.equal(torch.rand(3), now[0]) and np.array_equal(np.random.rand(3), now[1])


def test_the_deploy_contract_covers_the_frozen_weights(tmp_path):
    spec = EnvSpec(
        obs=ObsSpec(state_names=("q",)),
        action=ActionSpec(space="joint_pos", names=("j",), low=(-1.0,), high=(1.0,)),
        max_episode_steps=5,
    )
    net, _ = make()
    a = save(tmp_path / "a", 1, net)
    b = save(tmp_path / "b", 1, net)
    with torch.no_grad():  # the same trainable weights, other frozen ones
        net.encoder[1].running_var.add_(1)
    c = save(tmp_path / "c", 1, net)
    assert (a / "model.safetensors").read_bytes() == (c / "model.safetensors").read_bytes()
    digests = [contract(spec, p)["weights"] for p in (a, b, c)]
    assert digests[0] == digests[1] != digests[2]


def test_dropping_the_checkpoints_after_an_iteration_and_pointing_the_best(tmp_path):
    # a run resumed from iteration 2 abandons 3-5: the best (4) goes with them, last points at 2
    net, opt = make()
    for it in range(1, 6):
        step(net, opt)
        save(tmp_path, it, net, opt, keep=5)
    mark_best(tmp_path, 4)
    dropped = ck.drop_checkpoints_after(tmp_path, 2)
    assert dropped == ["iter_000003", "iter_000004", "iter_000005"]
    assert iter_dirs(tmp_path) == ["iter_000001", "iter_000002"]
    assert best_iteration(tmp_path) is None
    assert load_checkpoint(tmp_path)["counters"] == {"iteration": 2}
    assert len(frozen_files(tmp_path)) == 1 and hidden(tmp_path) == []
    # nothing later: nothing changes; a best at or before the iteration stays
    mark_best(tmp_path, 1)
    assert ck.drop_checkpoints_after(tmp_path, 2) == []
    assert best_iteration(tmp_path) == 1
    assert ck.drop_checkpoints_after(tmp_path / "no_run", 2) == []
    # a resume takes its checkpoint's best: another one, none, or one whose checkpoint is gone
    ck.point_best(tmp_path, 2)
    assert best_iteration(tmp_path) == 2
    ck.point_best(tmp_path, None)
    assert best_iteration(tmp_path) is None and not (tmp_path / "best").is_symlink()
    ck.point_best(tmp_path, 1)
    ck.point_best(tmp_path, 4)
    assert best_iteration(tmp_path) is None and not (tmp_path / "best").is_symlink()


def test_trim_metrics_drops_rows_past_the_checkpoint_and_an_unsaved_evaluation(tmp_path):
    """Rows of iterations 1-3, the checkpoint at 2, and iteration 1's evaluation (beside
    training) logged but in no checkpoint: its row goes, so that its re-run logs it once."""

    from embodied.resume import trim_metrics

    rows = [
        {"iteration": 0, "eval/success_rate": 0.1},  # before RL
        {"iteration": 1, "policy/loss": 0.5},
        {"iteration": 2, "policy/loss": 0.4},
        {"iteration": 1, "eval/success_rate": 0.3},  # logged at its iteration, later
        {"iteration": 1, "eval/a/success_rate": 0.3},
        {"iteration": 3, "policy/loss": 0.3},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    trim_metrics(tmp_path, 2, evaluated=1)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == rows[:3]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    trim_metrics(tmp_path, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:5]
    # a row cut by a crash (a killed run's last write) goes too
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"iteration": 4, "pol')
    trim_metrics(tmp_path, 3)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows


def test_an_unfinished_evaluation_keeps_its_rows_when_no_worker_can_run_it_again(tmp_path, capsys):
    """Iteration 2's checkpoint names iteration 1's evaluation beside training as in flight (it
    ran while iteration 2 trained), and that evaluation's row was logged after iteration 2's
    (hand-built from a real run). An embedded resume has no evaluation worker to run it on
    iteration 1's weights: its row stays, once, and the run says why. (From iteration 1's own
    checkpoint it runs in the loop first, as a stopped in-line one does: test_train_e2e.py. The
    other reasons, and the re-run beside training, are resumed runs on Ray:
    tests/test_cluster_overlap.py.)"""
    from scripted_envs import PPO, TINY_VLA, PushRightEnv, run_on

    run = tmp_path / "run"
    steps = 8 * PPO["num_steps"]  # 8 environments
    kw = dict(total_env_steps=3 * steps, algorithm=PPO, policy={**TINY_VLA, "value_head": True})
    torch.manual_seed(0)
    run_on(PushRightEnv(8), run, save_every=1, **kw)
    first, second = (run / "checkpoints" / f"iter_00000{i}" for i in (1, 2))
    at = torch.load(first / "trainer.pt", weights_only=False)["counters"]
    trainer = torch.load(second / "trainer.pt", weights_only=False)
    trainer["counters"]["evaluating"] = {
        k: at[k] for k in ("iteration", "env_steps", "train_seconds")
    }
    torch.save(trainer, second / "trainer.pt")
    metrics = run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evaluation = {"iteration": 1, "env_steps": steps, "eval/success_rate": 0.25}
    late = [rows[0], rows[1], evaluation, *rows[2:]]  # logged after iteration 2's row
    metrics.write_text("".join(json.dumps(row) + "\n" for row in late))
    torch.manual_seed(0)
    run_on(PushRightEnv(8), run, resume=str(second), **kw)
    out = capsys.readouterr()
    said = "the evaluation of iteration 1 was unfinished: it runs again only with cluster.eval"
    assert said in out.out + out.err
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row for row in logged if "eval/success_rate" in row and row["iteration"] == 1] == [
        evaluation
    ]
    assert [row["iteration"] for row in logged if "policy/loss" in row] == [1, 2, 3]
    assert "evaluating" not in load_checkpoint(run)["counters"]


def test_a_resumed_runs_first_metrics_row_is_not_glued_to_a_cut_one(tmp_path):
    from embodied.logger import RunLogger, read_jsonl

    (tmp_path / "metrics.jsonl").write_text('{"env_steps": 10}\n{"env_steps": 2')  # cut by a kill
    logger = RunLogger(tmp_path, enabled_tb=False)
    logger.log({"policy/loss": 0.5}, 30, iteration=3)
    logger.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [{"env_steps": 10}, {"env_steps": 30, "iteration": 3, "policy/loss": 0.5}]
