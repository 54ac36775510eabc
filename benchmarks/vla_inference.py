"""VLA inference: latency and throughput of ``act()`` per action head and batch size, and peak
memory.

Each (head, batch size) runs in a fresh process so that its peak memory is its own: on CPU the
peak resident set size while acting (the warm-up act included: VmHWM, reset after the model was
built), minus the resident size then (VmRSS); on a GPU ``torch.cuda.max_memory_allocated``.
Pretrained backbones (EfficientNet-Lite0 + all-MiniLM-L6-v2), one 128x128 camera, chunk K=4, the
8-dim Panda joint-delta action space.

``--heads ... smolvla`` adds LeRobot's SmolVLA (10 denoising steps, 16 VLM layers): from a local
SmolVLM2 directory with ``--smolvlm DIR``, or else a random one shaped like SmolVLM2-500M (SigLIP
B/16 at 512 px, a SmolLM2-360M-sized language model) built from its config alone, which times
the same computation without the weights.

    python benchmarks/vla_inference.py [--heads gaussian discrete flow smolvla] [--batch 1 8 32]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _spec(image_size: int):
    from embodied.schema import ActionSpec, CameraSpec, EnvSpec, ObsSpec

    return EnvSpec(
        obs=ObsSpec(
            cameras=(CameraSpec("base_camera", image_size, image_size),),
            state_names=tuple(f"q{i}" for i in range(25)),
        ),
        action=ActionSpec(
            "joint_delta",
            tuple(f"a{i}" for i in range(8)),
            (-0.1,) * 7 + (-0.01,),
            (0.1,) * 7 + (0.04,),
            gripper=7,
        ),
        max_episode_steps=50,
        instructions=("push the cube to the red and white target",),
    )


def _smolvlm2_500m_shaped(path: Path) -> Path:
    """Config-only SmolVLM2 directory with SmolVLM2-500M's published tower sizes (random
    weights)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
    from tiny_vlms import smolvlm

    return smolvlm(
        path,
        image=512,
        patch=16,
        scale=4,
        weights=False,
        vision=dict(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12
        ),
        text=dict(
            hidden_size=960,
            intermediate_size=2560,
            num_hidden_layers=32,
            num_attention_heads=15,
            num_key_value_heads=5,
            head_dim=64,
        ),
    )


def _policy(head: str, spec, smolvlm: str):
    from embodied.models import VLA, SmolVLA, SmolVLAConfig, VLAConfig

    if head != "smolvla":
        return VLA(spec, VLAConfig(head=head, chunk_size=4))
    if smolvlm:
        return SmolVLA(spec, SmolVLAConfig(vlm_path=smolvlm, chunk_size=4))
    path = _smolvlm2_500m_shaped(Path(tempfile.mkdtemp()) / "smolvlm2-500m-shaped")
    return SmolVLA(spec, SmolVLAConfig(vlm_path=str(path), load_vlm_weights=False, chunk_size=4))


def host_memory_mib(field: str) -> float:
    """This process's resident memory in MiB (Linux): ``VmRSS`` now, ``VmHWM`` its peak since
    the last ``reset_host_peak``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # (kB)
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_host_peak() -> None:
    """VmHWM back to the resident size now (Linux's clear_refs, this process only)."""
    Path("/proc/self/clear_refs").write_text("5")


def _run(
    head: str,
    batch: int,
    device: str,
    image_size: int,
    repeats: int,
    threads: int,
    smolvlm: str,
    queue,
) -> None:
    torch.set_num_threads(threads)
    from embodied.contract import random_observation

    spec = _spec(image_size)
    policy = _policy(head, spec, smolvlm).to(device).eval()
    obs = random_observation(spec, batch, device)
    # (ru_maxrss read after the warm-up held the warm-up's own peak: the column read ~0)
    base = host_memory_mib("VmRSS")
    reset_host_peak()
    with torch.no_grad():
        policy.act(obs)  # warm-up (caches the instruction embedding)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            policy.act(obs)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if device == "cuda"
        else host_memory_mib("VmHWM") - base
    )
    params = sum(p.numel() for p in policy.parameters()) / 1e6
    queue.put((statistics.median(times), peak, params))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--heads", nargs="+", default=["gaussian", "discrete", "flow"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--smolvlm", default="", help="local SmolVLM2 directory for the smolvla row")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    hw = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{mp.cpu_count()} cores {platform.machine()}"
    )
    print(
        f"VLA act(): {hw}, torch {torch.__version__}, {args.threads} threads, "
        f"{args.image_size}px, K=4, median of {args.repeats}"
    )
    mem = "peak GPU MiB" if args.device == "cuda" else "peak RSS +MiB"
    print(
        f"{'head':<10}{'batch':>6}{'params M':>10}{'latency ms':>12}{'chunks/s':>10}"
        f"{'actions/s':>11}{mem:>15}"
    )
    for head in args.heads:
        for b in args.batch:
            q = ctx.Queue()
            p = ctx.Process(
                target=_run,
                args=(
                    head,
                    b,
                    args.device,
                    args.image_size,
                    args.repeats,
                    args.threads,
                    args.smolvlm,
                    q,
                ),
            )
            p.start()
            latency, peak, params = q.get()
            p.join()
            print(
                f"{head:<10}{b:>6}{params:>10.1f}{latency * 1e3:>12.1f}{b / latency:>10.1f}"
                f"{4 * b / latency:>11.1f}{peak:>15.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
