"""The Megatron-core backend (``trainer.backend: megatron``): the VLA's transformer built from
megatron-core's own layers and sharded over tensor-parallel ranks, its weights converted to and
from the torch layout. Nothing here is imported unless that backend is chosen."""

import warnings

from embodied.config import ConfigError

# megatron-core warns on import that Transformer Engine and Apex are absent (it falls back to
# torch, which is what runs on a CPU): once per module, several times
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(are|is) not")


class RankLost(RuntimeError):
    """A TP rank's helper process exited (killed, out of memory, its own error) during a call:
    one line naming it. What it held of the learner is lost with it: the run ends (it can
    resume)."""

    shard_lost = True  # (the runner saves nothing after it: a checkpoint needs every shard)


def require() -> None:
    """A ConfigError naming the extra where megatron-core is not installed (before a run)."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise ConfigError(
            "trainer.backend: megatron needs megatron-core, which is not installed here: "
            "pip install 'embodied[megatron]' (or trainer.backend=torch)"
        ) from None
