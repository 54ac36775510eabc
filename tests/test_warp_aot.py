"""Warp's CUDA kernels compiled without a GPU (``simulators/mujoco/warp_aot.py``): every launch on
Warp's CPU device also compiles its module for CUDA, named by the module's kernels at that moment
and the launch's block size (as Warp names the module it loads on a GPU), into a binary (cubin)
for each architecture asked (sm_90 by default: an H100's or H200's)."""

import contextlib
import json
import re
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest

wp = pytest.importorskip("warp")
pytest.importorskip("mujoco_warp")

from warp._src import context  # noqa: E402 (pinned warp-lang)

from embodied.simulators.mujoco.warp_aot import compiling_for_cuda  # noqa: E402


@wp.kernel
def scale(values: wp.array(dtype=float), factor: float):
    i = wp.tid()
    values[i] = values[i] * factor


@wp.kernel(module=wp.get_module("embodied_test_warp_aot_grows"))  # a module that grows, below
def double(values: wp.array(dtype=float)):
    i = wp.tid()
    values[i] = values[i] * 2.0


def _cubin_kernels(folder, name, arch=90) -> set[str]:
    """The kernels in the binary built for ``arch`` (its .meta beside it)."""
    cubin = (folder / name / f"{name}.sm{arch}.cubin").read_bytes()
    (machine,) = struct.unpack_from("<H", cubin, 18)  # ELF e_machine
    (flags,) = struct.unpack_from("<I", cubin, 48)  # ELF64 e_flags: sm_N in the low byte (< 100)
    assert (cubin[:4], machine, flags & 0xFF) == (b"\x7fELF", 190, arch)  # 190: EM_CUDA
    assert (folder / name / f"{name}.meta").exists()
    symbols = re.findall(rb"\0(\w+)_[0-9a-f]{8}_cuda_kernel_forward\0", cubin)  # key_hash
    return {symbol.decode() for symbol in symbols}


@contextlib.contextmanager
def _at_block(module, block_dim: int):
    """The module as Warp sees it for a launch at ``block_dim``, for the block."""
    launched_at = module.options["block_dim"]
    module.options["block_dim"] = block_dim
    try:
        yield module
    finally:
        module.options["block_dim"] = launched_at


def _name_at(module, block_dim: int) -> str:
    with _at_block(module, block_dim):
        return module.get_module_identifier()


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
    assert _cubin_kernels(tmp_path, at_64) == {scale.key}


class _H100:
    """What Warp asks of a CUDA device to name the file it loads (there is no GPU here): an H100
    whose driver (CUDA 13.0, as on the machines lent to us) is newer than Warp's CUDA 12.9."""

    is_cpu = False
    is_cubin_supported = True
    arch = 90
    alias = "cuda:0"
    runtime = SimpleNamespace(driver_version=(13, 0), toolkit_version=(12, 9))
    get_cuda_output_format = context.Device.get_cuda_output_format
    get_cuda_compile_arch = context.Device.get_cuda_compile_arch
    _get_cuda_arch_suffix = context.Device._get_cuda_arch_suffix


def test_the_file_built_is_the_one_warp_loads_on_an_h100(tmp_path, monkeypatch):
    values = wp.ones(4, dtype=float, device="cpu")
    with compiling_for_cuda(tmp_path):
        wp.launch(scale, dim=4, inputs=[values, 2.0], device="cpu", block_dim=64)
    name = _name_at(scale.module, 64)
    with _at_block(scale.module, 64) as module:
        loads = module._get_compile_output_name(_H100())
        monkeypatch.setattr(wp.config, "cuda_output", None)  # Warp left to choose
        monkeypatch.setattr(context.runtime, "default_ptx_arch", 90)  # (75 here: no GPU)
        would_load = module._get_compile_output_name(_H100())
    assert loads == f"{name}.sm90.cubin"  # what require_warp asks Warp for
    assert (tmp_path / name / loads).is_file()
    assert would_load == f"{name}.sm90.ptx"  # which the driver would compile at every load


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
    assert _cubin_kernels(tmp_path, before, arch=80) == {double.key}
    assert _cubin_kernels(tmp_path, before, arch=90) == {double.key}
    assert _cubin_kernels(tmp_path, after) == {double.key, shift.key}
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
        assert _cubin_kernels(tmp_path, entry)  # a CUDA kernel in each
