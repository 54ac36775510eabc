"""Where a piece of work made the host wait on a CUDA device (for the gpu tests)."""

import warnings

import torch


def with_syncs(run) -> tuple:
    """``run()``'s result, and the lines ("file:line") at which torch saw it make the host wait
    on the device (``torch.cuda.set_sync_debug_mode``), one per wait."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = [
        f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}"
        for w in caught
        if "synchroniz" in str(w.message)
    ]
    return result, sites
