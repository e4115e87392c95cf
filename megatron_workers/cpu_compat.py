"""Lets megatron-core 0.16.1 run on a CPU-only torch (the cpu profile: gloo, local layer spec, fp32).

megatron-core assumes CUDA in a handful of places that a CPU run reaches. ``apply_cpu_compat()``
patches exactly those, as plain wrappers of torch functions (a TorchFunctionMode would not do: modes
are thread-local and inactive inside ``autograd.Function.backward``, where megatron also allocates).
The device="cuda" factories are replaced only inside the megatron modules that call them.
Every patch of steps 1-6 was shown necessary by turning it off (docs/cpu-profile.md); steps 7-9 are
savings: the CPU's stand-ins for what apex's kernels do on GPU (weight gradients added straight into
DDP's buffer, gradients scaled in place), each equal to megatron's unfused path to the bit. The sites
are line numbers of megatron-core 0.16.1, which setup.py pins.

It is a no-op when CUDA is available: the gpu profile runs megatron-core unpatched.
"""
from __future__ import annotations

import functools
import types

import torch

_CPU = torch.device("cpu")
_applied = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def _cpu_device_factory(fn):
    """``fn(..., device="cuda")`` -> ``fn(..., device="cpu")``; any other call is unchanged."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)

    return wrapper


class _TorchWithCpuFactories(types.ModuleType):
    """``torch`` as a few megatron modules see it: zeros/ones/tensor place device="cuda" on the CPU;
    every other attribute is torch's own."""

    def __init__(self):
        super().__init__("torch")
        for name in ("zeros", "ones", "tensor"):
            setattr(self, name, _cpu_device_factory(getattr(torch, name)))

    def __getattr__(self, name):  # only called for attributes not set above
        return getattr(torch, name)


class _CudaAliasTypeName(str):
    """What ``Tensor.type()`` answers on CPU: 'torch.FloatTensor' that also equals
    'torch.cuda.FloatTensor', so megatron's type checks accept CPU tensors of the same dtype."""

    def __eq__(self, other):
        if isinstance(other, str) and other.startswith("torch.cuda."):
            other = "torch." + other[len("torch.cuda."):]
        return str.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _identity_compile(model=None, **options):
    """torch.compile's signature, compiling nothing: as a decorator it returns the function itself."""
    return (lambda fn: fn) if model is None else model


def import_megatron_without_compile() -> None:
    """Imports megatron-core with torch.compile as the identity while its ``jit_fuser`` is bound
    (megatron/core/jit.py: ``jit_fuser = torch.compile``, which every fusion module decorates with).
    Decorating with the real one imports torch's dynamo and inductor: 3.1 of the 6.2 s a process
    spends importing megatron-core on the 2-core machine. The decorated functions run eagerly, with
    the same math: on the cpu profile only the SwiGLU's (megatron_workers/model.py: masked softmax,
    bias dropout and rope fusions are gpu-only; its RMSNorm is torch's own). Nothing to do
    when megatron-core is already imported."""
    import sys

    if "megatron.core.jit" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _identity_compile
    try:
        import megatron.core.jit  # noqa: F401  (megatron/core/__init__.py imports it first)
    finally:
        torch.compile = compile_


