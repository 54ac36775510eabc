"""Let torchvision's Python half import where its compiled operators cannot load.

The package registry's torchvision wheels are CUDA builds: next to the CPU build of torch their
``_C`` extension fails to load (it links libtorch_cuda), and ``import torchvision`` then stops
at ``operator torchvision::nms does not exist`` while registering its meta kernels
(shared/ENVIRONMENT.md). Everything this project and LeRobot use from torchvision is Python over
torch (``transforms``, ``transforms.v2``); only the detection operators (nms, roi_align,
deform_conv2d, ...) are compiled. So where ``_C`` does not load, ``ensure_importable`` declares
those operators' schemas without kernels: torchvision then imports, and calling one of them
fails with torch's own "could not run torchvision::nms ... CPU backend" error. Where ``_C`` loads
(a matching build), the real operators are registered and nothing is declared here.

``install_hook`` (run by ``import embodied``) defers all of it, torch's import included, to the
moment anything first looks for torchvision, so that importing embodied stays cheap.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

# the operators torchvision's _meta_registrations.py looks up at import, with their signatures
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, "
    "float rois_scale, int rois_zero_point, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
    "float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, "
    "Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
    "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
# the torch.library fragment holding the declarations (kept alive for the process)
_library = None
# True where torchvision's compiled operators are missing and were declared here
ops_declared = False


def ensure_importable() -> None:
    """Make ``import torchvision`` work in this process (a no-op where it is not installed or
    where its compiled operators load). Call before anything imports torchvision."""
    global _library, ops_declared
    spec = importlib.util.find_spec("torchvision")
    if spec is None or _library is not None or not spec.submodule_search_locations:
        return
    import torch

    if hasattr(torch.ops.torchvision, "nms"):  # already registered (torchvision imported first)
        return
    folder = Path(spec.submodule_search_locations[0])
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (folder / f"_C{suffix}").is_file():
            try:
                torch.ops.load_library(str(folder / f"_C{suffix}"))
                return  # a build that matches this torch: its real operators are registered
            except OSError:
                break
    # schemas only, no kernels
    _library = torch.library.Library("torchvision", "FRAGMENT")  # noqa: TOR901
    for schema in _SCHEMAS:
        _library.define(schema)
    ops_declared = True


class _FirstLookup(importlib.abc.MetaPathFinder):
    """Runs ``ensure_importable`` when torchvision is first imported or looked up, then steps
    aside."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            ensure_importable()
        return None  # the regular finders find the module


def install_hook() -> None:
    if "torchvision" not in sys.modules and not any(
        isinstance(f, _FirstLookup) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _FirstLookup())
