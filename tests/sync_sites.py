"""Where a piece of work made the host wait on a CUDA device, for the gpu tests: the count of
benchmarks/host_syncs.py, each wait at the line outside torch that called into it."""

from benchmark_scripts import load

_host_syncs = load("host_syncs")


def with_syncs(run) -> tuple:
    """``run()``'s result, and the lines ("file:line") at which it made the host wait on the
    device (``torch.cuda.set_sync_debug_mode``), one per wait."""
    result, sites = _host_syncs.counted(run)
    return result, sorted(sites.elements())
