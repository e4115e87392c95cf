"""Everything that touches vLLM: the engine (a Ray actor), the rollout pool, and the receiving side
of weight sync. Imports ``rlcore`` only (never ``megatron_workers``); vLLM itself is imported inside
the engine, so importing this package stays cheap."""
from .engine import VLLMEngine
from .pool import RolloutPool

__all__ = ["RolloutPool", "VLLMEngine"]
