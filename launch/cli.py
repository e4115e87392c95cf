"""``rlx``: the command line.

    rlx validate JOB.yaml [key.sub=value ...]   check a job spec; start nothing
    rlx show     JOB.yaml [key.sub=value ...]   print the resolved spec: every key, defaults included
    rlx train    JOB.yaml [key.sub=value ...]   validate, then train
    rlx plan     JOB.yaml [key.sub=value ...]   memory per GPU of every role; fails when one cannot fit
    rlx plan     JOB.yaml --suggest --gpus-per-node G --nodes N   valid layouts, ranked by a cost model
    rlx plan     CPU_JOB.yaml --suggest [--calibrate] [--actor-pools 1,2]   the actor's layouts on its pool(s), ranked
    rlx submit   JOB.yaml --nodes N [key.sub=value ...]   sbatch a Ray cluster on N nodes that trains JOB
    rlx export   CHECKPOINT --to hf OUT [--role actor|critic]   a checkpoint as a HuggingFace model folder
    rlx train|validate|show|plan|submit JOB.yaml --verl verl.key=value ...   verl main_ppo overrides instead

rlx train exits with 0 when done, 2 for a spec it refuses, 1 when the run fails, and 75 when SIGTERM or
SIGUSR1 stopped it after saving a checkpoint (rlcore/preemption.py; launch/rlx.sbatch requeues on it).
"""
from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys
import threading
from typing import NoReturn

from rlcore.checkpoint import CheckpointError
from rlcore.data import DataError
from rlcore.faults import RunStopped
from rlcore.job import ConfigError, load_job
from rlcore.validate import JobLayout, for_another_machine, validate
from rlcore.reward import RewardError
from launch.verl_args import add_verl_flag, load_verl_job


def _layout_table(layout: JobLayout) -> str:
    rows = [("role", "pool", "gpus", "tp", "pp", "dp/engines")]
    for role in ("actor", "reference", "critic"):
        r = getattr(layout, role)
        if r is not None:  # a colocated reference runs in its host's processes (reference.colocate)
            rows.append((role if r.host is None else f"{role} (in {r.host})", r.pool, r.gpus, r.tp, r.pp, r.dp))
    for name, r in layout.reward.items():  # the reward models' scoring roles
        rows.append((name, r.pool, r.gpus, r.tp, r.pp, r.dp))
    ro = layout.rollout
    if ro is not None:  # a preference job without greedy validation has no engines
        rows.append(("rollout", ro.pool, ro.gpus, ro.tp, "-", ro.engines))
    if layout.judge is not None:
        rows.append(("judge", layout.judge.pool, layout.judge.gpus, layout.judge.tp, "-", layout.judge.engines))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows)


def _to_yaml(cfg) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _check_datasets(cfg) -> None:
    """Reads and tokenizes every prompt row, so a malformed one is named now."""
    from transformers import AutoTokenizer

    from rlcore.data import PromptLoader, load_datasets

    if cfg.algorithm.type != "rl":  # preference pairs (and DPO's greedy validation prompts)
        from rlcore.preference_data import load_preference_task

        load_preference_task(cfg)
        return
    train, _ = load_datasets(cfg.data, AutoTokenizer.from_pretrained(cfg.model.path))
    PromptLoader(train, cfg.data.batch_size)  # refuses a dataset smaller than one batch


