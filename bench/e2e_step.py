"""End-to-end step benchmark: runs N training steps of a job spec in this process (``rlcore.trainer``,
the real Ray + Megatron + vLLM stack) and prints, as a markdown table, the median time of each phase,
the generation and training throughput, and the peak memory of every role's processes.

    .venv/bin/python -m bench.e2e_step yaml_configs/quickstart_cpu.yaml --steps 6 --warmup 1
    .venv/bin/python -m bench.e2e_step yaml_configs/smollm2_math_cpu.yaml --steps 4 [key.sub=value ...]

Phases are the loop's own ``timing/*_s`` metrics; "other" is the rest of the step (building the
batch, advantages, metrics). Throughput counts tokens over the measured steps: generated = response
tokens / rollout time, trained = prompt+response tokens of the update's batches / update time.
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

# The table's phases in loop order: (metric key, label).
PHASES = (("timing/rollout_s", "rollout (vLLM generate)"), ("timing/reward_s", "reward"),
          ("timing/logprob_s", "log-probs (old, ref)"), ("timing/update_s", "update (fwd+bwd+optim)"),
          ("timing/weight_sync_s", "weight sync"))
TOTAL = "timing/step_s"


class TokenCounter:
    """Wraps the trainer's rollout ``generate`` and actor ``update`` to count the tokens each step
    generates and trains on (the loop itself does not report them)."""

    def __init__(self, trainer):
        self.generated = self.trained = 0
        generate, update = trainer.rollout.generate, trainer.actor.update

        def counted_generate(*args, **kwargs):
            trajs = generate(*args, **kwargs)
            self.generated += sum(len(t.response_ids) for t in trajs)
            return trajs

        def counted_update(batch, *args, **kwargs):
            self.trained += int(batch["attention_mask"].sum())
            return update(batch, *args, **kwargs)

        trainer.rollout.generate, trainer.actor.update = counted_generate, counted_update

    def take(self) -> tuple[int, int]:
        out = (self.generated, self.trained)
        self.generated = self.trained = 0
        return out


def run_bench(spec: str, overrides: list[str], steps: int, warmup: int) -> dict:
    import ray

    from launch.compose import build_trainer
    from rlcore.job import load_job
    from rlcore.validate import validate

    cfg = load_job(spec, overrides)
    cfg.trainer.val_every = 0
    cfg.trainer.run_dir = cfg.trainer.run_dir.rstrip("/") + "-bench"
    layout = validate(cfg)
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, layout)
    startup_s = time.perf_counter() - t0
    try:
        counter = TokenCounter(trainer)
        measured = []
        for step in range(1, warmup + steps + 1):
            metrics = trainer.train_step(step)
            generated, trained = counter.take()
            print(f"bench step {step}{' (warm-up)' if step <= warmup else ''}: "
                  f"{metrics[TOTAL]:.2f} s, reward {metrics.get('reward/mean', float('nan')):.3f}, "
                  f"logprob_diff_max {metrics.get('rollout/logprob_diff_max', float('nan')):.2g}",
                  file=sys.stderr, flush=True)
            if step > warmup:
                measured.append((metrics, generated, trained))
        memory = {"driver": [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]}
        memory["actor"] = trainer.actor.peak_memory_mb()
        if trainer.reference is not None:
            memory["reference"] = trainer.reference.peak_memory_mb()
        memory["rollout"] = trainer.rollout.peak_memory_mb()
    finally:
        trainer.shutdown()
        ray.shutdown()
    return dict(spec=spec, overrides=overrides, layout=layout, cfg=cfg, startup_s=startup_s,
                warmup=warmup, measured=measured, memory=memory)


def render(result: dict) -> str:
    measured, cfg = result["measured"], result["cfg"]
    phases = [(key, label) for key, label in PHASES if all(key in m for m, _, _ in measured)]
    median = {key: statistics.median(m[key] for m, _, _ in measured) for key, _ in phases}
    # "other" per step, then its median: medians of parts do not add up to the median of a sum.
    median["other"] = statistics.median(m[TOTAL] - sum(m[k] for k, _ in phases) for m, _, _ in measured)
    rows = [(label, median[key]) for key, label in phases] + [("other", median["other"])]
    total = statistics.median(m[TOTAL] for m, _, _ in measured)
    parts = sum(value for _, value in rows)  # shares are of the summed medians
    slowest = max(rows, key=lambda r: r[1])
    lay = result["layout"]
    lines = [
        f"`{result['spec']}`{' ' + ' '.join(result['overrides']) if result['overrides'] else ''}: "
        f"{cfg.data.batch_size} prompts x {cfg.rollout.n} samples, <= {cfg.rollout.max_response_length} "
        f"new tokens; actor TP{lay.actor.tp} PP{lay.actor.pp} DP{lay.actor.dp}"
        f"{'' if lay.reference is None else ' + reference'}, {lay.rollout.engines} vLLM engine(s); "
        f"median of {len(measured)} steps after {result['warmup']} warm-up step(s) "
        f"(start-up {result['startup_s']:.0f} s, not counted)",
        "",
        "| phase | median s | share |",
        "|---|---:|---:|",
    ]
    lines += [f"| {label} | {value:.2f} | {100 * value / parts:.0f}% |" for label, value in rows]
    lines.append(f"| **step total** (median of the totals) | **{total:.2f}** | |")
    gen = sum(g for _, g, _ in measured) / sum(m["timing/rollout_s"] for m, _, _ in measured)
    trained = sum(t for _, _, t in measured) / sum(m["timing/update_s"] for m, _, _ in measured)
    lines += ["", "| throughput | tokens/s |", "|---|---:|",
              f"| generated (response tokens / rollout time) | {gen:.0f} |",
              f"| trained (prompt+response tokens / update time) | {trained:.0f} |",
              "", "| role | processes | peak RSS per process, MiB |", "|---|---:|---|"]
    for role, values in result["memory"].items():
        lines.append(f"| {role} | {len(values)} | {', '.join(f'{v:.0f}' for v in values)} |")
    diffs = [m["rollout/logprob_diff_max"] for m, _, _ in measured if "rollout/logprob_diff_max" in m]
    if diffs:
        lines += ["", f"Largest engine/trainer log-prob gap over the measured steps: {max(diffs):.2g}."]
    lines.append(f"Slowest phase: {slowest[0]} ({100 * slowest[1] / parts:.0f}% of a step).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not measured (default 1)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        p.error(f"--steps={a.steps} must be >= 1 and --warmup={a.warmup} >= 0")
    if not os.path.isfile(a.spec):
        p.error(f"job spec {a.spec!r} not found")
    result = run_bench(a.spec, a.overrides, a.steps, a.warmup)
    # The raw per-step figures, so a table can be re-rendered or compared later.
    raw = os.path.join(result["cfg"].trainer.run_dir, "bench.json")
    os.makedirs(os.path.dirname(raw), exist_ok=True)
    with open(raw, "w") as f:
        json.dump({"spec": a.spec, "overrides": a.overrides, "startup_s": result["startup_s"],
                   "memory_mb": result["memory"], "steps": [
                       {"metrics": m, "generated_tokens": g, "trained_tokens": t} for m, g, t in result["measured"]]},
                  f, indent=1)
    print(render(result))
    print(f"(per-step figures: {raw})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
