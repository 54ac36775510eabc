import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in the tests may reach for a model hub
os.environ.setdefault(
    "MUJOCO_GL", "egl"
)  # headless MuJoCo rendering, set before anything imports mujoco

import pytest
import torch

# first: embodied makes torchvision importable before transformers looks for it
import embodied  # noqa: F401

# one thread per pytest process: `make test` runs two on two cores (more would oversubscribe
# them), and every test starts from the same count, which the sums depend on
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of 2 CPUs for a test module (started as ``embodied train`` starts one);
    each run places its own workers on it and removes them at its end."""
    ray = pytest.importorskip("ray")
    from embodied.cluster.config import ClusterConfig
    from embodied.cluster.start import start_ray

    # (nothing here signals its processes: they heed SIGTERM, and the shutdown is 4 s faster)
    start_ray(ClusterConfig(num_cpus=2), hold_sigterm=False)
    yield
    ray.shutdown()


def _threads_kept():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def restored_threads():
    """torch's thread count as it was before each test (1): a test (or an in-process ``train``)
    that sets it would otherwise change the sums of every later test in the same worker."""
    yield from _threads_kept()


@pytest.fixture(autouse=True, scope="module")
def restored_threads_per_module():
    """The same around each module: its module-scoped fixtures may train (``train`` sets it)."""
    yield from _threads_kept()


@pytest.fixture
def one_thread():
    """torch on one thread here, as in a run's workers (runner.torch_threads): the same sums."""
    torch.set_num_threads(1)  # (``restored_threads`` restores the count after the test)
