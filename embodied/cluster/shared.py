"""Weight sync through memory both sides map (``cluster.weight_sync: shared``), for inference
copies on the actor worker's node: CUDA IPC where the actor's weights are on a GPU (a sync is a
copy from GPU memory to GPU memory), shared memory on the host otherwise.

The actor worker (rank 0) keeps the state-dict entries a sync can carry in one flat buffer per
dtype, allocated once in memory other processes can map (``SharedWeights``). A sync copies the
current weights into it (all of them, or the ones an update can change) and each inference copy
copies them out into its policy. Only the buffers' handles, once per worker, and the version
cross Ray: a few hundred bytes where the object store carries every weight. The handles are
torch's own (``ForkingPickler``: a CUDA IPC handle, or a shared-memory file name under the
``file_system`` sharing strategy, which any process of the node can open while the actor lives).
The driver asks the copies to read only after the actor's write has returned (and, on a GPU,
finished), and the next write comes with the next sync: a reader never sees a half-written
buffer.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch


@dataclass(frozen=True)
class Entry:
    """Where a state-dict entry lives in the buffers: its dtype's buffer, offset, shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in elements of its dtype's buffer


class SharedWeights:
    """State-dict entries in one flat buffer per dtype, in memory other processes can map."""

    def __init__(self, entries: list[Entry], buffers: dict[torch.dtype, torch.Tensor]):
        self.entries = entries
        self.buffers = buffers

    @classmethod
    def allocate(cls, state: dict[str, torch.Tensor]) -> SharedWeights:
        """Buffers for every entry of ``state`` on its device (one device for all), in state-dict
        order within each dtype, filled with ``state``."""
        devices = {t.device for t in state.values()}
        if len(devices) != 1:
            raise ValueError(
                f"weight_sync shared: the policy's state is on {sorted(map(str, devices))}"
            )
        device = devices.pop()
        sizes: dict[torch.dtype, int] = {}
        entries = []
        for key, tensor in state.items():
            offset = sizes.get(tensor.dtype, 0)
            entries.append(Entry(key, tensor.dtype, tuple(tensor.shape), offset))
            sizes[tensor.dtype] = offset + tensor.numel()
        buffers = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        if device.type == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")  # (handles any process opens)
            for buffer in buffers.values():
                buffer.share_memory_()
        shared = cls(entries, buffers)
        shared.write(state)
        return shared

    def views(self, keys=None) -> dict[str, torch.Tensor]:
        """Each entry (those in ``keys``; None: all) as a view into its buffer."""
        return {
            e.key: self.buffers[e.dtype][e.offset : e.offset + _numel(e.shape)].view(e.shape)
            for e in self.entries
            if keys is None or e.key in keys
        }

    def write(self, state: dict[str, torch.Tensor]) -> int:
        """Copy ``state``'s entries into the buffers; the bytes copied. On a GPU it returns once
        the copies have finished (a reader in another process comes next)."""
        nbytes = 0
        views = self.views(state.keys())
        for key, tensor in state.items():
            views[key].copy_(tensor)
            nbytes += tensor.numel() * tensor.element_size()
        device = next(iter(self.buffers.values())).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return nbytes

    def handles(self) -> bytes:
        """What another process of this node opens the buffers with (``SharedWeights.open``)."""
        out = io.BytesIO()
        ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump((self.entries, self.buffers))
        return out.getvalue()

    @classmethod
    def open(cls, handles: bytes) -> SharedWeights:
        """The buffers of another process of this node, mapped here (no copy)."""
        import torch.multiprocessing  # noqa: F401  (registers torch's rebuild functions)

        entries, buffers = pickle.loads(handles)
        return cls(entries, buffers)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
