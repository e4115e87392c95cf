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
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op where CUDA is available")
def test_cpu_compat_is_targeted():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
