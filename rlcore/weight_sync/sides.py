"""What weight sync needs of the two sides, as Protocols: the orchestration (``sync.py``) talks to the
actor's group and the rollout pool only through ``WeightSender`` and ``WeightReceiver``, a transport's
writer reads one Megatron rank's weights only through ``StageSource``. rlcore imports neither side."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from .group import StageLink
from .plan import Bucket

# ``write(dest, rows)``: copies this rank's part of one full HF tensor (rows ``rows`` of it, or all of
# it for None) into ``dest``, casting to its dtype.
ShardWrite = Callable[[torch.Tensor, "tuple[int, int] | None"], None]


class WeightSender(Protocol):
    """The actor's side (``megatron_workers.MegatronGroup``): one bucket plan and one weight-sync group
    per PP stage. The ``init``/``send`` calls return Ray refs, not awaited: both sides of a group op
    block until the other side is there, so the caller gets them together with the receivers'."""

    profile: str  # "cpu" or "gpu"
    role: str  # names its ranks in errors ("actor")

    def node_ips(self) -> list[str]:
        """The node of every rank (a transport may need them all on one)."""

    def weight_sync_plans(self, bucket_bytes: int, wire_dtype: str) -> list[list[Bucket]]:
        """One plan per PP stage, in stage order; the ranks keep theirs for ``send_weights``."""

    def weight_sync_links(self, transport: str, receivers: int) -> list[StageLink]:
        """Each stage sender's link for the registered ``transport``, ``receivers`` ranks joining it."""

    def init_weight_sync(self, links: list[StageLink]) -> list[Any]:
        """Every rank joins its stage's group (refs)."""

    def send_weights(self, with_checksums: bool = False) -> list[Any]:
        """Every stage sends one sync (refs of the stage senders' stats, None for other ranks; with
        ``checksums`` of what they sent when asked)."""


class WeightReceiver(Protocol):
    """The rollout side (``rollout.RolloutPool``): every vLLM worker of every engine joins each stage's
    group."""

    dtype: str  # the engines' dtype: every sync's wire dtype

    @property
    def num_engines(self) -> int: ...

    @property
    def num_receiving_ranks(self) -> int:
        """Members of each stage group on this side: every vLLM worker of every engine."""

    def node_ips(self) -> list[str]: ...

    def init_weight_sync(self, links: list[StageLink], plans: list[list[Bucket]]) -> list[Any]:
        """Every worker joins every stage group (refs)."""

    def receive_weights(self, version: int) -> list[Any]:
        """Every engine receives and loads one sync (refs of their stats dicts)."""

    def weight_checksums(self) -> list[dict[str, float]]:
        """One HF-named ``checksum`` dict per engine."""


class StageSource(Protocol):
    """One Megatron rank's weights of its PP stage, as a transport's writer reads them; both yield in
    the stage plan's order (HF names)."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF tensors, TP shards all-gathered: every TP rank of the stage must iterate together."""

    def shard_writes(self) -> Iterator[tuple[str, ShardWrite]]:
        """A ``write`` per tensor for this rank's own shard: no collective."""
