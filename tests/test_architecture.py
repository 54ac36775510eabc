"""The import direction of shared/DESIGN.md section 1, as an allow-list: what each part of the
package may import (docs/design-notes.md 60). grimp (import-linter's import graph) walks a
package's folder on disk and does not see setuptools' package-dir mapping, so the test lays the
source out as installed (simulators/ -> embodied/simulators/, ...) in a temporary directory and
builds the graph of that copy."""

import json
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


# What each part of the package may import from the rest of it (its own modules aside): an
# allow-list, so that a new dependency between parts is a decision made here, in review. The
# parts DESIGN.md section 1 names come first; a module that is in no entry fails the test.
ALLOWED = {
    # the contract, and the parts behind it: the contract only (algorithms: torch only)
    "embodied.schema": set(),
    "embodied.simulators": {"embodied.compiling", "embodied.schema"},  # (env.compile)
    "embodied.robots": {"embodied.schema"},
    "embodied.models": {"embodied.schema"},
    "embodied.algorithms": set(),
    # leaves of the core
    "embodied": {"embodied.torchvision_ops"},  # (the package's __init__)
    "embodied.torchvision_ops": set(),
    "embodied.config": {"embodied.config_files", "embodied.logger"},  # (write_atomic)
    "embodied.config_files": set(),
    "embodied.streams": set(),
    "embodied.seeds": {"embodied.schema"},
    "embodied.video": set(),
    "embodied.logger": set(),
    "embodied.events": {"embodied.logger"},
    "embodied.cli_errors": set(),
    "embodied.bench_report": {"embodied.logger"},
    "embodied.contract": {"embodied.schema"},
    "embodied.numerics": {"embodied.schema"},
    "embodied.compiling": {"embodied.schema"},
    "embodied.env_group": {"embodied.schema"},
    "embodied.inference": {"embodied.compiling", "embodied.schema", "embodied.streams"},
    "embodied.frozen_weights": set(),
    "embodied.checkpoint": {"embodied.frozen_weights", "embodied.schema", "embodied.megatron"},
    "embodied.record_files": {"embodied.checkpoint"},
    "embodied.resume": {
        "embodied.checkpoint",
        "embodied.config",
        "embodied.logger",
        "embodied.record_files",
    },
    "embodied.run": {
        "embodied.checkpoint",
        "embodied.config",
        "embodied.logger",
        "embodied.numerics",
        "embodied.resume",
    },
    "embodied.dataset": {"embodied.schema"},
    "embodied.multitask": {"embodied.schema", "embodied.simulators"},
    "embodied.twin": {"embodied.robots", "embodied.simulators", "embodied.twin_camera"},
    "embodied.twin_camera": set(),
    # the rollout, the algorithms' bookkeeping, the learner
    "embodied.episode_stats": set(),
    "embodied.rollout": {
        "embodied.env_group",
        "embodied.episode_stats",
        "embodied.inference",
        "embodied.run",
        "embodied.schema",
    },
    "embodied.evaluate": {"embodied.logger", "embodied.rollout", "embodied.run", "embodied.video"},
    "embodied.learner": {"embodied.rollout"},
    "embodied.algorithm": {"embodied.algorithms", "embodied.learner", "embodied.rollout"},
    "embodied.ppo": {
        "embodied.algorithm",
        "embodied.algorithms",
        "embodied.learner",
        "embodied.rollout",
    },
    "embodied.grpo": {
        "embodied.algorithm",
        "embodied.algorithms",
        "embodied.learner",
        "embodied.rollout",
    },
    "embodied.megatron": {
        "embodied.checkpoint",
        "embodied.config",
        "embodied.learner",
        "embodied.models",
        "embodied.numerics",
        "embodied.rollout",
        "embodied.schema",
    },
    # the roles, in one process and on Ray; the run's config and its runner
    "embodied.roles": {
        "embodied.algorithm",
        "embodied.checkpoint",
        "embodied.config",
        "embodied.env_group",
        "embodied.evaluate",
        "embodied.inference",
        "embodied.learner",
        "embodied.megatron",
        "embodied.models",
        "embodied.recording",
        "embodied.resume",
        "embodied.rollout",
        "embodied.schema",
        "embodied.stages",
        "embodied.streams",
    },
    "embodied.cluster": {
        "embodied.checkpoint",
        "embodied.config",
        "embodied.env_group",
        "embodied.episode_stats",
        "embodied.evaluate",
        "embodied.events",
        "embodied.frozen_weights",
        "embodied.inference",
        "embodied.models",
        "embodied.multitask",
        "embodied.numerics",
        "embodied.roles",
        "embodied.rollout",
        "embodied.run",
        "embodied.schema",
        "embodied.stages",
        "embodied.streams",
    },
    "embodied.train_config": {
        "embodied.algorithm",
        "embodied.cluster",
        "embodied.config",
        "embodied.grpo",
        "embodied.learner",
        "embodied.megatron",
        "embodied.models",
        "embodied.multitask",
        "embodied.ppo",
        "embodied.schema",
        "embodied.seeds",
        "embodied.simulators",
    },
    "embodied.run_state": {"embodied.episode_stats", "embodied.run"},
    "embodied.recording": {
        "embodied.checkpoint",
        "embodied.logger",
        "embodied.record_files",
        "embodied.rollout",
        "embodied.schema",
    },
    "embodied.episodes": {
        "embodied.recording",
        "embodied.resimulate",
        "embodied.schema",
        "embodied.video",
    },
    "embodied.resimulate": {
        "embodied.multitask",
        "embodied.recording",
        "embodied.replay",
        "embodied.roles",
        "embodied.schema",
    },
    "embodied.episode_dataset": {
        "embodied.dataset",
        "embodied.episodes",
        "embodied.recording",
        "embodied.replay",  # (the recorded run's config: what its policy read)
        "embodied.resimulate",
        "embodied.schema",
    },
    "embodied.from_records": {
        "embodied.checkpoint",
        "embodied.events",
        "embodied.logger",
        "embodied.record_files",
        "embodied.recording",
        "embodied.replay",
        "embodied.report",
        "embodied.resume",
        "embodied.roles",
        "embodied.run",
        "embodied.run_state",
        "embodied.schema",
        "embodied.train_config",
    },
    "embodied.replay": {
        "embodied.config",
        "embodied.numerics",
        "embodied.recording",
        "embodied.roles",
        "embodied.schema",
        "embodied.train_config",
    },
    "embodied.stages": set(),
    # the run's report: what its directory holds, as a page
    "embodied.report_data": {
        "embodied.evaluate",
        "embodied.events",
        "embodied.logger",
        "embodied.record_files",
        "embodied.recording",
        "embodied.schema",
    },
    "embodied.report": {
        "embodied.episodes",
        "embodied.logger",
        "embodied.recording",
        "embodied.report_data",
        "embodied.schema",
    },
    "embodied.evaluations": {
        "embodied.checkpoint",
        "embodied.evaluate",
        "embodied.logger",
        "embodied.resume",
        "embodied.roles",
        "embodied.run",
        "embodied.run_state",
        "embodied.seeds",
        "embodied.train_config",
    },
    "embodied.runner": {
        "embodied.checkpoint",  # (CheckpointWriteError)
        "embodied.cluster",
        "embodied.config",
        "embodied.episode_stats",
        "embodied.evaluations",
        "embodied.events",
        "embodied.from_records",
        "embodied.logger",
        "embodied.multitask",
        "embodied.numerics",
        "embodied.recording",
        "embodied.report",
        "embodied.resume",
        "embodied.roles",
        "embodied.rollout",
        "embodied.run",
        "embodied.run_state",
        "embodied.seeds",
        "embodied.stages",
        "embodied.streams",
        "embodied.train_config",
    },
    # the other jobs and the command line
    "embodied.sft_data": {"embodied.dataset", "embodied.schema"},
    "embodied.sft_config": {
        "embodied.cluster",
        "embodied.config",
        "embodied.learner",
        "embodied.models",
        "embodied.multitask",
        "embodied.schema",
        "embodied.seeds",
        "embodied.simulators",
        "embodied.train_config",
    },
    "embodied.sft": {
        "embodied.cluster",
        "embodied.config",
        "embodied.dataset",
        "embodied.evaluate",
        "embodied.learner",
        "embodied.logger",
        "embodied.megatron",
        "embodied.models",
        "embodied.multitask",
        "embodied.numerics",
        "embodied.report",
        "embodied.resume",
        "embodied.roles",
        "embodied.run",
        "embodied.schema",
        "embodied.seeds",
        "embodied.sft_config",
        "embodied.sft_data",
        "embodied.simulators",
        "embodied.streams",
        "embodied.train_config",
    },
    "embodied.demos": {
        "embodied.checkpoint",
        "embodied.config",
        "embodied.dataset",
        "embodied.models",
        "embodied.multitask",
        "embodied.run",  # (StopSignals)
        "embodied.seeds",
        "embodied.schema",
        "embodied.simulators",
        "embodied.train_config",
    },
    "embodied.deploy_record": {"embodied.dataset", "embodied.schema", "embodied.video"},
    "embodied.deploy": {
        "embodied.deploy_policy",
        "embodied.deploy_record",
        "embodied.robots",
        "embodied.schema",
        "embodied.seeds",
        "embodied.simulators",
        "embodied.twin",
    },
    "embodied.read_arm": {"embodied.robots", "embodied.twin"},
    "embodied.deploy_policy": {
        "embodied.checkpoint",
        "embodied.demos",
        "embodied.robots",
        "embodied.schema",
    },
    "embodied.convert": {
        "embodied",
        "embodied.checkpoint",
        "embodied.demos",
        "embodied.megatron",
        "embodied.schema",
    },
    "embodied.bench": {
        "embodied.bench_report",
        "embodied.checkpoint",
        "embodied.config",
        "embodied.demos",
        "embodied.evaluate",
        "embodied.logger",
        "embodied.models",
        "embodied.multitask",
        "embodied.schema",
        "embodied.seeds",
    },
    "embodied.cli_robot": {
        "embodied.cli_errors",
        "embodied.deploy",
        "embodied.read_arm",
        "embodied.robots",
    },
    "embodied.cli_eval": {
        "embodied",
        "embodied.checkpoint",
        "embodied.cli_errors",
        "embodied.config",
        "embodied.evaluate",
        "embodied.logger",
        "embodied.models",
        "embodied.multitask",
        "embodied.numerics",
        "embodied.schema",
        "embodied.seeds",
        "embodied.train_config",
    },
    "embodied.cli_runs": {
        "embodied.cli_errors",
        "embodied.episode_dataset",
        "embodied.episodes",
        "embodied.logger",
        "embodied.megatron",  # (require(): a megatron record's extra)
        "embodied.numerics",
        "embodied.record_files",
        "embodied.recording",
        "embodied.replay",
        "embodied.report",
        "embodied.resimulate",
        "embodied.schema",
    },
    "embodied.cli": None,  # the command line may import everything
}
PARTS = ("simulators", "robots", "models", "algorithms", "cluster", "megatron")

