"""The ``shm`` transport (cpu profile, every member on one node): two bucket-sized slots in /dev/shm,
mapped by the stage's TP ranks and every receiver. Each TP rank writes its own shard straight into its
place in the slot (no TP gather, no socket copies); receivers load from views of the slot. Two tiny
all-reduces per bucket order it: "ready" (all writers are done) and "done" (every receiver has loaded
it, so the slot can take bucket k+2).

Extra memory: the two slots (shared by the whole node, mapped by every member), plus, on a receiver,
the one split tensor being assembled and, for a reload, copies out of the slots.
"""
from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .checks import checksum
from .group import StageLink, WeightSyncGroup
from .plan import DTYPES, Assembler, Bucket, unpack
from .rss import PeakRss
from .sides import StageSource
from .transport import (LoadPiece, StageReader, StageWriter, Transport, count_bucket, finish_sending, in_turns,
                        next_for, receiver_stats, sender_stats, timed_wait)

NAME = "shm"


@dataclass(frozen=True)
class SlotLink(StageLink):
    """A stage link whose members share two bucket slots: slot i is the file f"{slot_path}.{i}"."""
    slot_path: str = ""
    slot_bytes: int = 0


class SharedSlots:
    """The two bucket slots of a ``shm`` link: files in /dev/shm mapped shared by every member. The
    stage's writer rank 0 creates them (``create=True``) before anyone joins the group and unlinks the
    files once the group is up (everyone has mapped them by then), so a crash leaves nothing behind."""

    def __init__(self, link: SlotLink, create: bool = False):
        self.paths = [f"{link.slot_path}.{i}" for i in range(2)]
        if create:
            for path in self.paths:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, link.slot_bytes)
                finally:
                    os.close(fd)
        try:
            self.slots = [torch.from_file(path, shared=True, size=link.slot_bytes, dtype=torch.uint8)
                          for path in self.paths]
        except RuntimeError as e:
            raise RuntimeError(f"weight sync (shm): cannot map {self.paths} ({e}); is every member of stage "
                               f"{link.stage}'s group on one node?") from e

    def view(self, k: int, bucket: Bucket) -> torch.Tensor:
        """The flat buffer of bucket number ``k`` (slot ``k % 2``) in the bucket's dtype."""
        return self.slots[k % 2][:bucket.nbytes].view(DTYPES[bucket.dtype])

    def unlink(self) -> None:
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def slot_bytes(plan: list[Bucket]) -> int:
    """The size of a ``shm`` slot for ``plan``: its largest bucket."""
    return max((b.nbytes for b in plan), default=0)


def write_buckets(group: WeightSyncGroup, slots: SharedSlots, plan: list[Bucket],
                  writes: Iterator[tuple[str, Callable[[torch.Tensor, tuple[int, int] | None], None]]],
                  with_checksums: bool = False) -> dict:
    """A writer's side of one ``shm`` sync (every TP rank of the stage runs it at once): for each
    bucket, waits until its slot is free (the receivers are done with bucket k-2), lets each
    ``write(dest, rows)`` of ``writes`` (HF name, in plan order) copy this rank's part of that tensor
    into ``dest`` (its view in the slot, in the wire dtype: the whole tensor, or rows ``rows`` of it
    for a piece of a tensor larger than a bucket), then signals "ready".
    Returns bytes, buckets, ``pack_s`` (the writes, incl. the cast), ``send_wait_s`` (waiting for a
    free slot) and ``gather_s`` (0: nothing is gathered); with ``with_checksums`` (writer rank 0
    only) the checksums of the full tensors once every writer is done."""
    stats = sender_stats(sum(s.numel() for s in slots.slots))
    sums: dict[str, float] = {}
    assemble = Assembler(copy_out=False)  # checksums of split tensors are taken whole
    clock = time.perf_counter
    done: list = [None, None]  # the "done" signal of the bucket last written to each slot
    signals = []  # keep every posted signal referenced until the end
    with PeakRss() as peak:
        for k, bucket in enumerate(plan):
            if done[k % 2] is not None:
                timed_wait(done[k % 2], stats, "send_wait_s")
            flat = slots.view(k, bucket)
            off = 0
            t = clock()
            for spec in bucket.tensors:
                if spec.rows is None or spec.rows[0] == 0:  # a new tensor (not the next piece of one)
                    name, write = next_for(writes, spec)
                write(flat[off:off + spec.numel].view(spec.piece_shape), spec.rows)
                off += spec.numel
            stats["pack_s"] += clock() - t
            ready = group.signal()
            if with_checksums:
                ready.wait()  # the other writers' parts are in the slot now
                for name, full in assemble(unpack(bucket, flat)):
                    sums.update(checksum([(name, full)]))
            done[k % 2] = group.signal()
            signals += [ready, done[k % 2]]
            stats["bytes"] += flat.numel() * flat.element_size()
            stats["buckets"] += 1
        t = clock()
        for work in signals:
            work.wait()
        stats["send_wait_s"] += clock() - t
    return finish_sending(stats, peak, writes, sums if with_checksums else None)


