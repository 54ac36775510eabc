"""The first step's line (``simulators/mujoco/warp_setup.py``): a run says how long Warp compiled
a scene's kernels when it compiled any, and nothing when it loaded them all from the cache."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("warp")
pytest.importorskip("mujoco_warp")

FIRST_STEPS = """
import warp as wp
from embodied.simulators.mujoco.warp_setup import require_warp, timed_first_step

require_warp()


@wp.kernel
def twice(values: wp.array(dtype=float)):
    i = wp.tid()
    values[i] = values[i] * 2.0


values = wp.ones(4, dtype=float, device="cpu")
step = lambda: wp.launch(twice, dim=4, inputs=[values], device="cpu")  # noqa: E731
timed_first_step("tiny", "cpu", step)  # compiled, or loaded from the cache
timed_first_step("tiny", "cpu", step)  # in memory already
print("values", values.numpy().tolist())
"""


def _first_steps(folder) -> list[str]:
    """The lines a process prints that steps a one-kernel scene twice, with ``folder / "cache"``
    as Warp's kernel cache (Warp reads a kernel's source: the script is a file)."""
    script = folder / "first_steps.py"
    script.write_text(FIRST_STEPS)
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, "WARP_CACHE_PATH": str(folder / "cache")},
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()


def test_a_compile_is_said_once_with_its_modules_and_a_load_from_the_cache_not_at_all(tmp_path):
    compiled = _first_steps(tmp_path)
    assert len(compiled) == 2
    assert re.fullmatch(
        rf"MuJoCo Warp: compiled 1 module of the tiny kernels in \d+ s; they are kept in "
        rf"{re.escape(str(tmp_path / 'cache'))} for the next run",
        compiled[0],
    )
    assert compiled[1] == "values [4.0, 4.0, 4.0, 4.0]"  # both steps ran
    assert _first_steps(tmp_path) == ["values [4.0, 4.0, 4.0, 4.0]"]  # a second run: loaded


def test_warm_steps_every_scene_and_says_what_it_compiled():
    run = subprocess.run(
        [sys.executable, "-m", "embodied.simulators.mujoco.warm"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    scenes = [
        re.fullmatch(
            r"MuJoCo Warp (\w+) on cpu: ready in [\d.]+ s \(\d+ modules compiled for cpu\)", line
        )
        for line in run.stdout.splitlines()
        if not line.startswith("MuJoCo Warp: compiled")  # (a cold cache)
    ]
    assert [scene and scene.group(1) for scene in scenes] == ["pick", "push", "reach", "renderer"]


def test_warp_without_mujoco_warp_is_the_one_line_install_hint(monkeypatch):
    """warp-lang comes with other packages: without mujoco-warp beside it, a ModuleNotFoundError
    traceback."""
    from embodied.schema import UserError
    from embodied.simulators.mujoco.warp_setup import require_warp

    monkeypatch.setitem(sys.modules, "mujoco_warp", None)
    with pytest.raises(UserError, match=r"^env.backend=warp needs MuJoCo Warp: pip install"):
        require_warp()


def test_a_missing_dependency_of_mujoco_warp_names_itself(monkeypatch, tmp_path):
    """mujoco_warp installed without one of its own imports: that import's error, not "pip
    install embodied[warp]" (which has it installed already)."""
    from embodied.simulators.mujoco.warp_setup import require_warp

    (tmp_path / "mujoco_warp").mkdir()
    (tmp_path / "mujoco_warp" / "__init__.py").write_text("import a_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mujoco_warp", raising=False)
    with pytest.raises(ModuleNotFoundError) as raised:
        require_warp()
    assert raised.value.name == "a_dependency_not_installed"


def test_a_cuda_architecture_without_a_cuda_cache_is_refused(monkeypatch, capsys):
    """`warm --cuda-arch 80` warmed the CPU cache alone and said nothing of the 80."""
    from embodied.simulators.mujoco import warm

    monkeypatch.setattr(sys, "argv", ["warm", "--cuda-arch", "80"])
    monkeypatch.setattr(warm, "warm", lambda device: pytest.fail("warmed"))
    with pytest.raises(SystemExit) as stopped:
        warm.main()
    assert stopped.value.code == 2
    assert "--cuda-arch: only with --cuda-cache DIR" in capsys.readouterr().err
