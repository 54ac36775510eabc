"""Update throughput and memory: the torch engine against the megatron engine at TP=1 and at
TP=2 (two processes), at equal batch.

The tests' small VLA (random 32x32 vision, frozen) with a larger fusion transformer, so that the
part megatron shards dominates the update: d_model 512, 4 layers, 8 heads by default. GRPO
samples of one round of the test task (``--envs`` environments x 3 steps). Each configuration
runs in fresh processes and times ``--steps`` update steps (forward, backward, clipped Adam
step over the whole batch) after ``--warmup`` steps:
- samples/s;
- per rank, the peak resident set size (ru_maxrss) minus the resident size before the engine
  was built: the engine's copies and buffers, activations, gradients and Adam's state.
The torch engine and megatron at TP=1 get all ``--threads``; each TP=2 rank gets half. Megatron
runs once more with activation recomputation (``trainer.recompute``) at each TP size.

    python benchmarks/megatron.py [--steps 10] [--envs 64] [--d-model 512] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# this file is named as the package it measures: its folder stays off the import path
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != HERE]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)


def run_rank(rank: int, backend: str, tp: int, recompute: bool, port: int, args, out: str) -> None:
    """One rank: build, warm up, time; its numbers to ``out/rank.json``."""
    sys.path.insert(0, str(ROOT / "tests"))
    warnings.filterwarnings("ignore")
    from scripted_envs import TINY_VLA, PushRightEnv, prepared_samples

    from embodied.env_group import EnvGroup
    from embodied.grpo import GRPO, GRPOConfig
    from embodied.learner import TorchEngine
    from embodied.models.vla import VLA, VLAConfig

    torch.set_num_threads(max(1, args.threads // tp))
    if backend == "megatron":
        import torch.distributed as dist

        from embodied.megatron import parallel

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=tp)
        parallel.initialize(tp, seed=0, device=torch.device("cpu"))
    torch.manual_seed(0)
    envs = EnvGroup(PushRightEnv(args.envs))
    sizes = {"d_model": args.d_model, "layers": args.layers, "heads": args.heads}
    policy = VLA(envs.spec, VLAConfig(**{**TINY_VLA, **sizes})).eval()
    grpo = GRPOConfig(group_size=4, logprob_level="action")
    algorithm = GRPO(
        grpo,
        seed=0,
        task_of_env=envs.task_of_env,
        chunk_size=1,
        max_episode_steps=3,
        policy=policy,
    )
    samples = prepared_samples(envs, policy, algorithm)
    policy.train()
    before_mb = rss_mb()  # (the engine's buffers, gradients and optimizer state count)
    if backend == "megatron":
        from embodied.megatron.engine import MegatronEngine

        engine = MegatronEngine(
            policy,
            learning_rate=1e-4,
            max_grad_norm=1.0,
            with_value=False,
            recompute=recompute,
        )
    else:
        engine = TorchEngine(policy, learning_rate=1e-4, max_grad_norm=1.0)

    def step() -> None:
        loss, _ = algorithm.loss(engine, samples)
        engine.backward(loss)
        engine.step()

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    result = {
        "samples_per_s": args.steps * len(samples) / seconds,
        "peak_mb": rss_mb() - before_mb,
        "samples": len(samples),
        "fusion_params": sum(p.numel() for p in policy.fusion.parameters()),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    if backend == "megatron":
        engine.close()


def measure(backend: str, tp: int, recompute: bool, args) -> list[dict]:
    """Every rank's numbers for one configuration, each run in fresh processes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        spawn_args = (backend, tp, recompute, port, args, out)
        torch.multiprocessing.spawn(run_rank, args=spawn_args, nprocs=tp)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(tp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}; fusion d_model {args.d_model}, {args.layers} layers, "
        f"{args.heads} heads; {args.envs} envs x 3 steps per batch; {args.steps} steps timed"
    )
    rows = []
    configurations = [("torch", 1, False), ("megatron", 1, False), ("megatron", 2, False)]
    configurations += [("megatron", 1, True), ("megatron", 2, True)]
    for backend, tp, recompute in configurations:
        ranks = measure(backend, tp, recompute, args)
        name = f"{backend} + recompute" if recompute else backend
        rows.append((name, tp, ranks))
        print(f"  {name} TP={tp}: {ranks[0]['samples_per_s']:.0f} samples/s", flush=True)
    base = rows[0][2][0]["samples_per_s"]
    print("\n| engine | TP | samples/s | vs torch | peak MB per rank (above the model) |")
    print("|---|---|---|---|---|")
    for name, tp, ranks in rows:
        rate = ranks[0]["samples_per_s"]
        peaks = ", ".join(f"{r['peak_mb']:.0f}" for r in ranks)
        print(f"| {name} | {tp} | {rate:.0f} | {rate / base:.2f}x | {peaks} |")
    first = rows[0][2][0]
    print(f"\nfusion parameters: {first['fusion_params']:,}; {first['samples']} samples a batch")


if __name__ == "__main__":
    main()
