"""The sending side of weight sync on one Megatron rank: the stage's bucket plan and this rank's writer
of the chosen transport (``rlcore.weight_sync``). The worker holds one ``StageWeightSender`` and its
Ray-facing weight-sync methods delegate to it.

Only DP replica 0 sends (the other replicas hold the same weights and idle); within it, which TP ranks
write and how is the transport's business: the sender offers it the stage's weights both ways
(``StageSource``: TP-gathered full tensors, or each rank's own shard writes).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from rlcore.weight_sync import StageLink, create_writer, open_writer, plan_buckets

from .hf_weights import export_specs, iter_hf_tensors, iter_shard_writes


class StageWeightSender:
    """``model_chunks`` and ``hf``: this rank's stage of the model; ``coords``: its rank, tp_rank,
    pp_rank, dp_rank; ``address()``: this node's IP and a free port (for a stage sender's group
    store)."""

    def __init__(self, model_chunks: list, hf, coords: dict, tp: int, profile: str, device,
                 address: Callable[[], tuple[str, int]]):
        self.model_chunks, self.hf, self.tp, self.device, self.address = model_chunks, hf, tp, device, address
        self.rank, self.tp_rank = coords["rank"], coords["tp_rank"]
        self.pp_rank, self.dp_rank = coords["pp_rank"], coords["dp_rank"]
        self.backend = "nccl" if profile == "gpu" else "gloo"
        self.pack_threads = None if profile == "gpu" else 1  # see send_weights
        self.plan = self._plan_key = None
        self.writer = None  # this rank's StageWriter for the current link

    @property
    def is_stage_sender(self) -> bool:
        """The rank that speaks for its PP stage: DP rank 0, TP rank 0."""
        return self.dp_rank == 0 and self.tp_rank == 0

    # StageSource: the stage's weights, for the writer
    def tensors(self):
        return iter_hf_tensors(self.model_chunks, self.hf)

    def shard_writes(self):
        return iter_shard_writes(self.model_chunks, self.hf)

    def weight_sync_plan(self, bucket_bytes: int, wire_dtype: str):
        """This stage's bucket plan (list of rlcore.weight_sync.Bucket), which ``send_weights`` follows
        from now on (computed once per (bucket_bytes, wire_dtype), on every rank of DP replica 0: a
        transport may have every TP rank write its shards by it); returned by the stage sender, None
        elsewhere."""
        if self.dp_rank != 0:
            return None
        if self.plan is None or self._plan_key != (bucket_bytes, wire_dtype):
            self.plan = plan_buckets(export_specs(self.model_chunks, self.hf, wire_dtype), bucket_bytes)
            self._plan_key = (bucket_bytes, wire_dtype)
        return self.plan if self.is_stage_sender else None

    def weight_sync_link(self, transport: str, receivers: int) -> StageLink:
        """The stage sender's description of its weight-sync group for the registered ``transport``:
        its store's address and whatever the transport makes now, before anyone joins (e.g. shared
        buffers every member maps in ``init_weight_sync``)."""
        if not self.is_stage_sender:
            raise RuntimeError(f"rank {self.rank} is not a stage sender (DP0/TP0)")
        if self.plan is None:
            raise RuntimeError("call weight_sync_plan() before weight_sync_link()")
        self.close_weight_sync()
        host, port = self.address()
        self.writer = create_writer(transport, self.pp_rank, host, port, self.tp, receivers, self.plan)
        return self.writer.link

    def init_weight_sync(self, link: StageLink) -> None:
        """Joins this stage's weight-sync group as writer rank = TP rank (the ranks of DP replica 0
        below ``link.writers``; other ranks return at once). Blocks until every member has joined."""
        if self.dp_rank != 0 or link.stage != self.pp_rank:
            return
        if not self.is_stage_sender:  # the stage sender made its writer in weight_sync_link
            self.close_weight_sync()  # an earlier link's
            self.writer = open_writer(link, self.tp_rank, self.plan)
        self.writer.link = link  # the controller's copy of the one it made: it carries the sync timeout
        self.writer.join(self.backend, self.device)

    def close_weight_sync(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.writer = None

    def send_weights(self, with_checksums: bool = False) -> dict | None:
        """This rank's part of one sync of its PP stage (DP replicas other than 0 have nothing to do),
        as the link's transport does it; tensors are cast to the wire dtype. Returns the stage
        sender's stats (and checksums of what it sent with ``with_checksums``); None elsewhere."""
        if self.dp_rank != 0:
            return None
        if self.writer is None or not self.writer.joined:
            raise RuntimeError("weight sync is not set up: call weight_sync_plan() and init_weight_sync()")
        with math_threads(self.pack_threads):
            stats = self.writer.send(self, with_checksums)
        if not self.is_stage_sender:
            return None
        stats["pp_rank"] = self.pp_rank
        stats["transport"] = self.writer.link.transport
        return stats


@contextmanager
def math_threads(n: int | None):
    """torch's intra-op threads set to ``n`` for the block (None: left as they are).

    The cpu profile packs a sync's buckets with one thread. The sync is bound by the engine's reload,
    which runs on the same cores at the same time (the sender waits for free slots most of the sync),
    and a second copying thread only contends with it: on the SmolLM2 spec (2 cores, one actor rank
    with both, 32 MB buckets) the sync took 0.84 and 0.89 s against 1.05 and 1.20 s with the rank's two
    threads, its packing 0.21-0.23 s against 0.42-0.45 s (docs/cpu-profile.md, "Where a reload's time
    goes"). A copy is the same at any thread count."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
