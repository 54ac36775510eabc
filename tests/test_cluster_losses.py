"""Losses on a local Ray beyond what replacing a worker mends: a worker lost once too often in a
weight sync stops the run with the finished update's iteration saved; a rank lost inside the
update's collective stops it with one line; an evaluation worker that cannot come back loses
the evaluations beside training, not the run."""

import os
import signal
import time

import pytest
from cluster_runs import CLUSTER, ONE_ROUND, roles_on, rows, run_rounds
from scripted_envs import TINY_VLA, BrokenOnceFlagged, push_right_envs, run_on

from embodied.checkpoint import load_checkpoint
from embodied.cluster.inference import RemoteInference
from embodied.cluster.learner import Pending, RemoteLearner
from embodied.roles import WorkerLost

ray = pytest.importorskip("ray")


@pytest.mark.slow  # (22 s on 2 cores)
def test_a_worker_lost_too_often_in_a_sync_saves_the_iteration_the_update_finished(
    local_ray, tmp_path, monkeypatch
):
    """cluster.max_restarts 0, a checkpoint only at the end: the rollout worker SIGKILLed just
    before the sync after the second update stops the run, and that update's iteration is
    saved (the actor holds it) and logged, without the sync's numbers. It was lost, with every
    iteration since the last save."""
    send = RemoteInference.send_weights
    killed = []

    def send_weights(inference, version):
        if version == 2 and not killed:
            killed.append(ray.get(inference.workers[0].ping.remote()))
            os.kill(killed[0], signal.SIGKILL)
        return send(inference, version)

    monkeypatch.setattr(RemoteInference, "send_weights", send_weights)
    run_dir = tmp_path / "ray"
    with pytest.raises(WorkerLost, match="1 rounds in a row lost"):
        run_rounds(run_dir, 3, cluster={**CLUSTER, "max_restarts": 0})
    assert killed
    checkpoint = load_checkpoint(run_dir)
    assert checkpoint["counters"]["iteration"] == 2
    assert checkpoint["counters"]["policy_version"] == 2
    table = [r for r in rows(run_dir) if "policy/loss" in r]
    assert [r["iteration"] for r in table] == [1, 2]
    assert "cluster/sync_ms" in table[0] and "cluster/sync_ms" not in table[1]


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
    assert message.startswith(f"actor worker 1 (pid {killed[0]} on {os.uname().nodename}) lost: ")
    assert outcomes == ["WorkerLost"]  # lost inside the update
    assert "policy/loss" not in (tmp_path / "ray" / "metrics.jsonl").read_text()
    assert not list((tmp_path / "ray").glob("checkpoints/iter_*"))


@pytest.mark.slow  # (about 20 s)
def test_an_evaluation_worker_that_cannot_come_back_loses_evaluations_not_the_run(
    local_ray, tmp_path
):
    """The evaluation worker SIGKILLed mid-evaluation, and its simulator fails to start when
    Ray restarts it: that evaluation and every later one are lost, each with one line, and the
    run's other calls go on. The restart's error used to end the run (WorkerNotStarted)."""
    cluster = {**CLUSTER, "env": dict(num_cpus=0.5), "eval": dict(workers=1, num_cpus=0.5)}
    broken = tmp_path / "broken"
    roles = roles_on(tmp_path, cluster, TINY_VLA, BrokenOnceFlagged(broken))
    try:
        roles.sync(1)
        long = roles.start_evaluation(episodes=4000, seed=0)  # 1500 steps of 8 environments
        (evaluator,) = roles.groups["eval"].workers
        pid = ray.get(evaluator.ping.remote())
        broken.touch()  # (a simulator built from here fails)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLost, match=rf"^eval worker 0 \(pid {pid} on .+\) lost: "):
            long.result()
        roles.metrics()
        roles.sync(2)
        said = (
            r"could not start: RuntimeError: the simulator did not start; no evaluation runs "
            "beside training from here$"
        )
        for version in (3, 4):
            with pytest.raises(WorkerLost, match=said):
                roles.start_evaluation(episodes=8, seed=0).result()
            roles.metrics()
            roles.sync(version)
        assert [event["role"] for event in roles.events] == ["eval", "eval"]
    finally:
        roles.close()
