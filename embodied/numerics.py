"""CPU numerics: how a run gives the same floats on every x86 CPU, and what it ran on.

A float result depends on the code that computes it, and five libraries choose their code by the
CPU: MKL (torch's matrix products) picks its kernels by the processor; torch's own CPU kernels are
built for several instruction sets and the widest the CPU has runs (exp, log, softmax, reductions,
the normal sampler); oneDNN (convolutions) generates its code for the CPU at run time; numpy runs
its AVX2 or AVX-512 builds of tanh, exp, ... where the CPU has them; glibc's libm takes FMA
variants of sinf, exp, ... where it has FMA. PPO grows a difference in the 7th digit into another
learning curve (docs/benchmarks.md), so a run that must repeat on another machine pins them all:
MKL's conditional numerical reproducibility on its COMPATIBLE branch (the same results on every
x86 CPU), torch's kernels and numpy's at their portable builds, convolutions through torch's own
kernels (MKL underneath) instead of oneDNN, libm without its FMA variants, and torch's
deterministic algorithms. The number of threads changes sums too: a run fixes it
(``runner.torch_threads``).

numpy and glibc read their switches when a process starts, MKL and torch at their first use, so
the pins are environment variables (``PINNED_ENV``): ``restart`` runs the command line again in a
process started with them, and a pinned process passes them to those it starts (simulator, Ray and
tensor-parallel workers). The learner's and the policy's processes (``pin``, ``follow``: the run,
Ray workers, TP ranks) check that every library took its portable path and switch what is
switched at run time (oneDNN, deterministic algorithms); simulator workers inherit the pins.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import socket
import sys
from importlib import metadata
from pathlib import Path

import torch

from embodied.schema import UserError

GLIBC_MASKS = ("-AVX2", "-FMA", "-FMA4")  # libm's FMA variants (they need AVX2 too) are off


def _numpy_umath():
    try:  # numpy 2
        from numpy._core import _multiarray_umath
    except ImportError:  # numpy 1
        from numpy.core import _multiarray_umath
    return _multiarray_umath


# MKL's COMPATIBLE branch; torch's portable kernels; numpy's baseline, each of its dispatched
# builds off (their names are this numpy's); libm without FMA variants; EMBODIED_PINNED tells a
# started process to ``follow``; cuBLAS needs a fixed workspace for deterministic algorithms
PINNED_ENV = {
    "MKL_CBWR": "COMPATIBLE",
    "ATEN_CPU_CAPABILITY": "default",
    "NPY_DISABLE_CPU_FEATURES": " ".join(_numpy_umath().__cpu_dispatch__),
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=" + ",".join(GLIBC_MASKS),
    "EMBODIED_PINNED": "1",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
MKL_COMPATIBLE = 3  # mkl_cbwr.h: MKL_CBWR_COMPATIBLE
MKL_BRANCHES = {  # mkl_cbwr.h: the code branch values mkl_cbwr_get reports
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    11: "AVX512_MIC",
    12: "AVX512",
    13: "AVX512_MIC_E1",
    14: "AVX512_E1",
}
CPU_FLAGS = ("sse4_2", "avx", "fma", "avx2", "avx512f", "avx512_bf16", "amx_tile")  # of interest
VERSIONS = ("torch", "numpy", "mani-skill", "sapien", "mujoco", "ray", "megatron-core")


def _mkl():
    """The MKL inside torch's CPU library (its service functions), or None where torch has none
    or does not export them."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        mkl = ctypes.CDLL(str(lib))
        mkl.mkl_serv_cbwr_get.restype = ctypes.c_int
        mkl.mkl_serv_cbwr_set.restype = ctypes.c_int
        mkl.mkl_serv_cbwr_get_auto_branch.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return mkl


def restart() -> None:
    """Run this command line again in a new process started pinned, in place of this one (it
    never returns); numpy and glibc are then pinned from the start, which no running process can
    do for itself."""
    sys.stdout.flush()  # (what this process printed must not be lost with it)
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, pinned_environment(os.environ))


def restart_pinned(deterministic: bool, restartable: bool) -> None:
    """A deterministic run from the command line (``restartable``: this process's own) starts
    over in a process pinned from its first line, since numpy and glibc choose their code then;
    called from Python, the run itself refuses a process that did not start pinned (``pin``)."""
    if deterministic and restartable and not started_pinned():
        restart()


def pinned_environment(environ) -> dict:
    """``environ`` with the pins; glibc's masks join the tunables it sets (one hwcaps entry)."""
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    hwcaps = "glibc.cpu.hwcaps="
    masks = [m for t in tunables if t.startswith(hwcaps) for m in t[len(hwcaps) :].split(",")]
    masks += [m for m in GLIBC_MASKS if m not in masks]
    others = [t for t in tunables if not t.startswith(hwcaps)]
    glibc = ":".join([*others, hwcaps + ",".join(m for m in masks if m)])
    return {**environ, **PINNED_ENV, "GLIBC_TUNABLES": glibc}


