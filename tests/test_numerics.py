"""runner.deterministic (embodied/numerics.py): a pinned run repeats bit for bit where torch would
choose other kernels, and a process whose libraries already chose another code path is refused in
one line. Each run is `embodied train` in a fresh process: a process's code paths are chosen
once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_runs import TINY_REACH

from embodied import numerics
from embodied.numerics import PINNED_ENV

ROOT = Path(__file__).resolve().parent.parent
UNPINNED = {k: v for k, v in os.environ.items() if k not in PINNED_ENV}


def has_avx2() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx2" in cpuinfo.read_text()


def tiny_run(tmp_path, name: str, pinned: bool, env: dict) -> list[dict]:
    """A few seconds of PPO on the MuJoCo reach task in a fresh process under ``env``; its
    training rows without timings."""
    overrides = [
        *TINY_REACH,
        "runner.total_env_steps=64",
        f"runner.output_dir={tmp_path}",
        f"runner.name={name}",
        f"runner.deterministic={str(pinned).lower()}",
    ]
    command = [sys.executable, "-m", "embodied.cli", "train", "configs/mujoco/reach_ppo.yaml"]
    done = subprocess.run(
        [*command, *overrides], cwd=ROOT, env={**UNPINNED, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if '"policy/loss"' in line]
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


@pytest.mark.slow  # (47 s: four tiny training processes; CI runs the slow set)
@pytest.mark.skipif(not has_avx2(), reason="needs a CPU whose torch kernels can be AVX2 or not")
def test_a_pinned_run_repeats_bit_for_bit_where_torch_would_choose_other_kernels(tmp_path):
    """ATEN_CPU_CAPABILITY=avx2 against default stands in for two CPUs: unpinned, torch's
    normal sampler and softmax round otherwise and the runs part; pinned, both use the portable
    kernels and log the same numbers."""
    avx2 = {"ATEN_CPU_CAPABILITY": "avx2"}
    portable = {"ATEN_CPU_CAPABILITY": "default"}
    pinned = [tiny_run(tmp_path, f"pinned-{n}", True, env) for n, env in enumerate((avx2, {}))]
    assert len(pinned[0]) == 2 and pinned[0] == pinned[1]
    (start,) = json.loads((tmp_path / "pinned-0" / "host.json").read_text())["starts"]
    paths = start["code_paths"]  # (the command restarted itself pinned)
    assert start["deterministic"] and paths["torch_cpu_capability"] == "DEFAULT"
    assert paths["numpy_builds"] == [] and paths["onednn"] is False
    assert paths["deterministic_algorithms"] is True
    assert paths["mkl_branch"] in ("COMPATIBLE", None)  # (None: a torch without MKL)
    free = [tiny_run(tmp_path, f"free-{n}", False, env) for n, env in enumerate((avx2, portable))]
    assert free[0] != free[1]


LATE = "os.environ.update(numerics.pinned_environment(os.environ))\n"  # pins claimed too late


@pytest.mark.parametrize(
    "env, before, said",
    [
        ({}, "", "this process did not start with its CPU code paths pinned; `embodied train`"),
        ({}, "torch.ones(64, 64) @ torch.ones(64, 64)\n" + LATE, "MKL already runs on its OFF"),
        ({}, LATE, "numpy runs its ["),
        (
            {"NPY_DISABLE_CPU_FEATURES": PINNED_ENV["NPY_DISABLE_CPU_FEATURES"]},
            "torch.ones(4) * 2\n" + LATE,
            "torch runs its CPU kernels for {native}",  # AVX2 or AVX512: this CPU's own
        ),
    ],
    ids=["not started pinned", "MKL used before", "numpy unpinned", "torch's kernels chosen"],
)
def test_a_process_not_started_pinned_is_refused_in_one_line(env, before, said):
    """Pinned in its environment only after it started, a process cannot keep what it promises:
    each library that already chose its code is named."""
    native = torch.backends.cpu.get_cpu_capability()  # this process is not pinned
    if "{native}" in said and native == "DEFAULT":
        pytest.skip("needs a CPU whose torch kernels are not the portable ones")
    said = said.format(native=native)
    if "MKL" in said and numerics._mkl() is None:
        pytest.skip("needs torch with MKL inside")
    code = f"import os\nimport torch\nfrom embodied import numerics\n{before}numerics.pin()\n"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**UNPINNED, **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert f"UserError: runner.deterministic: {said}" in done.stderr


@pytest.mark.parametrize(
    "theirs, pinned",
    [
        (None, "glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4"),
        ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4"),
        (  # the user's own masks stay, in the one hwcaps entry glibc reads
            "glibc.cpu.hwcaps=-AVX512F,-FMA:glibc.malloc.arena_max=2",
            "glibc.malloc.arena_max=2:glibc.cpu.hwcaps=-AVX512F,-FMA,-AVX2,-FMA4",
        ),
    ],
)
def test_the_pins_join_the_glibc_tunables_a_user_sets(theirs, pinned, monkeypatch):
    environ = {"HOME": "/h"} if theirs is None else {"HOME": "/h", "GLIBC_TUNABLES": theirs}
    env = numerics.pinned_environment(environ)
    assert env["GLIBC_TUNABLES"] == pinned and env["HOME"] == "/h"
    assert numerics.pinned_environment(env) == env  # (a restart of a restart adds nothing)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert numerics.started_pinned()
    monkeypatch.setenv("GLIBC_TUNABLES", theirs or "")  # every pin but glibc's
    assert not numerics.started_pinned()
