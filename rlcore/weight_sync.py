"""The weight-sync wire format: the only contract between the trainer's workers and the rollout
engines (``megatron_workers`` and ``rollout`` never import each other; both import this).

A PP stage owns an ordered list of HF-named full tensors. ``plan_buckets`` cuts that list into buckets
of at most ``bucket_bytes``; the plan (names, shapes, dtypes, bucket boundaries) is computed once and
handed to the receivers, so each sync moves only flat buffers that both sides view by the plan. Every
stage has its own weight-sync group (``WeightSyncGroup``: a stand-alone torch.distributed group, gloo
on CPU, NCCL on GPU, independent of Megatron's world), described by a ``StageLink``. Two transports:

- ``broadcast`` (any placement; NCCL on GPU): the stage sender (DP0/TP0) gathers each tensor over its
  TP group, packs bucket k+1 while bucket k is in flight (two buffers) and broadcasts it
  (``send_buckets`` / ``receive_buckets``).
- ``shm`` (cpu profile, every member on one node): two bucket-sized slots in /dev/shm, mapped by the
  stage's TP ranks and every receiver. Each TP rank writes its own shard straight into its place in
  the slot (no TP gather, no socket copies); receivers load from views of the slot. Two tiny
  all-reduces per bucket order it: "ready" (all writers are done) and "done" (every receiver has
  loaded it, so the slot can take bucket k+2) (``write_buckets`` / ``receive_shared``).

A tensor larger than a bucket travels in row pieces (``split_rows``), so no bucket exceeds
``bucket_bytes`` (unless one row does). Extra memory: shm writers, the two slots (shared by the whole
node, mapped by every member); a broadcast sender, two buffers plus the tensor it is gathering;
receivers, the slots (shm) or two buffers per stage (broadcast; a fresh one per bucket for a reload,
which keeps views until a layer is complete), plus, while the pieces of a split tensor arrive, that
one tensor, assembled whole for vLLM's loaders. ``check=True`` compares per-tensor checksums
afterwards.
"""
from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorSpec:
    name: str  # HuggingFace parameter name, e.g. "model.layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]  # the full tensor's
    dtype: str  # a key of DTYPES: the dtype on the wire (the rollout engine's dtype)
    rows: tuple[int, int] | None = None  # a piece of a tensor larger than a bucket: rows [start, stop)

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return self.shape if self.rows is None else (self.rows[1] - self.rows[0], *self.shape[1:])

    @property
    def numel(self) -> int:
        n = 1
        for d in self.piece_shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    @property
    def is_last_piece(self) -> bool:
        return self.rows is None or self.rows[1] == self.shape[0]