def receive_shared(groups: list[WeightSyncGroup], slots: list[SharedSlots], plans: list[list[Bucket]],
                   stats: dict, copy_out: bool = False, load_piece: LoadPiece | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver's side of one ``shm`` sync: (HF name, view into the slot) of every bucket of every
    stage, the stages taking turns as their buckets become ready. A bucket's "done" is signalled
    when the consumer asks for the next tensor after it, so the consumer must have copied the views
    by then; ``copy_out`` yields copies instead (for a consumer that keeps them: vLLM's layerwise
    reload). ``load_piece``: see ``Assembler``. Adds ``bytes``, ``buckets``, ``tensors`` and
    ``recv_wait_s`` to ``stats``."""
    receiver_stats(stats)
    remaining = [iter(enumerate(plan)) for plan in plans]
    posted: list = [None] * len(plans)
    signals = []
    assemble = Assembler(copy_out, load_piece)

    def post(s: int) -> None:
        nxt = next(remaining[s], None)
        posted[s] = None if nxt is None else (nxt[0], nxt[1], groups[s].signal())

    for s in range(len(plans)):
        post(s)
    for s in in_turns(posted):
        k, bucket, ready = posted[s]
        timed_wait(ready, stats, "recv_wait_s")
        flat = slots[s].view(k, bucket)
        yield from assemble(unpack(bucket, flat))
        signals.append(groups[s].signal())  # done: the slot may take bucket k + 2
        count_bucket(stats, bucket, flat)
        post(s)  # only now: every member posts ready and done of one group in the same order
    for work in signals:
        work.wait()


class SlotWriter(StageWriter):
    """Every TP rank of the stage is a writer; TP rank 0 (the stage sender) creates the slots."""

    def __init__(self, link: SlotLink, tp_rank: int, plan: list[Bucket], create: bool = False):
        super().__init__(link, tp_rank, plan)
        self.slots = SharedSlots(link, create=create)

    @classmethod
    def create(cls, stage, host, port, tp, receivers, plan):
        link = SlotLink(stage, host, port, writers=tp, receivers=receivers, transport=NAME,
                        slot_path=f"/dev/shm/rlx-weight-sync-{uuid.uuid4().hex[:12]}-stage{stage}",
                        slot_bytes=slot_bytes(plan))
        return cls(link, 0, plan, create=True)

    def join(self, backend, device) -> None:
        super().join(backend, device)
        if self.tp_rank == 0:  # every member has mapped the slots: nothing is left behind on a crash
            self.slots.unlink()

    def send(self, source: StageSource, with_checksums: bool) -> dict | None:
        stats = write_buckets(self.group, self.slots, self.plan, source.shard_writes(),
                              with_checksums=with_checksums and self.tp_rank == 0)
        return stats if self.tp_rank == 0 else None

    def close(self) -> None:
        self.slots.unlink()
        super().close()


class SlotReader(StageReader):
    def __init__(self, *args, **kwargs):
        self.slots: list[SharedSlots] = []
        super().__init__(*args, **kwargs)

    def attach(self, link: SlotLink) -> None:
        self.slots.append(SharedSlots(link))

    def stream(self, stats, consumer_copies, load_piece=None):
        return receive_shared(self.groups, self.slots, self.plans, stats, copy_out=not consumer_copies,
                              load_piece=load_piece)

    def close(self) -> None:
        self.slots = []
        super().close()


class SharedMemory(Transport):
    name = NAME
    writer = SlotWriter
    reader = SlotReader

    @staticmethod
    def unusable(profile: str, nodes: set[str]) -> str | None:
        if profile == "cpu" and len(nodes) == 1:
            return None
        return "needs the cpu profile and the actor and rollout on one node"
