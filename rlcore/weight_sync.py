"""The weight-sync wire format: the only contract between the trainer's workers and the rollout
engines (``megatron_workers`` and ``rollout`` never import each other; both import this).

A sender (one per actor PP stage) owns an ordered list of HF-named full tensors. ``plan_buckets``
cuts that list into buckets of at most ``bucket_bytes``; the plan (names, shapes, dtypes, bucket
boundaries) is computed once and handed to the receivers, so each sync moves only flat buffers: the
sender packs a bucket into one contiguous buffer and broadcasts it over a ``WeightSyncGroup``; every
receiver unpacks views of the same buffer by the plan. The group is a stand-alone torch.distributed
process group (gloo on CPU, NCCL on GPU), independent of Megatron's default group.
"""
from __future__ import annotations

import datetime
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


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One flat buffer holding the bucket's tensors in plan order, cast to the wire dtype."""
    dtype = DTYPES[bucket.dtype]
    if out is None:
        out = torch.empty(bucket.numel, dtype=dtype, device=next(iter(tensors.values())).device)
    off = 0
    for s in bucket.tensors:
        t = tensors[s.name]
        if tuple(t.shape) != s.shape:
            raise ValueError(f"weight sync: {s.name} has shape {tuple(t.shape)}, the plan says {s.shape}")
        out[off:off + s.numel].copy_(t.reshape(-1))
        off += s.numel
    return out


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
    """Cheap per-tensor fingerprint (float64 sum of values and of squares' weighted by position)."""
    out = {}
    for name, t in tensors:
        x = t.detach().double().reshape(-1)
        w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device) / x.numel()
        out[name] = float(x.sum() + (x * w).sum())
    return out


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
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        opts = dist.AllreduceOptions()
        self._pg.allreduce([t], opts).wait()


# ----------------------------------------------------------------------- orchestration (controller)
def connect_weight_sync(senders, receivers, num_receivers: int, bucket_bytes: int, wire_dtype: str) -> None:
    """Builds one weight-sync group per actor PP stage: that stage's sender (rank 0) plus every rollout
    engine. ``senders`` is a MegatronGroup, ``receivers`` a RolloutPool (duck-typed: rlcore never
    imports them). Both sides block in group creation until all members join, hence one ray.get."""
    import ray

    plans = senders.weight_sync_plans(bucket_bytes, wire_dtype)
    endpoints = senders.weight_sync_endpoints()
    world_sizes = [1 + num_receivers] * len(endpoints)
    ray.get(senders.init_weight_sync(world_sizes) + receivers.init_weight_sync(endpoints, world_sizes, plans))


def sync_weights(senders, receivers, version: int) -> list:
    """Sends the actor's current weights to every engine; returns the receivers' reports."""
    import ray

    refs_out = senders.send_weights()
    refs_in = receivers.receive_weights(version)
    ray.get(refs_out)
    return ray.get(refs_in)
