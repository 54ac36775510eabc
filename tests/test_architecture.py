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
    _lay_out(tmp_path)
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


CYCLES = """
import sys

import grimp

graph = grimp.build_graph("embodied")
modules = sorted(graph.modules)
seen, stack, cycles = set(), [], []


def visit(module, on_path):
    # depth-first search over module-level and function-level imports alike
    seen.add(module)
    stack.append(module)
    on_path.add(module)
    for imported in sorted(graph.find_modules_directly_imported_by(module)):
        if imported in on_path:
            cycles.append(stack[stack.index(imported):] + [imported])
        elif imported not in seen:
            visit(imported, on_path)
    on_path.discard(module)
    stack.pop()


for module in modules:
    if module not in seen:
        visit(module, set())
print("\\n".join(" -> ".join(c) for c in cycles))
sys.exit(1 if cycles else 0)
"""


def test_no_import_cycles(tmp_path):
    """No module imports itself through others, at module level or inside a function."""
    _lay_out(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-c", CYCLES], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert res.returncode == 0, "import cycles:\n" + res.stdout + res.stderr


def _lay_out(tmp_path):
    pkg = tmp_path / "embodied"
    shutil.copytree(ROOT / "embodied", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for folder, name in SUBPACKAGES.items():
        shutil.copytree(ROOT / folder, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
