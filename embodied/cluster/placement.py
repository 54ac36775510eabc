"""Placement: the ``cluster:`` block turned into one Ray placement group, checked against the
resources Ray reports before any worker starts.

Every worker gets a bundle of its own (``num_cpus``, ``num_gpus``, custom resources; a role that
leaves ``num_cpus`` unset gets a share that fits the cluster, ``fitted_cpus``). The
strategy says where bundles may go: ``collocated`` STRICT_PACK (one node: fractional GPUs of the
rollout and actor workers share a device), ``hybrid`` PACK (together where they fit),
``disaggregated`` SPREAD (over the nodes where it can).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from embodied.cluster.config import ROLES, ClusterConfig
from embodied.config import ConfigError

STRATEGIES = {"collocated": "STRICT_PACK", "hybrid": "PACK", "disaggregated": "SPREAD"}
READY_TIMEOUT_S = 120.0


@dataclass
class Slot:
    """One worker's place: its role, index, bundle in the placement group and its resources."""

    role: str
    index: int
    bundle: int
    resources: dict[str, float]


def fitted_cpus(cfg: ClusterConfig, nodes: list[dict[str, float]] | None) -> float:
    """The CPUs each worker asks for whose role leaves ``num_cpus`` unset: one where the
    cluster has one for each beside the explicit requests (a collocated run: on its largest
    node), else an equal share of what is left, so that the README's three roles fit a 2-core
    machine at 2/3 CPU each. Explicit requests are taken as they are and checked."""
    roles = [getattr(cfg, role) for role in ROLES]
    unset = sum(r.workers for r in roles if r.num_cpus is None)
    if nodes is None or unset == 0:
        return 1.0
    cpus = [node.get("CPU", 0.0) for node in nodes] or [0.0]
    have = max(cpus) if cfg.placement == "collocated" else sum(cpus)
    left = have - sum(r.workers * r.num_cpus for r in roles if r.num_cpus is not None)
    if left <= 0:
        return 1.0  # (``check_fits`` names the role that does not fit)
    return min(1.0, math.floor(1000 * left / unset) / 1000)  # (Ray counts in 1e-4 CPU)


def plan_slots(cfg: ClusterConfig, nodes: list[dict[str, float]] | None = None) -> list[Slot]:
    """One bundle per worker, in role order (env, rollout, actor, eval); a role without
    ``num_cpus`` asks for ``fitted_cpus`` on ``nodes`` (None: one CPU)."""
    fitted = fitted_cpus(cfg, nodes)
    slots = []
    for role in ROLES:
        role_cfg = getattr(cfg, role)
        if role_cfg.workers == 0:
            continue
        cpus = fitted if role_cfg.num_cpus is None else role_cfg.num_cpus
        resources = {"CPU": float(cpus), "GPU": float(role_cfg.num_gpus)}
        resources.update({k: float(v) for k, v in role_cfg.resources.items()})
        resources = {k: v for k, v in resources.items() if v > 0}
        if not resources:
            raise ConfigError(
                f"cluster.{role}.num_cpus: a worker must ask for some resource (num_cpus, "
                "num_gpus or resources), or Ray cannot place it"
            )
        for index in range(role_cfg.workers):
            slots.append(Slot(role, index, len(slots), resources))
    return slots


def _amount(value: float) -> str:
    return f"{value:g}"


def check_fits(cfg: ClusterConfig, slots: list[Slot], nodes: list[dict[str, float]]) -> None:
    """A ``ConfigError`` naming the role and the resource when the slots cannot be placed on
    ``nodes`` (each node's total resources, as Ray reports them)."""
    where = f"{len(nodes)} node(s)"
    total: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.items():
            total[name] = total.get(name, 0.0) + amount
    # 1. the whole request against the whole cluster, role by role in order
    asked: dict[str, float] = {}
    for role in ROLES:
        mine = [s for s in slots if s.role == role]
        if not mine:
            continue
        for name in sorted(mine[0].resources):
            role_ask = sum(s.resources[name] for s in mine)
            asked[name] = asked.get(name, 0.0) + role_ask
            if asked[name] > total.get(name, 0.0) + 1e-9:
                others = asked[name] - role_ask
                before = f" beside {_amount(others)} for the roles before it" if others else ""
                raise ConfigError(
                    f"cluster.{role}: {len(mine)} {role} worker(s) ask for "
                    f"{_amount(role_ask)} {name}{before}, and the Ray cluster has "
                    f"{_amount(total.get(name, 0.0))} {name} ({where})"
                )
    # 2. every bundle on some node
    for slot in slots:
        if not any(_fits(slot.resources, node) for node in nodes):
            need = ", ".join(f"{_amount(v)} {k}" for k, v in sorted(slot.resources.items()))
            raise ConfigError(
                f"cluster.{slot.role}: one {slot.role} worker asks for {need} and no node of the "
                f"Ray cluster has that much ({where})"
            )
    # 3. collocated: everything on one node
    if cfg.placement == "collocated":
        everything: dict[str, float] = {}
        for slot in slots:
            for name, amount in slot.resources.items():
                everything[name] = everything.get(name, 0.0) + amount
        if not any(_fits(everything, node) for node in nodes):
            short = next(
                name
                for name in sorted(everything)
                if all(node.get(name, 0.0) + 1e-9 < everything[name] for node in nodes)
            )
            raise ConfigError(
                f"cluster.placement: collocated puts every worker on one node, and they ask for "
                f"{_amount(everything[short])} {short} in all; no node has that much ({where}); "
                "use cluster.placement=hybrid or disaggregated"
            )


def _fits(need: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(name, 0.0) + 1e-9 >= amount for name, amount in need.items())


def alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def place(cfg: ClusterConfig):
    """(the placement group, its slots), checked before anything starts."""
    import ray
    from ray.util.placement_group import placement_group

    nodes = alive_nodes()
    slots = plan_slots(cfg, nodes)
    check_fits(cfg, slots, nodes)
    group = placement_group(
        [slot.resources for slot in slots], strategy=STRATEGIES[cfg.placement], name=""
    )
    ready, _ = ray.wait([group.ready()], timeout=READY_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ConfigError(
            f"cluster.placement: Ray could not reserve the workers' resources within "
            f"{READY_TIMEOUT_S:.0f} s (other jobs hold them?); `ray status` shows what is in use"
        )
    return group, slots
