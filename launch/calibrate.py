"""``rlx plan --suggest --calibrate``: the cpu profile's cost-model constants, measured on this machine.

Two gloo processes of one thread each (as the workers run on a box with fewer cores than processes)
measure:
- ``matmul_flops``: a plain fp32 torch matmul's FLOP/s on one thread, at a micro-batch's shape
  ([tokens, hidden] x [hidden, ffn] of the job's model);
- ``microbatch_s`` and ``layer_s`` (``microbatch_forward_s``, ``layer_forward_s``): what one more
  micro-batch costs megatron's own 1F1B schedule per stage and per layer (forward and backward, or
  forward only; the loss hook, the PP=2 point-to-point exchange, kernel launches, autograd) beyond its
  arithmetic, from hidden-32 GPTModels of 1 and 3 layers per stage run with 1 and with 9
  micro-batches of 8 tokens;
- ``softmax_s_per_element``: a log-softmax and entropy pass over fp32 rows, per element (the LM
  head's over the vocabulary, the unfused attention's over [heads, s, s]);
- ``allreduce_s`` and ``allreduce_bytes_s``: a gloo all-reduce's latency and bandwidth (TP's four
  per layer per micro-batch, DP's gradient all-reduce);
- ``adam_s_per_param``: torch's fused AdamW step per fp32 parameter on one thread, the kernel the
  workers' optimizer runs on the cpu profile (each rank steps its own stage's parameters, all of them
  under DP);
- ``matmul_thread_gain`` and ``softmax_thread_gain``: what each thread past the first adds to a
  layer's matmuls at the micro-batch's shape and to the softmax pass above, as a fraction of one
  thread's rate, measured on all the machine's cores in one process after the two ranks have exited
  (a job with fewer ranks than cores gives each rank several math threads: ``launch/compose.py``
  ``job_threads``).
The cost model reads nothing else; the constants stored in ``launch/plan.py`` came from this command,
but the two thread gains (its micro-benchmarks read more than a whole update gains: the comment there).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
from typing import Optional


def _best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (the least disturbed by other processes on the cores)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _softmax_pass(logits):
    """A log-softmax and its entropy over fp32 rows: an elementwise pass bound by memory."""
    logp = logits.log_softmax(-1)
    return (logp.exp() * logp).sum(-1)


def _rank(rank: int, port: int, model_dirs: list[str], tokens: int, hidden: int, ffn: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron_workers.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_workers.model import build_gpt_model, read_hf_config, transformer_config

    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {}
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, ffn)
    torch.mm(a, b)
    out["matmul_flops"] = 2 * tokens * hidden * ffn / _best(lambda: torch.mm(a, b), 5)

    # The LM head's log-softmax and entropy over the vocabulary, and the unfused attention softmax:
    # elementwise passes over fp32 rows, bound by memory, not by the matmul rate.
    logits = torch.randn(tokens, 8192)
    _softmax_pass(logits)
    out["softmax_s_per_element"] = _best(lambda: _softmax_pass(logits), 5) / logits.numel()

    x = torch.randn(tokens, hidden)
    small = torch.zeros(8)
    dist.all_reduce(small)
    lat = _best(lambda: dist.all_reduce(small), 20)
    big = _best(lambda: dist.all_reduce(x), 5)
    out["allreduce_s"] = lat
    out["allreduce_bytes_s"] = x.numel() * 4 / max(big - lat, 1e-9)

    weights = torch.nn.Parameter(torch.randn(1 << 22))
    weights.grad = torch.randn_like(weights)
    adam = torch.optim.AdamW([weights], lr=1e-6, fused=True)  # as megatron_workers/engine.py use_fused_cpu_adam
    adam.step()
    out["adam_s_per_param"] = _best(adam.step, 5) / weights.numel()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    ids = torch.randint(0, 16, (1, 8))
    pos = torch.arange(8).expand_as(ids)

    def per_microbatch(path: str, forward_only: bool) -> float:
        """Seconds one more micro-batch adds to megatron's schedule on the model at ``path``."""
        hf = read_hf_config(path)
        config = transformer_config(hf, "cpu", "float32", 1, 2)
        # Wrapped in megatron's DDP as the workers' trained models are: its gradient buffer is where
        # the linear layers accumulate their weight gradients (the config's gradient_accumulation_fusion).
        model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                        build_gpt_model(hf, config, "cpu"))

        def step(microbatches: int):
            def forward_step(_, m):
                return m(ids, pos, None), lambda out: (out.float().mean(), {})

            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(microbatches)),
                                        model=[model], num_microbatches=microbatches, seq_length=8,
                                        micro_batch_size=1, forward_only=forward_only)

        with torch.set_grad_enabled(not forward_only):
            step(2)
            return (_best(lambda: step(9), 5) - _best(lambda: step(1), 5)) / 8

    # 1 and 3 layers per stage: what a micro-batch costs per stage, and per layer on top (launches,
    # autograd, Python: about what a layer of a small model costs whatever its width).
    for suffix, forward_only in (("", False), ("_forward", True)):
        one, three = per_microbatch(model_dirs[0], forward_only), per_microbatch(model_dirs[1], forward_only)
        out[f"layer{suffix}_s"] = max(three - one, 0.0) / 2
        out[f"microbatch{suffix}_s"] = max(one - out[f"layer{suffix}_s"], 0.0)
    dist.barrier()
    if rank == 0:
        queue.put(out)
    queue.close()
    queue.join_thread()
    os._exit(0)  # skip interpreter teardown: gloo and megatron threads can hold it


