"""End-to-end step benchmark: runs N training steps of a job spec in this process (``rlcore.trainer``,
the real Ray + Megatron + vLLM stack) and prints, as a markdown table, the median time of each phase,
the overlap (step time / sum of the phases), the generation and training throughput, the update's
FLOP rate against a plain torch matmul loop measured in the same run, and the peak memory of every
role's processes.

    .venv/bin/python -m bench.e2e_step yaml_configs/quickstart_cpu.yaml --steps 6 --warmup 1
    .venv/bin/python -m bench.e2e_step yaml_configs/smollm2_math_cpu.yaml --steps 4 [key.sub=value ...]

Phases are the loop's own ``timing/*_s`` metrics; "other" is the rest of the step (building the
batch, metrics). "step / sum of phases" is each step's total over the sum of its timed phases
(median over the steps): 1.0 for a strictly sequential loop, below 1 when phases overlap.
Throughput counts tokens over the measured steps: generated = response tokens / rollout time,
trained = prompt+response tokens of the update's batches / update time.

The update's model FLOPs are counted per row the model runs (with ``actor.shared_prompt`` one row per
prompt: the prompt once, then its responses), not per row of the batch: for each of the row's
real (prompt+response) tokens the layers' matmuls (2 x their weights), the attention scores and
values over the tokens before it, and the output layer (2 x hidden x vocabulary) on the positions
whose log-prob enters the loss (one per response token); x3 for forward + backward. The reference
is a square matmul loop (~2 s each) on the job's device, measured in the same process (cpu: fp32
2048 x 2048 on 1 thread and on every core, once before the roles start and once after they stop, the
higher of the two kept, so that a neighbour's load during one of them does not lower the machine's
limit and flatter the update; gpu: the job's dtype, 8192 x 8192, on GPU 0 after the roles stop);
"update / matmul" is the update's rate over the matmul's (the cpu profile's: over the all-core
matmul), i.e. its MFU against a measured peak.

The first ``--warmup`` steps are run and left out (first-call costs: lazy imports, allocator growth).
Validation is off; the run writes its metrics to ``<trainer.run_dir>-bench``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from bench.memory import PeakTreePss

# The table's phases in loop order: (metric key, label). Timers the loop reports beyond these (the
# critic's, a baseline rollout's) get rows of their own, named by their key.
PHASES = (("timing/rollout_s", "rollout (vLLM generate)"), ("timing/reward_s", "reward"),
          ("timing/logprob_s", "log-probs (old, ref)"), ("timing/values_s", "values (critic forward)"),
          ("timing/advantages_s", "advantages"), ("timing/critic_update_s", "critic update"),
          ("timing/update_s", "update (fwd+bwd+optim)"), ("timing/weight_sync_s", "weight sync"))
TOTAL = "timing/step_s"
SYNC_KEYS = ("weight_sync/load_s", "weight_sync/recv_wait_s", "weight_sync/pack_s", "weight_sync/send_wait_s",
             "weight_sync/recv_page_faults")


def update_flops_per_row(hf, tokens: int, scored: int) -> float:
    """Model FLOPs of one training row (forward + backward = 3 x forward) with ``tokens`` real tokens
    of which ``scored`` positions feed the loss through the output layer. ``hf``: HFModelSpec."""
    h, q, kv = hf.hidden_size, hf.num_attention_heads * hf.head_dim, hf.num_kv_heads * hf.head_dim
    layer_weights = h * q + 2 * h * kv + q * h + 3 * h * hf.ffn_hidden_size  # qkv, out, SwiGLU
    # Token i (0-based) attends to i + 1 positions: scores and weighted values, 2 FLOPs per MAC each.
    attention = 4 * q * tokens * (tokens + 1) // 2
    forward = hf.num_layers * (2 * layer_weights * tokens + attention) + 2 * h * hf.vocab_size * scored
    return 3.0 * forward


def executed_rows(batch, shared_prompt: bool) -> list[tuple[int, int]]:
    """(tokens, scored positions) of each row the model runs for ``batch``: its own rows, or with
    ``shared_prompt`` one row per prompt (the prompt once, then every response; packing.py)."""
    tokens = batch["attention_mask"].sum(dim=1).tolist()
    scored = batch["response_mask"].sum(dim=1).tolist()
    if not shared_prompt:
        return [(int(t), int(s)) for t, s in zip(tokens, scored)]
    from megatron_workers.packing import prompt_groups

    rows = []
    for group in prompt_groups(batch):
        prompt = int(tokens[group[0]] - scored[group[0]])
        rows.append((prompt + int(sum(scored[r] for r in group)), int(sum(scored[r] for r in group))))
    return rows


def model_params(hf) -> int:
    """All weights (embedding and output layer once each, twice when untied; norms and biases left out)."""
    h, q, kv = hf.hidden_size, hf.num_attention_heads * hf.head_dim, hf.num_kv_heads * hf.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * hf.ffn_hidden_size
    return hf.num_layers * layer + hf.vocab_size * h * (1 if hf.tie_word_embeddings else 2)


def matmul_rate(threads: int | None = None, device: str = "cpu", dtype: str = "float32", size: int = 2048,
                seconds: float = 2.0) -> float:
    """FLOP/s of a ``size`` x ``size`` torch matmul loop run for about ``seconds`` (cpu: on
    ``threads`` threads)."""
    import torch

    dt = getattr(torch, dtype)
    previous = torch.get_num_threads()
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=dt, device=device)
        b = torch.randn(size, size, dtype=dt, device=device)
        c = torch.empty(size, size, dtype=dt, device=device)
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        torch.mm(a, b, out=c)  # first-call costs (kernel selection, thread pool start)
        sync()
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(1 if device == "cpu" else 20):
                torch.mm(a, b, out=c)
                count += 1
            sync()
        return 2.0 * size ** 3 * count / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)


def measure_matmuls(device: str, dtype: str) -> list[dict]:
    """The reference rates of this run: cpu: fp32 on 1 thread and on every core; gpu: ``dtype``."""
    if device == "gpu":
        return [{"label": f"{dtype} matmul 8192 x 8192, 1 GPU", "threads": None,
                 "flops": matmul_rate(device="cuda", dtype=dtype, size=8192)}]
    cores = os.cpu_count() or 1
    return [{"label": f"fp32 matmul 2048 x 2048, {t} thread{'s' if t > 1 else ''}", "threads": t,
             "flops": matmul_rate(t)} for t in sorted({1, cores})]


def higher_of(before: list[dict], after: list[dict]) -> list[dict]:
    """Each reference of ``before`` with the higher of its two rates (the machine's limit: a
    transiently loaded machine only reads lower) and both readings, for the table."""
    merged = []
    for b, a in zip(before, after, strict=True):
        if b["label"] != a["label"]:
            raise ValueError(f"matmul references differ: {b['label']!r} and {a['label']!r}")
        merged.append({**b, "flops": max(b["flops"], a["flops"]), "readings": (b["flops"], a["flops"])})
    return merged


class TokenCounter:
    """Wraps the trainer's rollout ``generate`` and actor ``update`` to count the tokens each step
    generates and trains on, and the update's model FLOPs (the loop itself does not report them)."""

    def __init__(self, trainer, hf=None):
        self.generated = self.trained = 0
        self.flops = 0.0
        generate, update = trainer.rollout.generate, trainer.actor.update
        shared_prompt = trainer.cfg.actor.shared_prompt

        def counted_generate(*args, **kwargs):
            trajs = generate(*args, **kwargs)
            self.generated += sum(len(t.response_ids) for t in trajs)
            return trajs

        def counted_update(batch, *args, **kwargs):
            self.trained += int(batch["attention_mask"].sum())
            if hf is not None:
                self.flops += sum(update_flops_per_row(hf, t, s) for t, s in executed_rows(batch, shared_prompt))
            return update(batch, *args, **kwargs)

        trainer.rollout.generate, trainer.actor.update = counted_generate, counted_update

    def take(self) -> tuple[int, int, float]:
        out = (self.generated, self.trained, self.flops)
        self.generated = self.trained = 0
        self.flops = 0.0
        return out


