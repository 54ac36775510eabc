"""What one step of a loop costs the device: torch's profiler over ``steps`` steps, summed per
step (benchmarks/gpu_throughput.py ``--profile``).

- ``ops``: the top-level torch operators the host issued (each may launch kernels);
- on CUDA, ``kernels`` and ``kernel_ms``: the kernels that ran and their summed time (Warp's and
  a captured CUDA graph's kernels included), and the ten costliest kernels by summed time;
  ``copies``: the memory copies and sets beside them (not counted as kernels).

The profiler records only the first pass through the body of a CUDA graph's while loop
(pytorch/kineto#1062), and MuJoCo Warp's solver iterates in one (``capture_while``): the physics'
kernel time is too low, in raw and ours alike. Compare what ours adds to raw, not kernel time
with wall time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass
class StepProfile:
    ops: float  # top-level torch operators per step
    kernels: float  # device kernels per step (0 on a CPU)
    kernel_ms: float  # their summed time per step
    copies: float  # device memory copies and sets per step
    top: list[tuple[str, float, float]]  # (kernel, ms per step, launches per step), costliest first


COPIES = ("Memcpy", "Memset")  # the profiler's names for copies and sets on the device


def summarise(
    op_names: list[str], device_times: list[tuple[str, float]], steps: int, top: int = 10
) -> StepProfile:
    """``op_names``: top-level operators; ``device_times``: (name, microseconds) per launch of
    a kernel, a copy or a set."""
    kernel_times = [(name, us) for name, us in device_times if not name.startswith(COPIES)]
    time_by_kernel: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    for name, us in kernel_times:
        time_by_kernel[name] += us
        launches[name] += 1
    costliest = [
        (name, us / 1000 / steps, launches[name] / steps)
        for name, us in time_by_kernel.most_common(top)
    ]
    return StepProfile(
        ops=len(op_names) / steps,
        kernels=len(kernel_times) / steps,
        kernel_ms=sum(time_by_kernel.values()) / 1000 / steps,
        copies=(len(device_times) - len(kernel_times)) / steps,
        top=costliest,
    )


def profiled(run: Callable[[], object], steps: int, device: torch.device) -> StepProfile:
    """Profile ``run()`` (``steps`` steps of a loop) on ``device``."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    cuda = torch.autograd.DeviceType.CUDA
    op_names = [
        e.name
        for e in events
        if e.device_type != cuda and e.name.startswith("aten::") and e.cpu_parent is None
    ]
    device_times = [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == cuda]
    return summarise(op_names, device_times, steps)


def profile_text(label: str, p: StepProfile) -> str:
    lines = [
        f"- {label}: {p.ops:.1f} torch operators, {p.kernels:.1f} kernels, "
        f"{p.kernel_ms:.3f} ms of kernels, {p.copies:.1f} copies per step"
    ]
    lines += [f"  - {ms:.3f} ms, {n:.1f}x: {name[:90]}" for name, ms, n in p.top]
    return "\n".join(lines)
