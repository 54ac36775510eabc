"""The roles on a local Ray (2 CPUs): the same numbers as the embedded run, placement checked
before anything starts, workers killed with SIGKILL mid-rollout and replaced, resume.

One Ray instance serves the module (started as ``embodied train`` starts one); each run places
its own workers and removes them at its end.
"""

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from scripted_envs import (
    GRPO,
    PUSH_RIGHT_TASKS,
    TINY_VLA,
    PushRightEnv,
    Saboteur,
    push_right_envs,
    push_right_tasks,
    run_on,
    subset_stepping_envs,
)

from embodied.checkpoint import load_checkpoint
from embodied.cli import main
from embodied.cluster import evaluation as cluster_evaluation
from embodied.cluster.config import ClusterConfig, RoleConfig
from embodied.cluster.envs import RemoteEnvGroup
from embodied.cluster.evaluation import Evaluation
from embodied.cluster.inference import RemoteInference
from embodied.cluster.learner import Pending, RemoteLearner
from embodied.cluster.roles import RayRoles
from embodied.config import load_config
from embodied.episode_stats import EpisodeStats
from embodied.multitask import MultiTaskEnv
from embodied.replay import differences, replay
from embodied.roles import Roles, WorkerLost
from embodied.rollout import CollectPlan
from embodied.run import EVALUATED_AT
from embodied.runner import train
from embodied.train_config import TrainConfig

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "env.num_envs=2",
    "env.num_workers=0",  # the simulator in the env worker's process: no subprocess to start
    "algorithm.num_steps=8",
    "algorithm.update_epochs=2",
    "algorithm.num_minibatches=2",
    "algorithm.anneal_lr=false",
    "policy.hidden_sizes=[32,32]",
    "runner.eval_every=0",
    "runner.eval_episodes=2",
    "runner.final_eval_episodes=2",
    "runner.save_every=1",
    "runner.progress=false",
    "runner.video=false",
    f"runner.total_env_steps={3 * 2 * 8}",
]
# one worker per role on 2 CPUs: the env worker's simulator runs in its own subprocess
ON_RAY = ["cluster.enabled=true", "cluster.rollout.num_cpus=0.5", "cluster.actor.num_cpus=0.5"]
CLUSTER = dict(enabled=True, rollout=dict(num_cpus=0.5), actor=dict(num_cpus=0.5))
TWO_ENV_WORKERS = {**CLUSTER, "env": dict(workers=2, num_cpus=0.5)}
# GRPO with one round per iteration, every group kept: a fixed count of chunks per update
ONE_ROUND = {**GRPO, "max_rounds": 1, "dynamic_sampling": False}
TIMING = ("time/", "cluster/", "eval/policy_ms", "eval/env_steps_per_s")


@pytest.fixture(scope="module")
def local_ray():
    from embodied.cluster.start import start_ray

    start_ray(ClusterConfig(num_cpus=2))
    yield
    ray.shutdown()


def pushcube(tmp_path, name, extra=()):
    overrides = [*TINY, f"runner.output_dir={tmp_path}", f"runner.name={name}", *extra]
    return load_config(TrainConfig, ROOT / "configs/maniskill/pushcube_ppo.yaml", overrides)[0]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def untimed(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if not k.startswith(TIMING) and k != "minutes"}


def assert_same_numbers(a: list[dict], b: list[dict], rel=1e-6, abs=1e-9, skip=()) -> None:
    """Row by row, every metric but timings (and ``skip``) equal to ``rel`` (relative)."""
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b):
        keys = {k for k in row_a if not k.startswith(TIMING)}
        assert keys == {k for k in row_b if not k.startswith(TIMING)}
        for key in keys - set(skip):
            assert row_a[key] == pytest.approx(row_b[key], rel=rel, abs=abs), key


