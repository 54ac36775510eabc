"""Import LeRobot's robot and camera classes on a machine where torchvision cannot load.

``lerobot.robots`` imports ``lerobot.processor``, whose human-in-the-loop step imports
``torchvision.transforms.functional`` at module level (to crop images, which deploying never
does). The package registry's torchvision wheels are CUDA builds that fail next to a CPU torch
(``operator torchvision::nms does not exist``; shared/ENVIRONMENT.md). Where the real torchvision
imports, nothing here happens. Where it does not, that one module import is answered, only while
``lerobot.processor`` loads, by a placeholder whose every attribute raises ImportError naming the
cause; afterwards ``torchvision`` is absent again, so other libraries (transformers) still see
it missing and any real use of it fails loudly.
"""

from __future__ import annotations

import sys
import types

REASON = ("torchvision could not be imported next to this torch build (the registry's wheels are CUDA "
          "builds); embodied loaded LeRobot's drivers without it, and this LeRobot feature needs it")
_NAMES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class _Unavailable(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"{self.__name__}.{name}: {REASON}")


def _torchvision_works() -> bool:
    try:
        import torchvision  # noqa: F401
        return True
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # what the failed import left half-built
        return False


def import_lerobot_processor() -> None:
    """Import ``lerobot.processor`` (and so make ``lerobot.robots`` importable) on any machine."""
    if "lerobot.processor" in sys.modules or _torchvision_works():
        return
    # libraries that lerobot.processor pulls in check at import whether torchvision exists:
    # import them first, while it is plainly missing
    import datasets  # noqa: F401
    import lerobot.utils.utils  # noqa: F401
    import transformers.image_utils  # noqa: F401
    import transformers.models.auto.processing_auto  # noqa: F401

    placeholders = {name: _Unavailable(name) for name in _NAMES}
    placeholders["torchvision"].transforms = placeholders["torchvision.transforms"]
    placeholders["torchvision.transforms"].functional = placeholders["torchvision.transforms.functional"]
    sys.modules.update(placeholders)
    try:
        import lerobot.processor  # noqa: F401
    finally:
        for name in _NAMES:
            sys.modules.pop(name, None)
