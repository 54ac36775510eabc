"""The import direction of shared/DESIGN.md section 1, enforced with import-linter.

import-linter (grimp) walks a package's folder on disk and does not see setuptools' package-dir
mapping, so the test lays the source out as installed (simulators/ -> embodied/simulators/, ...)
in a temporary directory and runs the real ``lint-imports`` on that copy.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = {
    "simulators": "simulators",
    "robots": "robots",
    "models": "models",
    "algorithms": "algorithms",
}


def test_import_contracts_hold(tmp_path):
    pkg = tmp_path / "embodied"
    shutil.copytree(ROOT / "embodied", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for folder, name in SUBPACKAGES.items():
        shutil.copytree(ROOT / folder, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run(
        [exe, "--config", "pyproject.toml", "--no-cache"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 kept, 0 broken" in res.stdout