def started_pinned() -> bool:
    """Whether this process started with every pin in its environment."""
    environ = os.environ
    glibc = environ.get("GLIBC_TUNABLES", "")
    ours = {k: v for k, v in PINNED_ENV.items() if k != "GLIBC_TUNABLES"}
    return all(environ.get(k) == v for k, v in ours.items()) and all(
        mask in glibc for mask in GLIBC_MASKS
    )


def pin() -> None:
    """Apply the pins in this process, which must have started with ``PINNED_ENV`` (numpy and
    glibc choose their code as a process starts); raises UserError where it did not."""
    if not started_pinned():
        raise UserError(
            "runner.deterministic: this process did not start with its CPU code paths pinned; "
            "`embodied train`, `sft` and `eval` restart themselves so, and Python started with "
            "the variables of embodied.numerics.PINNED_ENV runs pinned"
        )
    follow()


def setup(threads: int) -> None:
    """This process's intra-op threads, and the pins it was started with (``follow``)."""
    torch.set_num_threads(threads)
    follow()


def follow() -> None:
    """In a process started pinned (``PINNED_ENV`` in its environment): check that MKL, torch and
    numpy run their portable code, and send convolutions through torch's own kernels and every
    op through its deterministic algorithm. A process started unpinned is left as it is."""
    if not started_pinned():
        return
    mkl = _mkl()
    if mkl is not None and mkl.mkl_serv_cbwr_set(MKL_COMPATIBLE) != 0:
        branch = MKL_BRANCHES.get(mkl.mkl_serv_cbwr_get(1), "?")
        raise UserError(f"runner.deterministic: MKL already runs on its {branch} branch here")
    if _numpy_builds():
        raise UserError(f"runner.deterministic: numpy runs its {_numpy_builds()} builds here")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "DEFAULT":
        raise UserError(f"runner.deterministic: torch runs its CPU kernels for {capability} here")
    torch.backends.mkldnn.enabled = False
    torch.use_deterministic_algorithms(True)


def _numpy_builds() -> list[str]:
    """The dispatched builds of numpy's functions running in this process (none: its baseline)."""
    umath = _numpy_umath()
    return [build for build in umath.__cpu_dispatch__ if umath.__cpu_features__.get(build)]


def _cpu() -> dict:
    """The processor: its model, logical cores, and which of CPU_FLAGS it has (Linux)."""
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return {
        "model": model,
        "logical_cores": os.cpu_count(),
        "flags": [flag for flag in CPU_FLAGS if flag in flags],
    }


def _versions() -> dict:
    found = {"python": platform.python_version(), "glibc": "-".join(platform.libc_ver())}
    for name in VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    mkl = _mkl()
    if mkl is not None:
        text = ctypes.create_string_buffer(256)
        mkl.MKL_Get_Version_String(text, len(text))
        found["mkl"] = text.value.decode()
    return found


def host() -> dict:
    """What this process computes on: the CPU, the code paths in effect (MKL's branch and the one
    AUTO would take here, torch's kernel build, oneDNN, threads, deterministic algorithms), the
    GPUs and the libraries' versions; for ``RUN/host.json``."""
    mkl = _mkl()
    paths = {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "numpy_builds": _numpy_builds(),
        "mkl_branch": None if mkl is None else MKL_BRANCHES.get(mkl.mkl_serv_cbwr_get(1)),
        "mkl_auto_branch": None
        if mkl is None
        else MKL_BRANCHES.get(mkl.mkl_serv_cbwr_get_auto_branch()),
        "onednn": torch.backends.mkldnn.enabled,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch_threads": torch.get_num_threads(),
        "environment": {k: os.environ[k] for k in sorted(PINNED_ENV) if k in os.environ},
    }
    # names only where CUDA is up already: asking would start it in a driver that needs none
    cuda = torch.cuda.is_initialized()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count() if cuda else 0)]
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "cpu": _cpu(),
        "code_paths": paths,
        "gpus": gpus,
        "cuda_devices": torch.cuda.device_count(),
        "versions": _versions(),
    }


def record(run_dir: Path, *, iteration: int, deterministic: bool) -> None:
    """This start of the run (at ``iteration``) in ``RUN/host.json``: {"starts": [{"iteration",
    "deterministic", **host()}]}, a new file at iteration 0, one start more at a resume. Not in
    config.yaml: a resume on another machine is the same run."""
    path = Path(run_dir) / "host.json"
    starts = json.loads(path.read_text())["starts"] if path.exists() and iteration else []
    starts.append({"iteration": iteration, "deterministic": deterministic, **host()})
    part = path.with_suffix(".json.part")
    part.write_text(json.dumps({"starts": starts}, indent=2))
    os.replace(part, path)
