"""The import direction of shared/DESIGN.md section 1, enforced with import-linter."""

import shutil
import subprocess
import sys
from pathlib import Path


def test_import_contracts_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    res = subprocess.run([exe, "--config", "pyproject.toml"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 kept, 0 broken" in res.stdout