def run_bench(spec: str, overrides: list[str], steps: int, warmup: int, validate_around: bool = False,
              matmul: bool = True, run_dir_suffix: str = "-bench", sample_pss: bool = True) -> dict:
    """Builds the job's trainer here and runs ``warmup + steps`` steps. ``validate_around``: the
    greedy validation accuracy before the first and after the last step (``val_before``/``val_after``).
    ``matmul``: measure the reference matmul rates too. ``sample_pss``: sample the tree's summed PSS
    while the steps run (every 0.5 s it reads every /proc/PID/stat and the tree's smaps_rollup, which
    took 15-37% of a core from the timed phases on the 2-core box); off: ``peak_pss_mb`` is None."""
    import ray

    from launch.compose import build_trainer
    from rlcore.hf_config import read_hf_config
    from rlcore.job import load_job
    from rlcore.validate import validate

    cfg = load_job(spec, overrides)
    cfg.trainer.val_every = 0
    cfg.trainer.run_dir = cfg.trainer.run_dir.rstrip("/") + run_dir_suffix
    layout = validate(cfg)
    hf = read_hf_config(cfg.model.path, cfg.model.hf_config)
    matmuls = measure_matmuls("cpu", "float32") if matmul and layout.device == "cpu" else []
    t0 = time.perf_counter()
    pss = PeakTreePss().__enter__() if sample_pss else None  # this process and every one it starts, counted once
    trainer = build_trainer(cfg, layout)
    startup_s = time.perf_counter() - t0
    val = {}
    try:
        counter = TokenCounter(trainer, hf)
        if validate_around:
            val["val_before"] = trainer.validate()["val/reward_mean"]
        measured = []
        for step in range(1, warmup + steps + 1):
            metrics = trainer.train_step(step)
            generated, trained, flops = counter.take()
            print(f"bench step {step}{' (warm-up)' if step <= warmup else ''}: "
                  f"{metrics[TOTAL]:.2f} s, reward {metrics.get('reward/mean', float('nan')):.3f}, "
                  f"logprob_diff_max {metrics.get('rollout/logprob_diff_max', float('nan')):.2g}",
                  file=sys.stderr, flush=True)
            if step > warmup:
                measured.append((metrics, generated, trained, flops))
        if validate_around:
            val["val_after"] = trainer.validate()["val/reward_mean"]
            val["val_questions"] = len(trainer.val_set)
        memory = {"driver": [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]}
        memory["actor"] = trainer.actor.peak_memory_mb()
        if trainer.reference is not None and layout.reference.host is None:  # else in the actor's processes
            memory["reference"] = trainer.reference.peak_memory_mb()
        if trainer.critic is not None:
            memory["critic"] = trainer.critic.peak_memory_mb()
        memory["rollout"] = trainer.rollout.peak_memory_mb()
    finally:
        if pss is not None:
            pss.__exit__(None, None, None)
        trainer.shutdown()
        ray.shutdown()
    if matmul and layout.device == "gpu":  # the GPU is free again
        matmuls = measure_matmuls("gpu", layout.dtype)
    elif matmuls:  # the cores are free again: the same loops, the higher reading kept
        matmuls = higher_of(matmuls, measure_matmuls("cpu", "float32"))
    return dict(spec=spec, overrides=overrides, layout=layout, cfg=cfg, startup_s=startup_s,
                warmup=warmup, measured=measured, memory=memory, matmuls=matmuls,
                peak_pss_mb=pss.mb if pss is not None else None,
                params=model_params(hf), **val)


