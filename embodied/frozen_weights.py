"""Which weights of a policy are frozen, and a digest of them that names their checkpoint file
(embodied/checkpoint.py): checkpoints with the same frozen weights share one file."""

from __future__ import annotations

import hashlib
import json
import weakref

import torch

# model -> (key, weak references to its frozen tensors, digest): see frozen_digest
_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def frozen_keys(model: torch.nn.Module) -> set[str]:
    """State-dict keys of frozen parameters, and of the buffers of modules whose own parameters
    exist and are all frozen."""
    keys = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        own = module.named_parameters(prefix, recurse=False, remove_duplicate=False)
        params = dict(own)
        keys.update(k for k, p in params.items() if not p.requires_grad)
        if params and not any(p.requires_grad for p in params.values()):
            buffers = module.named_buffers(prefix, recurse=False, remove_duplicate=False)
            keys.update(k for k, _ in buffers)
    return keys


def frozen_digest(model: torch.nn.Module, frozen: dict) -> str:
    """_digest(frozen), remembered per model while every frozen tensor is the same object at the
    same version (in-place changes count up ``_version``), address and dtype. PyTorch does not
    count changes made through ``tensor.data``: those are not seen."""
    names = sorted(frozen)
    key = [(k, frozen[k]._version, frozen[k].data_ptr(), frozen[k].dtype) for k in names]
    cached = _DIGESTS.get(model)
    if cached and cached[0] == key and all(r() is frozen[k] for k, r in zip(names, cached[1])):
        return cached[2]
    digest = _digest(frozen)
    _DIGESTS[model] = (key, [weakref.ref(frozen[k]) for k in names], digest)
    return digest


def _digest(tensors: dict) -> str:
    """sha1 over the sorted names, dtypes, shapes and bytes of ``tensors``: 16 hex digits."""
    h = hashlib.sha1()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:16]
