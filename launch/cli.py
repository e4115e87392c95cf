"""``rlx``: the command line.

    rlx validate JOB.yaml [key.sub=value ...]   check a job spec; start nothing
    rlx show     JOB.yaml [key.sub=value ...]   print the resolved spec: every key, defaults included
    rlx train    JOB.yaml [key.sub=value ...]   validate, then train
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from rlcore.data import DataError
from rlcore.job import ConfigError, JobLayout, load_job, validate
from rlcore.reward import RewardError


def _layout_table(layout: JobLayout) -> str:
    rows = [("role", "pool", "gpus", "tp", "pp", "dp/engines")]
    for role in ("actor", "reference"):
        r = getattr(layout, role)
        if r is not None:
            rows.append((role, r.pool, r.gpus, r.tp, r.pp, r.dp))
    ro = layout.rollout
    rows.append(("rollout", ro.pool, ro.gpus, ro.tp, "-", ro.engines))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows)


def _to_yaml(cfg) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _check_datasets(cfg) -> None:
    """Reads and tokenizes every prompt row, so a malformed one is named now."""
    from transformers import AutoTokenizer

    from rlcore.data import PromptLoader, load_datasets

    train, _ = load_datasets(cfg.data, AutoTokenizer.from_pretrained(cfg.model.path))
    PromptLoader(train, cfg.data.batch_size)  # refuses a dataset smaller than one batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlx", description="Megatron-first RL trainer for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("validate", "check a job spec without starting anything"),
                        ("show", "print the resolved job spec (defaults, file, overrides) as YAML"),
                        ("train", "validate a job spec, then train")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("job", help="YAML job spec")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.tp=2 trainer.total_steps=5")
    args = parser.parse_args(argv)

    try:
        cfg = load_job(args.job, args.overrides)
        if args.command == "show":
            print(_to_yaml(cfg), end="")
            return 0
        layout = validate(cfg)
        if args.command == "validate":
            _check_datasets(cfg)  # `train` reads them anyway, before Ray starts
    except (ConfigError, DataError) as e:
        print(f"rlx {args.command}: {e}", file=sys.stderr)
        return 2
    print(f"{args.job}: valid ({layout.device} profile, {layout.total_gpus} GPUs)")
    print(_layout_table(layout))
    if args.command == "validate":
        return 0

    from rlcore.trainer import run

    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    # The resolved spec next to the metrics: what actually ran, overrides included.
    with open(os.path.join(cfg.trainer.run_dir, "job.yaml"), "w") as f:
        f.write(_to_yaml(cfg))
    try:
        history = run(cfg, layout)
    except (DataError, RewardError) as e:
        # The user's data or reward function, not a bug here: one line, no traceback. Every step
        # finished before it is already in metrics.jsonl.
        print(f"rlx train: {e}", file=sys.stderr)
        return 1
    if history:
        print("final step:", json.dumps({k: round(v, 4) for k, v in history[-1].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
