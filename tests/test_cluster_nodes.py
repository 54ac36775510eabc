"""Two Ray nodes on this machine (Ray's own multi-node test cluster): a simulator node and a
learner node, told apart by custom resources, of one CPU each. The roles land where the
placement says."""

import json

import pytest
from scripted_envs import GRPO, push_right_envs, run_on

from embodied.cluster.config import ClusterConfig, RoleConfig
from embodied.cluster.placement import place
from embodied.cluster.start import start_ray

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"sim": 2}})
    learner_node = cluster.add_node(num_cpus=1, resources={"learn": 2})
    start_ray(ClusterConfig(address=cluster.address))
    yield cluster.head_node.node_id, learner_node.node_id
    ray.shutdown()
    cluster.shutdown()


def test_env_workers_on_one_node_and_the_learner_on_the_other(two_nodes, tmp_path):
    sim_node, learn_node = two_nodes
    cluster = {
        "enabled": True,
        "placement": "disaggregated",
        "env": {"num_cpus": 0.5, "resources": {"sim": 1}},
        "rollout": {"num_cpus": 0.5, "resources": {"learn": 1}},
        "actor": {"num_cpus": 0.5, "resources": {"learn": 1}},
    }
    summary = run_on(
        None,
        tmp_path / "run",
        total_env_steps=8 * 3 * 2,
        cluster=cluster,
        env_factory=push_right_envs,
        algorithm={**GRPO, "max_rounds": 1, "dynamic_sampling": False},
    )
    assert summary["final"]["eval/episodes"] == 16
    status = json.loads((tmp_path / "run" / "cluster.json").read_text())
    nodes = {w["role"]: w["node_id"] for w in status["workers"]}
    assert nodes == {"env": sim_node, "rollout": learn_node, "actor": learn_node}


def test_hybrid_keeps_the_rollout_and_actor_workers_on_one_node(two_nodes):
    """Three workers of half a CPU on two nodes of one: ``hybrid`` reserves one bundle for the
    rollout and actor workers, on one node, and the env worker's on the other (PACK over a
    bundle each had put the env and rollout workers together, and the actor worker apart)."""
    half = RoleConfig(num_cpus=0.5)
    cfg = ClusterConfig(enabled=True, placement="hybrid", env=half, rollout=half, actor=half)
    group, slots = place(cfg)
    try:
        nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
        where = {slot.role: nodes[slot.bundle] for slot in slots}
    finally:
        ray.util.remove_placement_group(group)
    assert where["rollout"] == where["actor"] != where["env"]
    assert set(where.values()) == set(two_nodes)
