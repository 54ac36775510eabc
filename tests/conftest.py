import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in the tests may reach for a model hub
os.environ.setdefault(
    "MUJOCO_GL", "egl"
)  # headless MuJoCo rendering, set before anything imports mujoco

import pytest
import torch

# first: embodied makes torchvision importable before transformers looks for it
import embodied  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
