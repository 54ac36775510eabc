"""Workers lost on a local Ray (SIGKILL, as in a segfault, or restarted unseen): replaced, their
rounds collected again, their data lost with them and no more; a simulator's own error; a
role lost too often in a round stops the run with one line (more: test_cluster_losses.py)."""

import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cluster_runs import (
    CLUSTER,
    ONE_ROUND,
    TWO_ENV_WORKERS,
    Recorder,
    Saboteur,
    discarded_rounds,
    roles_on,
    rows,
    run_rounds,
)
from scripted_envs import push_right_tasks_with_goals, run_on

from embodied.checkpoint import load_checkpoint
from embodied.cli import main
from embodied.cluster.learner import RemoteLearner
from embodied.cluster.roles import RayRoles
from embodied.episode_stats import EpisodeStats
from embodied.roles import WorkerLost
from embodied.rollout import CollectPlan
from embodied.schema import UserError

ray = pytest.importorskip("ray")


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


@pytest.mark.slow  # (56 s on 2 cores, the default suite's longest; CI runs the slow set)
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
    # each loss names the worker: its index and the process it was, and an env worker's task,
    # rows and seeds: its round's reset (GRPO: a group's 4 rows share one), or its episodes of
    # the final evaluation (held out: 3e9 on; 8 of the 16 each)
    host = os.uname().nodename
    named = [e["worker"] for e in status["events"]]
    first, last = (int(named[event].split()[2]) for event in (0, 2))
    envs = [f"envs {4 * index}-{4 * index + 3}" for index in (first, last)]
    where = [f"pid {pid} on {host}; task all" for pid in (killed_env, saboteur.killed(3))]
    round_seed = rf"env worker {first} \({re.escape(where[0])}; {envs[0]}; seed \d+\)"
    assert re.fullmatch(round_seed, named[0])
    seeds = f"seeds {3 * 10**9 + 8 * last}..{3 * 10**9 + 8 * last + 7}"
    assert named[2] == f"env worker {last} ({where[1]}; {envs[1]}; {seeds})"
    assert named[1] == f"rollout worker 0 (pid {killed_rollout} on {host})"
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
    for line, worker in zip(shown[7:], named):
        assert f": {worker} lost (" in line
    assert len(recorder.samples) == iterations
    recorder.assert_whole_rounds()
    # one episode per environment and round: nothing of the lost rounds was counted
    counts = [r["episode/count"] for r in table if "episode/count" in r]
    assert counts == [8.0] * iterations


@pytest.mark.slow  # (about 20 s each)
@pytest.mark.parametrize("weight_sync", ["object_store", "broadcast"])
def test_a_round_lost_beside_the_update_is_collected_again_with_the_updates_weights(
    local_ray, tmp_path, monkeypatch, weight_sync
):
    """cluster.max_staleness 1: the rollout worker SIGKILLed in the third iteration's round,
    collected while the second update runs. The actor holds only that update's weights, so the
    round collected again acts with them and says so (version 2, not the lost round's 1); the
    copies' new weight-sync group waits for the update rather than beside it."""
    run_dir = tmp_path / "ray"
    saboteur = Saboteur(tmp_path)
    recorder = Arming(saboteur, run_dir, {2: rollout_pid})
    recorder.patch(monkeypatch)
    iterations = 4
    cluster = {**TWO_ENV_WORKERS, "max_staleness": 1, "weight_sync": weight_sync}
    run_rounds(run_dir, iterations, env_factory=saboteur, cluster=cluster)
    assert saboteur.killed(2) is not None
    assert discarded_rounds(rows(run_dir)) == [(3, 1)]
    versions = [samples.policy_version.unique().tolist() for samples in recorder.samples]
    assert versions == [[0], [0], [2], [2]]
    recorder.assert_whole_rounds()


@pytest.mark.slow  # (36 s; a role lost too often stays in the default suite; CI runs this)
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


# why the worker was found restarted: without its connections, without the learner's weights,
# outside the weight-sync group
UNLINKED = "restarted since the last round: not connected"
UNSYNCED = "restarted since the last sync: its policy copy has none of the learner's weights"
UNGROUPED = "restarted since the last sync: not in the weight-sync group"