def block_ray(monkeypatch) -> None:
    """From here on, ``import ray`` (or any of its modules) fails in this process."""
    for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")] + ["ray"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_ppo_on_pushcube_gives_the_embedded_numbers(tmp_path, monkeypatch, request):
    with monkeypatch.context() as blocked:
        block_ray(blocked)  # the embedded run never imports Ray
        embedded = train(pushcube(tmp_path, "embedded"))
    request.getfixturevalue("local_ray")  # (started after: its log thread imports Ray modules)
    on_ray = train(pushcube(tmp_path, "ray", [*ON_RAY, "runner.trace=true"]))
    losses = [r["policy/loss"] for r in rows(tmp_path / "ray") if "policy/loss" in r]
    assert len(losses) == 3
    assert_same_numbers(rows(tmp_path / "embedded"), rows(tmp_path / "ray"))
    assert untimed(on_ray["final"]) == untimed(embedded["final"])
    status = json.loads((tmp_path / "ray" / "cluster.json").read_text())
    assert sorted(w["role"] for w in status["workers"]) == ["actor", "env", "rollout"]
    # the sync sends the trainable weights and the normaliser: the MLP has no frozen part
    synced = [r["cluster/sync_bytes"] for r in rows(tmp_path / "ray") if "cluster/sync_bytes" in r]
    assert synced and all(b > 0 for b in synced)
    # per iteration and role: busy time, idle share; per rollout step: bytes and waits
    training = [r for r in rows(tmp_path / "ray") if "policy/loss" in r]
    for row in training:
        for role in ("env", "rollout", "actor"):
            assert row[f"cluster/{role}_busy_s"] > 0
            assert 0 <= row[f"cluster/{role}_idle"] <= 1
        # the env worker acts through the rollout worker directly and its batch goes to the
        # actor worker directly: what passes through this process is per round (the plan, the
        # episode totals), less per step than one step's 2 x 8 actions (f32)
        assert 0 < row["cluster/env_bytes_per_step"] < 2 * 8 * 4
        assert "cluster/rollout_bytes_per_step" not in row  # (nothing crosses from here to it)
    # the trace of the second iteration: which role did what, when
    trace = json.loads((tmp_path / "ray" / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert names == {"env", "rollout", "actor", "runner"}
    spans = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"serve", "update", "collect"} <= spans


@pytest.mark.slow  # (45 s: with its sync fault; the default suite is at its 15-minute budget)
def test_inference_in_the_env_worker_gives_the_embedded_numbers(local_ray, tmp_path, monkeypatch):
    """``cluster.rollout.workers: 0``: the env worker collects each round with a policy copy of
    its own (one call per round, none per chunk); its rows are the embedded run's. Killed as
    the second round starts, it is restarted with the weights and the generator state of the
    last iteration, and the round collected again is the one the embedded run collected."""
    # (an evaluation at iteration 2: the env worker's policy copy acts there too)
    train(pushcube(tmp_path, "embedded", ["runner.eval_every=2"]))
    on_ray = ["cluster.enabled=true", "cluster.rollout.workers=0", "cluster.actor.num_cpus=0.5"]
    train(pushcube(tmp_path, "ray", [*on_ray, "runner.trace=true", "runner.eval_every=2"]))
    assert_same_numbers(rows(tmp_path / "embedded"), rows(tmp_path / "ray"))
    assert any("eval/success_rate" in r for r in rows(tmp_path / "ray"))
    status = json.loads((tmp_path / "ray" / "cluster.json").read_text())
    assert sorted(w["role"] for w in status["workers"]) == ["actor", "env"]
    training = [r for r in rows(tmp_path / "ray") if "policy/loss" in r]
    assert len(training) == 3
    for row in training:
        # the round's batch goes to the actor worker directly: per round, the plan and totals
        assert 0 < row["cluster/env_bytes_per_step"] < 2 * 8 * 4
        assert row["cluster/rollout_busy_s"] == 0 and row["cluster/env_busy_s"] > 0
    trace = json.loads((tmp_path / "ray" / "trace.json").read_text())["traceEvents"]
    by_role = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    env_calls = {e["name"] for e in trace if e["ph"] == "X" and by_role[e["pid"]] == "env"}
    assert "collect" in env_calls and "chunk" not in env_calls
    killed = []
    original = RayRoles.collect

    def collect(roles, *args, **kw):
        if len(killed) == 0 and roles.inference.version == 1:
            pid = ray.get(roles.envs.workers[0].ping.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return original(roles, *args, **kw)

    monkeypatch.setattr(RayRoles, "collect", collect)
    send = RemoteInference.send_weights

    def send_weights(inference, version):
        if len(killed) == 1 and version == 2:  # the sync after the second update
            pid = ray.get(inference.workers[0].ping.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return send(inference, version)

    monkeypatch.setattr(RemoteInference, "send_weights", send_weights)
    # weights by broadcast, in buckets of about 1 KB (a tensor each): the killed worker joins
    # a new sync group
    broadcast = ["cluster.weight_sync=broadcast", "cluster.sync_bucket_mb=0.001"]
    train(
        pushcube(
            tmp_path, "killed", [*on_ray, "runner.eval_every=2", "runner.trace=true", *broadcast]
        )
    )
    assert len(killed) == 2
    table = rows(tmp_path / "killed")
    lost = [r for r in table if "cluster/discarded_rounds" in r]
    assert discarded_rounds(table) == [(2, 1)]
    assert_same_numbers(rows(tmp_path / "embedded"), [r for r in table if r not in lost])
    synced = [r["cluster/sync_bytes"] for r in table if "cluster/sync_bytes" in r]
    assert synced and all(b == synced[0] > 0 for b in synced)  # (no frozen part to leave out)
    trace = json.loads((tmp_path / "killed" / "trace.json").read_text())["traceEvents"]
    by_role = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    calls = {(by_role[e["pid"]], e["name"]) for e in trace if e["ph"] == "X"}
    assert {("actor", "broadcast_weights"), ("env", "receive_weights")} <= calls
    # the worker lost in the sync after the second update was replaced and sent the weights:
    # no round was lost to it (above), and both faults are on record
    status = json.loads((tmp_path / "killed" / "cluster.json").read_text())
    assert [e["role"] for e in status["events"]] == ["env", "env"]
    assert status["workers"][0]["pid"] not in killed
    # and in the run's event log, which its report lists
    from embodied.events import read_events

    kinds = [e.kind for e in read_events(tmp_path / "killed")]
    assert kinds[0] == "start" and kinds[-1] == "end" and len(kinds) == 5
    assert sorted(kinds[1:-1]) == ["discarded_round", "fault", "fault"]


# (the default run resumes a Ray run in the data-parallel test, on the test task)
@pytest.mark.slow
def test_a_ppo_run_on_ray_resumes_to_the_embedded_numbers(local_ray, tmp_path):
    """From its own checkpoint, the generator state included."""
    train(pushcube(tmp_path, "embedded"))
    train(pushcube(tmp_path, "ray", ON_RAY))
    checkpoint = tmp_path / "ray" / "checkpoints" / "iter_000002"
    train(pushcube(tmp_path, "ray", [*ON_RAY, f"runner.resume={checkpoint}"]))
    assert_same_numbers(rows(tmp_path / "embedded"), rows(tmp_path / "ray"))


# the other simulators, with a tiny run each: embedded and on Ray, the same rows
SIMULATORS = [
    pytest.param(
        "configs/mujoco/reach_ppo.yaml",
        ["env.num_envs=4", "algorithm.num_steps=8", "env.render_size=32"],
        id="mujoco",
    ),
    pytest.param(
        "configs/libero/spatial_ppo_state.yaml",
        [
            "env.num_envs=2",
            "env.max_episode_steps=4",
            "env.settle_steps=1",
            "env.image_size=32",
            "algorithm.num_steps=4",
        ],
        id="libero",
        marks=pytest.mark.slow,  # robosuite's start takes most of a minute per run
    ),
]


@pytest.mark.parametrize("config, sizes", SIMULATORS)
def test_other_simulators_on_ray_give_the_embedded_numbers(local_ray, tmp_path, config, sizes):
    """Two PPO iterations: env workers hold any registered simulator behind the contract."""
    common = [
        *sizes,
        f"runner.output_dir={tmp_path}",
        "runner.total_env_steps=" + str(2 * _steps_per_iteration(sizes)),
        "runner.eval_every=0",
        "runner.eval_episodes=2",
        "runner.final_eval_episodes=2",
        "runner.progress=false",
        "runner.video=false",
    ]
    for name, extra in (("embedded", []), ("ray", ON_RAY)):
        cfg = load_config(TrainConfig, ROOT / config, [*common, f"runner.name={name}", *extra])[0]
        train(cfg)
    table = rows(tmp_path / "ray")
    assert len([r for r in table if "policy/loss" in r]) == 2
    assert_same_numbers(rows(tmp_path / "embedded"), table)


def _steps_per_iteration(sizes: list[str]) -> int:
    values = dict(s.split("=") for s in sizes)
    return int(values["env.num_envs"]) * int(values["algorithm.num_steps"])


@pytest.fixture
def one_thread():
    """torch on one thread here, as in the workers (runner.torch_threads): the same sums."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_grpo_on_two_env_workers_gives_the_embedded_numbers(local_ray, tmp_path, one_thread):
    """Each env worker holds half the environments; seeds go by rows, so nothing changes. The
    rollout worker reads the weights from the actor's shared memory (``weight_sync: shared``).
    The actor worker records every second iteration, and its updates replay here bit for
    bit."""
    steps = 8 * 3 * 4
    torch.manual_seed(0)
    embedded = run_on(PushRightEnv(8), tmp_path / "embedded", total_env_steps=steps)
    torch.manual_seed(0)
    on_ray = run_on(
        None,
        tmp_path / "ray",
        total_env_steps=steps,
        cluster={**TWO_ENV_WORKERS, "weight_sync": "shared"},
        env_factory=push_right_envs,
        record_rollouts=2,
    )
    records = sorted(p.name for p in (tmp_path / "ray" / "rollouts").iterdir())
    assert records == ["iter_000002", "iter_000004"]
    for iteration in (2, 4):
        record, metrics, digest = replay(tmp_path / "ray", iteration)
        weights = (record.meta["digest_after"], digest)
        assert differences(record.meta["metrics"], metrics, weights=weights) == []
    assert len([r for r in rows(tmp_path / "ray") if "policy/loss" in r]) >= 2
    assert_same_numbers(rows(tmp_path / "embedded"), rows(tmp_path / "ray"))
    assert untimed(on_ray["final"]) == untimed(embedded["final"])
    status = json.loads((tmp_path / "ray" / "cluster.json").read_text())
    envs = [w for w in status["workers"] if w["role"] == "env"]
    assert len(envs) == 2 and envs[0]["pid"] != envs[1]["pid"]
    # after an update only what it can change reaches the rollout worker: the frozen vision
    # encoder (in the checkpoint's shared frozen file) is not sent again, the rest is
    checkpoint = load_checkpoint(tmp_path / "ray")
    frozen = load_file(Path(checkpoint["path"]).parent / checkpoint["meta"]["frozen"])
    model = checkpoint["model"]
    assert frozen and set(frozen) < set(model)
    trainable = sum(t.numel() * t.element_size() for k, t in model.items() if k not in frozen)
    synced = [r["cluster/sync_bytes"] for r in rows(tmp_path / "ray") if "cluster/sync_bytes" in r]
    assert synced and all(b == trainable for b in synced)


def test_env_workers_holding_different_tasks_evaluate_as_the_embedded_run(
    local_ray, tmp_path, one_thread, monkeypatch
):
    """Two tasks on two env workers, one each: every evaluation (before RL, during training,
    the final one) is one call per env worker, which evaluates its own task's episodes acting
    through the rollout worker, and gives the embedded run's numbers. The final evaluation's
    video is the first env worker's task's."""
    kw = dict(total_env_steps=8 * 3 * 2, algorithm=ONE_ROUND, eval_every=1, video=True)
    torch.manual_seed(0)
    both = [PushRightEnv(4, threshold=PUSH_RIGHT_TASKS[t]) for t in PUSH_RIGHT_TASKS]
    embedded = run_on(MultiTaskEnv(both, list(PUSH_RIGHT_TASKS)), tmp_path / "embedded", **kw)
    evaluated = []  # per evaluation: each env worker's (episodes, seed) per task of its own
    whole = RemoteEnvGroup.episode_shares

    def episode_shares(envs, episodes, seed):
        evaluated.append(whole(envs, episodes, seed))
        return evaluated[-1]

    monkeypatch.setattr(RemoteEnvGroup, "episode_shares", episode_shares)
    torch.manual_seed(0)
    on_ray = run_on(
        None,
        tmp_path / "ray",
        cluster=TWO_ENV_WORKERS,
        env_factory=push_right_tasks,
        env_cfg={"tasks": list(PUSH_RIGHT_TASKS)},
        **kw,
    )
    timings = [f"eval/{t}/{k}" for t in PUSH_RIGHT_TASKS for k in ("policy_ms", "env_steps_per_s")]
    assert_same_numbers(rows(tmp_path / "embedded"), rows(tmp_path / "ray"), skip=timings)
    assert set(on_ray["tasks"]) == set(PUSH_RIGHT_TASKS)
    video = str(tmp_path / "ray" / "videos" / "final_eval.mp4")
    for task in PUSH_RIGHT_TASKS:
        assert untimed(on_ray["tasks"][task]) == {
            **untimed(embedded["tasks"][task]),
            "eval/video": video,
        }
    assert Path(video).stat().st_size > 0
    # before RL, after iteration 1, the final one: 16 episodes of each task on the one env
    # worker that holds it
    assert evaluated == [[[(16, 0)], [(16, 0)]]] * 3


def run_rounds(
    run_dir: Path, iterations: int, env_factory=push_right_envs, cluster=TWO_ENV_WORKERS
) -> dict:
    """One-round GRPO iterations of the test task on two env workers and a rollout worker."""
    return run_on(
        None,
        run_dir,
        total_env_steps=8 * 3 * iterations,
        cluster=cluster,
        env_factory=env_factory,
        algorithm=ONE_ROUND,
    )


def record_calls(monkeypatch, order: list, cls, name: str, label: str) -> None:
    """Each call of ``cls.name`` (a driver-side method) first appends ``label`` to ``order``."""
    whole = getattr(cls, name)

    def recorded(*args, **kwargs):
        order.append(label)
        return whole(*args, **kwargs)

    monkeypatch.setattr(cls, name, recorded)


class Recorder:
    """Keeps what the learner is sent: each update's round (``samples``: the batch the driver
    handed over; the tests here collect one round per update)."""

    def __init__(self):
        self.samples = []
        self.rounds = []
        self.add_original = RemoteLearner.add_round
        self.original = RemoteLearner.start_update
        recorder = self

        def add_round(learner_self, shards):
            try:  # (now: its env worker may be lost later)
                recorder.rounds.append(shards.fetch())
            except ray.exceptions.ObjectLostError:
                pass  # (lost with its env worker: the learner's add_round says so)
            return recorder.add_original(learner_self, shards)

        def start_update(learner_self):
            (batch,) = recorder.rounds  # (one round per update)
            recorder.samples.append(batch)
            recorder.rounds = []
            return recorder.original(learner_self)

        self.add_round = add_round
        self.start_update = start_update

    def patch(self, monkeypatch) -> None:
        monkeypatch.setattr(RemoteLearner, "add_round", self.add_round)
        monkeypatch.setattr(RemoteLearner, "start_update", self.start_update)

    def assert_whole_rounds(self) -> None:
        """No transition of a lost partial round in any update's batch: every episode starts at
        its reset (the test task's state is the step index) and runs its 3 steps in order."""
        for samples in self.samples:
            state = samples.obs.state.view(3, 8)  # [T, B]: each round's chunks, time-major
            assert torch.equal(state, torch.arange(3.0)[:, None].expand(3, 8))


def roles_on(tmp_path, cluster: dict, policy: dict, env_factory) -> RayRoles:
    """The roles of a one-round GRPO run on 8 environments of ``env_factory``, started."""
    from embodied.cluster import ray_roles
    from embodied.config import compose

    source = {
        "seed": 0,
        "policy": policy,
        "algorithm": ONE_ROUND,
        "env": {"num_envs": 8},
        "cluster": cluster,
        "runner": {"output_dir": str(tmp_path), "progress": False},
    }
    cfg = compose(TrainConfig, [("test", source)])
    roles = ray_roles(cfg, None, tmp_path, env_factory=env_factory)
    assert isinstance(roles, Roles)  # every member of the protocol the runner drives
    return roles


class Arming(Recorder):
    """A ``Recorder`` that arms the saboteur's gates as updates are sent: ``targets[k]`` (the
    pid to kill, or a function of the run directory giving it) once the k-th update is sent,
    so that the next round loses a worker at its second step."""

    def __init__(self, saboteur: Saboteur, run_dir: Path, targets: dict):
        super().__init__()
        recorded = self.start_update

        def start_update(learner_self):
            pending = recorded(learner_self)
            target = targets.get(len(self.samples))
            if target is not None:
                saboteur.arm(len(self.samples), target(run_dir) if callable(target) else target)
            return pending

        self.start_update = start_update


def rollout_pid(run_dir: Path) -> int:
    status = json.loads((run_dir / "cluster.json").read_text())
    return next(w["pid"] for w in status["workers"] if w["role"] == "rollout")


def test_workers_killed_mid_rollout_are_replaced_and_their_rounds_collected_again(
    local_ray, tmp_path, monkeypatch, capsys
):
    """Two env workers acting through one rollout worker: an env worker dies at the second step
    of the second iteration's round (SIGKILL, as in a segfault), the rollout worker at the
    second step of the third's, an env worker at the second step of the final evaluation. The
    restarted rollout worker maps the actor's shared weights afresh (``weight_sync: shared``)."""
    run_dir = tmp_path / "ray"
    saboteur = Saboteur(tmp_path)
    recorder = Arming(saboteur, run_dir, {1: "self", 2: rollout_pid})
    recorder.patch(monkeypatch)
    iterations = 4
    evaluated = []  # the weights' version of each evaluation started on the env workers
    whole_evaluation = RayRoles._evaluate

    def evaluate(roles, *args):
        evaluated.append(roles.inference.version)
        if roles.inference.version == iterations and saboteur.killed(3) is None:
            saboteur.arm(3, "self")
        return whole_evaluation(roles, *args)

    monkeypatch.setattr(RayRoles, "_evaluate", evaluate)
    shared = {**TWO_ENV_WORKERS, "weight_sync": "shared"}
    summary = run_rounds(run_dir, iterations, env_factory=saboteur, cluster=shared)
    killed_env, killed_rollout = saboteur.killed(1), saboteur.killed(2)
    assert killed_env is not None and killed_rollout is not None
    # the final evaluation lost an env worker midway and ran again whole
    assert saboteur.killed(3) is not None and evaluated[-2:] == [iterations, iterations]
    table = rows(run_dir)
    assert discarded_rounds(table) == [(2, 1), (3, 2)]
    # the run went on: every iteration updated, and the final evaluation ran
    assert len([r for r in table if "policy/loss" in r]) == iterations
    assert summary["final"]["eval/episodes"] == 16
    assert summary["env_steps"] == 8 * 3 * iterations  # the lost rounds are not counted
    status = json.loads((run_dir / "cluster.json").read_text())
    assert [e["role"] for e in status["events"]] == ["env", "rollout", "env"]
    pids = {(w["role"], w["index"]): w["pid"] for w in status["workers"]}
    assert killed_env not in (pids[("env", 0)], pids[("env", 1)])
    assert saboteur.killed(3) not in (pids[("env", 0)], pids[("env", 1)])
    assert pids[("rollout", 0)] != killed_rollout
    # `embodied cluster status` shows each worker and the faults
    capsys.readouterr()  # (what the run printed)
    assert main(["cluster", "status", str(run_dir)]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].startswith("placement collocated, run ended")
    assert [line.split()[:2] for line in shown[2:6]] == [
        ["env", "0"],
        ["env", "1"],
        ["rollout", "0"],
        ["actor", "0"],
    ]
    assert shown[6] == "faults: 3"
    assert "env worker lost" in shown[7] and "rollout worker lost" in shown[8]
    assert "env worker lost" in shown[9]
    assert len(recorder.samples) == iterations
    recorder.assert_whole_rounds()
    # one episode per environment and round: nothing of the lost rounds was counted
    counts = [r["episode/count"] for r in table if "episode/count" in r]
    assert counts == [8.0] * iterations


def test_an_env_worker_lost_before_the_learner_fetched_its_round_loses_that_round(
    local_ray, tmp_path, monkeypatch
):
    """The batches stay with the env workers that collected them until the actor worker fetches
    them: env worker 0 SIGKILLed (and restarted) between its second round and that fetch loses
    the round, which is collected again; the run goes on as if nothing happened."""
    recorder = Recorder()
    add_round = recorder.add_round
    killed = []

    def add_round_after_a_loss(learner, shards):
        if len(recorder.samples) == 1 and not killed:  # (the second iteration's round)
            # restarted before the fetch: the old process, the shard's owner, is gone for good
            killed.append(killed_and_restarted(roles_seen[0].envs.workers[0]))
        return add_round(learner, shards)

    roles_seen = watch_roles(monkeypatch)
    recorder.add_round = add_round_after_a_loss
    recorder.patch(monkeypatch)
    iterations = 3
    run_rounds(tmp_path / "ray", iterations)
    assert killed
    assert_one_round_lost_with_an_env_worker(tmp_path / "ray", iterations, "its round's data was")
    recorder.assert_whole_rounds()


def discarded_rounds(table: list[dict]) -> list[tuple[int, int]]:
    """(iteration, rounds discarded so far) of each metrics row that logs a discarded round."""
    key = "cluster/discarded_rounds"
    return [(r["iteration"], r[key]) for r in table if key in r]


def assert_one_round_lost_with_an_env_worker(run_dir, iterations: int, what: str) -> None:
    """The run logged one discarded round, every iteration's update, and one fault: an env
    worker lost, ``what`` (was / were) lost with it."""
    table = rows(run_dir)
    assert [count for _, count in discarded_rounds(table)] == [1]
    assert len([r for r in table if "policy/loss" in r]) == iterations
    status = json.loads((run_dir / "cluster.json").read_text())
    assert [e["role"] for e in status["events"]] == ["env"]
    assert f"{what} lost with it" in status["events"][0]["detail"]


def watch_roles(monkeypatch) -> list:
    """A list that holds the run's ``RayRoles`` once it collects its first round."""
    seen = []
    collect_whole = RayRoles.collect

    def collect(roles, *args, **kw):
        seen[:] = [roles]
        return collect_whole(roles, *args, **kw)

    monkeypatch.setattr(RayRoles, "collect", collect)
    return seen


def killed_and_restarted(worker) -> int:
    """SIGKILL a worker's process and wait until Ray has restarted it; the old pid."""
    pid = ray.get(worker.ping.remote())
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            if ray.get(worker.ping.remote(), timeout=30) != pid:
                return pid
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.1)


@pytest.mark.slow  # (25 s)
def test_workers_restarted_between_rounds_are_found_unconnected_and_brought_back(
    local_ray, tmp_path, monkeypatch
):
    """An env worker dies and is restarted while the first update runs, the rollout worker
    while the second does: each next round finds it without its connections, loses that round
    and collects it again once everyone is connected afresh (and the rollout worker has all
    the weights again)."""
    recorder = Recorder()
    start_update = recorder.start_update
    roles_seen = watch_roles(monkeypatch)
    killed = []

    def start_update_then_kill(learner):
        pending = start_update(learner)
        updates = len(recorder.samples)
        if updates in (1, 2):
            role = "env" if updates == 1 else "rollout"
            killed.append(killed_and_restarted(roles_seen[0].groups[role].workers[0]))
        return pending

    recorder.start_update = start_update_then_kill
    recorder.patch(monkeypatch)
    iterations = 4
    run_rounds(tmp_path / "ray", iterations)
    assert len(killed) == 2
    table = rows(tmp_path / "ray")
    assert discarded_rounds(table) == [(2, 1), (3, 2)]
    assert len([r for r in table if "policy/loss" in r]) == iterations
    events = json.loads((tmp_path / "ray" / "cluster.json").read_text())["events"]
    assert [e["role"] for e in events] == ["env", "rollout"]
    assert all("not connected" in e["detail"] for e in events)
    recorder.assert_whole_rounds()


def test_a_simulator_error_mid_round_ends_the_round_with_that_error(local_ray, tmp_path):
    """An env worker's simulator raises at a round's second step: its rollout worker and the
    other env worker lose their links, and the round ends with the simulator's own error, not
    theirs."""
    import ray

    saboteur = Saboteur(tmp_path)
    policy = {"name": "actor_critic", "hidden_sizes": [8], "use_images": False}
    roles = roles_on(tmp_path, TWO_ENV_WORKERS, policy, saboteur)
    plan = CollectPlan(seeds=3, group_of_env=torch.full((8,), -1), num_chunks=3, episode_base=0)
    try:
        roles.sync(0)
        saboteur.arm(1, "raise")
        stats = EpisodeStats(8, roles.envs.task_names, torch.device("cpu"))
        obs = roles.envs.reset(seed=plan.seeds)
        with pytest.raises(ray.exceptions.RayTaskError, match="the simulator broke") as error:
            roles.collect(obs, plan, stats)
        assert isinstance(error.value.cause, RuntimeError)
        assert (tmp_path / "claimed-1").exists() and saboteur.killed(1) is None  # (no kill)
    finally:
        roles.close()


def test_a_role_lost_too_often_stops_the_run_with_a_resumable_checkpoint(
    local_ray, tmp_path, monkeypatch
):
    """cluster.max_restarts 0: the first lost round stops the run; the last completed
    iteration is saved first."""
    saboteur = Saboteur(tmp_path)
    recorder = Arming(saboteur, tmp_path / "ray", {1: "self"})
    recorder.patch(monkeypatch)
    with pytest.raises(WorkerLost) as lost:
        run_on(
            None,
            tmp_path / "ray",
            total_env_steps=8 * 3 * 4,
            cluster={**CLUSTER, "max_restarts": 0},
            env_factory=saboteur,
            algorithm=ONE_ROUND,
        )
    message = str(lost.value)
    assert "\n" not in message
    assert message.startswith("env worker lost: ")
    assert message.endswith("1 rounds in a row lost (cluster.max_restarts=0)")
    checkpoint = load_checkpoint(tmp_path / "ray")
    assert checkpoint["counters"]["iteration"] == 1
    assert checkpoint["counters"]["env_steps"] == 8 * 3


def test_asynchronous_collection_overlaps_the_update_one_version_behind(
    local_ray, tmp_path, monkeypatch
):
    """cluster.max_staleness 1: iteration i is collected while update i - 1 runs, so its chunks
    come from the weights of update i - 2, and the update corrects for them (decoupled PPO)."""
    recorder = Recorder()
    order = []

    def start_update(learner):
        order.append("update")
        return recorder.start_update(learner)

    recorder.patch(monkeypatch)
    monkeypatch.setattr(RemoteLearner, "start_update", start_update)
    record_calls(monkeypatch, order, RayRoles, "collect", "collect")
    record_calls(monkeypatch, order, Pending, "result", "wait")
    iterations = 4
    summary = run_on(
        None,
        tmp_path / "ray",
        total_env_steps=8 * 3 * iterations,
        cluster={**CLUSTER, "max_staleness": 1},
        env_factory=push_right_envs,
        algorithm=ONE_ROUND,
        trace=True,
    )
    versions = [samples.policy_version.unique().tolist() for samples in recorder.samples]
    assert versions == [[0], [0], [1], [2]]
    # the driver's order of calls: each iteration's collection starts after the previous
    # update was sent and before its result was awaited (no timing, so no load-sensitivity)
    overlapped = ["update", "collect", "wait"] * (iterations - 1)
    assert order == ["collect", *overlapped, "update", "wait"]
    table = rows(tmp_path / "ray")
    training = [r for r in table if "policy/loss" in r]
    assert [r["iteration"] for r in training] == [1, 2, 3, 4]
    # the update of a batch one version old weights its terms by pi_prox / pi_behaviour
    assert all(r["policy/behaviour_weight"] > 0 for r in training)
    assert summary["env_steps"] == 8 * 3 * iterations
    assert summary["final"]["eval/episodes"] == 16
    # the trace shows the roles' calls: the actor's updates, the env worker's rounds
    trace = json.loads((tmp_path / "ray" / "trace.json").read_text())["traceEvents"]
    role = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    spans = [(role[e["pid"]], e["name"]) for e in trace if e["ph"] == "X"]
    assert ("actor", "update") in spans
    assert ("env", "collect") in spans and ("rollout", "serve") in spans


def test_data_parallel_actor_workers_give_the_embedded_numbers_and_a_lost_one_stops_the_run(
    local_ray, tmp_path, monkeypatch, one_thread
):
    """Two actor workers (torch DDP over gloo) each take half of every minibatch: the embedded
    run's numbers, to float rounding. Rank 1 killed before the third update stops the run with
    one line; resumed from the second iteration's checkpoint on one actor worker, it ends as
    the embedded run."""
    iterations = 3
    steps = 8 * 3 * iterations
    torch.manual_seed(0)
    run_on(PushRightEnv(8), tmp_path / "embedded", total_env_steps=steps, algorithm=ONE_ROUND)
    cluster = {**CLUSTER, "actor": dict(workers=2, num_cpus=0.25)}
    original = RemoteLearner.start_update
    killed = []

    def start_update(learner):
        ranks = ray.get([w.data_parallel.remote() for w in learner.workers])
        assert ranks == [(0, 2), (1, 2)]
        if not killed and len(rows(tmp_path / "ray")) == 3:  # before RL, iterations 1 and 2
            killed.append(ray.get(learner.workers[1].ping.remote()))
            os.kill(killed[0], signal.SIGKILL)  # (before it is sent: a tiny one is soon over)
        return original(learner)

    monkeypatch.setattr(RemoteLearner, "start_update", start_update)
    torch.manual_seed(0)
    kw = dict(
        total_env_steps=steps,
        cluster=cluster,
        env_factory=push_right_envs,
        algorithm=ONE_ROUND,
        save_every=1,
    )
    with pytest.raises(WorkerLost) as lost:
        run_on(None, tmp_path / "ray", **kw)
    message = str(lost.value)
    assert killed and "\n" not in message
    assert message.startswith("actor worker lost: ")
    assert message.endswith("the learner's state is lost: resume from the run's last checkpoint")
    assert load_checkpoint(tmp_path / "ray")["counters"]["iteration"] == 2
    status = json.loads((tmp_path / "ray" / "cluster.json").read_text())
    ranks = [w["pid"] for w in status["workers"] if w["role"] == "actor"]
    assert len(ranks) == 2 and ranks[1] == killed[0] and ranks[0] != ranks[1]

    # resumed on one actor worker: a checkpoint does not depend on how many ranks wrote it
    monkeypatch.setattr(RemoteLearner, "start_update", original)
    resumed = tmp_path / "ray" / "checkpoints" / "iter_000002"
    run_on(None, tmp_path / "ray", resume=str(resumed), **{**kw, "cluster": CLUSTER})
    table = rows(tmp_path / "ray")
    assert [r["iteration"] for r in table if "policy/loss" in r] == [1, 2, 3]
    # averaged in another order than one process sums: equal to float rounding
    assert_same_numbers(rows(tmp_path / "embedded"), table, rel=1e-5, abs=1e-7)


@pytest.mark.slow  # (27 s; megatron's TP=2 parity is in the suite, in process)
def test_megatron_tp_ranks_as_actor_workers_give_the_embedded_numbers(
    local_ray, tmp_path, one_thread
):
    """`trainer.backend=megatron trainer.tensor_parallel=2 cluster.actor.workers=2`: each actor
    worker is a TP rank holding its shard of the VLA's learner (gloo). GRPO's logged numbers are
    the embedded torch run's to float rounding; each rank writes its shard file of every
    checkpoint, and joined, the weights are the torch run's."""
    pytest.importorskip("megatron.core")
    iterations = 2
    steps = 8 * 3 * iterations
    kw = dict(total_env_steps=steps, algorithm=ONE_ROUND, save_every=1)
    torch.manual_seed(0)
    run_on(PushRightEnv(8), tmp_path / "embedded", **kw)
    cluster = {**CLUSTER, "actor": dict(workers=2, num_cpus=0.25)}
    trainer = {"backend": "megatron", "tensor_parallel": 2}
    torch.manual_seed(0)
    run_on(
        None, tmp_path / "ray", cluster=cluster, env_factory=push_right_envs, trainer=trainer, **kw
    )
    table = rows(tmp_path / "ray")
    assert [r["iteration"] for r in table if "policy/loss" in r] == [1, 2]
    assert_same_numbers(rows(tmp_path / "embedded"), table, rel=1e-5, abs=1e-6)
    last = tmp_path / "ray" / "checkpoints" / "iter_000002"
    shard = load_file(last / "model-tp01-of-02.safetensors")
    assert "weight/fusion/layers.0.mlp.linear_fc1.weight" in shard
    joined = load_checkpoint(last)["model"]
    want = load_checkpoint(tmp_path / "embedded" / "checkpoints" / "iter_000002")["model"]
    assert joined.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(joined[key], value, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # (22 s; the evaluation worker's numbers are in the suite, below)
def test_an_evaluation_worker_answers_while_it_evaluates_and_its_loss_loses_one_evaluation(
    local_ray, tmp_path
):
    """The run's calls to every role (timing, weight syncs) go on while a long evaluation runs;
    the evaluation worker killed mid-evaluation loses that evaluation only, and the worker Ray
    restarts evaluates the next one with the weights it is sent."""
    cluster = {**CLUSTER, "env": dict(num_cpus=0.5), "eval": dict(workers=1, num_cpus=0.5)}
    roles = roles_on(tmp_path, cluster, TINY_VLA, push_right_envs)
    try:
        roles.sync(1)
        long = roles.start_evaluation(episodes=4000, seed=0)  # 1500 steps of 8 environments
        roles.metrics()
        roles.sync(2)
        assert not long.ready()  # those calls were answered while it ran
        evaluators = roles.groups["eval"]
        (evaluator,) = evaluators.workers
        os.kill(ray.get(evaluator.ping.remote()), signal.SIGKILL)
        with pytest.raises(WorkerLost, match="^eval worker lost: "):
            long.result()
        before = {role: group.heartbeat for role, group in roles.groups.items()}
        evaluators.lost = False
        roles.metrics()  # a lost evaluation worker fails no other call
        roles.sync(3)
        # its heartbeat is when it last answered: before the kill where this timing call
        # found it lost, else (Ray restarted it first) now, with the others'
        assert roles.groups["env"].heartbeat > before["env"]
        assert roles.groups["actor"].heartbeat > before["actor"]
        if evaluators.lost:
            assert evaluators.heartbeat == before["eval"]
        else:
            assert evaluators.heartbeat > before["eval"]
        short = roles.start_evaluation(episodes=8, seed=0)
        assert short.result()["all"]["eval/episodes"] == 8
        assert [event["role"] for event in roles.events] == ["eval"]
    finally:
        roles.close()


@pytest.mark.slow  # (the runner's part is in test_rollout.py, in process)
def test_pipeline_stages_auto_times_each_split_and_keeps_the_fastest(local_ray, tmp_path, capsys):
    """Two env workers whose environments step subsets: lockstep, or 2 or 4 stages of each
    worker's rows. The first iteration warms up, the next three time 1, 2 and 4 stages, and the
    fastest stays."""
    iterations = 6
    run_on(
        None,
        tmp_path / "ray",
        total_env_steps=8 * 3 * iterations,
        policy={"name": "actor_critic", "hidden_sizes": [8], "use_images": False},
        cluster=TWO_ENV_WORKERS,
        env_factory=subset_stepping_envs,
        algorithm=ONE_ROUND,
        pipeline_stages="auto",
    )
    table = [r for r in rows(tmp_path / "ray") if "rollout/pipeline_stages" in r]
    used = [int(r["rollout/pipeline_stages"]) for r in table]
    speed = {used[i]: table[i]["time/env_steps_per_s"] for i in (1, 2, 3)}
    chosen = max(speed, key=speed.get)
    assert used == [1, 1, 2, 4, chosen, chosen]
    assert f"pipeline_stages auto: {chosen} (collection per 1000 env steps: 1: " in (
        capsys.readouterr().out
    )


@pytest.mark.slow  # (30 s: four sets of roles; the default suite is at its 15-minute budget)
def test_auto_stages_are_the_splits_where_the_rounds_are_collected(local_ray, tmp_path):
    """Each env worker collects its own rows' round and splits them into stages where its
    environments step subsets, chunks of any length (a stage's chunk runs in a thread while
    the policy acts for another)."""
    # (factory, env workers, rollout workers, candidates for chunks of 1 action, for chunks of 2)
    cases = [
        (push_right_envs, 2, 1, [1], [1]),
        (subset_stepping_envs, 2, 1, [1, 2, 4], [1, 2, 4]),
        (subset_stepping_envs, 1, 1, [1, 2, 4, 8], [1, 2, 4, 8]),
        (push_right_envs, 2, 0, [1], [1]),
        (subset_stepping_envs, 2, 0, [1, 2, 4], [1, 2, 4]),
    ]
    for factory, env_workers, rollout_workers, for_one, for_two in cases:
        cluster = {
            **CLUSTER,
            "env": dict(workers=env_workers, num_cpus=0.5),
            "rollout": dict(workers=rollout_workers, num_cpus=0.5 if rollout_workers else 0),
        }
        policy = {"name": "actor_critic", "hidden_sizes": [8], "use_images": False}  # (state)
        roles = roles_on(tmp_path, cluster, policy, factory)
        try:
            assert roles.stage_candidates(chunk_size=1) == for_one
            assert roles.stage_candidates(chunk_size=2) == for_two
        finally:
            roles.close()


@pytest.mark.slow  # (8 s: a set of roles)
def test_one_env_worker_pipelines_its_own_rows_into_the_lockstep_round(local_ray, tmp_path):
    """One env worker whose environments step subsets runs each stage's chunk of 2 actions in a
    thread while the rollout worker acts for the other stage. The round equals the lockstep
    one (the scripted environments' rewards and ends do not depend on the actions), episodes
    that end mid-chunk and on a chunk's last action included."""
    cluster = {**CLUSTER, "env": dict(workers=1, num_cpus=0.5)}
    policy = {"name": "actor_critic", "hidden_sizes": [8], "use_images": False, "chunk_size": 2}
    roles = roles_on(tmp_path, cluster, policy, subset_stepping_envs)
    plan = CollectPlan(seeds=3, group_of_env=torch.full((8,), -1), num_chunks=4, episode_base=0)
    rounds = {}
    try:
        roles.sync(0)
        assert 2 in roles.stage_candidates(chunk_size=2)
        for stages in (1, 2):
            envs = roles.envs
            stats = EpisodeStats(envs.num_envs, envs.task_names, torch.device("cpu"))
            obs = envs.reset(seed=plan.seeds)
            shards = roles.collect(obs, plan, stats, stages=stages, chunk_size=2)
            rounds[stages] = (shards.fetch(), stats)
    finally:
        roles.close()
    (lockstep, lockstep_stats), (staged, staged_stats) = rounds[1], rounds[2]
    # episodes of 3 steps: they end on a chunk's first action, then on its last
    assert staged.truncated[:, 0].tolist() == [[False, False], [True, False], [False, True]] + [
        [False, False]
    ]
    for name in ("rewards", "terminated", "truncated", "valid", "episode_id", "group_id"):
        assert torch.equal(getattr(staged, name), getattr(lockstep, name)), name
    for name in ("values", "next_values"):
        torch.testing.assert_close(getattr(staged, name), getattr(lockstep, name), msg=name)
    assert torch.equal(staged.obs.state, lockstep.obs.state)
    assert staged_stats.summary() == lockstep_stats.summary()


def test_evaluations_beside_training_give_the_embedded_evaluations(
    local_ray, tmp_path, monkeypatch, one_thread
):
    """Two evaluation workers evaluate iterations 1 and 2 while training goes on, each half of
    the episodes: every row (the evaluations' too, logged at their iteration) is the embedded
    run's, in which training waited for each evaluation."""
    iterations = 3
    kw = dict(total_env_steps=8 * 3 * iterations, algorithm=ONE_ROUND, eval_every=1)
    torch.manual_seed(0)
    embedded = run_on(PushRightEnv(8), tmp_path / "embedded", **kw)
    started = []  # the weight version each evaluation was sent
    order = []  # the driver's calls: evaluations started and taken, rounds collected
    original = RayRoles.start_evaluation

    in_flight = []  # the evaluations sent

    def start_evaluation(roles, **call):
        started.append(roles.inference.version)
        order.append("evaluate")
        in_flight.append(original(roles, **call))
        return in_flight[-1]

    monkeypatch.setattr(RayRoles, "start_evaluation", start_evaluation)
    # the trace keeps the second iteration's worker calls: the evaluation sent after the first
    # lands in it when both of its workers finished before that iteration's metrics are read.
    # That is the order of events, not of seconds: the metrics wait for it here (its result is
    # still taken where the runner takes it)
    original_metrics = RayRoles.metrics

    def metrics_after_the_evaluation(roles):
        import ray

        if in_flight:
            ray.wait(in_flight[-1].refs, num_returns=len(in_flight[-1].refs))
        return original_metrics(roles)

    monkeypatch.setattr(RayRoles, "metrics", metrics_after_the_evaluation)
    record_calls(monkeypatch, order, RayRoles, "collect", "collect")
    record_calls(monkeypatch, order, Evaluation, "result", "result")
    shares = []  # the (episodes, seed) of each evaluation worker, per evaluation

    def split_episodes(episodes, seed, parts):
        shares.append(split_whole(episodes, seed, parts))
        return shares[-1]

    split_whole = cluster_evaluation.split_episodes
    monkeypatch.setattr(cluster_evaluation, "split_episodes", split_episodes)
    torch.manual_seed(0)
    cluster = {**CLUSTER, "env": dict(num_cpus=0.5), "eval": dict(workers=2, num_cpus=0.25)}
    beside = run_on(
        None, tmp_path / "ray", cluster=cluster, env_factory=push_right_envs, trace=True, **kw
    )
    assert started == [1, 2]
    assert shares == [[(8, 0), (8, 8)]] * 2  # 16 episodes from seed 0: 8 each
    table = rows(tmp_path / "ray")
    evaluations = [r["iteration"] for r in table if "eval/success_rate" in r]
    assert evaluations == [0, 1, 2, 3]  # before RL, beside training (1 and 2), the final one

    def by_iteration(rows_of_a_run):
        return sorted(rows_of_a_run, key=lambda r: (r["iteration"], "eval/success_rate" in r))

    assert_same_numbers(by_iteration(rows(tmp_path / "embedded")), by_iteration(table))

    def untimed_evals(summary):
        return [
            (e["iteration"], e["env_steps"], e["success_rate"], untimed(e["tasks"]["all"]))
            for e in summary["evals"]
        ]

    assert [e["iteration"] for e in beside["evals"]] == [1, 2]
    assert untimed_evals(beside) == untimed_evals(embedded)
    assert beside["best"] == embedded["best"]
    assert (tmp_path / "ray" / "best").resolve().name == f"iter_{beside['best']['iteration']:06d}"
    # each evaluation was sent before the next round was collected and taken after it (the
    # driver's order, not timing: no load-sensitivity)
    beside_rounds = ["collect", "evaluate", "collect", "result", "evaluate", "collect", "result"]
    assert order == beside_rounds
    # the trace of the second iteration: both evaluation workers evaluated
    trace = json.loads((tmp_path / "ray" / "trace.json").read_text())["traceEvents"]
    role = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    spans = [e for e in trace if e["ph"] == "X"]
    evaluations = [e for e in spans if role[e["pid"]] == "eval" and e["name"] == "evaluate"]
    assert len(evaluations) == 2  # one per worker


def test_an_impossible_placement_is_one_line_before_any_worker_starts(local_ray, tmp_path, capsys):
    argv = [
        "train",
        str(ROOT / "configs/maniskill/pushcube_ppo.yaml"),
        *TINY,
        f"runner.output_dir={tmp_path}",
        *ON_RAY,
        "cluster.actor.num_gpus=3",
    ]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "embodied: error: cluster.actor: 1 actor worker(s) ask for 3 GPU, and the Ray cluster "
        "has 0 GPU (1 node(s))"
    ]
    assert not (tmp_path / "pushcube_ppo").exists()  # nothing was made


def slots_of(**roles):
    from embodied.cluster.placement import plan_slots

    cfg = ClusterConfig(enabled=True, **{k: RoleConfig(**v) for k, v in roles.items()})
    return cfg, plan_slots(cfg)


@pytest.mark.parametrize(
    "roles, nodes, placement, error",
    [
        # the whole request: the first role whose share does not fit is named
        (
            dict(env=dict(workers=4, num_cpus=1)),
            [{"CPU": 2.0}],
            "collocated",
            "cluster.env: 4 env worker(s) ask for 4 CPU, and the Ray cluster has 2 CPU",
        ),
        (
            dict(rollout=dict(num_gpus=1), actor=dict(num_gpus=0.5)),
            [{"CPU": 8.0, "GPU": 1.0}],
            "collocated",
            "cluster.actor: 1 actor worker(s) ask for 0.5 GPU beside 1 for the roles before it",
        ),
        # enough in all, but no node holds one worker's bundle
        (
            dict(actor=dict(num_cpus=4)),
            [{"CPU": 3.0}, {"CPU": 3.0}],
            "disaggregated",
            "cluster.actor: one actor worker asks for 4 CPU and no node of the Ray cluster has",
        ),
        # every bundle fits somewhere, but collocated wants them on one node
        (
            dict(env=dict(num_cpus=1.5), rollout=dict(num_cpus=1), actor=dict(num_cpus=1)),
            [{"CPU": 2.0}, {"CPU": 2.0}],
            "collocated",
            "cluster.placement: collocated puts every worker on one node",
        ),
        (
            dict(env=dict(resources={"sim": 1})),
            [{"CPU": 4.0}],
            "hybrid",
            "cluster.env: 1 env worker(s) ask for 1 sim, and the Ray cluster has 0 sim",
        ),
    ],
)
def test_a_placement_that_cannot_fit_names_the_role_and_the_resource(
    roles, nodes, placement, error
):
    from embodied.cluster.placement import check_fits
    from embodied.config import ConfigError

    cfg, slots = slots_of(**roles)
    cfg.placement = placement
    with pytest.raises(ConfigError) as raised:
        check_fits(cfg, slots, nodes)
    assert str(raised.value).startswith(error)


def test_a_placement_that_fits_passes_and_gives_one_bundle_per_worker():
    from embodied.cluster.placement import check_fits

    cfg, slots = slots_of(
        env=dict(workers=2, num_cpus=1), rollout=dict(num_gpus=0.5), actor=dict(num_gpus=0.5)
    )
    check_fits(cfg, slots, [{"CPU": 4.0, "GPU": 1.0}])
    assert [(s.role, s.index, s.bundle) for s in slots] == [
        ("env", 0, 0),
        ("env", 1, 1),
        ("rollout", 0, 2),
        ("actor", 0, 3),
    ]
    assert slots[2].resources == {"CPU": 1.0, "GPU": 0.5}


@pytest.mark.parametrize(
    "roles, nodes, placement, cpus",
    [
        # the README's first cluster command on 2 cores: env, rollout and actor at 2/3 each
        (dict(), [{"CPU": 2.0}], "collocated", [0.666, 0.666, 0.666]),
        # what explicit requests leave is shared by the others
        (dict(env=dict(num_cpus=1)), [{"CPU": 2.0}], "collocated", [1.0, 0.5, 0.5]),
        # one CPU each where the cluster has them
        (dict(env=dict(workers=3)), [{"CPU": 16.0}], "collocated", [1.0] * 5),
        # collocated counts the largest node; spread placements the whole cluster
        (dict(), [{"CPU": 1.0}, {"CPU": 2.0}], "collocated", [0.666] * 3),
        (dict(), [{"CPU": 1.0}, {"CPU": 2.0}], "disaggregated", [1.0] * 3),
        # explicit requests that take everything: the others ask for one (check_fits names it)
        (dict(actor=dict(num_cpus=2)), [{"CPU": 2.0}], "collocated", [1.0, 1.0, 2.0]),
    ],
)
def test_roles_without_num_cpus_share_the_cpus_the_cluster_has(roles, nodes, placement, cpus):
    from embodied.cluster.placement import check_fits, plan_slots

    cfg = ClusterConfig(enabled=True, placement=placement)
    for role, values in roles.items():
        setattr(cfg, role, RoleConfig(**values))
    slots = plan_slots(cfg, nodes)
    assert [s.resources["CPU"] for s in slots] == cpus
    if sum(cpus) <= max(n["CPU"] for n in nodes) or placement != "collocated":
        check_fits(cfg, slots, nodes)
    else:
        from embodied.config import ConfigError

        with pytest.raises(ConfigError, match="cluster.actor: 1 actor worker"):
            check_fits(cfg, slots, nodes)
    assert [s.resources["CPU"] for s in plan_slots(cfg)] == [  # (no cluster to fit: one each)
        1.0 if role.num_cpus is None else role.num_cpus
        for role in (cfg.env, cfg.rollout, cfg.actor)
        for _ in range(role.workers)
    ]


def test_env_configs_split_by_rows_and_tasks():
    from embodied.cluster.envs import split_env
    from embodied.config import ConfigError
    from embodied.simulators.maniskill import ManiSkillConfig

    one = ManiSkillConfig(num_envs=8, num_workers=4)
    assert [(c.num_envs, c.num_workers) for c in split_env(one, 2)] == [(4, 2), (4, 2)]
    # a share of one simulator process: the env worker simulates in its own process
    assert [(c.num_envs, c.num_workers) for c in split_env(one, 4)] == [(2, 0)] * 4
    single = ManiSkillConfig(num_envs=8, num_workers=1)
    assert [(c.num_envs, c.num_workers) for c in split_env(single, 1)] == [(8, 0)]
    three = ManiSkillConfig(tasks=["A", "B", "C"], num_envs=12, num_workers=3)
    parts = split_env(three, 3)
    assert [(c.tasks, c.num_envs) for c in parts] == [(["A"], 4), (["B"], 4), (["C"], 4)]
    parts = split_env(three, 6)
    assert [(c.tasks, c.num_envs) for c in parts] == [  # (one-task lists: named by the task)
        ([t], 2) for t in ("A", "A", "B", "B", "C", "C")
    ]
    with pytest.raises(ConfigError, match="cluster.env.workers: 3 env workers cannot share"):
        split_env(one, 3)
    with pytest.raises(ConfigError, match="cannot share 3 tasks of 4"):
        split_env(three, 2)


@pytest.mark.slow  # (about 50 s: an embedded run, a Ray run and two resumes)
def test_an_evaluation_unfinished_when_the_run_fails_runs_again_on_resume(
    local_ray, tmp_path, monkeypatch, one_thread
):
    """The run fails while iteration 2 is collected and iteration 1's evaluation runs beside
    it: iteration 1's checkpoint names that evaluation as in flight. The resumed run evaluates
    iteration 1's checkpoint again, and its evaluations are the embedded run's. So does a
    resume from the older checkpoint of iteration 2, whose evaluation's result only iteration
    3's checkpoint held."""
    iterations = 3
    kw = dict(total_env_steps=8 * 3 * iterations, algorithm=ONE_ROUND, eval_every=1)
    torch.manual_seed(0)
    embedded = run_on(PushRightEnv(8), tmp_path / "embedded", **kw)
    original = RayRoles.collect
    calls = []

    def collect(roles, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # iteration 2, with iteration 1's evaluation just sent
            raise RuntimeError("a crash while collecting")
        return original(roles, *args, **kwargs)

    monkeypatch.setattr(RayRoles, "collect", collect)
    cluster = {**CLUSTER, "env": dict(num_cpus=0.5), "eval": dict(workers=1, num_cpus=0.5)}
    run_dir = tmp_path / "run"
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="a crash while collecting"):
        run_on(None, run_dir, cluster=cluster, env_factory=push_right_envs, **kw)
    counters = load_checkpoint(run_dir)["counters"]
    assert counters["iteration"] == 1
    assert counters["evaluating"]["iteration"] == 1
    assert counters["evals"] == []
    monkeypatch.setattr(RayRoles, "collect", original)
    sent = []  # whether each evaluation got a checkpoint's weights
    start = RayRoles.start_evaluation

    def start_evaluation(roles, **call):
        sent.append(call.get("weights") is not None)
        return start(roles, **call)

    monkeypatch.setattr(RayRoles, "start_evaluation", start_evaluation)
    resumed = run_on(
        None, run_dir, cluster=cluster, env_factory=push_right_envs, resume=str(run_dir), **kw
    )
    assert sent == [True, False]  # iteration 1 again from its checkpoint, then iteration 2

    def untimed_evals(summary):
        return [
            (e["iteration"], e["success_rate"], untimed(e["tasks"]["all"]))
            for e in summary["evals"]
        ]

    assert untimed_evals(resumed) == untimed_evals(embedded)
    assert [e["iteration"] for e in resumed["evals"]] == [1, 2]
    assert "evaluating" not in load_checkpoint(run_dir)["counters"]
    # iteration 2's checkpoint was saved as its evaluation started: it lacks the result
    older = run_dir / "checkpoints" / "iter_000002"
    counters = load_checkpoint(older)["counters"]
    assert counters["evaluating"]["iteration"] == 2
    assert [e["iteration"] for e in counters["evals"]] == [1]
    sent.clear()
    again = run_on(
        None, run_dir, cluster=cluster, env_factory=push_right_envs, resume=str(older), **kw
    )
    assert sent == [True]  # iteration 2 again from its checkpoint
    assert untimed_evals(again) == untimed_evals(embedded)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row["iteration"] for row in logged if "eval/success_rate" in row]
    assert evaluated.count(2) == 1  # (the old row of iteration 2's evaluation was dropped)


@pytest.mark.slow  # (about 90 s: a Ray run and three resumes)
def test_an_unfinished_evaluation_that_cannot_run_again_keeps_its_row_on_resume(
    local_ray, tmp_path, capsys, one_thread
):
    """A real run's checkpoint edited by hand: iteration 1's names its evaluation beside training
    as unfinished, and that evaluation's row was logged after iteration 2's. A resumed run with an
    evaluation worker that still cannot run it again says why, keeps the row once and drops
    iteration 2's: no iteration is left (the steps, or the minutes, spent), or its checkpoint is
    gone (resumed from iteration 2's, which names it too)."""
    steps = 8 * 3  # an iteration: one round of 8 environments, 3 chunks each
    cluster = {**CLUSTER, "env": dict(num_cpus=0.5), "eval": dict(workers=1, num_cpus=0.5)}
    kw = dict(cluster=cluster, env_factory=push_right_envs, algorithm=ONE_ROUND, save_every=1)
    made = tmp_path / "made" / "run"
    torch.manual_seed(0)
    run_on(None, made, total_env_steps=2 * steps, **kw)
    # (no evaluation of 16 episodes gives 0.123: the row is the hand-written one)
    evaluation = {"iteration": 1, "env_steps": steps, "eval/success_rate": 0.123}
    checkpoints = made / "checkpoints"
    first = torch.load(checkpoints / "iter_000001" / "trainer.pt", weights_only=False)
    at = {key: first["counters"][key] for key in EVALUATED_AT}
    for name in ("iter_000001", "iter_000002"):  # each names iteration 1's evaluation in flight
        path = checkpoints / name / "trainer.pt"
        trainer = torch.load(path, weights_only=False)
        trainer["counters"]["evaluating"] = at
        torch.save(trainer, path)
    table = rows(made)
    (made / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [table[0], table[1], evaluation, *table[2:]])
    )

    def resume(case: str, checkpoint: str, gone: str | None = None, **run) -> tuple[str, list]:
        """(what the resumed run said of the evaluation, the iterations with a training row)"""
        run_dir = tmp_path / case / "run"
        shutil.copytree(made, run_dir, symlinks=True)
        if gone is not None:
            shutil.rmtree(run_dir / "checkpoints" / gone)
        capsys.readouterr()
        run_on(None, run_dir, resume=str(run_dir / "checkpoints" / checkpoint), **kw, **run)
        out = capsys.readouterr()
        lines = (out.out + out.err).splitlines()
        said = [line for line in lines if line.startswith("the evaluation of iteration")]
        assert len(said) == 1
        logged = rows(run_dir)
        assert [r for r in logged if r.get("eval/success_rate") == 0.123] == [evaluation]
        return said[0], [r["iteration"] for r in logged if "policy/loss" in r]

    spent = load_checkpoint(made / "checkpoints" / "iter_000001")["counters"]["train_seconds"]
    no_iteration_left = "no iteration is left to run it beside"
    assert resume("steps", "iter_000001", total_env_steps=steps) == (
        f"the evaluation of iteration 1 was unfinished: {no_iteration_left} "
        "(rows it logged before the stop, if any, are kept)",
        [1],
    )
    said, trained = resume(
        "minutes", "iter_000001", total_env_steps=2 * steps, max_minutes=spent / 120
    )
    assert no_iteration_left in said and trained == [1]
    said, trained = resume("gone", "iter_000002", gone="iter_000001", total_env_steps=3 * steps)
    assert re.search(r"its checkpoint \S+iter_000001 is gone", said) and trained == [1, 2, 3]
    assert "evaluating" not in load_checkpoint(tmp_path / "gone" / "run")["counters"]