@dataclass(frozen=True)
class Bucket:
    dtype: str
    tensors: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def split_rows(spec: TensorSpec, bucket_bytes: int) -> list[TensorSpec]:
    """``spec`` itself, or, if it is larger than a bucket, its pieces of as many whole rows (dim 0) as
    fit in one (at least one row each), so that no bucket exceeds ``bucket_bytes``."""
    if spec.nbytes <= bucket_bytes or len(spec.shape) == 0 or spec.shape[0] < 2:
        return [spec]
    per = max(1, bucket_bytes // (spec.nbytes // spec.shape[0]))
    return [TensorSpec(spec.name, spec.shape, spec.dtype, (a, min(a + per, spec.shape[0])))
            for a in range(0, spec.shape[0], per)]


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Greedy, order-preserving cut into buckets of one dtype and at most ``bucket_bytes`` each; a
    tensor larger than that travels in row pieces (``split_rows``; only a single row larger than a
    bucket makes a larger one)."""
    buckets: list[Bucket] = []
    cur: list[TensorSpec] = []
    cur_bytes = 0
    for s in (piece for spec in specs for piece in split_rows(spec, bucket_bytes)):
        if cur and (cur_bytes + s.nbytes > bucket_bytes or s.dtype != cur[0].dtype):
            buckets.append(Bucket(cur[0].dtype, tuple(cur)))
            cur, cur_bytes = [], 0
        cur.append(s)
        cur_bytes += s.nbytes
    if cur:
        buckets.append(Bucket(cur[0].dtype, tuple(cur)))
    return buckets


def unpack(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[TensorSpec, torch.Tensor]]:
    """(spec, view) pairs over ``buffer`` in plan order (a piece's view has its ``piece_shape``)."""
    out, off = [], 0
    for s in bucket.tensors:
        out.append((s, buffer[off:off + s.numel].view(s.piece_shape)))
        off += s.numel
    return out


def plan_tensors(plan: list[Bucket]) -> list[TensorSpec]:
    """The whole tensors of a plan, in order (each split tensor once, as its full spec), after checking
    that every split tensor's pieces follow each other and cover its rows exactly."""
    out: list[TensorSpec] = []
    pending = None  # (spec, next row) of a split tensor whose pieces are still arriving
    for spec in (t for b in plan for t in b.tensors):
        if pending is not None:
            if spec.name != pending[0].name or spec.rows is None or spec.rows[0] != pending[1]:
                raise ValueError(f"weight sync plan: {pending[0].name} stops at row {pending[1]} of "
                                 f"{pending[0].shape[0]}; {spec.name} rows {spec.rows} came next")
        elif spec.rows is not None and spec.rows[0] != 0:
            raise ValueError(f"weight sync plan: {spec.name} starts at row {spec.rows[0]}, not 0")
        if spec.rows is None:
            out.append(spec)
        elif spec.is_last_piece:
            out.append(TensorSpec(spec.name, spec.shape, spec.dtype))
            pending = None
        else:
            pending = (spec, spec.rows[1])
    if pending is not None:
        raise ValueError(f"weight sync plan: {pending[0].name} ends at row {pending[1]} of {pending[0].shape[0]}")
    return out


class _Assembler:
    """Turns a receiver's (spec, view) stream into (HF name, full tensor): whole tensors pass as they
    are (views, or copies with ``copy_out``); the pieces of a split tensor are copied into one tensor
    that is yielded when its last piece arrives (the only extra memory on a receiver beyond the
    buckets: one split tensor at a time, since pieces arrive in order), unless ``load_piece(spec,
    view)`` takes the piece itself (returns True: e.g. rows copied straight into their parameter)."""

    def __init__(self, copy_out: bool, load_piece: Callable[[TensorSpec, torch.Tensor], bool] | None = None):
        self.copy_out, self.load_piece, self.partial = copy_out, load_piece, {}

    def __call__(self, pairs) -> Iterator[tuple[str, torch.Tensor]]:
        for spec, view in pairs:
            if spec.rows is not None and self.load_piece is not None and self.load_piece(spec, view):
                continue
            if spec.rows is None:
                yield spec.name, view.clone() if self.copy_out else view
                continue
            full = self.partial.get(spec.name)
            if full is None:
                full = self.partial[spec.name] = torch.empty(spec.shape, dtype=view.dtype, device=view.device)
            full[spec.rows[0]:spec.rows[1]].copy_(view)
            if spec.is_last_piece:
                yield spec.name, self.partial.pop(spec.name)


def empty_buffer(bucket: Bucket, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.empty(bucket.numel, dtype=DTYPES[bucket.dtype], device=device)


TRANSPORTS = ("auto", "shm", "broadcast")


@dataclass(frozen=True)
class StageLink:
    """How every member reaches one PP stage's weight-sync group. Ranks ``0..writers-1`` produce the
    buckets (the stage sender alone with ``broadcast``; all TP ranks of the stage's DP replica 0 with
    ``shm``, rank = TP rank), ranks ``writers..`` are the vLLM workers of every engine."""
    stage: int
    host: str  # the store's address (writer rank 0)
    port: int
    writers: int
    receivers: int
    transport: str  # "broadcast" or "shm"
    slot_path: str = ""  # shm: slot i is the file f"{slot_path}.{i}"
    slot_bytes: int = 0

    @property
    def world_size(self) -> int:
        return self.writers + self.receivers


class SharedSlots:
    """The two bucket slots of a ``shm`` link: files in /dev/shm mapped shared by every member. The
    stage's writer rank 0 creates them (``create=True``) before anyone joins the group and unlinks the
    files once the group is up (everyone has mapped them by then), so a crash leaves nothing behind."""

    def __init__(self, link: StageLink, create: bool = False):
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
        dtype = DTYPES[bucket.dtype]
        return self.slots[k % 2][:bucket.numel * dtype.itemsize].view(dtype)

    def unlink(self) -> None:
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def slot_bytes(plan: list[Bucket]) -> int:
    """The size of a ``shm`` slot for ``plan``: its largest bucket."""
    return max((b.numel * DTYPES[b.dtype].itemsize for b in plan), default=0)


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
        self.signal().wait()

    def signal(self):
        """Posts a one-element all-reduce: it completes once every member has posted its own (a
        non-blocking barrier; ops of one group complete in posting order on every member)."""
        return self._pg.allreduce([torch.zeros(1, device=self.device)], dist.AllreduceOptions())


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
    return _finish_sending(stats, peak, tensors, sums if with_checksums else None)


def _timed_wait(work, stats: dict, key: str) -> None:
    """``work.wait()``, its seconds added to ``stats[key]``."""
    t = time.perf_counter()
    work.wait()
    stats[key] += time.perf_counter() - t


def _next_for(items: Iterator[tuple[str, object]], spec: TensorSpec) -> tuple[str, object]:
    """The model's next (HF name, tensor or writer), which must be the plan's ``spec``."""
    item = next(items, None)
    if item is None:
        raise RuntimeError(f"weight sync: the model ran out of tensors before {spec.name!r} of the plan")
    if item[0] != spec.name:
        raise RuntimeError(f"weight sync: the model yields {item[0]!r} where the plan has {spec.name!r}")
    return item


def _finish_sending(stats: dict, peak: PeakRss, items: Iterator, sums: dict | None) -> dict:
    """A sender's stats once its plan is done: the model must have nothing left to send."""
    stats["peak_extra_bytes"] = peak.extra_bytes
    leftover = next(items, None)
    if leftover is not None:
        raise RuntimeError(f"weight sync: the model yields {leftover[0]!r}, which the plan lacks")
    if sums is not None:
        stats["checksums"] = sums
    return stats


def _send_loop(group, plan, tensors, buffers, stats, sums, clock) -> None:
    in_flight: list = [None, None]  # the Work occupying each of the two buffer slots
    for k, bucket in enumerate(plan):
        slot = k % 2
        if in_flight[slot] is not None:  # bucket k-2 used this buffer
            _timed_wait(in_flight[slot], stats, "send_wait_s")
        flat = buffers[bucket.dtype][slot][:bucket.numel]
        off = 0
        for spec in bucket.tensors:
            if spec.rows is None or spec.rows[0] == 0:  # a new tensor (not the next piece of one)
                t = clock()
                name, tensor = _next_for(tensors, spec)
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
                    stats: dict, reuse_buffers: bool = False,
                    load_piece: Callable[[TensorSpec, torch.Tensor], bool] | None = None
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
    for key in ("bytes", "buckets", "tensors", "recv_wait_s"):
        stats.setdefault(key, 0)
    remaining = [iter(plan) for plan in plans]
    posted: list = [None] * len(plans)
    pools = [[None, None] for _ in plans]
    assemble = _Assembler(copy_out=False, load_piece=load_piece)
    counts = [0] * len(plans)

    def post(s: int) -> None:
        bucket = next(remaining[s], None)
        if bucket is None:
            posted[s] = None
            return
        if reuse_buffers:
            slot = counts[s] % 2
            counts[s] += 1
            dtype = DTYPES[bucket.dtype]
            if pools[s][slot] is None or pools[s][slot].numel() * pools[s][slot].element_size() < bucket.numel * dtype.itemsize:
                pools[s][slot] = torch.empty(max(b.numel * DTYPES[b.dtype].itemsize for b in plans[s]),
                                             dtype=torch.uint8, device=device)
            buf = pools[s][slot][:bucket.numel * dtype.itemsize].view(dtype)
        else:
            buf = empty_buffer(bucket, device)
        posted[s] = (bucket, buf, groups[s].broadcast_async(buf, src=0))

    for s in range(len(plans)):
        post(s)
    for s in _in_turns(posted):
        bucket, buf, work = posted[s]
        _timed_wait(work, stats, "recv_wait_s")
        post(s)  # the stage's next bucket arrives while this one is consumed
        stats["bytes"] += buf.numel() * buf.element_size()
        stats["buckets"] += 1
        stats["tensors"] += sum(spec.is_last_piece for spec in bucket.tensors)
        yield from assemble(unpack(bucket, buf))
        del buf


def _in_turns(posted: list) -> Iterator[int]:
    """The stages whose next bucket is posted (``posted[s]`` not None), in turns, until none is: the
    caller consumes stage s's bucket and re-posts or clears ``posted[s]`` before asking for the next."""
    while any(p is not None for p in posted):
        for s in range(len(posted)):
            if posted[s] is not None:
                yield s


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
    stats = {"bytes": 0, "buckets": 0, "gather_s": 0.0, "pack_s": 0.0, "send_wait_s": 0.0,
             "buffer_bytes": sum(s.numel() for s in slots.slots)}
    sums: dict[str, float] = {}
    assemble = _Assembler(copy_out=False)  # checksums of split tensors are taken whole
    clock = time.perf_counter
    done: list = [None, None]  # the "done" signal of the bucket last written to each slot
    signals = []  # keep every posted signal referenced until the end
    with PeakRss() as peak:
        for k, bucket in enumerate(plan):
            if done[k % 2] is not None:
                _timed_wait(done[k % 2], stats, "send_wait_s")
            flat = slots.view(k, bucket)
            off = 0
            t = clock()
            for spec in bucket.tensors:
                if spec.rows is None or spec.rows[0] == 0:  # a new tensor (not the next piece of one)
                    name, write = _next_for(writes, spec)
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
    return _finish_sending(stats, peak, writes, sums if with_checksums else None)


def receive_shared(groups: list[WeightSyncGroup], slots: list[SharedSlots], plans: list[list[Bucket]],
                   stats: dict, copy_out: bool = False,
                   load_piece: Callable[[TensorSpec, torch.Tensor], bool] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver's side of one ``shm`` sync: (HF name, view into the slot) of every bucket of every
    stage, the stages taking turns as their buckets become ready. A bucket's "done" is signalled
    when the consumer asks for the next tensor after it, so the consumer must have copied the views
    by then; ``copy_out`` yields copies instead (for a consumer that keeps them: vLLM's layerwise
    reload). ``load_piece``: see ``_Assembler``. Adds ``bytes``, ``buckets``, ``tensors`` and
    ``recv_wait_s`` to ``stats``."""
    for key in ("bytes", "buckets", "tensors", "recv_wait_s"):
        stats.setdefault(key, 0)
    remaining = [iter(enumerate(plan)) for plan in plans]
    posted: list = [None] * len(plans)
    signals = []
    assemble = _Assembler(copy_out, load_piece)

    def post(s: int) -> None:
        nxt = next(remaining[s], None)
        posted[s] = None if nxt is None else (nxt[0], nxt[1], groups[s].signal())

    for s in range(len(plans)):
        post(s)
    for s in _in_turns(posted):
        k, bucket, ready = posted[s]
        _timed_wait(ready, stats, "recv_wait_s")
        flat = slots[s].view(k, bucket)
        yield from assemble(unpack(bucket, flat))
        signals.append(groups[s].signal())  # done: the slot may take bucket k + 2
        stats["bytes"] += flat.numel() * flat.element_size()
        stats["buckets"] += 1
        stats["tensors"] += sum(spec.is_last_piece for spec in bucket.tensors)
        post(s)  # only now: every member posts ready and done of one group in the same order
    for work in signals:
        work.wait()


# ----------------------------------------------------------------------- orchestration (controller)
def connect_weight_sync(senders, receivers, num_receivers: int, bucket_bytes: int, wire_dtype: str,
                        transport: str = "auto") -> list[StageLink]:
    """Builds one weight-sync group per actor PP stage: that stage's writers plus every vLLM worker
    of every rollout engine. ``senders`` is a MegatronGroup, ``receivers`` a RolloutPool (duck-typed:
    rlcore never imports them); ``num_receivers`` is the number of engines (each joins with its
    ``tp`` workers). ``transport`` (``rollout.weight_transport``): ``shm`` when every member is on
    one node and the profile is cpu, ``broadcast`` otherwise (``auto``), or forced. Both sides block
    in group creation until all members join, hence one ray.get. Calling it again (a new actor, a new
    bucket size) replaces the groups. Returns the links."""
    import ray

    if num_receivers != receivers.num_engines:
        raise ValueError(f"weight sync: num_receivers={num_receivers}, but the rollout pool has "
                         f"{receivers.num_engines} engines")
    if transport not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transport={transport!r}: expected one of {list(TRANSPORTS)}")
    nodes = set(senders.node_ips()) | set(receivers.node_ips())
    one_cpu_node = senders.profile == "cpu" and len(nodes) == 1
    if transport == "auto":
        transport = "shm" if one_cpu_node else "broadcast"
    elif transport == "shm" and not one_cpu_node:
        raise ValueError(f"rollout.weight_transport=shm needs the cpu profile and the actor and rollout on one "
                         f"node; here: profile {senders.profile}, nodes {sorted(nodes)}")
    plans = senders.weight_sync_plans(bucket_bytes, wire_dtype)
    links = senders.weight_sync_links(transport, receivers.num_receiving_ranks)
    ray.get(senders.init_weight_sync(links) + receivers.init_weight_sync(links, plans))
    return links


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
