"""Where a piece of work made the host wait on a CUDA device, for the gpu tests: the count of
benchmarks/host_syncs.py, each wait at the line outside torch that called into it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from host_syncs import counted  # noqa: E402


def with_syncs(run) -> tuple:
    """``run()``'s result, and the lines ("file:line") at which it made the host wait on the
    device (``torch.cuda.set_sync_debug_mode``), one per wait."""
    result, sites = counted(run)
    return result, sorted(sites.elements())
