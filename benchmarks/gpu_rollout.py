"""Issue 33's GPU layouts on Ray, side by side in one run (benchmarks/gpu_suite.sh runs it on a GPU
machine; on a CPU it runs the CPU cases only).

``--serve``: one rollout worker serving 1, 2, 4, ... CPU env workers (MuJoCo reach on its CPU
backend, ``--envs-per-worker`` each) in lockstep, on the GPU and on a CPU: env steps/s of a
collection round and the rollout worker's busy share.

``--sync``: a weight sync after an update (every trainable weight) to a GPU rollout worker
sharing the actor's bundle, from an actor on the GPU through CUDA IPC (``weight_sync:
shared``), from the same through the object store, and from an actor on the CPU through the
object store; on a CPU machine, shared memory against the object store and the broadcast.
The policy is an MLP of ``--sync-hidden`` (4 x 2048: 13M parameters, 50 MB).

    python benchmarks/gpu_rollout.py --serve --sync --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from scaling import collect_round, hardware

ROOT = Path(__file__).resolve().parent.parent
REACH = "configs/mujoco/reach_ppo.yaml"


def roles_for(overrides: list[str]):
    """The Ray roles of the reach config with ``overrides`` (no run directory needed)."""
    from embodied.cluster import ray_roles
    from embodied.config import load_config
    from embodied.train_config import TrainConfig

    cfg = load_config(TrainConfig, ROOT / REACH, ["runner.progress=false", *overrides])[0]
    out = Path("/tmp") / f"embodied-gpu-rollout-{os.getpid()}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    return cfg, ray_roles(cfg, None, out)


def serve(args, gpu: bool) -> list[dict]:
    """Env steps/s of one rollout worker (GPU and CPU) serving W CPU env workers."""
    devices = ["cuda", "cpu"] if gpu else ["cpu"]
    rows = []
    for workers in args.workers:
        for device in devices:
            share = 1.0 / (2 * workers + 2)  # (logical CPUs: every worker fits the node)
            cfg, roles = roles_for(
                [
                    f"env.num_envs={workers * args.envs_per_worker}",
                    f"algorithm.num_steps={args.round_steps}",
                    "cluster.enabled=true",
                    f"cluster.env.workers={workers}",
                    f"cluster.env.num_cpus={share}",
                    f"cluster.rollout.num_cpus={share}",
                    f"cluster.actor.num_cpus={share}",
                    f"cluster.rollout.num_gpus={0.5 if device == 'cuda' else 0}",
                    f"cluster.actor.num_gpus={0.5 if device == 'cuda' else 0}",
                ]
            )
            try:
                roles.sync(1)
                collect_round(cfg, roles, 1)  # warm-up: first resets, CUDA kernels
                roles.metrics()
                rates = []
                for _ in range(args.repeats):
                    steps, seconds = collect_round(cfg, roles, 1)
                    rates.append(steps / seconds)
                busy = 1.0 - roles.metrics()[0]["cluster/rollout_idle"]
            finally:
                roles.close()
            row = {
                "env_workers": workers,
                "rollout": device,
                "steps_per_s": statistics.median(rates),
            }
            row["rollout_busy"] = busy
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def sync_cases(gpu: bool) -> dict[str, list[str]]:
    """Name -> cluster overrides: where the actor is, how the weights travel."""
    if not gpu:
        return {
            "cpu actor, shared memory": ["cluster.weight_sync=shared"],
            "cpu actor, object store": ["cluster.weight_sync=object_store"],
            "cpu actor, broadcast": ["cluster.weight_sync=broadcast"],
        }
    on_gpu = ["cluster.rollout.num_gpus=0.5", "cluster.actor.num_gpus=0.5"]
    return {
        "gpu actor, CUDA IPC": [*on_gpu, "cluster.weight_sync=shared"],
        "gpu actor, object store": [*on_gpu, "cluster.weight_sync=object_store"],
        "cpu actor, object store": [
            "cluster.rollout.num_gpus=0.5",
            "cluster.actor.num_gpus=0",
            "cluster.weight_sync=object_store",
        ],
    }


def sync(args, gpu: bool) -> list[dict]:
    """Milliseconds per weight sync after an update, per case (medians of ``--repeats``)."""
    hidden = ",".join(str(h) for h in args.sync_hidden)
    rows = []
    for name, overrides in sync_cases(gpu).items():
        cfg, roles = roles_for(
            [
                "env.num_envs=2",
                f"policy.hidden_sizes=[{hidden}]",
                "cluster.enabled=true",
                "cluster.env.num_cpus=0.2",
                "cluster.rollout.num_cpus=0.2",
                "cluster.actor.num_cpus=0.2",
                *overrides,
            ]
        )
        try:
            roles.sync(1)  # (the full sync: every weight, once)
            timings = [roles.sync(2 + r) for r in range(args.repeats)]
        finally:
            roles.close()
        row = {
            "case": name,
            "sync_ms": statistics.median(t["cluster/sync_ms"] for t in timings),
            "megabytes": timings[0]["cluster/sync_bytes"] / 1e6,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", action="store_true", help="one rollout worker, W env workers")
    ap.add_argument("--sync", action="store_true", help="weight sync, side by side")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--envs-per-worker", type=int, default=16)
    ap.add_argument("--round-steps", type=int, default=50)
    ap.add_argument("--sync-hidden", type=int, nargs="+", default=[2048] * 4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    from embodied.cluster.config import ClusterConfig
    from embodied.cluster.start import start_ray

    gpu = torch.cuda.is_available()
    start_ray(ClusterConfig(num_cpus=os.cpu_count()))
    out = {"hardware": hardware(), "gpu": torch.cuda.get_device_name() if gpu else None}
    if args.serve:
        out["serve"] = serve(args, gpu)
    if args.sync:
        out["sync"] = sync(args, gpu)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
