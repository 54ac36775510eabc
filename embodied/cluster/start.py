"""Starting (or joining) Ray for a run, with what its workers need from the driver's
environment.

A local Ray (the run's own) starts with SIGTERM blocked in its processes: its daemons (GCS,
raylet) and every worker they start inherit the signal mask of the driver's thread that started
them. A SIGTERM sent to every process of a job (SLURM's ``scancel`` and time limit, ``timeout``,
systemd stopping a unit) then stops the driver alone: it finishes at the next consistent point
and saves the last completed iteration through the actor worker, then stops Ray. A cluster the
run joins (``cluster.address``) has daemons of its own: such a signal stops them, and with them
every worker (README, "On Ray").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from embodied.cluster.config import ClusterConfig
from embodied.cluster.workers import DRIVER_CWD
from embodied.config import ConfigError
from embodied.numerics import PINNED_ENV

# environment variables the workers need as the driver has them (hub access, renderers)
# (and a pinned driver's numerics: every worker starts with MKL's and torch's code paths pinned)
PASSED_ENV = (
    "HF_HUB_OFFLINE",
    "MUJOCO_GL",
    "PYOPENGL_PLATFORM",
    "LIBERO_CONFIG_PATH",
    *PINNED_ENV,
)


def start_ray(cfg: ClusterConfig, hold_sigterm: bool = True) -> bool:
    """Join ``cfg.address`` or start a local Ray (unless this process has one already); whether
    this call started it. Workers get the driver's module path (a simulator registered in the
    user's script imports there too) and the environment variables in ``PASSED_ENV``. A local
    Ray's processes hold SIGTERM (``hold_sigterm``: see the module docstring; it costs about 4 s
    at ``ray.shutdown``, which waits a second for each daemon to heed a SIGTERM before it kills
    it). Without Ray installed: a ``ConfigError`` naming the install."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "cluster.enabled: the roles on Ray need Ray, which is not installed here: "
            "pip install 'embodied[ray]' (or set cluster.enabled=false)"
        ) from None
    if ray.is_initialized():
        return False
    env_vars = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env_vars["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env_vars[DRIVER_CWD] = os.getcwd()  # (relative paths in the config: workers.py's _start)
    runtime_env = {"env_vars": env_vars}
    if cfg.address:
        try:
            ray.init(address=cfg.address, runtime_env=runtime_env, logging_level="WARNING")
        except ConnectionError as e:
            raise ConfigError(f"cluster.address: cannot join {cfg.address!r}: {e}") from None
    else:
        with sigterm_blocked() if hold_sigterm else contextlib.nullcontext():
            _init_local(ray, cfg, runtime_env)
    return True


def _init_local(ray, cfg: ClusterConfig, runtime_env: dict) -> None:
    ray.init(
        # a Ray of this run's own, even where another runs on the machine (`ray.init()` without
        # an address would join one started by `ray start`)
        address="local",
        num_cpus=cfg.num_cpus,
        num_gpus=cfg.num_gpus,
        include_dashboard=False,
        runtime_env=runtime_env,
        logging_level="WARNING",
    )


@contextlib.contextmanager
def sigterm_blocked():
    """SIGTERM blocked in this thread meanwhile, and so in every process it starts (a pending one
    arrives afterwards)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
