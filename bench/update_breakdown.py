"""Where the actor's update spends its time: the job's real batches, then the update alone, rank by rank.

    .venv/bin/python -m bench.update_breakdown yaml_configs/smollm2_math_cpu.yaml --steps 3
        [--rounds K] [--per-update] [--profile] [--malloc glibc,keep,keep-trim] [--batches FILE]
        [key.sub=value ...]

First ``--steps`` steps of the job run as in ``bench/e2e_step.py`` (Ray, Megatron, vLLM) and the
batches the actor's update receives are kept; everything then shuts down. The actor's world is then
started again as plain local processes (the same ``RoleSpec`` and math threads the composition root
gives it, no Ray, no vLLM) and runs ``MegatronEngine.update`` on each kept batch (its DP shard), after
one warm-up update. Inside every rank megatron's own pieces are timed: the schedule's forward and
backward steps, the pipeline's p2p calls (mostly waiting for the other stage: fill, drain and
imbalance), ``finalize_model_grads`` (the DP gradient all-reduce and the tied embedding's all-reduce
between the first and last stage; with PP it also waits for the slower stage's last backward), the
finite check (the grad norm), the optimizer step and the buffer zeroing. The table gives each rank's
medians over the kept batches, and its stage's model FLOPs (counted as ``bench/e2e_step.py`` counts
them) over its forward + backward time against a one-thread matmul measured first in the same run.

Each rank's CPU time in the update (user and system, from getrusage), its minor page faults and
its resident memory once the update is done are counted too: the system time is mostly the kernel
faulting in (and zero-filling) pages that malloc had given back. ``--malloc`` takes a comma-separated
list of allocator modes, replayed one after the other on the same batches (default: the spec's
``resources.host_malloc``, as its workers run): ``glibc`` (its defaults) and ``keep`` (mmap off and a 1 GiB trim threshold, so that each micro-batch reuses the
pages the last one freed), the two values of ``resources.host_malloc`` set as the workers set them,
and ``keep-trim`` (``keep``, then ``malloc_trim(0)`` after every update, the pages back to the kernel
between steps; the trim counts in the update's time, under "other"). A row gives a hash of each stage's weights after the replay: the same in every mode.
docs/cpu-profile.md, "Host memory", has what each costs.

``--rounds K`` replays the kept batches K times over after the warm-up (the medians then over all
K x ``--steps`` updates): whether an update's cost depends on the batch or on what the updates before
it left in the heap. ``--per-update`` adds a row per replayed update: its batch, and in each rank its
time, FLOP rate, system CPU and minor page faults, and its start and end on CLOCK_MONOTONIC (to look at one update of a
``perf record -k CLOCK_MONOTONIC`` taken over the replay: ``perf report --time START,END``).

``--profile`` also writes torch.profiler's op table of each rank's last update to
``<trainer.run_dir>-breakdown/profile_rank<r>.txt``, and the same ops split by input shape (which GEMM
is slow) to ``profile_rank<r>_shapes.txt``. With ``--rounds 2`` or more the last update is a batch's
second replay, past the heap's growth (the first replay of the largest batch faults its pages in).

``--batches FILE`` keeps the collected batches in FILE (torch.save), and when FILE exists replays
its first ``--steps`` batches instead of running the job: the same updates, replayed by two checkouts
one after the other (an A/B of a change), with no Ray or vLLM start in between. The batches are data
only (token ids, masks, advantages); the job spec still gives the model and the layout.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import functools
import hashlib
import os
import resource
import socket
import statistics
import sys
import time

PIECES = (("fwd", "forward steps"), ("bwd", "backward steps"), ("p2p", "pipeline p2p (waits)"),
          ("finalize", "finalize_model_grads (all-reduces)"), ("finite", "finite check (grad norm)"),
          ("optim", "optimizer step"), ("zero", "zero grad buffers"))


def collect_batches(spec: str, overrides: list[str], steps: int, run_dir: str) -> tuple[list, object]:
    """The batches (and loss config, head arguments) of the job's first ``steps`` actor updates."""
    import ray

    from launch.compose import build_trainer
    from rlcore.job import load_job
    from rlcore.validate import validate

    cfg = load_job(spec, overrides)
    cfg.trainer.val_every = 0
    cfg.trainer.run_dir = run_dir
    trainer = build_trainer(cfg, validate(cfg))
    kept = []
    update = trainer.actor.update

    def keep(batch, loss_cfg, **head_args):
        kept.append(({k: v.clone() for k, v in batch.items()}, loss_cfg, head_args))
        return update(batch, loss_cfg, **head_args)

    trainer.actor.update = keep
    try:
        for step in range(1, steps + 1):
            trainer.train_step(step)
    finally:
        trainer.shutdown()
        ray.shutdown()
    return kept, cfg