@pytest.mark.slow  # (25 s each)
@pytest.mark.parametrize(
    "weight_sync, rollout_workers, killed_workers, discarded, details",
    [
        ("object_store", 1, [("env", 0), ("rollout", 0)], [(2, 1)], [UNLINKED, UNSYNCED]),
        ("broadcast", 1, [("env", 0), ("rollout", 0)], [(2, 1)], [UNLINKED, UNGROUPED]),
        ("object_store", 0, [("env", 0), ("env", 1)], [], [UNSYNCED, UNSYNCED]),
    ],
)
def test_workers_restarted_between_rounds_are_found_unconnected_and_brought_back(
    local_ray,
    tmp_path,
    monkeypatch,
    weight_sync,
    rollout_workers,
    killed_workers,
    discarded,
    details,
):
    """A worker dies and is restarted while the first update runs, another while the second
    does. An env worker without its connections is found by the next round, which it loses and
    which is collected again once everyone is connected afresh. A policy copy (a rollout worker,
    or an env worker's with ``rollout.workers: 0``) without the learner's weights, or outside
    the weight-sync group, is found by the sync after the update, which sends it every weight
    (the frozen ones too) in a new group, its stream restored: no round is lost to it."""
    recorder = Recorder()
    start_update = recorder.start_update
    roles_seen = watch_roles(monkeypatch)
    killed = []

    def start_update_then_kill(learner):
        pending = start_update(learner)
        updates = len(recorder.samples)
        if updates in (1, 2):
            role, index = killed_workers[updates - 1]
            killed.append(killed_and_restarted(roles_seen[0].groups[role].workers[index]))
        return pending

    recorder.start_update = start_update_then_kill
    recorder.patch(monkeypatch)
    iterations = 4
    cluster = {
        **TWO_ENV_WORKERS,
        "rollout": dict(workers=rollout_workers, num_cpus=0.5 * rollout_workers),
        "weight_sync": weight_sync,
    }
    run_rounds(tmp_path / "ray", iterations, cluster=cluster)
    assert len(killed) == 2
    table = rows(tmp_path / "ray")
    assert discarded_rounds(table) == discarded
    assert len([r for r in table if "policy/loss" in r]) == iterations
    events = json.loads((tmp_path / "ray" / "cluster.json").read_text())["events"]
    assert [(e["role"], e["detail"]) for e in events] == [
        (role, detail) for (role, _), detail in zip(killed_workers, details)
    ]
    recorder.assert_whole_rounds()


def test_a_worker_lost_in_a_call_to_several_is_named_before_a_survivors_error(local_ray, tmp_path):
    """A survivor's error (as a collective fails when its peer goes) can reach ray.get before
    Ray reports the peer's death: it was raised as it was, no WorkerLost, and nothing was
    recovered. Here the peer says it is going, and exits half a second later."""
    from embodied.cluster.calls import get

    going = tmp_path / "going"

    @ray.remote(num_cpus=0, max_restarts=0)
    class Peer:
        def broken(self):
            while not going.exists():
                time.sleep(0.01)
            raise RuntimeError("the collective its peer left")

        def die(self):
            going.touch()
            time.sleep(0.5)
            os._exit(1)

    survivor, dying = Peer.remote(), Peer.remote()
    ray.get([survivor.__ray_ready__.remote(), dying.__ray_ready__.remote()])  # (both started)
    calls = [survivor.broken.remote(), dying.die.remote()]
    with pytest.raises(WorkerLost, match=r"^rollout worker 1 lost: "):
        get(calls, "rollout", lambda index: f"rollout worker {index}")
    ray.kill(survivor)


@pytest.mark.parametrize(
    "broke",
    [pytest.param("raise", marks=pytest.mark.slow), "user"],  # (a round's set-up each)
)
def test_a_simulator_error_mid_round_ends_the_round_with_that_error(local_ray, tmp_path, broke):
    """An env worker's simulator raises at a round's second step: its rollout worker and the
    other env worker lose their links, and the round ends with the simulator's own error, not
    theirs: a bug with its traceback, a user's error (a non-finite action) as itself, one line
    (the text of Ray's wrapper of it was the worker's traceback)."""
    import ray

    saboteur = Saboteur(tmp_path)
    policy = {"name": "actor_critic", "hidden_sizes": [8], "use_images": False}
    roles = roles_on(tmp_path, TWO_ENV_WORKERS, policy, saboteur)
    plan = CollectPlan(seeds=3, group_of_env=torch.full((8,), -1), num_chunks=3, episode_base=0)
    try:
        roles.sync(0)
        roles.envs.reset(seed=np.int64(5))  # (a numpy seed is an integer too: env b gets 5 + b)
        assert roles.envs.seeds == [[5, 6, 7, 8], [9, 10, 11, 12]]
        saboteur.arm(1, broke)
        stats = EpisodeStats(roles.envs.task_names, torch.device("cpu"))
        obs = roles.envs.reset(seed=plan.seeds)
        with pytest.raises((ray.exceptions.RayTaskError, UserError)) as error:
            roles.collect(obs, plan, stats)
        if broke == "raise":
            assert isinstance(error.value.cause, RuntimeError)
            assert "the simulator broke" in str(error.value)
        else:
            assert type(error.value) is UserError
            assert str(error.value) == "the actions of environments [1] are not finite"
        assert (tmp_path / "claimed-1").exists() and saboteur.killed(1) is None  # (no kill)
    finally:
        roles.close()


def test_a_role_lost_too_often_stops_the_run_with_a_resumable_checkpoint(
    local_ray, tmp_path, monkeypatch, capsys
):
    """cluster.max_restarts 0: the first lost round stops the run, with one line naming the
    worker (its process, task, rows and the round's seeds); the last completed iteration is
    saved first, and no round is said to be collected again."""
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
    host = os.uname().nodename
    worker = f"env worker 0 (pid {saboteur.killed(1)} on {host}; task all; envs 0-7; seeds 2, 3)"
    assert message.startswith(f"{worker} lost: ")
    assert message.endswith("1 rounds in a row lost (cluster.max_restarts=0)")
    checkpoint = load_checkpoint(tmp_path / "ray")
    assert checkpoint["counters"]["iteration"] == 1
    assert checkpoint["counters"]["env_steps"] == 8 * 3
    assert "collected again" not in capsys.readouterr().out
    assert discarded_rounds(rows(tmp_path / "ray")) == []


