"""Placement: roles' resources planned, checked against the Ray cluster before any worker
starts (one line naming the role and the resource), and env configs split over env
workers. What stops a cluster run before or at its start, or for good (Ray missing, a worker
that cannot start, a lost actor worker), is one line that says what there is to resume."""

import os
import re
import signal

import pytest
import torch
from cluster_runs import (
    ON_RAY,
    ROOT,
    TINY,
    TWO_ENV_WORKERS,
    block_ray,
    overflowing_at_close,
    roles_on,
    rows,
    unready_evaluators,
)
from tiny_runs import TINY_REACH

from embodied.cli import main
from embodied.cluster.config import ClusterConfig, RoleConfig
from embodied.cluster.placement import plan_slots
from embodied.cluster.roles import RayRoles

ray = pytest.importorskip("ray")
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_ray_missing_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch):
    """(First in the module: the other tests' Ray, once started, imports its modules.)"""
    block_ray(monkeypatch)
    argv = ["train", str(ROOT / "configs/mujoco/reach_ppo.yaml"), *TINY_REACH]
    assert main([*argv, f"runner.output_dir={tmp_path}", "cluster.enabled=true"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "embodied: error: cluster.enabled: the roles on Ray need Ray, which is not installed "
        "here: pip install 'embodied[ray]' (or set cluster.enabled=false)"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing was made


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
        # each resource fits on some node, all of them on none (a StopIteration traceback)
        (
            dict(env=dict(num_cpus=1), rollout=dict(num_gpus=0.5), actor=dict(num_gpus=0.5)),
            [{"CPU": 8.0}, {"CPU": 2.0, "GPU": 1.0}],
            "collocated",
            "cluster.placement: collocated puts every worker on one node, and they ask for "
            "3 CPU, 1 GPU in all; no node has all of it (2 node(s)); use",
        ),
        (
            dict(env=dict(resources={"sim": 1})),
            [{"CPU": 4.0}],
            "hybrid",
            "cluster.env: 1 env worker(s) ask for 1 sim, and the Ray cluster has 0 sim",
        ),
        # hybrid: the rollout and actor workers' one bundle on no node
        (
            dict(rollout=dict(num_cpus=1), actor=dict(num_cpus=1)),
            [{"CPU": 1.5}, {"CPU": 1.5}],
            "hybrid",
            "cluster.placement: hybrid keeps the rollout and actor workers on one node, and they "
            "ask for 2 CPU in all; no node of the Ray cluster has that much (2 node(s)); use "
            "cluster.placement=disaggregated",
        ),
        # every bundle fits some node and the sums fit, but not how they divide (Ray would wait
        # 120 s and blame other jobs): 2 + 2 + 2 CPUs on two 3-CPU nodes
        (
            dict(env=dict(workers=2, num_cpus=2), rollout=dict(num_cpus=1), actor=dict(num_cpus=1)),
            [{"CPU": 3.0}, {"CPU": 3.0}],
            "hybrid",
            "cluster.placement: hybrid's bundles (2 CPU; 2 CPU; 2 CPU) fit the Ray cluster's sums "
            "but cannot be divided among its nodes (2 node(s); a GPU share below 1 comes from one "
            "device)",
        ),
        # three 0.6 GPU shares: 1.8 of a node's 2 GPUs, but a share comes from one device
        (
            dict(rollout=dict(workers=2, num_gpus=0.6), actor=dict(num_gpus=0.6)),
            [{"CPU": 8.0, "GPU": 2.0}],
            "collocated",
            "cluster.placement: collocated's bundles (1 CPU; 1 CPU, 0.6 GPU; 1 CPU, 0.6 GPU; "
            "1 CPU, 0.6 GPU) fit",
        ),
    ],
)
def test_a_placement_that_cannot_fit_names_the_role_and_the_resource(
    roles, nodes, placement, error
):
    from embodied.cluster.placement import check_fits
    from embodied.config import ConfigError

    cfg, _ = slots_of(**roles)
    cfg.placement = placement
    slots = plan_slots(cfg)  # (hybrid: one bundle for the rollout and actor workers)
    with pytest.raises(ConfigError) as raised:
        check_fits(cfg, slots, nodes)
    assert str(raised.value).startswith(error)


@pytest.mark.parametrize(
    "roles, nodes, placement",
    [
        # 2 + 1 + 1 + 2 CPUs on two 3-CPU nodes: only 2 + 1 beside 1 + 2 fits
        (
            dict(env=dict(workers=2, num_cpus=2), rollout=dict(num_cpus=1), actor=dict(num_cpus=1)),
            [{"CPU": 3.0}, {"CPU": 3.0}],
            "disaggregated",
        ),
        # 0.5 + 0.5 + 0.5 + 0.5 GPU: two shares on each device
        (
            dict(rollout=dict(workers=3, num_gpus=0.5), actor=dict(num_gpus=0.5)),
            [{"CPU": 8.0, "GPU": 2.0}],
            "collocated",
        ),
        # a whole GPU and a share: the share goes to the other device
        (
            dict(rollout=dict(num_gpus=0.7), actor=dict(num_gpus=1)),
            [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 2.0}],
            "collocated",
        ),
    ],
)
def test_a_placement_that_fits_only_one_way_is_accepted(roles, nodes, placement):
    from embodied.cluster.placement import check_fits

    cfg, _ = slots_of(**roles)
    cfg.placement = placement
    check_fits(cfg, plan_slots(cfg), nodes)


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