def phase_keys(measured: list) -> list[tuple[str, str]]:
    """(key, label) of every timed phase present in all measured steps, in loop order."""
    known = dict(PHASES)
    keys = [k for k in known if all(k in m[0] for m in measured)]
    extra = sorted({k for m in measured for k in m[0] if k.startswith("timing/") and k != TOTAL} - set(known))
    keys += [k for k in extra if all(k in m[0] for m in measured)]
    return [(k, known.get(k, k[len("timing/"):-len("_s")])) for k in keys]


def overlap(measured: list) -> float:
    """Median over the steps of step time / the sum of its timed phases."""
    phases = phase_keys(measured)
    return statistics.median(m[TOTAL] / sum(m[k] for k, _ in phases) for m, *_ in measured)


def logprob_gap_line(measured: list) -> str | None:
    """The largest engine/trainer log-prob gap of the measured steps. Synchronous, it is numerics alone
    (~1e-5 in fp32); with trainer.off_policy_steps the trajectories were sampled by older weights, so it
    also holds the policy's change since then, and the line says so rather than look like a mismatch."""
    diffs = [m["rollout/logprob_diff_max"] for m, *_ in measured if "rollout/logprob_diff_max" in m]
    if not diffs:
        return None
    lag = max(m.get("rollout/staleness_max", 0.0) for m, *_ in measured)
    why = (f" (trajectories up to {lag:.0f} weight version(s) old: the gap includes the policy's own change "
           f"since they were sampled, which actor.loss.rollout_correction is for)" if lag > 0 else "")
    return f"Largest engine/trainer log-prob gap over the measured steps: {max(diffs):.2g}{why}."