def apply_cpu_compat() -> None:
    """Patches torch for megatron-core on a CPU-only build; idempotent, and a no-op with CUDA."""
    global _applied
    if _applied or torch.cuda.is_available():
        return

    # 0. Before anything imports megatron-core: its fusions imported as plain functions (above).
    import_megatron_without_compile()

    # 1. current_device() must name the CPU: megatron allocates on it in
    #    distributed/param_and_grad_buffer.py:783,800,806 (DDP buffers),
    #    models/common/embeddings/rotary_pos_embedding.py:162 (inv_freq),
    #    utils.py:631 (global memory buffer, from transformer/dot_product_attention.py:189),
    #    pipeline_parallel/p2p_communication.py:190-202,313,321 (PP receive buffers).
    torch.cuda.current_device = lambda: _CPU

    # 2. synchronize() must be a no-op: pipeline_parallel/p2p_communication.py:242,398 call it after
    #    every PP send/receive.
    torch.cuda.synchronize = lambda device=None: None

    # 3. Literal device="cuda" in tensor factories must land on the CPU. Only the megatron modules
    #    that do it see CPU-placing factories (a stand-in for their global `torch`): replacing
    #    torch.tensor itself broke other libraries in the process (torch's `with torch.device(...)`
    #    context keys on the identity of torch.tensor; transformers then built garbage RoPE buffers).
    #    zeros: pipeline_parallel/schedules.py:596,983,2138 (total_num_tokens, every schedule),
    #      distributed/param_and_grad_buffer.py:768, optimizer/clip_grads.py:103,174;
    #    ones: transformer/utils.py:35 (the default causal mask of the local attention);
    #    tensor: optimizer/optimizer.py:473,481,485,907, optimizer/clip_grads.py:90, utils.py:1207.
    import importlib

    torch_with_cpu_factories = _TorchWithCpuFactories()
    for module in ("megatron.core.pipeline_parallel.schedules", "megatron.core.distributed.param_and_grad_buffer",
                   "megatron.core.optimizer.clip_grads", "megatron.core.transformer.utils",
                   "megatron.core.optimizer.optimizer", "megatron.core.utils"):
        mod = importlib.import_module(module)
        if mod.torch is not torch:
            raise RuntimeError(f"{module}.torch is not the torch module: the cpu compat layer targets "
                               f"megatron-core 0.16.1")
        mod.torch = torch_with_cpu_factories

    # 4. Tensor.type() is compared with 'torch.cuda.FloatTensor': optimizer/clip_grads.py:167 (an
    #    assert when clipping gradients), optimizer/distrib_optimizer.py:361,420,582 (a TypeError at
    #    :431 for any parameter that is not a CUDA tensor). Only the no-argument form is changed.
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            return _CudaAliasTypeName(original_type(self))
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type

    # 5. The RNG tracker reads torch.cuda.get_rng_state (tensor_parallel/random.py:235,250) and its
    #    fork() runs in every attention forward. Every weight comes from the HF checkpoint and dropout
    #    is 0, so no random numbers are drawn: megatron's own inference tracker (a no-op fork) is exact.
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    # 6. With tied embeddings and PP > 1 the first and last stages align their embedding copies with
    #    `weight.data = weight.data.cuda()` (models/common/language_module/language_module.py:244).
    #    Tensor.cuda is the identity only while that method runs.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup_embeddings = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(setup_embeddings)
    def setup_embeddings_on_cpu(self):
        tensor_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            setup_embeddings(self)
        finally:
            torch.Tensor.cuda = tensor_cuda
        embedding_and_head_into_main_grad(self)

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_on_cpu

    # 7. Not a necessity but a saving: megatron's gradient accumulation fusion (the config's
    #    gradient_accumulation_fusion, model.py) adds each linear layer's weight gradient straight into
    #    its DDP main_grad (tensor_parallel/layers.py:569) instead of materialising the whole gradient
    #    and adding it in the DDP hook (distributed_data_parallel.py:437). The kernel comes from apex's
    #    CUDA extension (layers.py:46); CpuWgradAccumulation is the same sum, in cache-sized slabs.
    from megatron.core.tensor_parallel import layers

    if not hasattr(layers, "_grad_accum_fusion_available"):
        raise RuntimeError("megatron.core.tensor_parallel.layers has no _grad_accum_fusion_available: the "
                           "cpu compat layer targets megatron-core 0.16.1")
    layers.fused_weight_gradient_mlp_cuda = CpuWgradAccumulation
    layers._grad_accum_fusion_available = True

    # 8. The same for the word embedding: its backward (F.embedding, tensor_parallel/layers.py:287)
    #    makes a dense [vocab / TP, hidden] gradient (113 MB for SmolLM2, fresh pages every
    #    micro-batch) that the DDP hook then adds whole into main_grad, though only the rows of the
    #    micro-batch's tokens are non-zero. EmbeddingIntoMainGrad adds those rows into main_grad.
    if getattr(layers, "F", None) is not torch.nn.functional:
        raise RuntimeError("megatron.core.tensor_parallel.layers.F is not torch.nn.functional: the cpu compat "
                           "layer targets megatron-core 0.16.1")
    layers.F = _FunctionalWithFusedEmbedding()

    # 9. Gradient clipping scales each gradient through megatron's local multi_tensor_scale
    #    (utils.py:1212, `dst.copy_(src * scale)`: a temporary the size of every gradient) when apex
    #    is missing; clip_grads.py passes the same list as source and destination, so the product
    #    goes in place, with the same multiplication.
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_scale

    if clip_grads.multi_tensor_scale_impl is not local_multi_tensor_scale:
        raise RuntimeError("megatron.core.optimizer.clip_grads does not use megatron's local multi_tensor_scale: "
                           "the cpu compat layer targets megatron-core 0.16.1 without apex")
    clip_grads.multi_tensor_scale_impl = multi_tensor_scale_in_place

    # 10. megatron's fused SwiGLU (the config's bias_activation_fusion, model.py) keeps only its input,
    #     linear_fc1's output, for the backward; the unfused activation (mlp.py's glu) keeps silu(gate)
    #     and `up + glu_linear_offset` besides (2 x 3.6 MB per layer for SmolLM2's 620 tokens of a step,
    #     218 MB over its 30 layers). Its backward helper, written for torch.compile, recomputes the
    #     sigmoid twice and runs ~10 elementwise ops eagerly; swiglu_back_as_autograd is the unfused
    #     path's own backward (silu_backward and two products) on the recomputed silu.
    from megatron.core.fusions import fused_bias_swiglu

    if not hasattr(fused_bias_swiglu, "swiglu_back"):
        raise RuntimeError("megatron.core.fusions.fused_bias_swiglu has no swiglu_back: the cpu compat layer "
                           "targets megatron-core 0.16.1")
    fused_bias_swiglu.swiglu_back = swiglu_back_as_autograd
    _applied = True