@pytest.mark.slow  # (about 20 s)
@pytest.mark.timeout(300)  # the gloo timeout is 600 s: a collective left hanging fails here
def test_a_rank_lost_inside_the_update_collective_stops_the_run_with_one_line(
    local_ray, tmp_path, monkeypatch, one_thread
):
    """Rank 1 of two actor workers SIGKILLed a second into the first update, whose million
    epochs cannot end before the kill on any machine: rank 0's collective fails, the update's
    result is the lost worker (not a hang until the gloo timeout), and the run stops with one
    line, having logged and saved no iteration."""
    original = RemoteLearner.start_update
    result_whole = Pending.result
    killed = []
    outcomes = []  # what each awaited update gave: "metrics" or the error's type

    def start_update(learner):
        # rank 1's process id first (a ping would queue behind the update)
        killed.append(ray.get(learner.workers[1].ping.remote()))
        pending = original(learner)
        time.sleep(1.0)  # (into the update: the kill's moment, asserted nowhere)
        os.kill(killed[0], signal.SIGKILL)
        return pending

    def result(pending):
        try:
            metrics = result_whole(pending)
        except Exception as error:
            outcomes.append(type(error).__name__)
            raise
        outcomes.append("metrics")
        return metrics

    monkeypatch.setattr(RemoteLearner, "start_update", start_update)
    monkeypatch.setattr(Pending, "result", result)
    cluster = {**CLUSTER, "actor": dict(workers=2, num_cpus=0.25)}
    with pytest.raises(WorkerLost) as lost:
        run_on(
            None,
            tmp_path / "ray",
            total_env_steps=8 * 3 * 3,
            cluster=cluster,
            env_factory=push_right_envs,
            algorithm={**ONE_ROUND, "update_epochs": 10**6},
            save_every=1,
        )
    message = str(lost.value)
    assert len(killed) == 1 and "\n" not in message
    assert message.startswith("actor worker lost: ")
    assert outcomes == ["WorkerLost"]  # lost inside the update
    assert "policy/loss" not in (tmp_path / "ray" / "metrics.jsonl").read_text()
    assert not list((tmp_path / "ray").glob("checkpoints/iter_*"))


def test_the_first_observations_lost_with_their_env_worker_lose_only_that_round(
    local_ray, tmp_path, monkeypatch
):
    """The first reset's observations stay with the env workers until the actor worker fetches
    them for its normaliser: env worker 0 SIGKILLed (and restarted) before that fetch loses
    the first round, which is collected again from the same reset; the run goes on."""
    seen = []
    sync = RayRoles.sync

    def sync_seen(roles, version):
        seen[:] = [roles]
        return sync(roles, version)

    killed = []
    init_normalizer = RemoteLearner.init_normalizer

    def init_after_a_loss(learner, obs):
        if not killed:
            killed.append(killed_and_restarted(seen[0].envs.workers[0]))
        return init_normalizer(learner, obs)

    monkeypatch.setattr(RayRoles, "sync", sync_seen)
    monkeypatch.setattr(RemoteLearner, "init_normalizer", init_after_a_loss)
    iterations = 2
    run_rounds(tmp_path / "ray", iterations)
    assert killed
    what = "the first observations were"
    assert_one_round_lost_with_an_env_worker(tmp_path / "ray", iterations, what)