IDLE = "cluster: the Ray cluster has {} GPU(s), but {}, so those workers run on the CPU; give "


@pytest.mark.parametrize(
    "roles, nodes, device, note",
    [
        (
            {},
            [{"CPU": 4.0, "GPU": 1.0}],
            "auto",
            IDLE.format(1, "cluster.rollout.num_gpus and cluster.actor.num_gpus are 0")
            + "them a GPU or a share of one (cluster.actor.num_gpus=0.5)",
        ),
        (
            dict(rollout=dict(num_gpus=0.5)),
            [{"CPU": 4.0, "GPU": 2.0}],
            "auto",
            IDLE.format(2, "cluster.actor.num_gpus is 0")
            + "them a GPU or a share of one (cluster.actor.num_gpus=0.5)",
        ),
        (  # inference in the env workers: theirs is the GPU it needs
            dict(rollout=dict(workers=0), actor=dict(num_gpus=1)),
            [{"CPU": 4.0}, {"CPU": 4.0, "GPU": 8.0}],
            "auto",
            IDLE.format(8, "cluster.env.num_gpus is 0")
            + "them a GPU or a share of one (cluster.env.num_gpus=0.5)",
        ),
        (dict(rollout=dict(num_gpus=0.5), actor=dict(num_gpus=0.5)), [{"GPU": 1.0}], "auto", None),
        ({}, [{"CPU": 4.0}], "auto", None),  # no GPU
        ({}, [{"CPU": 4.0, "GPU": 1.0}], "cpu", None),  # the CPU chosen
    ],
)
def test_workers_that_ask_for_no_gpu_on_a_cluster_with_gpus_get_a_note(roles, nodes, device, note):
    """Ray shows a worker no GPU it did not ask for: with the default num_gpus 0 the learner
    trained on the CPU of a GPU machine, and nothing said so."""
    from embodied.cluster.placement import idle_gpus_note

    cfg, _ = slots_of(**roles)
    assert idle_gpus_note(cfg, nodes, device) == note


def test_hybrid_gives_the_rollout_and_actor_workers_one_bundle():
    from embodied.cluster.placement import bundles_of, check_fits

    cfg, _ = slots_of()
    cfg.placement = "hybrid"
    cfg.env, cfg.rollout = RoleConfig(workers=2, num_cpus=1), RoleConfig(workers=2, num_gpus=0.25)
    cfg.actor = RoleConfig(num_cpus=2, num_gpus=0.5)
    slots = plan_slots(cfg)
    assert [(s.role, s.index, s.bundle) for s in slots] == [
        ("env", 0, 0),
        ("env", 1, 1),
        ("rollout", 0, 2),
        ("rollout", 1, 2),
        ("actor", 0, 2),
    ]
    assert slots[2].resources == {"CPU": 1.0, "GPU": 0.25}  # (each asks for its own share)
    assert bundles_of(slots) == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}]
    check_fits(cfg, slots, [{"CPU": 2.0}, {"CPU": 4.0, "GPU": 1.0}])


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
        # hybrid: the rollout and actor workers' one bundle fits the largest node too
        (dict(), [{"CPU": 1.0}, {"CPU": 1.0}], "hybrid", [0.5] * 3),
        (dict(), [{"CPU": 1.0}, {"CPU": 2.0}], "hybrid", [1.0] * 3),
        # explicit requests that take everything: the others ask for one (check_fits names it)
        (dict(actor=dict(num_cpus=2)), [{"CPU": 2.0}], "collocated", [1.0, 1.0, 2.0]),
    ],
)
def test_roles_without_num_cpus_share_the_cpus_the_cluster_has(roles, nodes, placement, cpus):
    from embodied.cluster.placement import check_fits

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
    from embodied.cluster.envs import split_env, untimed_note
    from embodied.config import ConfigError
    from embodied.simulators.maniskill import ManiSkillConfig

    one = ManiSkillConfig(num_envs=8, num_workers=4)
    assert [(c.num_envs, c.num_workers) for c in split_env(one, 2)] == [(4, 2), (4, 2)]
    # a share of one simulator process: the env worker simulates in its own process, where
    # env.step_timeout_s does not apply (said at the start)
    assert [(c.num_envs, c.num_workers) for c in split_env(one, 4)] == [(2, 0)] * 4
    assert untimed_note(one, split_env(one, 2)) is None
    note = untimed_note(one, split_env(one, 4))
    assert note.startswith("note: env.num_workers=4 over 4 env workers is one simulator process")
    assert "env.step_timeout_s does not apply" in note and "env.num_workers=8 keeps" in note
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