def swiglu_back_as_autograd(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of ``silu(y_1) * y_2`` (``y_1, y_2 = chunk(y, 2, -1)``) with respect to ``y``, as
    autograd computes it for the unfused activation: ``silu_backward(g * y_2, y_1)`` for the gate,
    ``g * silu(y_1)`` for the up projection, each written into its half of one buffer. Equal to the
    unfused backward to the bit (tests/test_megatron_cpu_compat.py)."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    grad = torch.empty_like(y)
    grad_1, grad_2 = torch.chunk(grad, 2, -1)
    torch.ops.aten.silu_backward.grad_input(g * y_2, y_1, grad_input=grad_1)
    torch.mul(g, torch.nn.functional.silu(y_1), out=grad_2)
    return grad


def multi_tensor_scale_in_place(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """megatron's ``local_multi_tensor_scale`` (``dst = src * scale``) without the temporary when
    ``dst`` is ``src``."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        if dst is src:
            dst.mul_(scale)
        else:
            dst.copy_(src * scale)


class EmbeddingIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds the gradient's rows straight into
    ``weight.main_grad`` (megatron's DDP buffer), as megatron's linear layers do under gradient
    accumulation fusion: the dense backward's per-row sums (each row's gradients added in token
    order onto zero) are formed for the micro-batch's distinct tokens only, then added once each,
    the same arithmetic as the dense gradient added whole. The weight's own gradient is megatron's
    placeholder (``torch.empty``, ``grad_added_to_main_grad`` set), or none where the stage's output
    layer gives it (embedding_and_head_into_main_grad), so DDP's hook adds nothing."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        rows, position = torch.unique(ids.reshape(-1), return_inverse=True)
        sums = grad.new_zeros((rows.numel(), grad.shape[1])).index_add_(0, position, grad)
        weight.main_grad.index_add_(0, rows, sums.to(weight.main_grad.dtype))
        weight.grad_added_to_main_grad = True
        if getattr(weight, "head_gives_placeholder", False):
            # The output layer's placeholder reaches the weight's accumulator, so DDP's hook still runs
            # (megatron's overlapped reduce counts on it); a second one would be summed (113 MB).
            return None, None
        return None, torch.empty(weight.main_grad.shape, dtype=grad.dtype, device=grad.device)


def embedding_and_head_into_main_grad(model) -> None:
    """Where one stage uses the tied embedding as its output layer too (PP=1), megatron marks the weight
    ``zero_out_wgrad`` (language_module.py:201): the output layer's placeholder gradient is then
    ``torch.zeros`` of the weight's shape, autograd sums it with the embedding's dense gradient, and
    DDP's hook adds that sum into main_grad: on the CPU three fresh 113 MB buffers per micro-batch
    for SmolLM2. With gradient accumulation fusion both uses add into main_grad themselves instead
    (the output layer its weight gradient, EmbeddingIntoMainGrad its rows, in that order, as the hook
    did), the output layer's placeholder is left unwritten (``torch.empty``) and the embedding hands
    autograd none (``head_gives_placeholder``), so the hook adds nothing. The same sums in the same
    order: equal to the bit (tests/test_megatron_cpu_compat.py)."""
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return
    weight = model.shared_embedding_or_output_weight()
    if getattr(weight, "zero_out_wgrad", False) and model.config.gradient_accumulation_fusion:
        weight.zero_out_wgrad = False
        weight.head_gives_placeholder = True


def embedding_into_main_grad(input, weight, *args, **kwargs):
    """``F.embedding`` as megatron's VocabParallelEmbedding calls it, through EmbeddingIntoMainGrad
    when the weight trains under megatron's DDP with gradient accumulation fusion. Not for a weight
    megatron marks ``zero_out_wgrad`` (a tied output layer on the same stage that does not add into
    main_grad itself: embedding_and_head_into_main_grad), nor with other options."""
    if (args or kwargs or not torch.is_grad_enabled() or not weight.requires_grad
            or getattr(weight, "main_grad", None) is None or not hasattr(weight, "grad_added_to_main_grad")
            or getattr(weight, "zero_out_wgrad", False)):
        return torch.nn.functional.embedding(input, weight, *args, **kwargs)
    return EmbeddingIntoMainGrad.apply(input, weight)


class _FunctionalWithFusedEmbedding(types.ModuleType):
    """``torch.nn.functional`` as megatron's tensor_parallel/layers.py sees it: ``embedding`` is
    embedding_into_main_grad; every other attribute is torch's own."""

    def __init__(self):
        super().__init__("torch.nn.functional")
        self.embedding = embedding_into_main_grad

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)


class CpuWgradAccumulation:
    """apex's ``fused_weight_gradient_mlp_cuda`` interface on the CPU: ``main_grad += grad_output^T @
    input`` for 2-D ``[tokens, in]`` / ``[tokens, out]`` operands.

    One ``addmm_`` (BLAS beta = 1) would add the product into ``main_grad`` block by block along the
    tokens, a different rounding from the unfused path's ``main_grad.add_(grad_output.t() @ input)``
    once a micro-batch holds more tokens than one of the GEMM's blocks (~190 on the development
    machine). So the product is formed a slab of output rows at a time (every element summed over all
    tokens by the same GEMM) and each slab added once: equal to the unfused path to the bit
    (tests/test_megatron_cpu_compat.py), with a slab (4 MiB, reused by the allocator) in place of the
    whole weight gradient (113 MB for SmolLM2's tied head, fresh pages from the kernel on every
    micro-batch). 4 MiB rather than 1: 1 MiB slabs (455 rows of a 576-wide layer) multiplied at
    0.83-0.92 of the rate of 4 MiB ones on SmolLM2's shapes at two threads, and the update was ~5%
    shorter (docs/cpu-profile.md, "Weight gradients straight into the DDP buffer").
    """

    SLAB_ELEMENTS = 1 << 20  # floats per slab: 4 MiB in fp32

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        rows = max(1, CpuWgradAccumulation.SLAB_ELEMENTS // max(1, main_grad.shape[1]))
        grad_output_t = grad_output.t()
        for start in range(0, main_grad.shape[0], rows):
            main_grad[start:start + rows].add_(grad_output_t[start:start + rows].matmul(total_input))

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        # The cpu profile keeps fp32 main gradients (grad_reduce_in_fp32); a half-precision one means
        # a config this layer was not written for.
        raise RuntimeError(f"gradient accumulation fusion on the cpu profile takes fp32 main gradients, "
                           f"got {main_grad.dtype}")
