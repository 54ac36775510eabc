"""Where a piece of work made the host wait on a CUDA device, for the gpu tests: the count of
benchmarks/host_syncs.py, each wait at the line outside torch that called into it. Loaded from
its file: benchmarks/ on sys.path would put its megatron.py before megatron-core."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "host_syncs.py"
_spec = importlib.util.spec_from_file_location("benchmarks_host_syncs", _PATH)
_host_syncs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_host_syncs)


def with_syncs(run) -> tuple:
    """``run()``'s result, and the lines ("file:line") at which it made the host wait on the
    device (``torch.cuda.set_sync_debug_mode``), one per wait."""
    result, sites = _host_syncs.counted(run)
    return result, sorted(sites.elements())
