"""The Megatron-core backend (``trainer.backend: megatron``): the VLA's transformer built from
megatron-core's own layers and sharded over tensor-parallel ranks, its weights converted to and
from the torch layout. Nothing here is imported unless that backend is chosen."""

import warnings

# megatron-core warns on import that Transformer Engine and Apex are absent (it falls back to
# torch, which is what runs on a CPU): once per module, several times
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(are|is) not")
