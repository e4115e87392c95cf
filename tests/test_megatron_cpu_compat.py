"""The CPU compatibility layer patches only what megatron needs, and leaves torch usable by the other
libraries in the process. It patches process-wide state, so it runs in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECKS = textwrap.dedent("""
    import torch
    from megatron_workers.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    apply_cpu_compat()  # idempotent
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils
    import sys

    # megatron's fusions were decorated without torch.compile: dynamo and inductor never imported,
    # the decorated functions plain (and still right), torch.compile itself torch's own again.
    import megatron.core.jit
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import get_megatron_optimizer
    assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules, "dynamo imported"
    assert megatron.core.jit.jit_fuser(len) is len
    y = torch.randn(3, 8)
    a, b = torch.chunk(y + 1.0, 2, -1)
    assert torch.equal(bias_swiglu(y, torch.ones(8)), torch.nn.functional.silu(a) * b)
    assert torch.compile.__module__ == "torch"
    # megatron's fused SwiGLU (bias_activation_fusion), the cpu profile's activation: its forward and
    # its backward (the cpu layer's swiglu_back) equal the unfused activation's autograd to the bit,
    # and it keeps only its input for the backward, not silu(gate) and the up half as well.
    from megatron.core.fusions import fused_bias_swiglu
    from megatron_workers.cpu_compat import swiglu_back_as_autograd
    assert fused_bias_swiglu.swiglu_back is swiglu_back_as_autograd
    gen = torch.Generator().manual_seed(2)
    for shape in ((5, 2, 16), (155, 4, 3072), (7, 2002)):
        y = (3 * torch.randn(shape, generator=gen)).requires_grad_(True)
        grad_out = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
        gate, up = torch.chunk(y, 2, -1)
        unfused = torch.nn.functional.silu(gate) * (up + 0.0)  # megatron's glu, glu_linear_offset 0
        unfused.backward(grad_out)
        y2 = y.detach().clone().requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fused = fused_bias_swiglu.bias_swiglu_impl(y2, None)
        fused.backward(grad_out)
        assert torch.equal(fused, unfused) and torch.equal(y2.grad, y.grad), shape
        assert len(saved) == 1 and saved[0].data_ptr() == y2.data_ptr(), [t.shape for t in saved]

    # megatron's literal device="cuda" allocations land on the CPU ...
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert transformer_utils.get_default_causal_mask(4).device.type == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")
    # ... while torch's own factories are untouched: `with torch.device(...)` still places them
    # (replacing torch.tensor globally made transformers build garbage RoPE buffers).
    with torch.device("meta"):
        assert torch.tensor([1.0]).device.type == "meta"
    try:
        torch.zeros(1, device="cuda")
        raise SystemExit("torch.zeros(device='cuda') outside megatron must still fail on a CPU build")
    except (AssertionError, RuntimeError):
        pass
    # Tensor.type() answers both spellings for megatron's checks, and casts still work.
    x = torch.zeros(2)
    assert x.type() == "torch.cuda.FloatTensor" and x.type() == "torch.FloatTensor"
    assert x.type() in ["torch.cuda.FloatTensor"] and x.type() != "torch.cuda.HalfTensor"
    assert x.type(torch.float64).dtype == torch.float64
    # Tensor.cuda is patched only inside LanguageModule.setup_embeddings_and_output_layer.
    try:
        x.cuda()
        raise SystemExit("Tensor.cuda() must still fail on a CPU build")
    except (AssertionError, RuntimeError):
        pass
    # Gradient accumulation fusion: megatron's linear layers take the CPU stand-in for apex's kernel,
    # whose accumulation equals the unfused gradient-then-add to the bit, also past one GEMM block of
    # tokens (~190 here) and across slabs (SmolLM2's MLP and tied head: 2 and 28 slabs), at one thread
    # and at the two a SmolLM2 rank runs with.
    from megatron.core.tensor_parallel import layers
    from megatron_workers.cpu_compat import CpuWgradAccumulation
    assert layers._grad_accum_fusion_available and layers.fused_weight_gradient_mlp_cuda is CpuWgradAccumulation
    g = torch.Generator().manual_seed(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for tokens, out_features, in_features in ((37, 40, 24), (300, 1536, 576), (692, 3072, 576),
                                                  (447, 49152, 576), (1000, 49152, 64)):
            inp = torch.randn(tokens, in_features, generator=g)
            out = torch.randn(tokens, out_features, generator=g)
            main_grad = torch.randn(out_features, in_features, generator=g)
            expected = main_grad + out.t().matmul(inp)
            CpuWgradAccumulation.wgrad_gemm_accum_fp32(inp, out, main_grad)
            assert torch.equal(main_grad, expected), (threads, tokens, (main_grad - expected).abs().max())
    torch.set_num_threads(1)
    try:
        CpuWgradAccumulation.wgrad_gemm_accum_fp16(inp, out, main_grad.bfloat16())
        raise SystemExit("a bf16 main gradient must be refused on the cpu profile")
    except RuntimeError as e:
        assert "fp32 main gradients" in str(e)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op where CUDA is available")
def run_script(script: str, **env_vars: str) -> None:
    """Runs ``script`` in a fresh one-thread interpreter (the repository on its path, a free port in
    PORT for a one-process gloo world, ``env_vars`` added) and expects it to print exactly "ok"."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", PORT=str(port), **env_vars)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_cpu_compat_is_targeted():
    run_script(CHECKS)


# resources.host_malloc=keep in a fresh process: a large block freed and allocated again reuses its
# pages (few minor faults) where glibc's defaults unmap it and fault it in again (one per 4 KiB page).
HOST_MALLOC = textwrap.dedent("""
    import resource
    import torch
    from megatron_workers.host_malloc import use_host_malloc

    def faults_of_a_fresh_block():
        torch.ones(64 << 18).sum()  # 64 MiB, freed at once
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(64 << 18).sum()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    pages = (64 << 20) // resource.getpagesize()
    assert faults_of_a_fresh_block() > pages // 2  # glibc's defaults: above the mmap threshold, unmapped
    use_host_malloc("keep")
    faults_of_a_fresh_block()  # the first block on the heap
    kept = faults_of_a_fresh_block()
    assert kept < pages // 20, (kept, pages)
    try:
        use_host_malloc("tcmalloc")
    except ValueError as e:
        assert "resources.host_malloc" in str(e) and "glibc, keep" in str(e)
    else:
        raise AssertionError("an unknown mode was accepted")
    print("ok")
""")


def test_host_malloc_keep_reuses_freed_pages():
    run_script(HOST_MALLOC)


# The start of a script that runs megatron on one gloo rank: the cpu layer, a world of one, TP = PP = 1.
ONE_RANK_MEGATRON = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    from megatron_workers.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
""")