def render(result: dict) -> str:
    measured, cfg = result["measured"], result["cfg"]
    phases = phase_keys(measured)
    median = {key: statistics.median(m[key] for m, *_ in measured) for key, _ in phases}
    # "other" per step, then its median: medians of parts do not add up to the median of a sum.
    median["other"] = statistics.median(m[TOTAL] - sum(m[k] for k, _ in phases) for m, *_ in measured)
    other = "other" if median["other"] >= 0 else "other (below 0: phases overlapped, trainer.off_policy_steps)"
    rows = [(label, median[key]) for key, label in phases] + [(other, median["other"])]
    total = statistics.median(m[TOTAL] for m, *_ in measured)
    parts = sum(max(value, 0.0) for _, value in rows)  # shares are of the summed medians
    slowest = max(rows, key=lambda r: r[1])
    lay = result["layout"]
    lines = [
        f"`{result['spec']}`{' ' + ' '.join(result['overrides']) if result['overrides'] else ''}: "
        f"{cfg.data.batch_size} prompts x {cfg.rollout.n} samples, <= {cfg.rollout.max_response_length} "
        f"new tokens; actor TP{lay.actor.tp} PP{lay.actor.pp} DP{lay.actor.dp}"
        f"{'' if lay.reference is None else ' + reference'}, {lay.rollout.engines} vLLM engine(s); "
        f"{lay.device} profile, {lay.dtype}; "
        f"median of {len(measured)} steps after {result['warmup']} warm-up step(s) "
        f"(start-up {result['startup_s']:.0f} s, not counted)",
        "",
        "| phase | median s | share |",
        "|---|---:|---:|",
    ]
    lines += [f"| {label} | {value:.2f} | {100 * value / parts:.0f}% |" for label, value in rows]
    lines.append(f"| **step total** (median of the totals) | **{total:.2f}** | |")
    lines.append(f"| step / sum of phases (median over steps; 1.0 = no overlap) | {overlap(measured):.2f} | |")
    sync = {key: statistics.median(m[key] for m, *_ in measured) for key in SYNC_KEYS
            if all(key in m for m, *_ in measured)}
    if len(sync) == len(SYNC_KEYS):
        lines += ["", f"Weight sync (medians; rlcore.weight_sync.sync_metrics): engine load "
                      f"{sync['weight_sync/load_s']:.2f} s, waiting for arrivals {sync['weight_sync/recv_wait_s']:.2f} s; "
                      f"slowest sender packing {sync['weight_sync/pack_s']:.2f} s, waiting {sync['weight_sync/send_wait_s']:.2f} s; "
                      f"{sync['weight_sync/recv_page_faults']:,.0f} minor page faults in the engines' processes per sync."]
    gen = sum(g for _, g, _, _ in measured) / sum(m["timing/rollout_s"] for m, *_ in measured)
    update_s = sum(m["timing/update_s"] for m, *_ in measured)
    trained = sum(t for _, _, t, _ in measured) / update_s
    lines += ["", "| throughput | tokens/s |", "|---|---:|",
              f"| generated (response tokens / rollout time) | {gen:.0f} |",
              f"| trained (prompt+response tokens / update time) | {trained:.0f} |"]
    flops = sum(f for *_, f in measured)
    if flops and result.get("matmuls"):
        rate = flops / update_s
        unit, scale = ("TFLOP/s", 1e12) if lay.device == "gpu" else ("GFLOP/s", 1e9)
        ref = result["matmuls"][-1]
        lines += ["", f"| update FLOP rate (model FLOPs counted per row; {result['params'] / 1e6:.1f}M weights) "
                      f"| {unit} | update / this |", "|---|---:|---:|",
                  f"| update: {flops / len(measured) / scale:.1f} {unit[:-2]} per step / {update_s / len(measured):.2f} s "
                  f"(means over the steps) | {rate / scale:.1f} | |"]
        lines += [f"| {m['label']} (same run{reading_note(m, scale)}) | {m['flops'] / scale:.1f} | "
                  f"{rate / m['flops']:.2f} |" for m in result["matmuls"]]
        lines.append(f"| **update / {ref['label']}** ({'MFU' if lay.device == 'gpu' else 'the cores'}) "
                     f"| | **{rate / ref['flops']:.2f}** |")
    lines += ["", "| role | processes | peak RSS per process, MiB |", "|---|---:|---|"]
    for role, values in result["memory"].items():
        lines.append(f"| {role} | {len(values)} | {', '.join(f'{v:.0f}' for v in values)} |")
    lines.append(f"| **all** | {sum(len(v) for v in result['memory'].values())} | "
                 f"**{sum(map(sum, result['memory'].values())):.0f}** |")
    if result["peak_pss_mb"] is not None:
        lines.append(f"| **counted once** (peak summed PSS of this process's tree: the roles and Ray's own "
                     f"processes; shared pages once) | | **{result['peak_pss_mb']:.0f}** |")
    gap = logprob_gap_line(measured)
    if gap:
        lines += ["", gap]
    lines.append(f"Slowest phase: {slowest[0]} ({100 * slowest[1] / parts:.0f}% of a step).")
    return "\n".join(lines)


