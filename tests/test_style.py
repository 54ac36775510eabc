"""The code's style is checked like its behaviour: ``ruff format`` (line length 100) and ``ruff
check`` as configured in pyproject.toml must both pass over the whole tree."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff() -> str:
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(exe).exists():
        pytest.fail("ruff is not installed (it is in the dev extra: scripts/setup.sh installs it)")
    return exe


def test_ruff_format_leaves_every_file_as_it_is():
    res = subprocess.run(
        [ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_check_finds_nothing():
    res = subprocess.run([ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# every folder of Python: the package's (installed as embodied.*), benchmarks, scripts, tests
FOLDERS = (
    "embodied",
    "simulators",
    "robots",
    "models",
    "algorithms",
    "benchmarks",
    "scripts",
    "tests",
)


def test_every_module_stays_within_500_lines():
    """A module does one job and stays within 500 lines: the package, its benchmarks, scripts and
    tests alike (a longer one is split where its jobs part)."""
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
    }
    assert len(sizes) > 100  # (the tree was found)
    assert {name: n for name, n in sizes.items() if n > 500} == {}
