"""Shared-prompt rows (``actor.shared_prompt``) on the gpu profile: the same numbers as the plain rows,
and what the masked attention costs. Needs one NVIDIA GPU and the gpu stack (bench/gpu_check.sh runs
it after building the assets):

    .venv-gpu/bin/python -m bench.gpu_shared_prompt [--model .cache/smollm2-135m-instruct]

1. **Same numbers.** A batch shaped like the SmolLM2 job's (4 training questions of
   .cache/math-arith in the model's chat template, ~43 tokens, 8 responses each of 8-16 tokens)
   runs through one actor group (TP1 PP1, the gpu profile: TransformerEngine's layer spec) with its
   plain rows (TE's fused causal attention, fused RoPE) and with shared-prompt rows (one row per
   prompt with its explicit mask: TE's unfused attention, megatron's unfused RoPE): the forward's
   log-probs, then one update from the same weights against them (its loss, with an entropy term,
   and its gradient norm). In float32 and in bfloat16. Tolerances:
   - float32: log-probs within 5e-3 (max over the response tokens), loss and grad norm within 1e-3
     relative. Not 1e-5 as on the cpu profile: TE runs float32 GEMMs in TF32
     (CUBLAS_COMPUTE_32F_FAST_TF32), whose 10-bit mantissa rounds differently once the two
     paths' summation orders differ.
   - bfloat16: against the float32 plain run as the reference, the shared rows' error must stay
     within 4x the plain rows' error + 0.05 on the log-probs' max, 2x + 0.01 on their mean (over
     the response tokens), and 4x + 2e-2 relative on the loss and the grad norm. The margin: TE's
     unfused attention rounds the scores to bf16 before its softmax (the fused kernels keep them in
     fp32), and megatron's unfused RoPE multiplies by bf16 cos/sin (TE's fused one in fp32). A wrong
     mask or wrong positions give errors of whole nats, far outside either bound; the float32 check
     is the sharp one.
2. **What it costs.** TE's ``DotProductAttention`` alone (forward + backward, median of 20 after 3
   warm-ups) at SmolLM2-135M's heads (9 query, 3 key-value, head dim 64) in bfloat16, for the job's
   shape and longer ones: the plain rows (n rows of prompt + response, causal: TE's fused backend),
   the packed row (prompt + n responses, one row, its arbitrary mask: TE's unfused backend, the
   [1, 1, L, L] mask built by megatron_workers/packing.py), and the packed row under the causal mask
   on the fused backend (the wrong mask: only what a fused kernel would take at that length). The
   backend each used is read back from TE; the memory column is the peak above the inputs.

Prints one table per part and exits 1 when a part-1 tolerance is broken. Never in CI.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

DEFAULT_MODEL = ".cache/smollm2-135m-instruct"
DEFAULT_DATA = ".cache/math-arith/train.parquet"
# (prompt tokens, response tokens, responses per prompt) of the timing table: the SmolLM2 job's, then longer
ATTENTION_SHAPES = ((43, 16, 8), (256, 128, 8), (512, 512, 8), (1024, 2048, 8))
RESPONSE_TEXTS = ("The answer is {a}.", "{q} The result is {a}.", "Let me work it out step by step: {a}.",
                  "It is {a}, because {q}", "{a}", "So {q} gives {a}, the final number.")


# ------------------------------------------------------------------------------- 1. same numbers
def job_batch(model: str, data: str, prompts: int = 4, n: int = 8, seed: int = 0):
    """The SmolLM2 job's shape: the first ``prompts`` questions of ``data`` in the model's chat
    template, ``n`` responses each (text about the answer, 8-16 tokens), as rlcore.batch.build_batch
    makes the rows; advantages random, token-mean loss weights."""
    import pyarrow.parquet as pq
    import transformers

    from rlcore.algos import loss_weights
    from rlcore.batch import Trajectory, build_batch
    from rlcore.data import chat_ids

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    rows = pq.read_table(data).to_pylist()[:prompts]
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for p, row in enumerate(rows):
        prompt = chat_ids(tokenizer, row["prompt"])
        q, a = row["extra_info"]["question"], row["reward_model"]["ground_truth"]
        for i in range(n):
            text = RESPONSE_TEXTS[(p + i) % len(RESPONSE_TEXTS)].format(q=q, a=a) + " " + q
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            length = int(torch.randint(8, 17, (), generator=g))
            ids = (ids * 4)[:length] + [tokenizer.eos_token_id]
            trajs.append(Trajectory(p, prompt, ids, [0.0] * len(ids), "stop", 0))
    batch = build_batch(trajs, pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["loss_weights"] = loss_weights(mask, "token-mean", mask.shape[1])
    return batch


def run_group(model: str, placement, batch, dtype: str, shared: bool, forwards: int = 3) -> dict:
    """One actor group on the gpu profile: log-probs, the median time of ``forwards`` forward calls,
    and one update (loss, grad norm) from the loaded weights."""
    import time

    from megatron_workers.group import MegatronGroup
    from rlcore.algos import LossConfig
    from rlcore.batch import Batch
    from rlcore.config import OptimConfig
    from rlcore.roles import RoleSpec

    spec = RoleSpec("actor", model, tp=1, pp=1, dp=1, micro_batch_size=8, profile="gpu", dtype=dtype, seed=0,
                    optim=OptimConfig(lr=1e-5, clip_grad=1.0), shared_prompt=shared)
    group = MegatronGroup(spec, placement)
    try:
        batch = Batch(batch)
        logprobs = group.forward(batch)["logprobs"]
        times = []
        for _ in range(forwards):
            t0 = time.perf_counter()
            group.forward(batch)
            times.append(time.perf_counter() - t0)
        batch["old_logprobs"] = logprobs
        # The entropy term makes the loss depend on every scored position's whole distribution (at
        # ratio 1 the policy term alone is the advantages' mean, the same for any model).
        metrics = dict(group.update(batch, LossConfig(entropy_coeff=0.01, kl_coeff=0.0)))
        return {"logprobs": logprobs.float(), "loss": metrics["actor/loss"], "grad_norm": metrics["actor/grad_norm"],
                "forward_s": statistics.median(times)}
    finally:
        group.shutdown()


def _errors(got: dict, ref: dict, mask: torch.Tensor) -> dict:
    diff = (got["logprobs"] - ref["logprobs"]).abs()[mask]
    return {"lp_max": float(diff.max()), "lp_mean": float(diff.mean()),
            "loss_rel": abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12),
            "gn_rel": abs(got["grad_norm"] - ref["grad_norm"]) / max(abs(ref["grad_norm"]), 1e-12)}


def same_numbers(model: str, data: str) -> bool:
    from rlcore.placement import ResourcePools, start_ray

    batch = job_batch(model, data)
    mask = batch["response_mask"].bool()
    start_ray("gpu", total_gpus=1)
    placement = ResourcePools({"actor": 1}, {"actor": "actor"}).placement("actor")
    runs = {(dtype, shared): run_group(model, placement, batch, dtype, shared)
            for dtype in ("float32", "bfloat16") for shared in (False, True)}
    ref = runs[("float32", False)]
    err = {key: _errors(run, ref, mask) for key, run in runs.items()}
    checks = []
    fp32 = err[("float32", True)]
    checks.append(("float32 shared vs plain: log-prob max", fp32["lp_max"], 5e-3))
    checks.append(("float32 shared vs plain: loss rel", fp32["loss_rel"], 1e-3))
    checks.append(("float32 shared vs plain: grad norm rel", fp32["gn_rel"], 1e-3))
    plain, shared = err[("bfloat16", False)], err[("bfloat16", True)]
    checks.append(("bfloat16 shared vs float32: log-prob max", shared["lp_max"], 4 * plain["lp_max"] + 0.05))
    checks.append(("bfloat16 shared vs float32: log-prob mean", shared["lp_mean"], 2 * plain["lp_mean"] + 0.01))
    checks.append(("bfloat16 shared vs float32: loss rel", shared["loss_rel"], 4 * plain["loss_rel"] + 2e-2))
    checks.append(("bfloat16 shared vs float32: grad norm rel", shared["gn_rel"], 4 * plain["gn_rel"] + 2e-2))

    rows, seqs = batch["input_ids"].shape
    print(f"\n### Shared-prompt rows vs plain rows on the gpu profile ({model}: {rows} rows x {seqs} tokens, "
          f"{int(mask.sum())} response tokens)\n")
    print("| dtype | rows | loss | grad norm | forward (s) | log-prob err max / mean (vs fp32 plain) |")
    print("|---|---|---|---|---|---|")
    for (dtype, sh), run in runs.items():
        e = err[(dtype, sh)]
        print(f"| {dtype} | {'shared' if sh else 'plain'} | {run['loss']:.6f} | {run['grad_norm']:.6f} | "
              f"{run['forward_s']:.3f} | {e['lp_max']:.2e} / {e['lp_mean']:.2e} |")
    print("\n| check | value | tolerance | |")
    print("|---|---|---|---|")
    ok = True
    for name, value, tol in checks:
        passed = value <= tol
        ok &= passed
        print(f"| {name} | {value:.2e} | {tol:.2e} | {'ok' if passed else 'FAILED'} |")
    import ray

    ray.shutdown()
    return ok


# ------------------------------------------------------------------------------ 2. what it costs
def _backend_used() -> str:
    """The backend TE's DotProductAttention picked on its last call."""
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

    b = dpa._attention_backends
    if b["use_flash_attention"]:
        return "flash"
    if b["use_fused_attention"]:
        return f"fused (cuDNN {getattr(b['fused_attention_backend'], 'name', b['fused_attention_backend'])})"
    return "unfused" if b["use_unfused_attention"] else "none"


