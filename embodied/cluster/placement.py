"""Placement: the ``cluster:`` block turned into one Ray placement group, checked against the
resources Ray reports before any worker starts.

Every worker asks for ``num_cpus``, ``num_gpus`` and custom resources (a role that leaves
``num_cpus`` unset gets a share that fits the cluster, ``fitted_cpus``) and gets a bundle of its
own, except with ``hybrid``: the rollout and actor workers share one bundle, which Ray reserves
on one node, so they are together whatever the strategy does with the rest. The strategy says
where bundles may go: ``collocated`` STRICT_PACK (one node: fractional GPUs of the rollout and
actor workers share a device), ``hybrid`` PACK (the env and evaluation workers' bundles beside
the shared one where they fit, elsewhere where they do not), ``disaggregated`` SPREAD (over the
nodes where it can).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from embodied.cluster.config import ROLES, ClusterConfig
from embodied.config import ConfigError

STRATEGIES = {"collocated": "STRICT_PACK", "hybrid": "PACK", "disaggregated": "SPREAD"}
TOGETHER = ("rollout", "actor")  # the roles ``hybrid`` keeps on one node (one bundle)
READY_TIMEOUT_S = 120.0


@dataclass
class Slot:
    """One worker's place: its role, index, bundle in the placement group and its resources
    (the bundle's, or its share of a bundle it shares)."""

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
    shares = [_share(have, roles, unset)]
    together = [getattr(cfg, role) for role in TOGETHER]
    unset_together = sum(r.workers for r in together if r.num_cpus is None)
    if cfg.placement == "hybrid" and unset_together:  # (and their bundle on one node)
        shares.append(_share(max(cpus), together, unset_together))
    if min(shares) <= 0:
        return 1.0  # (``check_fits`` names the role that does not fit)
    return min(1.0, *shares)


def _share(have: float, roles: list, unset: int) -> float:
    """What ``have`` CPUs leave each of ``unset`` workers beside the explicit requests of
    ``roles``, rounded down to Ray's units (0: nothing left)."""
    left = have - sum(r.workers * r.num_cpus for r in roles if r.num_cpus is not None)
    return max(0.0, math.floor(1000 * left / unset) / 1000)  # (Ray counts in 1e-4 CPU)


def plan_slots(cfg: ClusterConfig, nodes: list[dict[str, float]] | None = None) -> list[Slot]:
    """One bundle per worker, in role order (env, rollout, actor, eval), the rollout and actor
    workers' one bundle together with ``hybrid``; a role without ``num_cpus`` asks for
    ``fitted_cpus`` on ``nodes`` (None: one CPU)."""
    fitted = fitted_cpus(cfg, nodes)
    slots: list[Slot] = []
    bundles = 0
    shared = None  # the bundle ``hybrid`` gives the rollout and actor workers
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
        together = cfg.placement == "hybrid" and role in TOGETHER
        for index in range(role_cfg.workers):
            if together and shared is not None:
                bundle = shared
            else:
                bundle, bundles = bundles, bundles + 1
                shared = bundle if together else shared
            slots.append(Slot(role, index, bundle, resources))
    return slots


def bundles_of(slots: list[Slot]) -> list[dict[str, float]]:
    """Each bundle's resources: the sum of its workers'."""
    out: list[dict[str, float]] = [{} for _ in range(max(s.bundle for s in slots) + 1)]
    for slot in slots:
        for name, amount in slot.resources.items():
            out[slot.bundle][name] = out[slot.bundle].get(name, 0.0) + amount
    return out


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
    for bundle, need in enumerate(bundles_of(slots)):
        if any(_fits(need, node) for node in nodes):
            continue
        amounts = ", ".join(f"{_amount(v)} {k}" for k, v in sorted(need.items()))
        mine = [s for s in slots if s.bundle == bundle]
        if len(mine) > 1:
            raise ConfigError(
                f"cluster.placement: hybrid keeps the rollout and actor workers on one node, and "
                f"they ask for {amounts} in all; no node of the Ray cluster has that much "
                f"({where}); use cluster.placement=disaggregated"
            )
        raise ConfigError(
            f"cluster.{mine[0].role}: one {mine[0].role} worker asks for {amounts} and no node of "
            f"the Ray cluster has that much ({where})"
        )
    # 3. collocated: everything on one node
    if cfg.placement == "collocated":
        everything: dict[str, float] = {}
        for slot in slots:
            for name, amount in slot.resources.items():
                everything[name] = everything.get(name, 0.0) + amount
        if not any(_fits(everything, node) for node in nodes):
            short = [
                name
                for name in sorted(everything)
                if all(node.get(name, 0.0) + 1e-9 < everything[name] for node in nodes)
            ]
            # (none short everywhere: each resource fits on some node, all of them on none)
            asked = short[:1] or sorted(everything)
            amounts = ", ".join(f"{_amount(everything[name])} {name}" for name in asked)
            raise ConfigError(
                f"cluster.placement: collocated puts every worker on one node, and they ask for "
                f"{amounts} in all; no node has {'that much' if short else 'all of it'} "
                f"({where}); use cluster.placement=hybrid or disaggregated"
            )
    # 4. the bundles on the nodes together (collocated: on one node)
    bundles = bundles_of(slots)
    candidates = [[node] for node in nodes] if cfg.placement == "collocated" else [nodes]
    if not any(_packs(bundles, group) is not False for group in candidates):
        asked = "; ".join(
            ", ".join(f"{_amount(v)} {k}" for k, v in sorted(need.items())) for need in bundles
        )
        raise ConfigError(
            f"cluster.placement: {cfg.placement}'s bundles ({asked}) fit the Ray cluster's "
            f"sums but cannot be divided among its nodes ({where}; a GPU share below 1 comes "
            "from one device): ask for less, or use another cluster.placement"
        )


PACK_SEARCH_STEPS = 10_000  # (beyond it the packing is not settled, and Ray's wait decides)


@dataclass
class _Free:
    """What is left on a node while bundles are placed: its resources, and its GPUs one by one
    (Ray gives a GPU share below 1 from one device, a whole number of GPUs as whole devices)."""

    resources: dict[str, float]
    gpus: list[float]


def _packs(bundles: list[dict[str, float]], nodes: list[dict[str, float]]) -> bool | None:
    """Whether every bundle can be placed on ``nodes`` at once: a search over the bundles,
    largest first; None where it does not settle within PACK_SEARCH_STEPS."""
    order = sorted(bundles, key=lambda need: (need.get("GPU", 0.0), need.get("CPU", 0.0)))
    free = [
        _Free({k: v for k, v in node.items() if k != "GPU"}, _devices(node.get("GPU", 0.0)))
        for node in nodes
    ]
    steps = [0]

    def place(left: list[dict[str, float]]) -> bool | None:
        if not left:
            return True
        steps[0] += 1
        if steps[0] > PACK_SEARCH_STEPS:
            return None
        need = left[-1]
        other = {k: v for k, v in need.items() if k != "GPU"}
        gpu = need.get("GPU", 0.0)
        unsettled = False
        for node in free:
            if not _fits(other, node.resources):
                continue
            for devices in _gpu_choices(node.gpus, gpu):
                _take(node, other, devices, gpu, sign=-1.0)
                placed = place(left[:-1])
                _take(node, other, devices, gpu, sign=1.0)
                if placed:
                    return True
                unsettled |= placed is None
        return None if unsettled else False

    return place(order)


def _devices(gpus: float) -> list[float]:
    """A node's GPUs one by one: whole devices, and the fraction Ray reports beyond them."""
    whole = int(gpus + 1e-9)
    rest = gpus - whole
    return [1.0] * whole + ([rest] if rest > 1e-9 else [])


def _gpu_choices(gpus: list[float], gpu: float) -> list[list[int]]:
    """The devices a GPU request may take: one with room for a share below 1 (one per distinct
    remainder), or that many whole free devices."""
    if gpu <= 0:
        return [[]]
    if gpu < 1:
        firsts: dict[float, int] = {}  # remainder -> its first device
        for i, left in enumerate(gpus):
            if left + 1e-9 >= gpu:
                firsts.setdefault(left, i)
        return [[i] for i in firsts.values()]
    whole = [i for i, left in enumerate(gpus) if left >= 1.0 - 1e-9]
    return [whole[: int(gpu + 1e-9)]] if len(whole) >= int(gpu + 1e-9) else []


def _take(node: _Free, other: dict[str, float], devices: list[int], gpu: float, sign: float):
    """Take (sign -1) or give back (+1) a bundle's resources on ``node``."""
    for name, amount in other.items():
        node.resources[name] += sign * amount
    for i in devices:
        node.gpus[i] += sign * min(gpu, 1.0)


def _fits(need: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(name, 0.0) + 1e-9 >= amount for name, amount in need.items())


def idle_gpus_note(cfg: ClusterConfig, nodes: list[dict[str, float]], device: str) -> str | None:
    """A note where the Ray cluster has GPUs but the workers that train and act ask for none
    with ``runner.device`` auto: Ray shows a worker no GPU it did not ask for, so they run on
    the CPU (the embedded run would train on the environment's device)."""
    gpus = sum(node.get("GPU", 0.0) for node in nodes)
    acting = "env" if cfg.rollout.workers == 0 else "rollout"  # (where the inference copies live)
    idle = [role for role in (acting, "actor") if not getattr(cfg, role).num_gpus]
    if device != "auto" or gpus == 0 or not idle:
        return None
    keys = " and ".join(f"cluster.{role}.num_gpus" for role in idle)
    return (
        f"cluster: the Ray cluster has {_amount(gpus)} GPU(s), but {keys} "
        f"{'is' if len(idle) == 1 else 'are'} 0, so those workers run on the CPU; give them "
        f"a GPU or a share of one (cluster.{idle[-1]}.num_gpus=0.5)"
    )


def alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def place(cfg: ClusterConfig, device: str = "auto"):
    """(the placement group, its slots), checked before anything starts; ``device``: the run's
    ``runner.device``."""
    import ray
    from ray.util.placement_group import placement_group

    nodes = alive_nodes()
    slots = plan_slots(cfg, nodes)
    check_fits(cfg, slots, nodes)
    note = idle_gpus_note(cfg, nodes, device)
    if note:
        print(note)
    group = placement_group(bundles_of(slots), strategy=STRATEGIES[cfg.placement], name="")
    ready, _ = ray.wait([group.ready()], timeout=READY_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ConfigError(
            f"cluster.placement: Ray could not reserve the workers' resources within "
            f"{READY_TIMEOUT_S:.0f} s (other jobs hold them?); `ray status` shows what is in use"
        )
    return group, slots