@needs_no_cuda
def test_a_worker_whose_constructor_fails_is_its_cause_in_one_line(local_ray, tmp_path, capsys):
    """An env worker asked for ManiSkill's GPU backend on a machine without CUDA: the embedded
    run's one line (exit 2), not "env worker lost ... resume" (there is nothing to resume)."""
    argv = ["train", str(ROOT / "configs/maniskill/pushcube_ppo.yaml"), *TINY, *ON_RAY]
    capsys.readouterr()
    assert main([*argv, f"runner.output_dir={tmp_path}", "env.backend=gpu"]) == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("embodied: ")]
    assert errors == [
        "embodied: error: env.backend=gpu needs a CUDA GPU and this machine has none; use "
        "env.backend=cpu"
    ]
    assert list(tmp_path.iterdir()) == []


def simulator_that_cannot_start(env_cfg):
    raise RuntimeError("no display for the renderer\n(its second line)")


def test_a_worker_that_cannot_start_for_another_reason_is_named_with_the_error(local_ray, tmp_path):
    """Any other error of a worker's constructor: the worker, the process it was, and the last
    line of its traceback."""
    from embodied.roles import WorkerNotStarted

    policy = {"name": "actor_critic", "hidden_sizes": [8], "use_images": False}
    with pytest.raises(WorkerNotStarted) as raised:
        roles_on(tmp_path, {"enabled": True}, policy, simulator_that_cannot_start)
    host = r"(\d+\.){3}\d+"  # (Ray names a node by its address)
    cause = "RuntimeError: no display for the renderer"
    assert re.fullmatch(
        rf"env worker 0 \(pid \d+ on {host}\) could not start: {cause}", str(raised.value)
    )


def test_a_lost_actor_worker_stops_the_run_with_one_line_and_no_resume_without_a_checkpoint(
    local_ray, tmp_path, capsys, monkeypatch
):
    """The actor worker SIGKILLed as the first round is collected: the round cannot reach the
    learner, whose state is gone, so the run stops. Nothing says the round is collected again,
    and with no checkpoint saved yet the line says to start again, not to resume."""
    killed = []
    collect = RayRoles.collect

    def kill_then_collect(roles, *args, **kw):
        killed.append(ray.get(roles.learner.workers[0].ping.remote()))
        os.kill(killed[-1], signal.SIGKILL)
        return collect(roles, *args, **kw)

    monkeypatch.setattr(RayRoles, "collect", kill_then_collect)
    argv = ["train", str(ROOT / "configs/mujoco/reach_ppo.yaml"), *TINY_REACH, *ON_RAY]
    capsys.readouterr()
    assert main([*argv, f"runner.output_dir={tmp_path}", "runner.name=lost"]) == 1
    out, err = capsys.readouterr()
    (line,) = [e for e in err.splitlines() if e.startswith("embodied: ")]
    actor = f"actor worker 0 (pid {killed[0]} on {os.uname().nodename})"
    assert line.startswith(f"embodied: error: {actor} lost: ")
    run = tmp_path / "lost"
    assert line.endswith(
        "; the learner's state (weights, optimizer) was lost with it; "
        f"{run} has no checkpoint to resume from: start the run again"
    )
    assert len(killed) == 1 and "collected again" not in out
    assert [r for r in rows(run) if "policy/loss" in r] == []


@pytest.mark.slow  # (18-45 s: a start that fails; a worker that cannot start is in the suite)
def test_an_evaluation_worker_that_cannot_start_stops_the_run_at_its_start(local_ray, tmp_path):
    """As any role's worker: it was marked lost without a word, every evaluation beside
    training and the best checkpoint lost, and `embodied cluster status` a KeyError."""
    from embodied.schema import UserError

    env = dict(workers=2, num_cpus=0.25)  # (4 environments each)
    cluster = {**TWO_ENV_WORKERS, "env": env, "eval": dict(workers=1, num_cpus=0.5)}
    with pytest.raises(UserError, match="^env.task: its assets are not on this node$"):
        roles_on(tmp_path, cluster, {"hidden_sizes": [8], "use_images": False}, unready_evaluators)
    assert ray.util.placement_group_table() == {} or all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values()
    )


def test_an_environment_that_fails_to_close_still_takes_the_cluster_down(local_ray, tmp_path):
    """Its error (one line) stopped the close halfway: the status never said the run ended, the
    workers and the placement group were left on the cluster."""
    from embodied.cluster.status import read_status
    from embodied.schema import UserError

    policy = {"hidden_sizes": [8], "use_images": False}
    roles = roles_on(tmp_path, TWO_ENV_WORKERS, policy, overflowing_at_close)
    roles.sync(1)
    with pytest.raises(UserError, match="^MuJoCo push: the contact buffer overflowed$"):
        roles.close()
    assert read_status(tmp_path)["ended"] is not None
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