def packed_mask(prompt: int, response: int, n: int, device: str) -> torch.Tensor:
    """The [1, 1, L, L] mask of one shared-prompt row, as packing.py builds it for the engine."""
    from megatron_workers.packing import shared_prompt_inputs
    from rlcore.batch import Trajectory, build_batch

    trajs = [Trajectory(0, [5] * prompt, [7] * response, [0.0] * response, "stop", 0) for _ in range(n)]
    inputs = shared_prompt_inputs(build_batch(trajs, pad_id=0))
    return inputs.attention_mask.to(device)


def time_attention(seq: int, rows: int, mask_type: str, mask, heads=9, kv_heads=3, head_dim=64,
                   iters: int = 20) -> tuple[float, float, str]:
    """(median ms of forward + backward, peak MiB above the inputs, backend) of TE's attention on
    ``rows`` rows of ``seq`` tokens (sbhd, bfloat16)."""
    import transformer_engine.pytorch as te

    attention = te.DotProductAttention(heads, head_dim, num_gqa_groups=kv_heads, attention_dropout=0.0,
                                       attn_mask_type=mask_type, qkv_format="sbhd")
    kw = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(seq, rows, heads, head_dim, **kw)
    k, v = (torch.randn(seq, rows, kv_heads, head_dim, **kw) for _ in range(2))
    grad = torch.randn(seq, rows, heads * head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        attention(q, k, v, attention_mask=mask, attn_mask_type=mask_type).backward(grad)

    for _ in range(3):
        step()
    backend = _backend_used()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return statistics.median(times), peak, backend


def attention_costs() -> None:
    print("\n### TE attention, forward + backward (bfloat16, 9 heads / 3 KV heads / 64; median of 20)\n")
    print("| prompt, response, n | rows x tokens | mask | backend | ms | peak MiB |")
    print("|---|---|---|---|---|---|")
    for prompt, response, n in ATTENTION_SHAPES:
        packed = prompt + n * response
        cases = (("plain rows, causal", prompt + response, n, "causal", None),
                 ("packed row, arbitrary", packed, 1, "arbitrary", "packed"),
                 ("packed row, causal (wrong mask: time only)", packed, 1, "causal", None))
        for label, seq, rows, mask_type, mask in cases:
            try:
                m = packed_mask(prompt, response, n, "cuda") if mask == "packed" else None
                ms, peak, backend = time_attention(seq, rows, mask_type, m)
                cells = f"{backend} | {ms:.3f} | {peak:.0f}"
            except torch.OutOfMemoryError:
                cells = "- | out of memory | -"
            finally:
                torch.cuda.empty_cache()
            print(f"| {prompt}, {response}, {n} | {rows} x {seq} | {label} | {cells} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--data", default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_shared_prompt needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    for path in (os.path.join(args.model, "config.json"), args.data):
        if not os.path.exists(path):
            print(f"{path} not found: build the assets first (python -m launch.assets.smollm2; "
                  "python -m launch.assets.math_data)", file=sys.stderr)
            return 2
    ok = same_numbers(args.model, args.data)
    attention_costs()
    if not ok:
        print("\nshared-prompt rows broke a tolerance above (FAILED rows)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
