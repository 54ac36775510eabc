"""Weight sync through shared memory (embodied/cluster/shared.py), by hand: the buffers' layout,
and another process that maps them, reads every entry whole and sees the next write without a
new handle; on a GPU through CUDA IPC (the ``gpu`` case, in benchmarks/gpu_suite.sh)."""

import subprocess
import sys

import pytest
import torch

from embodied.cluster.shared import Entry, SharedWeights

# the other process: maps the buffers, prints each entry's sum, waits for a line, prints again
READER = """
import sys
from embodied.cluster.shared import SharedWeights

shared = SharedWeights.open(sys.stdin.buffer.read(int(sys.argv[1])))
for _ in range(2):
    views = shared.views()
    print(" ".join(f"{k}={float(v.double().sum()):g}" for k, v in views.items()), flush=True)
    sys.stdin.buffer.readline()
"""


def state(device: str = "cpu") -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(6, dtype=torch.float32, device=device).view(2, 3),
        "count": torch.tensor([7, 9], device=device),
        "b": torch.full((4,), 0.5, device=device),
        "mask": torch.tensor([True, False, True], device=device),
    }


def test_entries_are_laid_out_per_dtype_in_state_dict_order():
    shared = SharedWeights.allocate(state())
    assert shared.entries == [
        Entry("w", torch.float32, (2, 3), 0),
        Entry("count", torch.int64, (2,), 0),
        Entry("b", torch.float32, (4,), 6),
        Entry("mask", torch.bool, (3,), 0),
    ]
    assert {dtype: b.numel() for dtype, b in shared.buffers.items()} == {
        torch.float32: 10,
        torch.int64: 2,
        torch.bool: 3,
    }
    for key, tensor in state().items():
        assert torch.equal(shared.views()[key], tensor)
    # a write of some entries copies those only, and counts their bytes
    assert shared.write({"b": torch.ones(4)}) == 16
    assert torch.equal(shared.views()["b"], torch.ones(4))
    assert torch.equal(shared.views()["w"], state()["w"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_another_process_maps_the_buffers_and_sees_each_write(device):
    shared = SharedWeights.allocate(state(device))
    assert {b.device.type for b in shared.buffers.values()} == {device}
    handles = shared.handles()
    assert len(handles) < 2048  # handles, not the weights
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(len(handles))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=False,
    )
    try:
        reader.stdin.write(handles)
        reader.stdin.flush()
        assert reader.stdout.readline().decode().split() == ["w=15", "count=16", "b=2", "mask=2"]
        written = {
            "w": torch.full((2, 3), 2.0, device=device),
            "mask": torch.zeros(3, dtype=torch.bool, device=device),
        }
        assert shared.write(written) == 6 * 4 + 3
        reader.stdin.write(b"\n")
        reader.stdin.flush()
        assert reader.stdout.readline().decode().split() == ["w=12", "count=16", "b=2", "mask=0"]
        reader.stdin.write(b"\n")
        reader.stdin.close()
        assert reader.wait(timeout=60) == 0
    finally:
        reader.kill()