def _pool_sizes(text: str) -> list[int]:
    """``--actor-pools 1,2``: pool sizes, each a whole number of logical GPUs >= 1."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected sizes of the actor's pool as whole numbers >= 1, e.g. 1,2; got {text!r}")
    return sizes


def _plan(args, cfg, layout: JobLayout) -> int:
    from launch import plan

    for flag, given in (("--calibrate", args.calibrate), ("--memory-gb", args.memory_gb is not None),
                        ("--actor-pools", args.actor_pools is not None)):
        if given and not (args.suggest and layout.device == "cpu"):
            raise ConfigError(f"rlx plan {flag} belongs to the cpu profile's cost model: use it with --suggest on a "
                              "cpu-profile spec")
    if args.suggest and layout.device == "cpu":  # the actor's layouts on its pool (or --actor-pools sizes)
        constants = None
        if args.calibrate:
            from launch.calibrate import calibrate

            m, _ = plan.read_model(cfg)
            shape = plan.MicroBatchShape.of(cfg.actor.micro_batch_size, cfg.data.max_prompt_length,
                                            cfg.rollout.max_response_length, cfg.rollout.n, cfg.actor.shared_prompt)
            constants = calibrate(shape.tokens, m.hidden, m.ffn, cores=cfg.resources.num_cpus)
        found = plan.suggest_cpu(cfg, layout, args.top, constants, memory_gb=args.memory_gb,
                                 pool_sizes=args.actor_pools)
        print(plan.format_cpu_suggestions(found, cfg))
        return 0 if found.best else 2
    if args.suggest:
        gpus_per_node = args.gpus_per_node or cfg.resources.gpus_per_node
        nodes = args.nodes or cfg.resources.nodes
        if not gpus_per_node:
            raise ConfigError("rlx plan --suggest needs --gpus-per-node (or resources.gpus_per_node in the spec)")
        found = plan.suggest(cfg, layout, gpus_per_node, nodes, args.top)
        print(plan.format_suggestions(found, gpus_per_node, nodes))
        return 0 if found.best else 2
    estimate = plan.estimate(cfg, layout)
    print(f"{args.job}: {layout.total_gpus} GPUs on {cfg.resources.nodes} node(s)")
    print(plan.format_plan(estimate, cfg))
    plan.check(estimate, cfg)  # after the table, so a refusal comes with its figures
    if layout.device == "gpu":
        print("fits: every pool is within its GPU memory")
    else:
        print(("fits: the rollout KV cache holds a full-length sequence" if layout.rollout is not None else "fits")
              + " (cpu profile: the logical GPUs share the host's memory, so resources.gpu_memory_gb is not checked)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlx", description="Megatron-first RL trainer for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("validate", "check a job spec without starting anything"),
                        ("show", "print the resolved job spec (defaults, file, overrides) as YAML"),
                        ("train", "validate a job spec, then train")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("job", help="YAML job spec")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.tp=2 trainer.total_steps=5")
        add_verl_flag(p)
    plan = sub.add_parser("plan", help="estimate every role's memory per GPU; --suggest ranks layouts")
    submit = sub.add_parser("submit", help="submit the job to Slurm: a Ray cluster on --nodes nodes runs `rlx train`")
    for p in (plan, submit):
        p.add_argument("job", help="YAML job spec")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.tp=2 trainer.total_steps=5")
        add_verl_flag(p)
    plan.add_argument("--suggest", action="store_true", help="list the layouts that divide and fit, best first")
    plan.add_argument("--gpus-per-node", type=int, help="with --suggest (default: resources.gpus_per_node)")
    plan.add_argument("--nodes", type=int, help="with --suggest (default: resources.nodes)")
    plan.add_argument("--top", type=int, default=10, help="with --suggest: how many layouts to show")
    plan.add_argument("--memory-gb", type=float,
                      help="with --suggest on the cpu profile: only layouts whose actor ranks need at most this much "
                           "host memory together for their tensors (each rank's process adds ~0.5 GB of its own)")
    plan.add_argument("--calibrate", action="store_true",
                      help="with --suggest on the cpu profile: measure the cost model's constants on this machine")
    plan.add_argument("--actor-pools", type=_pool_sizes, metavar="N[,N...]",
                      help="with --suggest on the cpu profile: rank the actor's layouts on pools of these sizes "
                           "(logical GPUs; fewer ranks get more math threads each) instead of the spec's pool only")
    from launch.slurm import add_submit_arguments

    add_submit_arguments(submit)
    from launch.export import add_export_parser

    add_export_parser(sub)
    from launch.report import add_report_parser

    add_report_parser(sub)
    # Overrides may follow options (`rlx submit JOB --nodes 2 trainer.total_steps=5`): argparse leaves
    # them unparsed, so they are collected here.
    args, extra = parser.parse_known_args(argv)
    for item in extra:
        if item.startswith("-") or "=" not in item or (args.command not in ("plan", "submit")
                                                         and not getattr(args, "verl", False)):
            parser.error(f"unrecognized argument {item!r}")
        args.overrides.append(item)

    if args.command == "export":
        from launch.export import run_export

        return run_export(args)
    if args.command == "report":
        from launch.report import run_report

        return run_report(args)
    try:
        cfg = load_verl_job(args) if getattr(args, "verl", False) else load_job(args.job, args.overrides)
        if args.command == "show":
            print(_to_yaml(cfg), end="")
            return 0
        # A spec for another machine (model.hf_config, no model folder here) is checked without its files.
        layout = validate(cfg, require_files=True if args.command == "train" else None)
        if args.command == "validate" and not for_another_machine(cfg):
            _check_datasets(cfg)  # `train` reads them anyway, before any role starts
        if args.command == "plan":
            if cfg.algorithm.type != "rl" and args.suggest:
                raise ConfigError(f"rlx plan --suggest ranks RL layouts only (its cost model times rollouts), not "
                                  f"algorithm.type={cfg.algorithm.type}; `rlx plan` without it gives this job's memory")
            return _plan(args, cfg, layout)
        if args.command == "submit":
            from launch.slurm import submit

            return submit(args, cfg, layout)
    except (ConfigError, DataError) as e:
        print(f"rlx {args.command}: {e}", file=sys.stderr)
        return 2
    print(f"{args.job}: valid ({layout.device} profile, {layout.total_gpus} GPUs)")
    if for_another_machine(cfg):
        print(f"model.path={cfg.model.path} is not on this machine: checked against model.hf_config; the "
              "weights, tokenizer and data files are checked when the job starts")
    print(_layout_table(layout))
    if args.command == "validate":
        return 0

    from launch.compose import run
    from rlcore.preemption import REQUEUE_EXIT_STATUS, Preempted
    from rlcore.trainer import SamplingError

    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    # The resolved spec next to the metrics: what actually ran, overrides included.
    with open(os.path.join(cfg.trainer.run_dir, "job.yaml"), "w") as f:
        f.write(_to_yaml(cfg))
    from rlcore.worker_logs import open_run_logs

    open_run_logs(cfg.trainer.run_dir)  # every process's full output under run_dir/logs/, a quiet console
    # The controller's imports (torch, transformers, Ray) outlive the run: frozen for it, the
    # collections the run triggers walk only the objects it creates (as the roles' processes do).
    # Unfrozen after it, for a caller in the same process (tests): its collections and its exit see
    # every object again.
    gc.freeze()
    try:
        history = run(cfg, layout)
    except (DataError, RewardError, CheckpointError, SamplingError, RunStopped) as e:
        # The user's data, reward function or checkpoint (or a batch dynamic sampling could not
        # fill, or a process of the run that died), not a bug here: one line, no traceback. Every step
        # finished before it is already in metrics.jsonl.
        print(f"rlx train: {e}", file=sys.stderr)
        return 1
    except Preempted as e:  # SIGTERM/SIGUSR1: checkpoint saved; launch/rlx.sbatch requeues on this status
        print(f"rlx train: {e}", file=sys.stderr)
        return REQUEUE_EXIT_STATUS
    finally:
        gc.unfreeze()
    if history:
        print("final step:", json.dumps({k: round(v, 4) for k, v in history[-1].items()}))
    return 0


def entry() -> int:
    """The ``rlx`` command (setup.py's console script) and ``python -m launch.cli``: ``main``, then
    what the interpreter's exit does for programs (threads joined, then the exit handlers: logging's,
    W&B's, MLflow's), then the process ends. What it skips is the teardown after that, which walks
    every object torch, Ray and transformers made: 1.6-2.1 s of CPU after a one-step quickstart on
    the 2-core machine (0.1 s without it), ending in triton's bindings reporting their objects as
    leaked on stderr. By then every run is over: roles and Ray stopped, loggers and files closed."""
    exit_without_teardown(main())


def exit_without_teardown(code: int) -> NoReturn:
    """End the process with ``code`` as the interpreter's exit would, less its teardown of every module
    and object (the test suite's process ends this way too: tests/conftest.py)."""
    threading._shutdown()  # as the interpreter's exit: each non-daemon thread finishes (executors' too)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(entry())
