"""One PP stage's weight-sync group: a stand-alone torch.distributed group (gloo on CPU, NCCL on GPU,
independent of Megatron's world) of the stage's writers and every vLLM worker, and the ``StageLink``
that tells each member how to join it."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StageLink:
    """How every member reaches one PP stage's weight-sync group. Ranks ``0..writers-1`` produce the
    buckets (which ranks of the stage that is depends on the transport; rank = TP rank), ranks
    ``writers..`` are the vLLM workers of every engine. A transport that needs more (e.g. where its
    shared buffers are) subclasses it."""
    stage: int
    host: str  # the store's address (writer rank 0)
    port: int
    writers: int
    receivers: int
    transport: str  # the name it is registered under (rlcore.weight_sync.factory)
    # How long joining the group and each of its collectives wait for the other members (the controller
    # sets it from rollout.sync_timeout_s): a member that vanished is an error after it, not a hang.
    timeout_s: float = 600.0

    @property
    def world_size(self) -> int:
        return self.writers + self.receivers


class WeightSyncGroup:
    """A process group of ``world_size`` ranks (rank 0 is where the TCP store lives), built from an
    address rather than from the default group, so Megatron's ranks and vLLM's workers can share it
    without sharing a world."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 600.0, device: str | torch.device = "cpu"):
        self.rank, self.world_size, self.backend, self.device = rank, world_size, backend, device
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("rlx-weight-sync/", store)
        self._store = store  # keep the server alive for the group's lifetime
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # else NCCL's default (10 min), whatever rollout.sync_timeout_s says
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            raise ValueError(f"weight sync backend {backend!r}: expected gloo or nccl")

    @classmethod
    def join(cls, link: StageLink, rank: int, backend: str = "gloo",
             device: str | torch.device = "cpu") -> "WeightSyncGroup":
        """Member ``rank`` of ``link``'s group; blocks until every member has joined (at most
        ``link.timeout_s``, which also bounds each collective)."""
        return cls(link.host, link.port, rank, link.world_size, backend, link.timeout_s, device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0):
        """Posts the broadcast and returns its ``Work`` (``.wait()``); ``tensor`` must stay untouched
        until then. Posted ops of one group run in posting order on every member."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._pg.broadcast([tensor], opts)

    def barrier(self) -> None:
        self.signal().wait()

    def signal(self):
        """Posts a one-element all-reduce: it completes once every member has posted its own (a
        non-blocking barrier; ops of one group complete in posting order on every member)."""
        return self._pg.allreduce([torch.zeros(1, device=self.device)], dist.AllreduceOptions())
