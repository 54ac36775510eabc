"""The roles on a local Ray (2 CPUs) give the embedded run's numbers: PPO and GRPO, inference
in the env worker, other simulators, tasks split over env workers, data-parallel and
tensor-parallel actor workers, resume.

One Ray instance serves the module (started as ``embodied train`` starts one); each run places
its own workers and removes them at its end.
"""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from cluster_runs import (
    CLUSTER,
    ON_RAY,
    ONE_ROUND,
    ROOT,
    TWO_ENV_WORKERS,
    WholeSeedEnv,
    assert_same_numbers,
    block_ray,
    discarded_rounds,
    pushcube,
    roles_on,
    rows,
    untimed,
    whole_seed_envs,
)
from safetensors.torch import load_file
from scripted_envs import (
    PUSH_RIGHT_TASKS,
    PushRightEnv,
    push_right_envs,
    push_right_tasks,
    push_right_tasks_with_goals,
    run_on,
)

from embodied.checkpoint import load_checkpoint
from embodied.cluster.envs import RemoteEnvGroup
from embodied.cluster.inference import RemoteInference
from embodied.cluster.learner import RemoteLearner
from embodied.cluster.roles import RayRoles
from embodied.config import ConfigError, load_config
from embodied.env_group import EnvGroup
from embodied.episode_stats import EpisodeStats
from embodied.multitask import MultiTaskEnv
from embodied.replay import differences, replay
from embodied.roles import WorkerLost
from embodied.rollout import CollectPlan
from embodied.runner import train
from embodied.train_config import TrainConfig

ray = pytest.importorskip("ray")


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
    """From its own checkpoint, the generator state included. A forced resume with a policy of
    another size is the actor worker's one-line ConfigError, as in one process."""
    train(pushcube(tmp_path, "embedded"))
    train(pushcube(tmp_path, "ray", ON_RAY))
    checkpoint = tmp_path / "ray" / "checkpoints" / "iter_000002"
    resize = [f"runner.resume={checkpoint}", "runner.resume_force=true", "policy.hidden_sizes=[8]"]
    with pytest.raises(ConfigError, match="weights of other shapes") as raised:
        train(pushcube(tmp_path, "ray", [*ON_RAY, *resize]))
    assert type(raised.value) is ConfigError and "\n" not in str(raised.value)
    train(pushcube(tmp_path, "ray", [*ON_RAY, f"runner.resume={checkpoint}"]))
    assert_same_numbers(rows(tmp_path / "embedded"), rows(tmp_path / "ray"))


