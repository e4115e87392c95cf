"""HuggingFace <-> Megatron weights for the Qwen2/Llama GPTModel of ``model.py``.

One table, ``param_mappings``, says for every parameter of this rank's model which HF tensors it holds
and how they are split over tensor parallelism; loading (HF -> this rank's shards) and exporting
(shards -> full HF tensors, for weight sync and checkpoints) both read it.

Megatron layouts that differ from HF:
- ``linear_qkv`` fuses q, k and v per KV group: rows are [q heads of group 0, k0, v0, q heads of
  group 1, k1, v1, ...] (each head ``head_dim`` rows); TP splits whole groups. This covers GQA.
- ``linear_fc1`` (SwiGLU) holds [gate; up] *per TP shard*: shard r is [gate_r; up_r].
- ``linear_proj``/``linear_fc2`` are row-parallel (split on dim 1); the vocabulary (embedding and
  output layer) and the other linears are split on dim 0.
- Layer indices are local to a PP stage; ``layer.layer_number - 1`` is the global (HF) index.
- With virtual pipeline stages a PP rank holds several model chunks (a list of GPTModels, in
  ascending layer order): export walks them in that order, so a stage still yields its tensors in
  global layer order (the embedding is on the first chunk of PP rank 0, the final norm and output
  layer on the last chunk of the last PP rank).
- With tied embeddings and PP > 1 the last stage holds its own copy of the embedding as
  ``output_layer.weight``: it is loaded from ``model.embed_tokens.weight`` and not exported (the
  first stage exports the embedding; HF has no ``lm_head.weight`` for a tied model).
- The critic's value model (value_head.py) has a replicated ``output_layer`` = HF ``score``; an actor
  checkpoint has no ``score.weight`` (its ``lm_head.weight`` is ignored), so the head is optional.
  A reward model's score layer (score_head.py) is ``*ForSequenceClassification``'s ``score.weight``
  (no bias), optional in the same way (a reward model trained from a causal LM).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rlcore.weight_sync import DTYPES, TensorSpec

from .model import HFModelSpec

# How a Megatron parameter relates to its HF tensors.
REPLICATED = "replicated"  # same tensor on every TP rank (norms)
COLUMN = "column"  # split on dim 0
ROW = "row"  # split on dim 1
QKV = "qkv"  # q, k, v fused per KV group, groups split on dim 0
GATE_UP = "gate_up"  # [gate_r; up_r] per TP shard

# Per-layer parameters: megatron suffix (local spec and TransformerEngine spec names) -> (kind, HF suffixes).
_LAYER_PARAMS = {
    "input_layernorm.weight": (REPLICATED, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": (REPLICATED, ("input_layernorm.weight",)),  # TE spec
    "self_attention.linear_qkv.weight": (QKV, ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                               "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (QKV, ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                             "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": (ROW, ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": (REPLICATED, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": (REPLICATED, ("post_attention_layernorm.weight",)),  # TE spec
    "mlp.linear_fc1.weight": (GATE_UP, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": (ROW, ("mlp.down_proj.weight",)),
}


@dataclass(frozen=True)
class ParamMapping:
    megatron_name: str  # in the unwrapped GPTModel's named_parameters()
    kind: str
    hf_names: tuple[str, ...]
    exported: bool = True  # False: a copy another stage exports (the tied embedding's last-stage copy)
    optional: bool = False  # True: a checkpoint without it leaves the initial value (the value head)


def param_mappings(model, hf: HFModelSpec) -> list[ParamMapping]:
    """The mapping of every parameter of this rank's (unwrapped) GPTModel, in parameter order."""
    from .score_head import HF_SCORE_WEIGHT, is_score_model
    from .value_head import HF_BIAS, HF_WEIGHT, is_value_model

    layers = {str(i): layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    value_model, score_model = is_value_model(model), is_score_model(model)
    out = []
    for name, _ in model.named_parameters():
        if score_model and name == "output_layer.weight":  # a reward model's score (score_head.py)
            out.append(ParamMapping(name, REPLICATED, (HF_SCORE_WEIGHT,), optional=True))
        elif value_model and name in ("output_layer.weight", "output_layer.bias"):
            hf_name = HF_WEIGHT if name == "output_layer.weight" else HF_BIAS
            out.append(ParamMapping(name, REPLICATED, (hf_name,), optional=True))
        elif name == "embedding.word_embeddings.weight":
            out.append(ParamMapping(name, COLUMN, ("model.embed_tokens.weight",)))
        elif name == "output_layer.weight":
            if hf.tie_word_embeddings:  # the last stage's copy of the embedding (PP > 1)
                out.append(ParamMapping(name, COLUMN, ("model.embed_tokens.weight",), exported=False))
            else:
                out.append(ParamMapping(name, COLUMN, ("lm_head.weight",)))
        elif name == "decoder.final_layernorm.weight":
            out.append(ParamMapping(name, REPLICATED, ("model.norm.weight",)))
        elif name.startswith("decoder.layers."):
            local, suffix = name[len("decoder.layers."):].split(".", 1)
            if suffix not in _LAYER_PARAMS:
                raise ValueError(f"no HF mapping for Megatron parameter {name!r}")
            kind, hf_suffixes = _LAYER_PARAMS[suffix]
            prefix = f"model.layers.{layers[local]}."
            out.append(ParamMapping(name, kind, tuple(prefix + s for s in hf_suffixes)))
        else:
            raise ValueError(f"no HF mapping for Megatron parameter {name!r}")
    return out


def model_chunks(model) -> list:
    """The model chunks of this PP rank: ``model`` itself, or the list of its virtual-stage chunks."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


# ------------------------------------------------------------------------------ HF -> Megatron
class _SafetensorsCheckpoint:
    """Reads single tensors or slices of them from a (possibly sharded) safetensors checkpoint."""

    def __init__(self, model_path: str):
        from safetensors import safe_open

        index = os.path.join(model_path, "model.safetensors.index.json")
        single = os.path.join(model_path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            with safe_open(single, "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{model_path}: no model.safetensors or model.safetensors.index.json "
                                    f"(only safetensors checkpoints are supported)")
        self._path, self._weight_map, self._files = model_path, weight_map, {}
        self._safe_open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def slice(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        """``tensor[start:end]`` along ``dim`` (the whole tensor when ``dim`` is None), reading only that."""
        if name not in self._weight_map:
            raise KeyError(f"{self._path}: the checkpoint has no tensor {name!r}")
        file = self._weight_map[name]
        if file not in self._files:
            self._files[file] = self._safe_open(os.path.join(self._path, file), "pt")
        sl = self._files[file].get_slice(name)
        if dim is None:
            return sl[:]
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(start, end)
        return sl[tuple(index)]


def _hf_to_shard(ckpt: _SafetensorsCheckpoint, m: ParamMapping, hf: HFModelSpec, local_shape,
                 tp_rank: int, tp_size: int) -> torch.Tensor:
    if m.kind == REPLICATED:
        return ckpt.slice(m.hf_names[0])
    if m.kind in (COLUMN, ROW):
        dim = 0 if m.kind == COLUMN else 1
        n = local_shape[dim]
        return ckpt.slice(m.hf_names[0], dim, tp_rank * n, (tp_rank + 1) * n)
    if m.kind == QKV:
        groups = hf.num_kv_heads // tp_size
        g0, g1, hd, hpg = tp_rank * groups, (tp_rank + 1) * groups, hf.head_dim, hf.heads_per_kv_group
        q = ckpt.slice(m.hf_names[0], 0, g0 * hpg * hd, g1 * hpg * hd)
        k = ckpt.slice(m.hf_names[1], 0, g0 * hd, g1 * hd)
        v = ckpt.slice(m.hf_names[2], 0, g0 * hd, g1 * hd)
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(groups, hpg * hd, *rest), k.reshape(groups, hd, *rest),
                           v.reshape(groups, hd, *rest)], dim=1)
        return fused.reshape(-1, *rest)
    if m.kind == GATE_UP:
        n = local_shape[0] // 2
        gate = ckpt.slice(m.hf_names[0], 0, tp_rank * n, (tp_rank + 1) * n)
        up = ckpt.slice(m.hf_names[1], 0, tp_rank * n, (tp_rank + 1) * n)
        return torch.cat([gate, up], dim=0)
    raise AssertionError(m.kind)


@torch.no_grad()
def load_hf_weights(model, hf: HFModelSpec, model_path: str) -> None:
    """Copies this rank's shards of the HF checkpoint into ``model`` (the unwrapped GPTModel), reading
    only the tensors (and slices) this rank holds."""
    tp_rank, tp_size = _tp_rank_size()
    ckpt = _SafetensorsCheckpoint(model_path)
    params = dict(model.named_parameters())
    for m in param_mappings(model, hf):
        if m.optional and not all(n in ckpt for n in m.hf_names):
            continue
        param = params[m.megatron_name]
        shard = _hf_to_shard(ckpt, m, hf, tuple(param.shape), tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"{m.megatron_name} has shape {tuple(param.shape)} on TP rank {tp_rank}, "
                             f"but {m.hf_names} give {tuple(shard.shape)}: does {model_path} match its "
                             f"config.json?")
        param.copy_(shard)


# ------------------------------------------------------------------------------ Megatron -> HF
def _full_shapes(m: ParamMapping, hf: HFModelSpec, local_shape, tp_size: int) -> list[tuple[int, ...]]:
    if m.kind == REPLICATED:
        return [tuple(local_shape)]
    if m.kind == COLUMN:
        return [(local_shape[0] * tp_size, *local_shape[1:])]
    if m.kind == ROW:
        return [(local_shape[0], local_shape[1] * tp_size)]
    rest = tuple(local_shape[1:])
    if m.kind == QKV:
        q_rows = hf.num_attention_heads * hf.head_dim
        kv_rows = hf.num_kv_heads * hf.head_dim
        return [(q_rows, *rest), (kv_rows, *rest), (kv_rows, *rest)]
    if m.kind == GATE_UP:
        return [(local_shape[0] // 2 * tp_size, *rest)] * 2
    raise AssertionError(m.kind)


def export_specs(model, hf: HFModelSpec, wire_dtype: str) -> list[TensorSpec]:
    """The HF tensors this PP stage (a model or its list of chunks) exports, in the order
    ``iter_hf_tensors`` yields them."""
    if wire_dtype not in DTYPES:
        raise ValueError(f"wire dtype {wire_dtype!r}: expected one of {sorted(DTYPES)}")
    _, tp_size = _tp_rank_size()
    specs = []
    for chunk in model_chunks(model):
        params = dict(chunk.named_parameters())
        for m in param_mappings(chunk, hf):
            if not m.exported:
                continue
            shapes = _full_shapes(m, hf, tuple(params[m.megatron_name].shape), tp_size)
            specs.extend(TensorSpec(n, s, wire_dtype) for n, s in zip(m.hf_names, shapes))
    return specs


def _all_gather_tp(tensor: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=_tp_group())
    return parts


@torch.no_grad()
def iter_hf_tensors(model, hf: HFModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, full tensor) for everything this PP stage (a model or its list of chunks)
    exports, TP shards all-gathered, chunk after chunk (global layer order).

    Every rank of the TP group must run it to the end together (each tensor is a TP collective);
    only one DP replica needs to (the caller decides: DP rank 0). Tensors keep the model's dtype."""
    for chunk in model_chunks(model):
        yield from _iter_chunk_hf_tensors(chunk, hf)


def _iter_chunk_hf_tensors(model, hf: HFModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    _, tp_size = _tp_rank_size()
    params = dict(model.named_parameters())
    for m in param_mappings(model, hf):
        if not m.exported:
            continue
        local = params[m.megatron_name].detach()
        if m.kind == REPLICATED or (tp_size == 1 and m.kind in (COLUMN, ROW)):
            yield m.hf_names[0], local
        elif m.kind in (COLUMN, ROW):
            yield m.hf_names[0], torch.cat(_all_gather_tp(local, tp_size), dim=0 if m.kind == COLUMN else 1)
        elif m.kind == QKV:
            fused = torch.cat(_all_gather_tp(local, tp_size), dim=0) if tp_size > 1 else local
            hd, hpg, rest = hf.head_dim, hf.heads_per_kv_group, tuple(local.shape[1:])
            per_group = fused.reshape(hf.num_kv_heads, (hpg + 2) * hd, *rest)
            q, k, v = per_group.split([hpg * hd, hd, hd], dim=1)
            for name, t in zip(m.hf_names, (q, k, v)):
                yield name, t.reshape(-1, *rest)
        elif m.kind == GATE_UP:
            shards = _all_gather_tp(local, tp_size) if tp_size > 1 else [local]
            halves = [s.chunk(2, dim=0) for s in shards]
            yield m.hf_names[0], torch.cat([h[0] for h in halves], dim=0)
            yield m.hf_names[1], torch.cat([h[1] for h in halves], dim=0)
        else:
            raise AssertionError(m.kind)


def iter_shard_writes(model, hf: HFModelSpec) -> Iterator[tuple[str, Callable]]:
    """(HF name, ``write``) for everything this PP stage exports, in ``export_specs`` order:
    ``write(dest, rows)`` copies this TP rank's part of that full HF tensor into ``dest`` (a view in
    a shared weight-sync slot; the copy casts to its dtype): the whole tensor when ``rows`` is None,
    else the rows ``[start, stop)`` of it (a tensor larger than a bucket travels in pieces). When every
    TP rank of the stage has written, ``dest`` holds what ``iter_hf_tensors`` would have gathered,
    without any collective: the inverse of ``_hf_to_shard``. Replicated tensors are written by TP
    rank 0 only."""
    from functools import partial

    tp_rank, tp_size = _tp_rank_size()
    for chunk in model_chunks(model):
        params = dict(chunk.named_parameters())
        for m in param_mappings(chunk, hf):
            if not m.exported:
                continue
            local = params[m.megatron_name].detach()
            for i, name in enumerate(m.hf_names):
                yield name, partial(_write_shard, _shard_blocks(m.kind, i, local, hf, tp_rank, tp_size))


def _shard_blocks(kind: str, part: int, local: torch.Tensor, hf: HFModelSpec, tp_rank: int,
                  tp_size: int) -> list[tuple[int, torch.Tensor, slice]]:
    """Where TP rank ``tp_rank``'s shard lands in HF tensor number ``part`` of a mapping: a list of
    (first row in the full tensor, source rows, column slice of the full tensor)."""
    whole = slice(None)
    if kind == REPLICATED or (tp_size == 1 and kind in (COLUMN, ROW)):
        return [(0, local, whole)] if tp_rank == 0 else []
    if kind == COLUMN:
        return [(tp_rank * local.shape[0], local, whole)]
    if kind == ROW:
        n = local.shape[1]
        return [(0, local, slice(tp_rank * n, (tp_rank + 1) * n))]
    if kind == QKV:
        # local rows: [q heads, k, v] per KV group, for this rank's groups; HF's q/k/v rows are
        # ordered by group too, so group g of this rank is one block of rows in each.
        groups, hd, hpg = hf.num_kv_heads // tp_size, hf.head_dim, hf.heads_per_kv_group
        sizes = (hpg * hd, hd, hd)
        start = sum(sizes[:part])
        per_group = local.view(groups, (hpg + 2) * hd, *local.shape[1:])
        return [((tp_rank * groups + g) * sizes[part], per_group[g, start:start + sizes[part]], whole)
                for g in range(groups)]
    if kind == GATE_UP:
        n = local.shape[0] // 2  # local is [gate_r; up_r]
        return [(tp_rank * n, local[part * n:(part + 1) * n], whole)]
    raise AssertionError(kind)


@torch.no_grad()
def _write_shard(blocks: list[tuple[int, torch.Tensor, slice]], dest: torch.Tensor,
                 rows: tuple[int, int] | None = None) -> None:
    """Copies the part of ``blocks`` that falls in rows ``rows`` (all rows if None) of the full
    tensor into ``dest`` (those rows)."""
    lo, hi = rows if rows is not None else (0, dest.shape[0])
    for first, src, cols in blocks:
        a, b = max(lo, first), min(hi, first + src.shape[0])
        if a >= b:
            continue
        target = dest[a - lo:b - lo]
        if cols != slice(None):
            target = target[:, cols]
        target.copy_(src[a - first:b - first])
