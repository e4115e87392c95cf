"""The weight-sync wire format: the only contract between the trainer's workers and the rollout
engines (``megatron_workers`` and ``rollout`` never import each other; both import this).

A sender (one per actor PP stage) owns an ordered list of HF-named full tensors. ``plan_buckets``
cuts that list into buckets of at most ``bucket_bytes``; the plan (names, shapes, dtypes, bucket
boundaries) is computed once and handed to the receivers, so each sync moves only flat buffers: the
sender packs a bucket into one contiguous buffer and broadcasts it over a ``WeightSyncGroup``; every
receiver unpacks views of the same buffer by the plan. The group is a stand-alone torch.distributed
process group (gloo on CPU, NCCL on GPU), independent of Megatron's default group.

One sync (``sync_weights``): every PP stage's sender runs ``send_buckets`` at the same time (its TP
peers join the all-gathers, other DP replicas idle), casting to the wire (rollout) dtype while
packing and double-buffering (bucket k+1 is gathered and packed while bucket k is in flight), and
every vLLM worker runs ``receive_buckets``, which keeps the next bucket of every stage posted so
the stages arrive in parallel. Extra memory: two buckets on a sender, (stages + 1) buckets on a
receiver, where a bucket is ``bucket_bytes`` or the largest single tensor if that is larger (a
tensor is never split). ``check=True`` compares per-tensor checksums afterwards.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorSpec:
    name: str  # HuggingFace parameter name, e.g. "model.layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    dtype: str  # a key of DTYPES: the dtype on the wire (the rollout engine's dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Bucket:
    dtype: str
    tensors: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Greedy, order-preserving cut into buckets of one dtype and at most ``bucket_bytes`` each
    (a single tensor larger than that gets a bucket of its own)."""
    buckets: list[Bucket] = []
    cur: list[TensorSpec] = []
    cur_bytes = 0
    for s in specs:
        if cur and (cur_bytes + s.nbytes > bucket_bytes or s.dtype != cur[0].dtype):
            buckets.append(Bucket(cur[0].dtype, tuple(cur)))
            cur, cur_bytes = [], 0
        cur.append(s)
        cur_bytes += s.nbytes
    if cur:
        buckets.append(Bucket(cur[0].dtype, tuple(cur)))
    return buckets


def unpack(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view) pairs over ``buffer`` in plan order."""
    out, off = [], 0
    for s in bucket.tensors:
        out.append((s.name, buffer[off:off + s.numel].view(s.shape)))
        off += s.numel
    return out


def empty_buffer(bucket: Bucket, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.empty(bucket.numel, dtype=DTYPES[bucket.dtype], device=device)


def checksum(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Cheap per-tensor fingerprint: the float64 sum of the values plus their sum weighted by position
    (so a swap of two values changes it too). Equal tensors give bit-equal fingerprints."""
    out = {}
    for name, t in tensors:
        x = t.detach().double().reshape(-1)
        w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device) / x.numel()
        out[name] = float(x.sum() + (x * w).sum())
    return out


class WeightMismatchError(RuntimeError):
    """An engine's weights after a sync differ from the trainer's (``check_weights``)."""


def compare_checksums(expected: dict[str, float], got: dict[str, float], where: str,
                      order: list[str] | None = None, rel: float = 1e-9) -> None:
    """Raises ``WeightMismatchError`` naming the first tensor (in ``order``, default sorted names) whose
    checksum in ``got`` differs from ``expected`` by more than ``rel`` (relative to the tensor's scale)
    or is missing. ``where`` names the engine."""
    for name in order or sorted(expected):
        if name not in expected:
            continue
        want, have = expected[name], got.get(name)
        if have is None:
            raise WeightMismatchError(f"weight check: {where} has no tensor {name} after the sync")
        if abs(have - want) > rel * max(1.0, abs(want)):
            raise WeightMismatchError(f"weight check: {where} holds a different {name} than the trainer after "
                                      f"the sync (checksum {have!r}, trainer's {want!r})")


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
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            raise ValueError(f"weight sync backend {backend!r}: expected gloo or nccl")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0):
        """Posts the broadcast and returns its ``Work`` (``.wait()``); ``tensor`` must stay untouched
        until then. Posted ops of one group run in posting order on every member."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._pg.broadcast([tensor], opts)

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        opts = dist.AllreduceOptions()
        self._pg.allreduce([t], opts).wait()


# ------------------------------------------------------------------ the two sides of one sync
class PeakRss:
    """Measures this process's peak resident memory above its level at entry (``extra_bytes``), by
    sampling /proc/self/statm from a thread every ``interval_s``: what a sync really holds on top of
    the model, whatever allocated it (buffers, gathered tensors, vLLM's reload temporaries)."""

    def __init__(self, interval_s: float = 0.002):
        import os
        import threading

        self._interval, self._page = interval_s, os.sysconf("SC_PAGE_SIZE")
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._run, daemon=True)
        self.extra_bytes = 0

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:  # not Linux: no measurement
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.extra_bytes = max(self.extra_bytes, self._rss() - self._base)

    def __enter__(self) -> "PeakRss":
        self._base = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.extra_bytes = max(self.extra_bytes, self._rss() - self._base)


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
    stats = {"bytes": 0, "buckets": 0, "gather_s": 0.0, "pack_s": 0.0, "send_wait_s": 0.0,
             "buffer_bytes": sum(2 * n * DTYPES[d].itemsize for d, n in sizes.items())}
    sums: dict[str, float] = {}
    clock = time.perf_counter
    with PeakRss() as peak:
        buffers = {d: [torch.empty(n, dtype=DTYPES[d], device=device) for _ in range(2)] for d, n in sizes.items()}
        _send_loop(group, plan, tensors, buffers, stats, sums if with_checksums else None, clock)
    stats["peak_extra_bytes"] = peak.extra_bytes
    leftover = next(tensors, None)
    if leftover is not None:
        raise RuntimeError(f"weight sync: the model yields {leftover[0]!r}, which the plan lacks")
    if with_checksums:
        stats["checksums"] = sums
    return stats


