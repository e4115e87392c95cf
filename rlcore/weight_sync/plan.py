"""The bucket plan: the only contract between the trainer's workers and the rollout engines about what
a sync moves (pure: no processes, no transport).

A PP stage owns an ordered list of HF-named full tensors. ``plan_buckets`` cuts that list into buckets
of at most ``bucket_bytes``; the plan (names, shapes, dtypes, bucket boundaries) is computed once and
handed to the receivers, so each sync moves only flat buffers that both sides view by the plan. A
tensor larger than a bucket travels in row pieces (``split_rows``), so no bucket exceeds
``bucket_bytes`` (unless one row does); a receiver's ``Assembler`` puts the pieces together again.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

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

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


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


class Assembler:
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