def save_batches(kept: list, path: str) -> None:
    """``--batches``: the kept updates as plain data (tensors, the loss config's fields, the head's
    arguments), which ``load_batches`` reads back with torch.load's weights-only unpickler."""
    import dataclasses

    import torch

    torch.save([(batch, dataclasses.asdict(loss_cfg), head_args) for batch, loss_cfg, head_args in kept], path)


def load_batches(path: str) -> list:
    import torch

    from rlcore.config import LossConfig

    return [(batch, LossConfig(**loss_cfg), head_args)
            for batch, loss_cfg, head_args in torch.load(path, weights_only=True)]


def _timed(table: dict, key: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key] += time.perf_counter() - t0
    return wrapper


MALLOC_MODES = ("glibc", "keep", "keep-trim")  # resources.host_malloc's modes, and keep with a trim


def _libc():
    return ctypes.CDLL(None)


def replay_order(kept: int, rounds: int) -> list[int]:
    """The kept batches' indices in the order the ranks update on them: batch 0 (the warm-up, not
    counted), then all of them ``rounds`` times over."""
    return [0] + list(range(kept)) * rounds


def _rank(rank: int, spec, port: int, kept: list, rounds: int, profile_dir: str | None, malloc: str, queue) -> None:
    try:
        queue.put((rank, _run_rank(rank, spec, port, kept, rounds, profile_dir, malloc)))
    except BaseException as e:  # the parent must not wait forever for a rank that failed
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise


def _run_rank(rank: int, spec, port: int, kept: list, rounds: int, profile_dir: str | None, malloc: str) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_workers.engine import MegatronEngine
    from rlcore.batch import Batch

    from bench.e2e_step import matmul_rate

    # The engine sets the allocator as a worker would (resources.host_malloc), before the model exists.
    engine = MegatronEngine(dataclasses.replace(spec, host_malloc="keep" if malloc == "keep-trim" else malloc), rank)
    engine.init("127.0.0.1", port)
    table: dict = collections.defaultdict(float)
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    schedules.forward_step = _timed(table, "fwd", schedules.forward_step)
    schedules.backward_step = _timed(table, "bwd", schedules.backward_step)
    comm = p2p_communication.P2PCommunicator
    for name in ("recv_forward", "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
                 "send_backward_recv_forward"):
        setattr(comm, name, _timed(table, "p2p", getattr(comm, name)))
    engine.config.finalize_model_grads_func = _timed(table, "finalize", engine.config.finalize_model_grads_func)
    engine.optimizer.step = _timed(table, "optim", engine.optimizer.step)
    engine._check_finite = _timed(table, "finite", engine._check_finite)
    for ddp in engine.ddp_chunks:
        ddp.zero_grad_buffer = _timed(table, "zero", ddp.zero_grad_buffer)
    dist.barrier()
    one_thread = matmul_rate(1, seconds=1.0)  # the same moment as the updates, on this rank's core
    runs = []
    order = replay_order(len(kept), rounds)
    for i, b in enumerate(order):  # the first: warm-up
        batch, loss_cfg, head_args = kept[b]
        shard = Batch(batch).shard(engine.dp_rank, engine.dp)
        dist.barrier()
        table.clear()
        profiler = None
        if profile_dir and i == len(order) - 1:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            profiler.__enter__()
        usage0, start, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic(), time.perf_counter()
        engine.update(shard, loss_cfg, head_args)
        if malloc == "keep-trim":
            _libc().malloc_trim(0)
        total, usage = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        with open("/proc/self/statm") as f:  # resident pages now: what the rank holds into the next phase
            rss_after_mb = int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20
        if profiler is not None:
            profiler.__exit__(None, None, None)
            with open(os.path.join(profile_dir, f"profile_rank{rank}.txt"), "w") as f:
                f.write(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
            with open(os.path.join(profile_dir, f"profile_rank{rank}_shapes.txt"), "w") as f:
                f.write(profiler.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=30, max_shapes_column_width=90))
        if i > 0:
            runs.append(dict(table, batch=b, start=start, end=start + total, total=total,
                             user=usage.ru_utime - usage0.ru_utime, system=usage.ru_stime - usage0.ru_stime,
                             faults=usage.ru_minflt - usage0.ru_minflt,
                             rss_after_mb=rss_after_mb, peak_rss_mb=usage.ru_maxrss / 1024))
    dist.barrier()
    digest = hashlib.sha256()  # the weights after every replayed update: equal across --malloc modes
    for i, chunk in enumerate(engine.model_chunks):
        for name, param in sorted(chunk.named_parameters()):
            digest.update(f"{i}.{name}".encode())
            digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return dict(runs=runs, weights_sha256=digest.hexdigest()[:16], pp_rank=engine.pp_rank, dp_rank=engine.dp_rank,
                tp_rank=engine.tp_rank, layers=len(engine.model_chunks[0].decoder.layers), head=engine.is_last_stage,
                matmul_1t=one_thread)