# megatron's own branch for gradient accumulation fusion (tensor_parallel/layers.py) with the cpu
# kernel: the weight's gradient lands in main_grad, on top of what was there, and autograd's own
# .grad is the dummy megatron hands back (DDP's hook then skips its add). The same for the word
# embedding, and gradient clipping in place.
FUSED_WGRAD = ONE_RANK_MEGATRON + textwrap.dedent("""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(gradient_accumulation_fusion=True, use_cpu_initialization=True)
    layer = ColumnParallelLinear(24, 40, config=config, init_method=torch.nn.init.normal_, bias=False)
    weight = layer.weight
    start = torch.randn(40, 24)
    weight.main_grad, weight.grad_added_to_main_grad = start.clone(), False
    x = torch.randn(300, 1, 24, requires_grad=True)
    out, _ = layer(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected = start + grad_out.reshape(300, 40).t().matmul(x.detach().reshape(300, 24))
    assert weight.grad_added_to_main_grad, "megatron did not take its fused wgrad branch"
    assert torch.equal(weight.main_grad, expected), (weight.main_grad - expected).abs().max()
    assert torch.allclose(x.grad, grad_out.matmul(weight.detach()))

    # The word embedding likewise (cpu_compat step 8): megatron's VocabParallelEmbedding adds the rows
    # of its gradient into main_grad, equal to its dense gradient added whole, to the bit (tokens
    # repeated within the micro-batch, two micro-batches), and hands autograd megatron's placeholder.
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    emb = VocabParallelEmbedding(1000, 64, init_method=torch.nn.init.normal_, config=config)
    ids = [torch.randint(0, 50, (4, 300)), torch.randint(0, 1000, (2, 40))]
    grads = [torch.randn(4, 300, 64), torch.randn(2, 40, 64)]
    start = torch.randn(1000, 64)
    dense, dense_grads = start.clone(), []
    for i, g in zip(ids, grads):
        emb.weight.grad = None
        torch.nn.functional.embedding(i, emb.weight).backward(g)
        dense_grads.append(emb.weight.grad)
        dense.add_(emb.weight.grad)
    emb.weight.grad = None
    emb.weight.main_grad, emb.weight.grad_added_to_main_grad = start.clone(), False
    for i, g in zip(ids, grads):
        out = emb(i)
        assert torch.equal(out, torch.nn.functional.embedding(i, emb.weight.detach()))
        out.backward(g)
    assert emb.weight.grad_added_to_main_grad, "the embedding's gradient did not go to main_grad"
    assert torch.equal(emb.weight.main_grad, dense), (emb.weight.main_grad - dense).abs().max()
    # A weight that its stage also uses as the output layer (PP=1, tied) keeps the dense gradient:
    # megatron adds the summed gradient of both uses in DDP's hook.
    emb.weight.grad, emb.weight.zero_out_wgrad = None, True
    emb.weight.main_grad, emb.weight.grad_added_to_main_grad = start.clone(), False
    emb(ids[0]).backward(grads[0])
    assert torch.equal(emb.weight.main_grad, start) and not emb.weight.grad_added_to_main_grad
    assert torch.equal(emb.weight.grad, dense_grads[0])

    # Gradient clipping scales megatron's gradients in place (cpu_compat step 9), as the product does.
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    params = [torch.nn.Parameter(torch.randn(30, 7)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p)
    expected, storage = [p.grad * (1.0 / (4.0 + 1.0e-6)) for p in params], [p.grad.data_ptr() for p in params]
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    assert [p.grad.data_ptr() for p in params] == storage
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op where CUDA is available")
def test_megatron_accumulates_weight_gradients_into_main_grad_on_cpu():
    run_script(FUSED_WGRAD)


# A GPTModel whose one stage holds both the tied embedding and the output layer (PP=1): megatron marks
# the weight zero_out_wgrad and sums a zero-filled placeholder, the embedding's dense gradient and the
# DDP hook's add; the cpu layer has both uses add into main_grad themselves. Every parameter's main
# gradient after two micro-batches is the same to the bit either way.
TIED_STAGE = ONE_RANK_MEGATRON + textwrap.dedent("""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    def main_grads(megatrons_own_path: bool):
        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
            gradient_accumulation_fusion=True, masked_softmax_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
            pipeline_dtype=torch.float32)
        model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=1000,
                         max_sequence_length=64, share_embeddings_and_output_weights=True)
        weight = model.shared_embedding_or_output_weight()
        assert weight.head_gives_placeholder and not weight.zero_out_wgrad, "the tied weight was not re-marked"
        if megatrons_own_path:
            weight.zero_out_wgrad, weight.head_gives_placeholder = True, False
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        ddp.zero_grad_buffer()
        g = torch.Generator().manual_seed(1)
        for _ in range(2):  # two micro-batches, tokens repeated within each
            ids = torch.randint(0, 60, (2, 48), generator=g)
            logits = ddp(ids, torch.arange(48).expand(2, 48), None)
            (logits * torch.randn(logits.shape, generator=g)).sum().backward()
        assert weight.grad is None, "DDP's hook did not run for the tied weight"
        assert torch.count_nonzero(weight.main_grad[60:]) > 0, "the output layer's gradient is missing"
        return {name: p.main_grad.clone() for name, p in model.named_parameters()}

    fused, dense = main_grads(False), main_grads(True)
    assert fused.keys() == dense.keys()
    for name in fused:
        assert torch.equal(fused[name], dense[name]), (name, (fused[name] - dense[name]).abs().max())
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op where CUDA is available")
def test_tied_embedding_and_head_on_one_stage_add_into_main_grad_as_megatron_sums_them():
    run_script(TIED_STAGE)


