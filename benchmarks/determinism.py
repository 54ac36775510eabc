"""runner.deterministic on the README run (configs/maniskill/pushcube_ppo.yaml), two measurements:

``--check``: the run's first N iterations under each variation of the CPU's code paths that an
environment variable can make on one machine, deterministic and not: MKL's instruction set
(``MKL_ENABLE_INSTRUCTIONS``), torch's own kernels (``ATEN_CPU_CAPABILITY``), oneDNN
(``ONEDNN_MAX_CPU_ISA``), glibc's libm variants (``GLIBC_TUNABLES``: no FMA/AVX2, as on an older
CPU) and numpy's builds (``NPY_DISABLE_CPU_FEATURES``: its baseline only). Each run's logged
training numbers (timings left out) are compared bit for bit with the same mode's run without a
variation; a digest of them is printed, so that runs on two machines can be compared too
(``--reference FILE``: the ``--out`` of another machine).

``--cost``: the speed cost, as alternated pairs (deterministic, not) of the first M iterations,
each run's training minutes as it logged them; the median of the pairs' ratios is reported.

    python benchmarks/determinism.py --check [--iterations 20] [--out FILE] [--reference FILE]
    python benchmarks/determinism.py --cost [--iterations 60] [--pairs 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from embodied.numerics import PINNED_ENV

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/maniskill/pushcube_ppo.yaml"
STEPS_PER_ITERATION = 16 * 50  # the config's environments x steps
VARIATIONS = {  # name -> environment variables that change a code path on this machine
    "none": {},
    "mkl AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl SSE4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "torch DEFAULT": {"ATEN_CPU_CAPABILITY": "default"},
    "torch AVX2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "onednn SSE41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "glibc no FMA/AVX2": {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA"},
    "numpy baseline": {"NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR"},
}


def train(out: Path, name: str, iterations: int, deterministic: bool, env: dict) -> dict:
    """One run of the README config for ``iterations`` (no evaluation during training, a final
    one of 16 episodes, no video); returns {rows, minutes, wall_s}."""
    overrides = [
        f"runner.total_env_steps={iterations * STEPS_PER_ITERATION}",
        "runner.eval_every=0",
        "runner.final_eval_episodes=16",
        "runner.video=false",
        "runner.progress=false",
        f"runner.output_dir={out}",
        f"runner.name={name}",
        f"runner.deterministic={str(deterministic).lower()}",
    ]
    clean = {k: v for k, v in os.environ.items() if k not in _CODE_PATH_VARIABLES}
    command = [sys.executable, "-m", "embodied.cli", "train", CONFIG, *overrides]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env={**clean, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if '"policy/loss"' in line]
    return {"rows": rows, "minutes": rows[-1]["time/minutes"], "wall_s": wall}


_CODE_PATH_VARIABLES = {key for env in VARIATIONS.values() for key in env} | set(PINNED_ENV)


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def first_difference(a: list[dict], b: list[dict]) -> str:
    """Where two runs' untimed rows first differ ("" where they are equal)."""
    for row_a, row_b in zip(a, b):
        for key in row_a:
            if row_a[key] != row_b.get(key):
                return f"iteration {row_a['iteration']} {key}: {row_a[key]!r} vs {row_b[key]!r}"
    return "" if len(a) == len(b) else f"{len(a)} rows vs {len(b)}"


def digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


def check(iterations: int, out_file: Path | None, reference: Path | None) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for deterministic in (True, False):
            base = None
            for name, env in VARIATIONS.items():
                label = f"{'det' if deterministic else 'free'}-{name.replace(' ', '_')}"
                rows = untimed(train(Path(tmp), label, iterations, deterministic, env)["rows"])
                base = rows if base is None else base
                results[label] = {"digest": digest(rows), "differs": first_difference(rows, base)}
                same = "identical" if not results[label]["differs"] else results[label]["differs"]
                print(f"{label:32s} {results[label]['digest']}  {same}", flush=True)
    record = {"host": _host(), "iterations": iterations, "runs": results}
    if out_file is not None:
        out_file.write_text(json.dumps(record, indent=2))
    if reference is not None:
        theirs = json.loads(reference.read_text())
        for label, run in results.items():
            other = theirs["runs"].get(label, {}).get("digest")
            verdict = "same" if other == run["digest"] else f"differs ({other})"
            print(f"{label:32s} against {theirs['host']['cpu']}: {verdict}")


def cost(iterations: int, pairs: int) -> None:
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)  # alternate who goes first
            minutes = {}
            for deterministic in order:
                name = f"pair{pair}-{deterministic}"
                minutes[deterministic] = train(Path(tmp), name, iterations, deterministic, {})[
                    "minutes"
                ]
            ratios.append(minutes[True] / minutes[False])
            print(
                f"pair {pair}: deterministic {60 * minutes[True]:.1f} s, "
                f"free {60 * minutes[False]:.1f} s of training, ratio {ratios[-1]:.3f}",
                flush=True,
            )
    print(
        f"deterministic / free training time over {iterations} iterations: median "
        f"{statistics.median(ratios):.3f} of {pairs} pairs (range {min(ratios):.3f}-"
        f"{max(ratios):.3f}) on {_host()['cpu']}"
    )


def _host() -> dict:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        cpu = models[0] if models else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="bit-identity under code-path changes")
    mode.add_argument("--cost", action="store_true", help="speed: alternated pairs")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="--check: write the digests here (JSON)")
    parser.add_argument("--reference", type=Path, help="--check: another machine's --out")
    args = parser.parse_args()
    if args.check:
        check(args.iterations or 20, args.out, args.reference)
    else:
        cost(args.iterations or 60, args.pairs)


if __name__ == "__main__":
    main()
