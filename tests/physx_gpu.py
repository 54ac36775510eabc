"""Whether ManiSkill's physx_cuda backend can start here: besides a CUDA GPU it needs SAPIEN's
PhysX GPU library, which SAPIEN downloads from GitHub on first use (a machine without internet
cannot)."""

from pathlib import Path

import pytest


def physx_gpu_library() -> Path | None:
    """The library where SAPIEN looks for it, if it is there."""
    try:
        import sapien.physx
    except ImportError:
        return None
    path = Path.home() / ".sapien" / "physx" / sapien.physx.version() / "libPhysXGpu_64.so"
    return path if path.exists() else None


needs_physx_gpu = pytest.mark.skipif(
    physx_gpu_library() is None,
    reason="SAPIEN's PhysX GPU library (~/.sapien/physx/<version>/libPhysXGpu_64.so) is missing",
)