def reading_note(matmul: dict, scale: float) -> str:
    """', the higher of X before and Y after the job' where the reference was read twice."""
    if "readings" not in matmul:
        return ""
    before, after = (r / scale for r in matmul["readings"])
    return f"; the higher of {before:.1f} before and {after:.1f} after the job"


def write_raw(result: dict, path: str) -> None:
    """The raw per-step figures, so a table can be re-rendered or compared later."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"spec": result["spec"], "overrides": result["overrides"], "startup_s": result["startup_s"],
                   "memory_mb": result["memory"], "peak_pss_mb": result["peak_pss_mb"], "matmuls": result["matmuls"],
                   "params": result["params"],
                   **{k: result[k] for k in ("val_before", "val_after", "val_questions") if k in result},
                   "steps": [{"metrics": m, "generated_tokens": g, "trained_tokens": t, "update_flops": fl}
                             for m, g, t, fl in result["measured"]]},
                  f, indent=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not measured (default 1)")
    p.add_argument("--no-matmul", action="store_true", help="skip the reference matmul loops (~2 s each)")
    p.add_argument("--no-pss", action="store_true",
                   help="do not sample the summed PSS while the steps run (the sampler takes CPU from the timed phases)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        p.error(f"--steps={a.steps} must be >= 1 and --warmup={a.warmup} >= 0")
    if not os.path.isfile(a.spec):
        p.error(f"job spec {a.spec!r} not found")
    result = run_bench(a.spec, a.overrides, a.steps, a.warmup, matmul=not a.no_matmul, sample_pss=not a.no_pss)
    raw = os.path.join(result["cfg"].trainer.run_dir, "bench.json")
    write_raw(result, raw)
    print(render(result))
    print(f"(per-step figures: {raw})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