def _send_loop(group, plan, tensors, buffers, stats, sums, clock) -> None:
    in_flight: list = [None, None]  # the Work occupying each of the two buffer slots
    for k, bucket in enumerate(plan):
        slot = k % 2
        if in_flight[slot] is not None:  # bucket k-2 used this buffer
            t = clock()
            in_flight[slot].wait()
            stats["send_wait_s"] += clock() - t
        flat = buffers[bucket.dtype][slot][:bucket.numel]
        off = 0
        for spec in bucket.tensors:
            t = clock()
            item = next(tensors, None)
            stats["gather_s"] += clock() - t
            if item is None:
                raise RuntimeError(f"weight sync: the model ran out of tensors before {spec.name!r} of the plan")
            name, tensor = item
            if name != spec.name:
                raise RuntimeError(f"weight sync: the model yields {name!r} where the plan has {spec.name!r}")
            if tuple(tensor.shape) != spec.shape:
                raise ValueError(f"weight sync: {name} has shape {tuple(tensor.shape)}, the plan says {spec.shape}")
            t = clock()
            view = flat[off:off + spec.numel]
            view.copy_(tensor.reshape(-1))  # casts to the wire (rollout) dtype
            if sums is not None:
                sums.update(checksum([(name, view)]))
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
                    stats: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiver's side of one sync: (HF name, view) pairs of every bucket of every stage group,
    for a loader to consume lazily. The stages arrive in parallel: each group always has the receive
    of its next bucket posted while the current one is consumed, and the stages take turns. Extra
    memory: (number of stages + 1) buckets, plus whatever the consumer keeps referenced. Adds
    ``bytes``, ``buckets``, ``tensors`` and ``recv_wait_s`` (time blocked on arrivals) to ``stats``."""
    for key in ("bytes", "buckets", "tensors", "recv_wait_s"):
        stats.setdefault(key, 0)
    remaining = [iter(plan) for plan in plans]
    posted: list = [None] * len(plans)

    def post(s: int) -> None:
        # A fresh buffer per bucket: the consumer may keep views of the previous one alive.
        bucket = next(remaining[s], None)
        if bucket is None:
            posted[s] = None
            return
        buf = empty_buffer(bucket, device)
        posted[s] = (bucket, buf, groups[s].broadcast_async(buf, src=0))

    for s in range(len(plans)):
        post(s)
    active = [s for s in range(len(plans)) if posted[s] is not None]
    while active:
        for s in list(active):
            bucket, buf, work = posted[s]
            t = time.perf_counter()
            work.wait()
            stats["recv_wait_s"] += time.perf_counter() - t
            post(s)
            if posted[s] is None:
                active.remove(s)
            stats["bytes"] += buf.numel() * buf.element_size()
            stats["buckets"] += 1
            stats["tensors"] += len(bucket.tensors)
            yield from unpack(bucket, buf)
            del buf


# ----------------------------------------------------------------------- orchestration (controller)
def connect_weight_sync(senders, receivers, num_receivers: int, bucket_bytes: int, wire_dtype: str) -> None:
    """Builds one weight-sync group per actor PP stage: that stage's sender (rank 0) plus every vLLM
    worker of every rollout engine. ``senders`` is a MegatronGroup, ``receivers`` a RolloutPool
    (duck-typed: rlcore never imports them); ``num_receivers`` is the number of engines (each joins
    with its ``tp`` workers). Both sides block in group creation until all members join, hence one
    ray.get. Calling it again (a new actor, a new bucket size) replaces the groups."""
    import ray

    if num_receivers != receivers.num_engines:
        raise ValueError(f"weight sync: num_receivers={num_receivers}, but the rollout pool has "
                         f"{receivers.num_engines} engines")
    plans = senders.weight_sync_plans(bucket_bytes, wire_dtype)
    endpoints = senders.weight_sync_endpoints()
    world_sizes = [1 + receivers.num_receiving_ranks] * len(endpoints)
    ray.get(senders.init_weight_sync(world_sizes) + receivers.init_weight_sync(endpoints, world_sizes, plans))


def sync_weights(senders, receivers, version: int, check: bool = False) -> list:
    """Sends the actor's current weights to every engine; returns the receivers' reports (each with
    the senders' ``send`` stats added). With ``check`` (``rollout.check_weights``), compares every
    engine's weights afterwards with what the senders packed and raises ``WeightMismatchError``
    naming the first tensor that differs."""
    import ray

    refs_out = senders.send_weights(with_checksums=check)
    refs_in = receivers.receive_weights(version)
    sent = [s for s in ray.get(refs_out) if s is not None]
    reports = ray.get(refs_in)
    for r in reports:
        r["send"] = [{k: v for k, v in s.items() if k != "checksums"} for s in sent]
    if check:
        expected, order = {}, []
        for s in sent:
            expected.update(s["checksums"])
            order.extend(s["checksums"])
        check_engines(expected, receivers.weight_checksums(), order)
    return reports


def check_engines(expected: dict[str, float], per_engine: list[dict[str, float]], order: list[str] | None = None) -> None:
    """``compare_checksums`` for every engine's checksums (``RolloutPool.weight_checksums()``)."""
    for e, got in enumerate(per_engine):
        compare_checksums(expected, got, f"rollout engine {e}", order)