# resources.host_hugepages: the rank's process starts with torch's THP_MEM_ALLOC_ENABLE (Ray's runtime_env);
# where the kernel takes the advice, a fresh 64 MiB block is faulted in 2 MiB at a time.
HOST_HUGEPAGES = textwrap.dedent("""
    import os, resource, tempfile
    import torch
    from megatron_workers.host_malloc import THP_MODE_FILE, check_host_hugepages, hugepages_env

    assert hugepages_env(True) == {"THP_MEM_ALLOC_ENABLE": "1"} and hugepages_env(False) == {}
    assert check_host_hugepages(False) is None
    with tempfile.TemporaryDirectory() as d:
        for mode, warned in (("always [madvise] never", False), ("always madvise [never]", True)):
            with open(os.path.join(d, "enabled"), "w") as f:
                f.write(mode + "\\n")
            warning = check_host_hugepages(True, os.path.join(d, "enabled"))
            assert (warning is not None) == warned, (mode, warning)
        assert "resources.host_hugepages=true" in warning and "[never]" in warning
        assert "cannot be read" in check_host_hugepages(True, os.path.join(d, "missing"))
    if check_host_hugepages(True) is None:  # this kernel takes the advice
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(64 << 18).sum()  # 64 MiB
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < (64 << 20) // resource.getpagesize() // 20, faults
    del os.environ["THP_MEM_ALLOC_ENABLE"]
    try:
        check_host_hugepages(True)
    except RuntimeError as e:
        assert "started without THP_MEM_ALLOC_ENABLE=1" in str(e)
    else:
        raise AssertionError("a process without the advice was accepted")
    print("ok")
""")


def test_host_hugepages_advice_is_checked_in_the_rank():
    run_script(HOST_HUGEPAGES, THP_MEM_ALLOC_ENABLE="1")