# the other simulators, with a tiny run each: embedded and on Ray, the same rows
SIMULATORS = [
    pytest.param(
        "configs/mujoco/reach_ppo.yaml",
        ["env.num_envs=4", "algorithm.num_steps=8", "env.render_size=32"],
        id="mujoco",
        marks=pytest.mark.slow,  # (40 s; PPO and GRPO on Ray stay in the default suite)
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


@pytest.mark.slow  # (8 s; restarted env workers that infer get their keys back in the suite)
def test_env_workers_that_infer_act_on_the_privileged_keys_every_task_has(local_ray, tmp_path):
    """``rollout.workers: 0``, one task per env worker, ``far`` observing a privileged key that
    ``near`` lacks: each env worker's policy copy is built for the keys both have, as the
    learner's is, so the actor-critic (which reads every privileged key it is given) takes the
    learner's weights, and a round holds those keys only."""
    policy = {"name": "actor_critic", "hidden_sizes": [8], "use_images": False}
    cluster = {**TWO_ENV_WORKERS, "rollout": dict(workers=0)}
    tasks = {"tasks": ["far", "near"]}
    roles = roles_on(tmp_path, cluster, policy, push_right_tasks_with_goals, tasks)
    plan = CollectPlan(seeds=3, group_of_env=torch.full((8,), -1), num_chunks=3, episode_base=0)
    try:
        roles.sync(0)  # (all the weights: a copy of other shapes would refuse them)
        stats = EpisodeStats(roles.envs.task_names, torch.device("cpu"))
        batch = roles.collect(roles.envs.reset(seed=plan.seeds), plan, stats).fetch()
    finally:
        roles.close()
    assert list(batch.obs.privileged) == ["goal"]
    assert batch.obs.privileged["goal"].shape == (3, 8, 1)


def test_an_int_reset_seed_reaches_each_env_worker_as_an_int(local_ray, tmp_path):
    """As in the embedded run: ManiSkill's GPU backend resets a batch seeded by one int in one
    call, and one seeded by a list in a call per seed, from other initial states. Each env
    worker was sent its rows' list."""
    policy = {"name": "actor_critic", "hidden_sizes": [8], "use_images": False}
    roles = roles_on(tmp_path, TWO_ENV_WORKERS, policy, whole_seed_envs)
    try:
        on_ray = roles.envs.reset(seed=5).fetch()
        listed = roles.envs.reset(seed=list(range(5, 13))).fetch()
    finally:
        roles.close()
    embedded = EnvGroup(WholeSeedEnv([0] * 8)).reset(seed=5)
    assert embedded.state[:, 2].tolist() == [-s for s in range(5, 13)]
    assert on_ray.state[:, 2].tolist() == embedded.state[:, 2].tolist()
    assert listed.state[:, 2].tolist() == list(range(5, 13))


@pytest.mark.slow  # (28 s; CI runs the slow set)
def test_env_workers_holding_different_tasks_evaluate_as_the_embedded_run(
    local_ray, tmp_path, one_thread, monkeypatch
):
    """Two tasks on two env workers, one each: every evaluation (before RL, during training,
    the final one) is one call per env worker, which evaluates its own task's episodes acting
    through the rollout worker, and gives the embedded run's numbers. The final evaluation's
    video is the first env worker's, named by its task only."""
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
    for k, task in enumerate(PUSH_RIGHT_TASKS):
        expected = {**untimed(embedded["tasks"][task]), "eval/video": video}
        if k > 0:  # (the second env worker's task: the first worker's video does not show it)
            expected.pop("eval/video")
        assert untimed(on_ray["tasks"][task]) == expected
    assert Path(video).stat().st_size > 0
    # before RL, after iteration 1 (the selection seeds, 2e9 + seed), the final one (held out,
    # 3e9 + seed): 16 episodes of each task on the one env worker that holds it
    selection, held_out = [[(16, 2_000_000_000)]] * 2, [[(16, 3_000_000_000)]] * 2
    assert evaluated == [selection, selection, held_out]


@pytest.mark.slow  # (74 s on 2 cores; CI runs the slow set)
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
    assert message.startswith(f"actor worker 1 (pid {killed[0]} on {os.uname().nodename}) lost: ")
    assert message.endswith("; the learner's state (weights, optimizer) was lost with it")
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


def test_a_survivor_told_its_keys_in_recovery_drops_the_failed_rounds_steps():
    """A peer lost mid-round: the survivor's other stage was still stepping, and the new group
    that ``keep_privileged`` made (recovery) left it queued: the next round's reset took that
    step's answer. It is finished and dropped; the next round steps from the reset."""
    from scripted_envs import ScriptedEnv

    from embodied.cluster.workers import EnvWorker
    from embodied.multitask import MultiTaskEnv

    core = ScriptedEnv([0, 0, 0, 0], max_episode_steps=9, can_step_subsets=True)
    worker = EnvWorker(None, lambda cfg: MultiTaskEnv([core], ["a"]))
    worker.group.reset(seed=0)
    worker.group.send(torch.ones(2, 1, 1), torch.tensor([1, 3]))  # (never received)
    worker.keep_privileged([])
    assert core.pending == []
    obs = worker.group.reset(seed=10)
    assert obs.state[:, 0].tolist() == [0.0] * 4  # (t: every row at its start)
    worker.group.send(torch.ones(2, 1, 1), torch.tensor([1, 3]))
    assert worker.group.receive(torch.tensor([1, 3])).obs.state[:, 0].tolist() == [1.0, 1.0]


def test_an_env_worker_that_infers_runs_its_chunks_in_the_acting_thread():
    """Its policy samples from the run's stream, which swaps torch's global generator: a chunk
    stepping in a thread meanwhile (a simulator's automatic reset drawing from that generator)
    would take the stream's numbers. A plain env worker, whose process only steps, keeps the
    thread (its chunks of several actions pipeline); one that infers splits no stages for them."""
    from scripted_envs import ScriptedEnv

    from embodied.cluster.workers import EnvRolloutWorker, EnvWorker
    from embodied.models import ActorCriticConfig

    def factory(cfg):
        return ScriptedEnv([2, 0, 3, 1], max_episode_steps=5, can_step_subsets=True)

    plain = EnvWorker(None, factory)
    policy = ActorCriticConfig(hidden_sizes=[16], use_images=False)
    inferring = EnvRolloutWorker(None, factory, policy, "cpu", 1, 0, 0)
    assert len(plain.group.stage_split(2, chunk_size=4)) == 2
    assert inferring.group.stage_split(2, chunk_size=4) == [(None, slice(None))]
    assert len(inferring.group.stage_split(2, chunk_size=1)) == 2  # (one action: asynchronous)