IMPORTS = """
import json

import grimp

graph = grimp.build_graph("embodied")
pairs = [
    (module, imported)
    for module in graph.modules
    for imported in graph.find_modules_directly_imported_by(module)
]
print(json.dumps(pairs))
"""


def part_of(module: str) -> str:
    """The entry of ``ALLOWED`` a module belongs to: a subpackage of PARTS, or the module."""
    names = module.split(".")
    if len(names) > 1 and names[1] in PARTS:
        return ".".join(names[:2])
    return module


def test_every_part_imports_only_what_it_is_allowed(tmp_path):
    """Module-level and function-level imports alike (grimp sees both)."""
    _lay_out(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-c", IMPORTS], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert res.returncode == 0, res.stderr
    pairs = json.loads(res.stdout)
    parts = {part_of(module) for module, _ in pairs}
    assert parts - set(ALLOWED) == set(), "parts with no entry in ALLOWED"
    breaches = sorted(
        f"{part_of(module)} -> {part_of(imported)} ({module} imports {imported})"
        for module, imported in pairs
        if part_of(module) != part_of(imported)
        and ALLOWED[part_of(module)] is not None
        and part_of(imported) not in ALLOWED[part_of(module)]
    )
    assert breaches == [], "imports outside the allow-list:\n" + "\n".join(breaches)


def test_the_allow_list_catches_a_simulator_that_imports_the_runner():
    """The check itself, on a hand-built pair: a simulator may import only the contract."""
    assert part_of("embodied.simulators.mujoco.env") == "embodied.simulators"
    assert "embodied.runner" not in ALLOWED[part_of("embodied.simulators.mujoco.env")]
    assert "embodied.schema" in ALLOWED["embodied.models"]
    assert ALLOWED["embodied.algorithms"] == set()


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


def listed_and_on_disk() -> tuple[set[str], set[str]]:
    """(the packages pyproject installs, the package folders on disk under its package-dir)."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = set()
    for package, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((package, *parts)))
    return set(setup["packages"]), on_disk


def test_every_package_folder_is_installed_by_a_regular_install():
    """An editable install finds any folder; `pip install .` only the listed packages: a folder
    left out of the list breaks the CLI there (embodied.cluster once did, on the GPU machine)."""
    listed, on_disk = listed_and_on_disk()
    assert "embodied.cluster" in on_disk and "embodied.simulators.mujoco" in on_disk
    assert on_disk - listed == set(), "add these to pyproject's [tool.setuptools] packages"
