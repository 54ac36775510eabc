"""Weight sync by collective broadcast (``cluster.weight_sync: broadcast``).

The actor worker of rank 0 and every worker that holds an inference copy form a process group
of their own (``SyncGroup``), apart from the actor workers' data-parallel group. Its store lives
in the actor worker, which is never restarted; when Ray restarts a rollout (or env) worker, every
member joins a new group under a new prefix of that store (an ``epoch``), so a replaced worker
is taken back, as the object-store path takes it back.

A sync broadcasts the state-dict entries both sides select (all of them, or the ones an update
can change) in buckets: consecutive tensors of one dtype, up to ``bucket_bytes`` each, flattened
into one tensor per broadcast. A header broadcast first carries the entry count and the
elements in all; a receiver whose model differs stops with that, instead of reading garbage.

Gloo, with the tensors in host memory: the NCCL path (GPU to GPU) is not built yet.
"""

from __future__ import annotations

import datetime

import torch

SYNC_TIMEOUT_S = 120  # a member lost mid-broadcast leaves the others waiting this long at most


def buckets(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive entries of one dtype, up to ``bucket_bytes`` each (a larger tensor is a
    bucket of its own)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for key, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        last = out[-1] if out else None
        if last is None or last[0][1].dtype != tensor.dtype or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((key, tensor))
        size += nbytes
    return out


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # (gloo has no bool broadcast)


class SyncGroup:
    """One member of the sync group: rank 0 sends, the others receive."""

    def __init__(self, store, rank: int, size: int, epoch: int):
        import torch.distributed as dist

        self.rank = rank
        self.size = size
        prefixed = dist.PrefixStore(f"weights-sync-{epoch}", store)
        timeout = datetime.timedelta(seconds=SYNC_TIMEOUT_S)
        self.group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()

    def send(self, named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> int:
        """Broadcast ``named`` (rank 0); returns the bytes sent."""
        elements = sum(t.numel() for _, t in named)
        self._broadcast(torch.tensor([len(named), elements]))
        sent = 0
        for bucket in buckets(named, bucket_bytes):
            wire = _wire_dtype(bucket[0][1].dtype)
            flat = torch.cat([t.detach().cpu().reshape(-1).view(wire) for _, t in bucket])
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(
        self, named: list[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> dict[str, torch.Tensor]:
        """The sender's tensors for the entries ``named`` (this side's own, for their shapes
        and dtypes), on the host."""
        header = torch.zeros(2, dtype=torch.long)
        self._broadcast(header)
        elements = sum(t.numel() for _, t in named)
        if header.tolist() != [len(named), elements]:
            raise RuntimeError(
                f"weight sync: the actor sends {header[0]} entries of {header[1]} elements, this "
                f"worker's policy has {len(named)} of {elements}: the models differ"
            )
        out = {}
        for bucket in buckets(named, bucket_bytes):
            dtype = bucket[0][1].dtype
            flat = torch.empty(sum(t.numel() for _, t in bucket), dtype=_wire_dtype(dtype))
            self._broadcast(flat)
            pieces = flat.split([t.numel() for _, t in bucket])
            for (key, own), piece in zip(bucket, pieces):
                out[key] = piece.view(dtype).view(own.shape)
        return out


def host_store():
    """A store for the sync group, listening on a free port of this node: (store, address)."""
    import ray
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    timeout = datetime.timedelta(seconds=SYNC_TIMEOUT_S)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    return store, f"{host}:{store.port}"


def connect(address: str):
    """A client of the store at ``address`` (host:port)."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=SYNC_TIMEOUT_S)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
