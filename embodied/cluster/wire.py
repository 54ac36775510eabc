"""Tensors across process boundaries: as numpy arrays, which Ray's object store hands to readers
on the same node without a copy (pickle protocol 5 buffers in shared memory).

``to_wire`` replaces every tensor inside a structure (dataclasses, dicts, lists, tuples) by a
``Wired`` numpy array on the host; ``from_wire`` turns them back into tensors on a device. The
arrays a reader gets are read-only views of the object store: nothing here writes into them.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch

# torch.from_numpy warns about read-only arrays (the object store's); nothing writes into them
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


class Wired:
    """A tensor in transit: its numpy array (or, for dtypes numpy lacks, the CPU tensor)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __reduce__(self):
        return Wired, (self.array,)


def to_wire(x):
    """``x`` with every tensor on the host as a ``Wired`` numpy array."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: the tensor itself is pickled
            return Wired(t)
        return Wired(t.numpy())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = copy.copy(x)
        for f in dataclasses.fields(x):
            setattr(out, f.name, to_wire(getattr(x, f.name)))
        return out
    if isinstance(x, dict):
        return {k: to_wire(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_wire(v) for v in x)
    return x


def from_wire(x, device: torch.device | str = "cpu"):
    """``x`` with every ``Wired`` array a tensor on ``device``."""
    if isinstance(x, Wired):
        a = x.array
        t = a if isinstance(a, torch.Tensor) else torch.from_numpy(a)
        return t.to(device)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = copy.copy(x)
        for f in dataclasses.fields(x):
            setattr(out, f.name, from_wire(getattr(x, f.name), device))
        return out
    if isinstance(x, dict):
        return {k: from_wire(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(from_wire(v, device) for v in x)
    return x


def wire_bytes(x) -> int:
    """Bytes of the arrays inside a wired structure (what crosses the process boundary)."""
    if isinstance(x, Wired):
        a = x.array
        return int(a.numel() * a.element_size()) if isinstance(a, torch.Tensor) else a.nbytes
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return sum(wire_bytes(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, dict):
        return sum(wire_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(wire_bytes(v) for v in x)
    return 0
