"""What one step of a loop costs the device: torch's profiler over ``steps`` steps, summed per
step (benchmarks/gpu_throughput.py ``--profile``).

- ``ops``: the top-level torch operators the host issued (each may launch kernels);
- on CUDA, ``kernels`` and ``kernel_ms``: the kernels that ran and their summed time (Warp's and
  a captured CUDA graph's kernels included, where the profiler sees them), and the ten costliest
  kernels by summed time.

Where kernel time per step is less than the step's wall time, the device waited on the host."""

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
    top: list[tuple[str, float, float]]  # (kernel, ms per step, launches per step), costliest first


def summarise(
    op_names: list[str], kernel_times: list[tuple[str, float]], steps: int, top: int = 10
) -> StepProfile:
    """``op_names``: top-level operators; ``kernel_times``: (kernel, microseconds) per launch."""
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
    kernel_times = [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == cuda]
    return summarise(op_names, kernel_times, steps)


def profile_text(label: str, p: StepProfile) -> str:
    lines = [
        f"- {label}: {p.ops:.1f} torch operators, {p.kernels:.1f} kernels, "
        f"{p.kernel_ms:.3f} ms of kernels per step"
    ]
    lines += [f"  - {ms:.3f} ms, {n:.1f}x: {name[:90]}" for name, ms, n in p.top]
    return "\n".join(lines)