def stage_flops(hf, batch: dict, shared_prompt: bool, layers: int, head: bool, dp: int, dp_rank: int) -> float:
    """Model FLOPs (forward + backward) of ``layers`` layers (+ the output layer when ``head``) on this
    DP rank's shard, counted as bench/e2e_step.py counts the whole update."""
    from bench.e2e_step import executed_rows, update_flops_per_row
    from rlcore.batch import Batch

    shard = Batch(batch).shard(dp_rank, dp)
    total = 0.0
    for tokens, scored in executed_rows(shard, shared_prompt):
        body = update_flops_per_row(hf, tokens, 0)  # all layers, no output layer
        out = update_flops_per_row(hf, tokens, scored) - body
        total += body * layers / hf.num_layers + (out if head else 0.0)
    return total


def rank_flops(results: dict, kept: list, hf, shared_prompt: bool, dp: int) -> dict[int, list[float]]:
    """Per rank, its stage's model FLOPs on each kept batch."""
    return {r: [stage_flops(hf, batch, shared_prompt, res["layers"], res["head"], dp, res["dp_rank"])
                for batch, _, _ in kept] for r, res in results.items()}


def _print_table(results: dict, flops: dict[int, list[float]]) -> None:
    ranks = sorted(results)
    print("| | " + " | ".join(f"rank {r} (pp {results[r]['pp_rank']}, dp {results[r]['dp_rank']}: "
                              f"{results[r]['layers']} layers{' + head' if results[r]['head'] else ''})"
                              for r in ranks) + " |")
    print("|---|" + "---:|" * len(ranks))
    for key, label in PIECES + (("other", "other (micro-batch set-up, loss hooks, outputs)"), ("total", "**update**"),
                                ("user", "CPU time in the update: user"), ("system", "CPU time in the update: system"),
                                ("faults", "minor page faults in the update"),
                                ("rss_after_mb", "RSS of the rank after the update, MB"),
                                ("peak_rss_mb", "peak RSS of the rank, MB")):
        cells = []
        for r in ranks:
            runs = results[r]["runs"]
            if key == "other":
                values = [x["total"] - sum(x.get(k, 0.0) for k, _ in PIECES) for x in runs]
            else:
                values = [x.get(key, 0.0) for x in runs]
            whole = key in ("faults", "rss_after_mb", "peak_rss_mb")
            cells.append(f"{statistics.median(values):.0f}" if whole else f"{statistics.median(values):.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for r in ranks:
        res = results[r]
        rate = sum(flops[r][x["batch"]] for x in res["runs"]) / sum(x["fwd"] + x["bwd"] for x in res["runs"])
        cells.append(f"{rate / 1e9:.0f} GFLOP/s = {rate / res['matmul_1t']:.2f} x {res['matmul_1t'] / 1e9:.0f}")
    print("| stage FLOPs / (forward + backward) against a one-thread matmul | " + " | ".join(cells) + " |")
    print("| the stage's weights after the replayed updates (sha256) | "
          + " | ".join(f"`{results[r]['weights_sha256']}`" for r in ranks) + " |")


def per_update_rows(results: dict, flops: dict[int, list[float]]) -> list[str]:
    """The ``--per-update`` table: one row per replayed update (not the warm-up), each rank's time,
    its stage's FLOPs over that whole time (as bench/e2e_step.py rates the update), system CPU and minor
    page faults, and the update's start and end on CLOCK_MONOTONIC (rank 0's)."""
    ranks = sorted(results)
    rows = ["| update | batch | " + " | ".join(f"rank {r}: s, GFLOP/s, system s, faults" for r in ranks)
            + " | start, end (CLOCK_MONOTONIC, s) |",
            "|---:|---:|" + "---:|" * len(ranks) + "---|"]
    for n, first in enumerate(results[ranks[0]]["runs"], start=1):
        cells = [f"{x['total']:.2f}, {flops[r][x['batch']] / x['total'] / 1e9:.0f}, {x['system']:.2f}, {x['faults']}"
                 for r, x in ((r, results[r]["runs"][n - 1]) for r in ranks)]
        rows.append(f"| {n} | {first['batch']} | " + " | ".join(cells)
                    + f" | {first['start']:.2f}, {first['end']:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--steps", type=int, default=3, help="job steps whose batches the updates replay (default 3)")
    p.add_argument("--rounds", type=int, default=1,
                   help="replay the kept batches this many times over after the warm-up (default 1)")
    p.add_argument("--per-update", action="store_true",
                   help="a row per replayed update: batch, time, system CPU, page faults, start and end")
    p.add_argument("--profile", action="store_true", help="torch.profiler op tables of the last update (by op, and by op and input shape)")
    p.add_argument("--malloc", default=None,
                   help="comma-separated allocator modes to replay under, one after the other: glibc (its "
                        "defaults), keep, keep-trim (module docstring); default: the spec's resources.host_malloc")
    p.add_argument("--batches", metavar="FILE",
                   help="replay the batches kept in FILE if it exists, else collect them and keep them there")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps={a.steps} must be >= 1")
    if a.rounds < 1:
        p.error(f"--rounds={a.rounds} must be >= 1")
    modes = a.malloc.split(",") if a.malloc is not None else []
    unknown = [m for m in modes if m not in MALLOC_MODES]
    if unknown:
        p.error(f"--malloc: unknown mode(s) {unknown}; expected a comma-separated list of {', '.join(MALLOC_MODES)}")
    if not os.path.isfile(a.spec):
        p.error(f"job spec {a.spec!r} not found")

    import torch.multiprocessing as mp

    from launch.compose import job_threads, role_spec
    from megatron_workers.host_malloc import hugepages_env
    from rlcore.hf_config import read_hf_config
    from rlcore.validate import validate

    from rlcore.job import load_job

    run_dir = load_job(a.spec, a.overrides).trainer.run_dir.rstrip("/") + "-breakdown"
    if a.batches and os.path.isfile(a.batches):
        kept, cfg = load_batches(a.batches), load_job(a.spec, a.overrides)
        if len(kept) < a.steps:
            p.error(f"--batches {a.batches} holds {len(kept)} batches, fewer than --steps={a.steps}")
        kept = kept[:a.steps]
    else:
        kept, cfg = collect_batches(a.spec, a.overrides, a.steps, run_dir)
        if a.batches:
            save_batches(kept, a.batches)
    layout = validate(cfg)
    if layout.device != "cpu":
        p.error("the breakdown runs the actor's world as local processes: cpu profile only")
    act = cfg.actor
    spec = role_spec("actor", layout.actor, layout, cfg.model.path, act.micro_batch_size, cfg.trainer.seed,
                     optim=act.optim, threads=job_threads(cfg, layout)["actor"], shared_prompt=act.shared_prompt,
                     max_tokens_per_micro_batch=act.max_tokens_per_micro_batch)
    profile_dir = run_dir if a.profile else None
    os.makedirs(run_dir, exist_ok=True)
    hf = read_hf_config(cfg.model.path, cfg.model.hf_config)
    lay = layout.actor
    os.environ.update(hugepages_env(spec.host_hugepages))  # the spawned ranks start with it, as Ray starts them
    for mode in modes or [spec.host_malloc]:  # the same kept batches, one fresh world per allocator mode, back to back
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, spec, port, kept, a.rounds, profile_dir, mode, queue))
                 for r in range(spec.world_size)]
        for proc in procs:
            proc.start()
        results = dict(queue.get() for _ in procs)
        for proc in procs:
            proc.join()
        failed = {r: v for r, v in results.items() if isinstance(v, str)}
        if failed:
            print(f"ranks failed: {failed}", file=sys.stderr)
            return 1
        print(f"`{a.spec}`{' ' + ' '.join(a.overrides) if a.overrides else ''}: actor TP{lay.tp} PP{lay.pp} DP{lay.dp}"
              f"{' pp_layers ' + str(list(lay.pp_layers)) if lay.pp_layers else ''}, micro-batch {act.micro_batch_size}, "
              f"{spec.threads} thread(s) per rank, malloc: {mode}{', huge pages' * spec.host_hugepages}; "
              f"the updates of {len(kept)} job steps replayed{f' {a.rounds} times over' if a.rounds > 1 else ''} "
              f"(medians, s); load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
        print()
        flops = rank_flops(results, kept, hf, act.shared_prompt, lay.dp)
        _print_table(results, flops)
        print()
        if a.per_update:
            print("\n".join(per_update_rows(results, flops)))
            print()
    if profile_dir:
        print(f"\n(op tables: {profile_dir}/profile_rank<r>.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
