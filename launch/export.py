"""``rlx export CHECKPOINT --to hf OUT``: a checkpoint as a HuggingFace model folder.

The role's megatron-core distributed checkpoint is loaded into a one-process (TP1 PP1) Megatron model
of that role in this process, whatever layout saved it, and its weights are gathered with the same
HF mapping the weight sync uses (``megatron_workers.hf_weights``). OUT then holds:
- ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``
  when the weights exceed ``--max-shard-size`` (default 2GB);
- ``config.json`` of the job's model (for a critic: the ``*ForTokenClassification`` architecture with
  one label, and its ``score.weight`` head; for a reward model (the actor of an ``algorithm.type: rm``
  job): ``*ForSequenceClassification`` with one label and the pad id, and its ``score.weight``),
  ``torch_dtype`` set to what was written;
- every other file of the model folder (tokenizer, chat template, generation config) copied as is.
The whole model passes through this process's memory once (CPU, float32 on a machine without CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)$|.*\.safetensors\.index\.json$|.*\.bin\.index\.json$")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ROLE_HEADS = {"actor": "lm", "critic": "value"}  # the trainable roles a checkpoint holds, and their heads


def role_head(cfg, role: str) -> str:
    """The head ``role`` was trained with in the checkpoint's job: a preference objective's for the
    actor (``algorithm.type``: the reward model's score head for rm), else ``ROLE_HEADS``."""
    from rlcore.preference_losses import PREFERENCE_OBJECTIVES, is_preference

    if role == "actor" and is_preference(cfg):
        return PREFERENCE_OBJECTIVES.meta(cfg.algorithm.type).head
    return ROLE_HEADS[role]


class ExportError(Exception):
    """An export that cannot be done; the message names the file or option."""


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1.5GiB' or a number of bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ExportError(f"--max-shard-size={text!r}: expected a size like 2GB, 500MB or a byte count")
    unit = (m.group(2) or "").upper().rstrip("B")
    scale = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12,
             "KI": 2 ** 10, "MI": 2 ** 20, "GI": 2 ** 30, "TI": 2 ** 40}[unit]
    size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise ExportError(f"--max-shard-size={text!r} must be positive")
    return size


def shard_tensors(tensors: dict, max_shard_bytes: int) -> list[dict]:
    """Consecutive groups of ``tensors`` (in order) of at most ``max_shard_bytes`` each (a tensor
    larger than that gets a shard of its own)."""
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current:
        shards.append(current)
    return shards


def write_safetensors(tensors: dict, out: str, max_shard_bytes: int) -> list[str]:
    """Writes ``tensors`` in HF's (sharded) safetensors layout; returns the files written."""
    from safetensors.torch import save_file

    shards = shard_tensors(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file({k: v.contiguous() for k, v in shards[0].items()}, os.path.join(out, "model.safetensors"),
                  metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(out, name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names + ["model.safetensors.index.json"]


def _gather_role_weights(role_dir: str, role: str, model_path: str, cfg, head: str) -> dict:
    """Loads the role's distributed checkpoint into a forward-only TP1 PP1 engine of the role's head
    in this process and returns its full HF-named tensors."""
    import torch
    import torch.distributed as dist

    from megatron_workers.engine import MegatronEngine, free_port
    from rlcore.roles import RoleSpec

    profile = "gpu" if torch.cuda.is_available() else "cpu"
    dtype = "float32" if profile == "cpu" else "bfloat16"
    spec = RoleSpec(role, model_path, tp=1, pp=1, dp=1, micro_batch_size=1, profile=profile, dtype=dtype,
                    seed=cfg.trainer.seed, head=head)
    engine = MegatronEngine(spec, rank=0)
    engine.init("127.0.0.1", free_port())
    try:
        engine.load_checkpoint(role_dir, with_optimizer=False)
        return engine.hf_state_dict()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def export_hf(checkpoint: str, out: str, role: str = "actor", max_shard_bytes: int = 2 * 10 ** 9,
              dtype: str = "auto", model_path: str | None = None) -> list[str]:
    """Exports ``role`` of ``checkpoint`` (a step_N folder, or a checkpoint_dir: its ``latest``) to the
    HF folder ``out``. Returns the files written."""
    import torch

    from rlcore.checkpoint import JOB, LATEST, CheckpointError, read_latest, verify_checkpoint
    from rlcore.job import load_job

    if os.path.isfile(os.path.join(checkpoint, LATEST)):
        checkpoint = read_latest(checkpoint) or checkpoint
    verify_checkpoint(checkpoint)  # a damaged file is named before anything is loaded
    role_dir = os.path.join(checkpoint, role)
    if not os.path.isdir(role_dir):
        roles = sorted(d for d in os.listdir(checkpoint) if os.path.isdir(os.path.join(checkpoint, d)))
        raise ExportError(f"{role_dir}: the checkpoint has no {role!r} role (it has {roles})")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    if os.path.isdir(out) and os.listdir(out):
        raise ExportError(f"{out}: not empty; export into a new or empty folder")
    cfg = load_job(os.path.join(checkpoint, JOB), [])
    if model_path is None:
        model_path = (cfg.critic.model_path or cfg.model.path) if role == "critic" else cfg.model.path
    config_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_path):
        raise ExportError(f"{config_path}: not found; the export takes the config and tokenizer from the "
                          f"job's model folder: give it with --model PATH")
    with open(config_path) as f:
        hf_config = json.load(f)

    from megatron_workers.heads import HEADS

    head = role_head(cfg, role)
    try:  # before anything is loaded or written
        out_config = HEADS[head].hf_config(hf_config)
    except ValueError as e:  # e.g. a reward model whose config has no pad_token_id for SeqCls
        raise ExportError(f"{config_path}: {e}") from e
    tensors = _gather_role_weights(role_dir, role, model_path, cfg, head)
    if dtype == "auto":  # the dtype of the model the job started from
        dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    torch_dtype = getattr(torch, dtype)
    tensors = {k: v.to(torch_dtype) for k, v in tensors.items()}

    os.makedirs(out, exist_ok=True)
    written = write_safetensors(tensors, out, max_shard_bytes)
    for name in sorted(os.listdir(model_path)):  # tokenizer, chat template, generation config, ...
        src = os.path.join(model_path, name)
        if os.path.isfile(src) and name != "config.json" and not WEIGHT_FILE.match(name):
            shutil.copy2(src, os.path.join(out, name))
            written.append(name)
    out_config["torch_dtype"] = dtype
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(out_config, f, indent=2)
    written.append("config.json")
    return written


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint as a HuggingFace model folder")
    p.add_argument("checkpoint", help="a step_N checkpoint folder, or a checkpoint_dir (its latest)")
    p.add_argument("--to", required=True, choices=["hf"], help="the output format")
    p.add_argument("out", help="the output folder (new or empty)")
    p.add_argument("--role", default="actor", choices=sorted(ROLE_HEADS), help="which model to export")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights dtype (default: the torch_dtype of the job's model config.json)")
    p.add_argument("--model", default=None,
                   help="the HF folder to take config and tokenizer from (default: the job's model.path)")


def run_export(args: argparse.Namespace) -> int:
    from rlcore.checkpoint import CheckpointError
    from rlcore.job import ConfigError

    try:
        files = export_hf(args.checkpoint, args.out, args.role, parse_size(args.max_shard_size), args.dtype,
                          args.model)
    except (ExportError, CheckpointError, ConfigError) as e:
        print(f"rlx export: {e}", file=sys.stderr)
        return 2
    print(f"rlx export: wrote {args.out}: {', '.join(files)}")
    return 0
