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
from tiny_runs import TINY_REACH

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


@pytest.mark.skipif(not has_avx2(), reason="needs a CPU whose torch kernels can be AVX2 or not")
def test_a_pinned_run_repeats_bit_for_bit_where_torch_would_choose_other_kernels(tmp_path):
    """ATEN_CPU_CAPABILITY=avx2 against default stands in for two CPUs: unpinned, torch's
    normal sampler and softmax round otherwise and the runs part; pinned, both use the portable
    kernels and log the same numbers."""
    avx2 = {"ATEN_CPU_CAPABILITY": "avx2"}
    portable = {"ATEN_CPU_CAPABILITY": "default"}
    pinned = [tiny_run(tmp_path, f"pinned-{n}", True, env) for n, env in enumerate((avx2, {}))]
    assert len(pinned[0]) == 2 and pinned[0] == pinned[1]
    free = [tiny_run(tmp_path, f"free-{n}", False, env) for n, env in enumerate((avx2, portable))]
    assert free[0] != free[1]


@pytest.mark.parametrize(
    "env, before, said",
    [
        ({}, "", "this process did not start with its CPU code paths pinned; `embodied train`"),
        (
            {**PINNED_ENV, "MKL_CBWR": ""},
            "torch.ones(64, 64) @ torch.ones(64, 64)",
            "MKL already runs on its OFF branch here",
        ),
        ({**PINNED_ENV, "ATEN_CPU_CAPABILITY": "avx2"}, "", "torch runs its CPU kernels for AVX2"),
    ],
    ids=["not started pinned", "MKL used unpinned", "torch's kernels unpinned"],
)
def test_a_process_not_started_pinned_is_refused_in_one_line(env, before, said):
    if "AVX2" in said and not has_avx2():
        pytest.skip("needs a CPU whose torch kernels can be AVX2")
    code = f"import torch\n{before}\nfrom embodied import numerics\nnumerics.pin()\n"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**UNPINNED, **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert f"UserError: runner.deterministic: {said}" in done.stderr
