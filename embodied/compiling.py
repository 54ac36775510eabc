"""torch.compile on the hot path: one place that checks for inductor's code generator and
compiles with the project's settings (``policy.compile_act``, ``env.compile``)."""

from __future__ import annotations

import os
import shutil
import types
from collections.abc import Callable

import torch

from embodied.schema import UserError


def compiled(fn: Callable, device: torch.device, setting: str, fullgraph: bool = False) -> Callable:
    """``fn`` through torch.compile (inductor): its operators fused into fewer kernels, the same
    numbers up to float rounding, one graph per input shape. Random draws come from torch's
    generators as in eager mode (``fallback_random``). Without the device's code generator
    (triton on a GPU, a C++ compiler on a CPU): a one-line UserError naming ``setting``.
    ``fullgraph``: a graph break is an error instead of a silent fall back to eager."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401  (inductor's GPU code generator)
        except ImportError:
            raise UserError(
                f"{setting} on a GPU needs triton, which torch's CUDA wheels bring: "
                f"pip install triton, or set {setting}=false"
            ) from None
    elif not shutil.which(os.environ.get("CXX") or "g++"):  # (inductor's CPU code is C++)
        raise UserError(
            f"{setting} on a CPU needs a C++ compiler (g++, or the one CXX names): "
            f"apt install g++, or set {setting}=false"
        )
    options = {"fallback_random": True}
    return torch.compile(fn, dynamic=False, fullgraph=fullgraph, options=options)


def own_code(fn: types.FunctionType) -> types.FunctionType:
    """A copy of the plain function ``fn`` with a code object of its own. torch.compile keeps
    its compiled versions per code object, at most ``torch._dynamo.config.recompile_limit`` (8)
    for all the callers of a process, and past that fails (fullgraph) or runs eager; an owner's
    copy (an env's, whose task, size and settings are fixed) counts only its own versions. The
    price: each owner traces its graph anew (inductor's cache still serves the code)."""
    code = fn.__code__.replace()  # (equal to fn's, but another object)
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    return copy
