"""The ``broadcast`` transport (any placement; NCCL on GPU, gloo on CPU): the stage sender (DP0/TP0)
gathers each tensor over its TP group, packs bucket k+1 while bucket k is in flight (two buffers) and
broadcasts it; its TP peers only take part in the gathers. Receivers keep the next bucket of every
stage posted.

Extra memory: a sender, two buffers plus the tensor it is gathering; a receiver, two buffers per stage
(a fresh one per bucket for a reload, which keeps views until a layer is complete), plus, while the
pieces of a split tensor arrive, that one tensor, assembled whole for vLLM's loaders.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .checks import checksum
from .group import StageLink, WeightSyncGroup
from .plan import DTYPES, Assembler, Bucket, unpack
from .rss import PeakRss
from .sides import StageSource
from .transport import (LoadPiece, StageReader, StageWriter, Transport, count_bucket, finish_sending, in_turns,
                        next_for, receiver_stats, sender_stats, timed_wait)

NAME = "broadcast"


def empty_buffer(bucket: Bucket, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.empty(bucket.numel, dtype=DTYPES[bucket.dtype], device=device)


def send_buckets(group: WeightSyncGroup, plan: list[Bucket], tensors: Iterator[tuple[str, torch.Tensor]],
                 device: str | torch.device = "cpu", with_checksums: bool = False) -> dict:
    """The sender's side of one sync: packs ``tensors`` (HF name, full tensor, in plan order) bucket by
    bucket and broadcasts each as rank 0 of ``group``.

    Double-buffered: two flat buffers per wire dtype, each the size of the largest bucket; while
    bucket k is in flight (an async broadcast) bucket k+1 is gathered and packed into the other one.
    Extra memory: those two buffers plus the one tensor being packed. Returns bytes, buckets, the time
    spent producing tensors (``gather_s``: TP all-gathers and renaming, by the caller's iterator),
    packing (``pack_s``, incl. the cast to the wire dtype) and waiting for sends (``send_wait_s``); with
    ``with_checksums`` also ``checksums`` of what was packed (name -> ``checksum``)."""
    sizes: dict[str, int] = {}
    for bucket in plan:
        sizes[bucket.dtype] = max(sizes.get(bucket.dtype, 0), bucket.numel)
    stats = sender_stats(sum(2 * n * DTYPES[d].itemsize for d, n in sizes.items()))
    sums: dict[str, float] = {}
    clock = time.perf_counter
    with PeakRss() as peak:
        buffers = {d: [torch.empty(n, dtype=DTYPES[d], device=device) for _ in range(2)] for d, n in sizes.items()}
        _send_loop(group, plan, tensors, buffers, stats, sums if with_checksums else None, clock)
    return finish_sending(stats, peak, tensors, sums if with_checksums else None)


def _send_loop(group, plan, tensors, buffers, stats, sums, clock) -> None:
    in_flight: list = [None, None]  # the Work occupying each of the two buffer slots
    for k, bucket in enumerate(plan):
        slot = k % 2
        if in_flight[slot] is not None:  # bucket k-2 used this buffer
            timed_wait(in_flight[slot], stats, "send_wait_s")
        flat = buffers[bucket.dtype][slot][:bucket.numel]
        off = 0
        for spec in bucket.tensors:
            if spec.rows is None or spec.rows[0] == 0:  # a new tensor (not the next piece of one)
                t = clock()
                name, tensor = next_for(tensors, spec)
                stats["gather_s"] += clock() - t
                if tuple(tensor.shape) != spec.shape:
                    raise ValueError(f"weight sync: {name} has shape {tuple(tensor.shape)}, the plan says {spec.shape}")
                if sums is not None:
                    sums.update(checksum([(name, tensor.to(DTYPES[spec.dtype]))]))
            t = clock()
            piece = tensor if spec.rows is None else tensor[spec.rows[0]:spec.rows[1]]
            flat[off:off + spec.numel].copy_(piece.reshape(-1))  # casts to the wire (rollout) dtype
            stats["pack_s"] += clock() - t
            off += spec.numel
        in_flight[slot] = group.broadcast_async(flat, src=0)
        stats["bytes"] += flat.numel() * flat.element_size()
        stats["buckets"] += 1
    t = clock()
    for work in in_flight:
        if work is not None:
            work.wait()
    stats["send_wait_s"] += clock() - t


def receive_buckets(groups: list[WeightSyncGroup], plans: list[list[Bucket]], device: str | torch.device,
                    stats: dict, reuse_buffers: bool = False, load_piece: LoadPiece | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiver's side of one sync: (HF name, view) pairs of every bucket of every stage group,
    for a loader to consume lazily. The stages arrive in parallel: each group always has the receive
    of its next bucket posted while the current one is consumed, and the stages take turns. Extra
    memory: (number of stages + 1) buckets, plus whatever the consumer keeps referenced. Adds
    ``bytes``, ``buckets``, ``tensors`` and ``recv_wait_s`` (time blocked on arrivals) to ``stats``.

    ``reuse_buffers``: the consumer copies every tensor before asking for the next one (an in-place
    load), so each stage alternates between two buffers (2 x stages buckets, no fresh pages per sync);
    otherwise every bucket gets a fresh buffer (vLLM's layerwise reload keeps views until a layer is
    complete)."""
    receiver_stats(stats)
    remaining = [iter(plan) for plan in plans]
    posted: list = [None] * len(plans)
    pools = [[None, None] for _ in plans]
    assemble = Assembler(copy_out=False, load_piece=load_piece)
    counts = [0] * len(plans)

    def post(s: int) -> None:
        bucket = next(remaining[s], None)
        if bucket is None:
            posted[s] = None
            return
        if reuse_buffers:
            slot = counts[s] % 2
            counts[s] += 1
            if pools[s][slot] is None or pools[s][slot].numel() * pools[s][slot].element_size() < bucket.nbytes:
                pools[s][slot] = torch.empty(max(b.nbytes for b in plans[s]), dtype=torch.uint8, device=device)
            buf = pools[s][slot][:bucket.nbytes].view(DTYPES[bucket.dtype])
        else:
            buf = empty_buffer(bucket, device)
        posted[s] = (bucket, buf, groups[s].broadcast_async(buf, src=0))

    for s in range(len(plans)):
        post(s)
    for s in in_turns(posted):
        bucket, buf, work = posted[s]
        timed_wait(work, stats, "recv_wait_s")
        post(s)  # the stage's next bucket arrives while this one is consumed
        count_bucket(stats, bucket, buf)
        yield from assemble(unpack(bucket, buf))
        del buf


class BroadcastWriter(StageWriter):
    @classmethod
    def create(cls, stage, host, port, tp, receivers, plan):
        return cls(StageLink(stage, host, port, writers=1, receivers=receivers, transport=NAME), 0, plan)

    def send(self, source: StageSource, with_checksums: bool) -> dict | None:
        tensors = source.tensors()
        if self.tp_rank >= self.link.writers:
            for _ in tensors:  # a TP peer: the all-gathers run in lock-step with the sender's
                pass
            return None
        return send_buckets(self.group, self.plan, tensors, self.device, with_checksums)


class BroadcastReader(StageReader):
    def stream(self, stats, consumer_copies, load_piece=None):
        return receive_buckets(self.groups, self.plans, self.device, stats, reuse_buffers=consumer_copies,
                               load_piece=load_piece)


class Broadcast(Transport):
    name = NAME
    writer = BroadcastWriter
    reader = BroadcastReader
