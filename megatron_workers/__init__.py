"""Everything that touches megatron-core: the CPU compatibility layer, model construction from a
HuggingFace config, HF<->Megatron weight mapping, vocab-parallel log-probs, and the Ray-hosted
workers (``worker.MegatronWorker``) with their driver-side group (``group.MegatronGroup``).

Importing this package imports no megatron-core: workers import it after choosing the device profile.
"""
from .group import MegatronGroup

__all__ = ["MegatronGroup"]