@pytest.mark.slow  # (36 s; a round lost with its env worker stays in the default suite)
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


def die_soon(worker) -> None:
    """Run in a worker (``__ray_call__``): SIGKILL itself a second from now, so that the call
    the driver sends it next is in flight when it dies (the moment is asserted nowhere)."""
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def weights_of(worker) -> tuple[dict, int | None, dict | None]:
    """Run in a worker: its policy's state dict (the learner's, or its inference copy's), the
    copy's weight version and its stream."""
    if hasattr(worker, "learner"):
        return worker.learner.engine.torch_policy.state_dict(), None, None
    return worker.inference.policy.state_dict(), worker.version, worker.stream.state()


@pytest.mark.slow  # (45 s on 2 cores; CI runs the slow set)
def test_env_workers_that_infer_and_are_restarted_get_back_all_the_run_gave_them(
    local_ray, tmp_path, monkeypatch, capsys
):
    """``rollout.workers: 0``, weights by broadcast, env workers of two tasks whose privileged
    keys differ (``far`` observes one more than ``near``). Env worker 0 dies and is restarted
    while the first update runs: the sync after it finds the worker outside the sync group with
    none of the weights. Env worker 1 dies while the timing call after that sync is in
    flight. Each is replaced where it is found, as in a sync: before it acts again it is back in
    a sync group, with all the weights (the frozen vision encoder's too), its stream as the last
    round left it, and the privileged keys both tasks have. No round is lost."""
    roles_seen = watch_roles(monkeypatch)
    collect, start_update, metrics = RayRoles.collect, RemoteLearner.start_update, RayRoles.metrics
    killed, rounds = [], []  # rounds: per round and env worker (version, differing, same stream)

    def check_then_collect(roles, *args, **kw):
        actor, _, _ = ray.get(roles.learner.workers[0].__ray_call__.remote(weights_of))
        for index, worker in enumerate(roles.envs.workers):
            copy, version, stream = ray.get(worker.__ray_call__.remote(weights_of))
            differ = [k for k in actor if not torch.equal(copy[k], actor[k])]
            kept = roles.inference.streams[f"rollout/{index}"]["cpu"]
            rounds.append((version, len(differ), torch.equal(stream["cpu"], kept)))
        return collect(roles, *args, **kw)

    def kill_in_the_update(learner):
        pending = start_update(learner)
        if not killed:
            killed.append(killed_and_restarted(roles_seen[0].envs.workers[0]))
        return pending

    def kill_in_the_timing_call(roles):
        if roles.inference.version == 1 and len(killed) == 1:
            killed.append(ray.get(roles.envs.workers[1].ping.remote()))
            roles.envs.workers[1].__ray_call__.remote(die_soon)
        return metrics(roles)

    monkeypatch.setattr(RayRoles, "collect", check_then_collect)
    monkeypatch.setattr(RemoteLearner, "start_update", kill_in_the_update)
    monkeypatch.setattr(RayRoles, "metrics", kill_in_the_timing_call)
    cluster = {**TWO_ENV_WORKERS, "rollout": dict(workers=0), "weight_sync": "broadcast"}
    run_dir = tmp_path / "ray"
    iterations = 2
    run_on(
        None,
        run_dir,
        total_env_steps=8 * 3 * iterations,
        cluster=cluster,
        env_factory=push_right_tasks_with_goals,
        env_cfg={"tasks": ["far", "near"]},
        algorithm=ONE_ROUND,
    )
    assert len(killed) == 2
    table = rows(run_dir)
    assert len([r for r in table if "policy/loss" in r]) == iterations
    assert discarded_rounds(table) == []  # (found in the sync and the timing call)
    # every round: both copies at the last update's version, equal to the actor's weights in
    # every entry, each drawing from the stream the last round left it
    assert rounds == [(version, 0, True) for version in range(iterations) for _ in range(2)]
    events = json.loads((run_dir / "cluster.json").read_text())["events"]
    host = os.uname().nodename
    named = [
        f"env worker {i} (pid {pid} on {host}; task {task}; envs {4 * i}-{4 * i + 3}; seed "
        for i, (pid, task) in enumerate(zip(killed, ("far", "near")))
    ]
    assert [e["worker"][: len(prefix)] for e, prefix in zip(events, named)] == named
    assert events[0]["detail"] == UNGROUPED
    assert len(events) == 2
    said = capsys.readouterr().out  # (each loss, on the console as a lost round's is)
    assert f"{events[0]['worker']} lost: {UNGROUPED}; replaced, the weights sent again" in said
    assert f"{events[1]['worker']} lost: " in said
    assert "; replaced, its busy time since the last iteration lost (failure 1 in a row)" in said
