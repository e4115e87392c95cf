"""What a weight-sync transport is: a writer/reader pair behind one interface, plus the pieces of
their loops that every transport shares.

A transport moves each stage's buckets (the plan) from the actor's DP replica 0 of that stage to every
vLLM worker, over the stage's ``WeightSyncGroup``:
- ``StageWriter.create``: the stage sender (DP0/TP0) describes the stage's group in a ``StageLink``
  and makes whatever the members must find before they join (e.g. files to map);
- ``StageWriter``: one per rank of DP replica 0 of the stage; ranks below ``link.writers`` join the
  group, and every one of them runs ``send`` for each sync (a rank that is no writer may still have
  to take part, e.g. in the TP gathers of the tensors another rank sends);
- ``StageReader``: one per vLLM worker, for every stage at once; ``stream`` yields the (HF name,
  tensor) pairs of one sync for vLLM's loaders.
A new transport is one file defining a ``Transport`` subclass and one line registering it in
``factory.py``.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch

from .group import StageLink, WeightSyncGroup
from .plan import Bucket, TensorSpec
from .rss import PeakRss
from .sides import StageSource

LoadPiece = Callable[[TensorSpec, torch.Tensor], bool]  # see plan.Assembler


class StageWriter(ABC):
    """TP rank ``tp_rank`` of the actor's DP replica 0 of stage ``link.stage``, for the syncs over
    ``link``. Member ``tp_rank`` of the group if ``tp_rank < link.writers``."""

    def __init__(self, link: StageLink, tp_rank: int, plan: list[Bucket]):
        self.link, self.tp_rank, self.plan = link, tp_rank, plan
        self.group: WeightSyncGroup | None = None
        self.device: str | torch.device = "cpu"
        self.joined = False  # ``send`` needs ``join`` first

    @classmethod
    @abstractmethod
    def create(cls, stage: int, host: str, port: int, tp: int, receivers: int, plan: list[Bucket]) -> "StageWriter":
        """The stage sender's (TP rank 0's) writer, whose ``link`` (its store at ``host:port``,
        ``receivers`` ranks on the rollout side) every member then joins by."""

    def join(self, backend: str, device: str | torch.device) -> None:
        """Joins the group if this rank is a writer; blocks until every member has joined."""
        self.device = device
        if self.tp_rank < self.link.writers:
            self.group = WeightSyncGroup.join(self.link, self.tp_rank, backend, device)
        self.joined = True

    @abstractmethod
    def send(self, source: StageSource, with_checksums: bool) -> dict | None:
        """This rank's part of one sync. Returns, on TP rank 0, the stage's stats (``bytes``,
        ``buckets``, ``gather_s``, ``pack_s``, ``send_wait_s``, ``buffer_bytes``,
        ``peak_extra_bytes``; ``checksums`` of what was sent with ``with_checksums``); None elsewhere."""

    def close(self) -> None:
        self.group, self.joined = None, False


class StageReader(ABC):
    """One vLLM worker in every stage's group: rank ``ranks[s]`` of ``links[s]``'s, whose buckets
    follow ``plans[s]``. The groups are joined in stage order (every member uses that order, so the
    blocking joins cannot deadlock)."""

    def __init__(self, links: list[StageLink], ranks: list[int], plans: list[list[Bucket]], backend: str,
                 device: str | torch.device):
        self.links, self.plans, self.device = links, plans, device
        self.groups = []
        for link, rank in zip(links, ranks):
            self.attach(link)
            self.groups.append(WeightSyncGroup.join(link, rank, backend, device))

    def attach(self, link: StageLink) -> None:
        """What this worker must set up for ``link`` before joining its group (nothing by default)."""

    @abstractmethod
    def stream(self, stats: dict, consumer_copies: bool,
               load_piece: LoadPiece | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every bucket of every stage for one sync, the stages in parallel, for a
        loader to consume lazily. ``consumer_copies``: the consumer copies each tensor before asking for
        the next (an in-place load), so views into reused buffers are safe; otherwise (vLLM's layerwise
        reload keeps a layer's tensors until it is complete) the tensors must outlive their bucket.
        ``load_piece``: see ``plan.Assembler``. Adds ``bytes``, ``buckets``, ``tensors`` and
        ``recv_wait_s`` (time blocked on arrivals) to ``stats``."""

    def close(self) -> None:
        self.groups = []


class Transport:
    """A registered transport: its name (``rollout.weight_transport``, ``StageLink.transport``), where
    it can serve, and its writer and reader."""

    name: ClassVar[str]
    writer: ClassVar[type[StageWriter]]
    reader: ClassVar[type[StageReader]]
    auto: ClassVar[bool] = True  # may ``auto`` pick it (where it can serve; registry order decides)

    @staticmethod
    def unusable(profile: str, nodes: set[str]) -> str | None:
        """Why it cannot serve this placement (``profile``; the nodes of every member), or None."""
        return None


# ----------------------------------------------------------------- pieces the transports' loops share
def timed_wait(work, stats: dict, key: str) -> None:
    """``work.wait()``, its seconds added to ``stats[key]``."""
    t = time.perf_counter()
    work.wait()
    stats[key] += time.perf_counter() - t


def next_for(items: Iterator[tuple[str, object]], spec: TensorSpec) -> tuple[str, object]:
    """The model's next (HF name, tensor or writer), which must be the plan's ``spec``."""
    item = next(items, None)
    if item is None:
        raise RuntimeError(f"weight sync: the model ran out of tensors before {spec.name!r} of the plan")
    if item[0] != spec.name:
        raise RuntimeError(f"weight sync: the model yields {item[0]!r} where the plan has {spec.name!r}")
    return item


def sender_stats(buffer_bytes: int) -> dict:
    """A sender's stats before its first bucket."""
    return {"bytes": 0, "buckets": 0, "gather_s": 0.0, "pack_s": 0.0, "send_wait_s": 0.0,
            "buffer_bytes": buffer_bytes}


def finish_sending(stats: dict, peak: PeakRss, items: Iterator, sums: dict | None) -> dict:
    """A sender's stats once its plan is done: the model must have nothing left to send."""
    stats["peak_extra_bytes"] = peak.extra_bytes
    leftover = next(items, None)
    if leftover is not None:
        raise RuntimeError(f"weight sync: the model yields {leftover[0]!r}, which the plan lacks")
    if sums is not None:
        stats["checksums"] = sums
    return stats


def receiver_stats(stats: dict) -> dict:
    for key in ("bytes", "buckets", "tensors", "recv_wait_s"):
        stats.setdefault(key, 0)
    return stats


def count_bucket(stats: dict, bucket: Bucket, flat: torch.Tensor) -> None:
    """A receiver's stats after one bucket."""
    stats["bytes"] += flat.numel() * flat.element_size()
    stats["buckets"] += 1
    stats["tensors"] += sum(spec.is_last_piece for spec in bucket.tensors)


def in_turns(posted: list) -> Iterator[int]:
    """The stages whose next bucket is posted (``posted[s]`` not None), in turns, until none is: the
    caller consumes stage s's bucket and re-posts or clears ``posted[s]`` before asking for the next."""
    while any(p is not None for p in posted):
        for s in range(len(posted)):
            if posted[s] is not None:
                yield s
