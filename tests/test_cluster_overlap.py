"""What runs beside what on a local Ray: collection beside the update (one version behind),
pipeline stages of an env worker's rows, evaluations beside training (and their loss, and
an evaluation unfinished when a run stopped)."""

import json
import os
import re
import shutil
import signal

import pytest
import torch
from cluster_runs import (
    CLUSTER,
    ONE_ROUND,
    TWO_ENV_WORKERS,
    Recorder,
    assert_same_numbers,
    record_calls,
    roles_on,
    rows,
    untimed,
)
from scripted_envs import TINY_VLA, PushRightEnv, push_right_envs, run_on, subset_stepping_envs

from embodied.checkpoint import load_checkpoint
from embodied.cluster import evaluation as cluster_evaluation
from embodied.cluster.evaluation import Evaluation
from embodied.cluster.learner import Pending, RemoteLearner
from embodied.cluster.roles import RayRoles
from embodied.episode_stats import EpisodeStats
from embodied.roles import WorkerLost
from embodied.rollout import CollectPlan
from embodied.run import EVALUATED_AT

ray = pytest.importorskip("ray")


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
        pid = ray.get(evaluator.ping.remote())
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLost, match=rf"^eval worker 0 \(pid {pid} on .+\) lost: "):
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
    the policy acts for another); an env worker that infers itself (rollout workers 0) keeps
    chunks of several actions in lockstep, as the embedded run does (its policy's stream swaps
    torch's global generator, which a simulator in a chunk thread would draw from)."""
    # (factory, env workers, rollout workers, candidates for chunks of 1 action, for chunks of 2)
    cases = [
        (push_right_envs, 2, 1, [1], [1]),
        (subset_stepping_envs, 2, 1, [1, 2, 4], [1, 2, 4]),
        (subset_stepping_envs, 1, 1, [1, 2, 4, 8], [1, 2, 4, 8]),
        (push_right_envs, 2, 0, [1], [1]),
        (subset_stepping_envs, 2, 0, [1, 2, 4], [1]),
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
            stats = EpisodeStats(envs.task_names, torch.device("cpu"))
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
    # 16 episodes from the selection seeds (2e9 + seed 0): 8 each
    assert shares == [[(8, 2_000_000_000), (8, 2_000_000_008)]] * 2
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