def _thread_gains(tokens: int, hidden: int, ffn: int, threads: int) -> dict[str, float]:
    """(one thread's time / ``threads`` threads' - 1) / (``threads`` - 1) for a layer's matmuls and for
    the softmax pass: 1 where each thread adds a whole core's rate, 0 where it adds nothing. The
    matmuls are a layer's linear layers at ``tokens`` positions, forward and both backward products,
    as a transformer layer runs them: at a micro-batch's few hundred rows a second thread gains less
    than on one large square product."""
    import torch

    if threads < 2:  # one core: nothing to measure, and no layout runs a second thread here
        return {"matmul_thread_gain": 0.0, "softmax_thread_gain": 0.0}
    products = []
    for fan_in, fan_out in ((hidden, 3 * hidden), (hidden, hidden), (hidden, 2 * ffn), (ffn, hidden)):
        x, w, dy = torch.randn(tokens, fan_in), torch.randn(fan_out, fan_in), torch.randn(tokens, fan_out)
        products += [(x, w.t()), (dy, w), (dy.t(), x)]  # forward, input gradient, weight gradient

    def layer():
        for a, b in products:
            torch.mm(a, b)

    logits = torch.randn(tokens, 8192)
    before = torch.get_num_threads()
    seconds = {}
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            layer(), _softmax_pass(logits)
            seconds[n] = (_best(layer, 9), _best(lambda: _softmax_pass(logits), 9))
    finally:
        torch.set_num_threads(before)
    # Clipped to [0, 1]: a thread adds at most a core; beyond that the two readings are noise or cache.
    gain = [min(1.0, max(0.0, (one / many - 1) / (threads - 1))) for one, many in zip(seconds[1], seconds[threads])]
    return {"matmul_thread_gain": gain[0], "softmax_thread_gain": gain[1]}


def calibrate(tokens: int, hidden: int, ffn: int, cores: Optional[int] = None) -> dict[str, float]:
    """The constants, measured now (about 20 s on a 2-core machine); ``cores``: the math threads of
    one process on all the machine's cores (default: os.cpu_count())."""
    from launch.assets import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        model_dirs = [make_tiny_model(os.path.join(tmp, f"tiny{n}"), hidden_size=32, num_layers=n, num_heads=2,
                                      num_kv_heads=1, intermediate_size=64) for n in (2, 6)]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, port, model_dirs, tokens, hidden, ffn, queue)) for r in range(2)]
        for p in procs:
            p.start()
        out = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"calibration rank exited with {p.exitcode}")
    return {**out, **_thread_gains(tokens, hidden, ffn, cores or os.cpu_count() or 1)}
