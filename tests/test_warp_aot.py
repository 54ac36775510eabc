"""Warp's CUDA kernels compiled without a GPU (``simulators/mujoco/warp_aot.py``): every launch on
Warp's CPU device also compiles its module for CUDA, named by the module's kernels at that moment
and the launch's block size (as Warp names the module it loads on a GPU), into PTX for each
architecture asked (sm_90 by default: an H100's or H200's)."""

import json
import re
import subprocess
import sys

import pytest

wp = pytest.importorskip("warp")
pytest.importorskip("mujoco_warp")

from embodied.simulators.mujoco.warp_aot import compiling_for_cuda  # noqa: E402


@wp.kernel
def scale(values: wp.array(dtype=float), factor: float):
    i = wp.tid()
    values[i] = values[i] * factor


@wp.kernel(module=wp.get_module("embodied_test_warp_aot_grows"))  # a module that grows, below
def double(values: wp.array(dtype=float)):
    i = wp.tid()
    values[i] = values[i] * 2.0


def _ptx_entries(folder, name, arch=90) -> set[str]:
    """The kernels in the PTX built for ``arch`` (its .meta beside it)."""
    ptx = (folder / name / f"{name}.sm{arch}.ptx").read_text()
    assert re.search(rf"^\.target sm_{arch}$", ptx, re.MULTILINE)
    assert (folder / name / f"{name}.meta").exists()
    return set(re.findall(r"\.entry (\w+)_[0-9a-f]{8}_cuda_kernel_forward", ptx))  # key_hash


def _name_at(module, block_dim: int) -> str:
    launched_at = module.options["block_dim"]
    module.options["block_dim"] = block_dim
    try:
        return module.get_module_identifier()
    finally:
        module.options["block_dim"] = launched_at


def test_each_launch_compiles_its_module_for_the_block_size_it_asks(tmp_path):
    values = wp.ones(4, dtype=float, device="cpu")
    launch = wp.launch
    with compiling_for_cuda(tmp_path) as cuda:
        wp.launch(scale, dim=4, inputs=[values, 2.0], device="cpu", block_dim=64)
        wp.launch(scale, dim=4, inputs=[values, 3.0], device="cpu", block_dim=64)  # compiled
        wp.launch(scale, 4, [values, 0.5], device="cpu")  # Warp's default, 256; positional
    assert wp.launch is launch  # put back
    assert values.numpy().tolist() == [3.0] * 4  # the launches ran, on the CPU
    module = scale.module
    at_64 = _name_at(module, 64)
    at_256 = _name_at(module, 256)
    assert len({at_64, at_256, _name_at(module, 1)}) == 3  # the CPU's own is neither
    assert cuda.archs == (90,)
    assert cuda.compiled == [f"{at_64} @ 64 for sm_90", f"{at_256} @ 256 for sm_90"]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([at_64, at_256])
    assert _ptx_entries(tmp_path, at_64) == {scale.key}


def test_a_kernel_added_after_a_launch_is_a_new_module_state(tmp_path):
    values = wp.ones(4, dtype=float, device="cpu")
    grows = double.module
    with compiling_for_cuda(tmp_path, archs=(80, 90)) as cuda:
        wp.launch(double, dim=4, inputs=[values], device="cpu", block_dim=32)
        before = _name_at(grows, 32)

        @wp.kernel(module=grows)  # as MuJoCo Warp defines kernels lazily, some in shared modules
        def shift(values: wp.array(dtype=float), offset: float):
            i = wp.tid()
            values[i] = values[i] + offset

        wp.launch(shift, dim=4, inputs=[values, 1.0], device="cpu", block_dim=32)
        after = _name_at(grows, 32)
    assert before != after
    assert cuda.compiled == [
        f"{name} @ 32 for sm_{arch}" for name in (before, after) for arch in (80, 90)
    ]
    assert _ptx_entries(tmp_path, before, arch=80) == {double.key}
    assert _ptx_entries(tmp_path, before, arch=90) == {double.key}
    assert _ptx_entries(tmp_path, after) == {double.key, shift.key}
    assert values.numpy().tolist() == [3.0] * 4


def test_a_second_build_into_the_same_folder_compiles_nothing(tmp_path):
    values = wp.ones(4, dtype=float, device="cpu")
    with compiling_for_cuda(tmp_path) as first:
        wp.launch(scale, dim=4, inputs=[values, 2.0], device="cpu", block_dim=128)
    with compiling_for_cuda(tmp_path) as second:
        wp.launch(scale, dim=4, inputs=[values, 2.0], device="cpu", block_dim=128)
    assert len(first.compiled) == 1
    assert second.compiled == []
    assert second.already_there == 1


def test_a_module_that_fails_to_compile_is_said_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def refusing(module, **kwargs):
        raise RuntimeError("NVRTC said no")

    values = wp.ones(4, dtype=float, device="cpu")
    with compiling_for_cuda(tmp_path) as cuda:
        monkeypatch.setattr(wp, "compile_aot_module", refusing)
        wp.launch(scale, dim=4, inputs=[values, 2.0], device="cpu", block_dim=16)
    name = _name_at(scale.module, 16)
    assert cuda.failed == [f"{name} @ 16 for sm_90"]
    assert cuda.compiled == []
    assert values.numpy().tolist() == [2.0] * 4
    assert "NVRTC said no" in capsys.readouterr().err


WARM_AND_BUILD = """
import json, sys
from warp._src.context import user_modules
from embodied.simulators.mujoco.warm import warm
from embodied.simulators.mujoco.warp_aot import compiling_for_cuda
with compiling_for_cuda(sys.argv[1]) as cuda:
    warm("cpu")
loaded = [name for name, module in user_modules.items() if module.execs]
print(json.dumps({"loaded": loaded, "compiled": cuda.compiled, "failed": cuda.failed}))
"""


@pytest.mark.slow
def test_every_module_a_scene_loads_has_its_cuda_build(tmp_path):
    """Every module Warp loaded while the warm-up stepped each task and rendered (in a process of
    its own) has a CUDA entry: no launch went past the interception (a minute: NVRTC on every
    module)."""
    run = subprocess.run(
        [sys.executable, "-c", WARM_AND_BUILD, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    built = {entry.split(" @ ")[0] for entry in result["compiled"]}
    assert result["failed"] == []
    assert len(result["loaded"]) >= 30
    for name in result["loaded"]:
        assert any(entry.rsplit("_", 1)[0] == f"wp_{name}" for entry in built), name
    for entry in built:
        assert _ptx_entries(tmp_path, entry)  # a CUDA kernel in each
