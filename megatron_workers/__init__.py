"""Everything that touches megatron-core: the CPU compatibility layer, model construction from a
HuggingFace config, HF<->Megatron weight mapping, vocab-parallel log-probs, the role heads, and the
Ray-hosted role engine (``engine.MegatronEngine``) with its driver-side group (``group.MegatronGroup``).

Importing this package imports no megatron-core: engines import it after choosing the device profile.
"""
from .group import MegatronGroup

__all__ = ["MegatronGroup"]
