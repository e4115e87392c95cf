"""Checkpoints of a run: what is saved, how it is made atomic, and how a run finds one to resume from.

Layout under ``trainer.checkpoint_dir`` (default ``<run_dir>/checkpoints``)::

    latest                    the name of the newest complete checkpoint ("step_00000004"), written last
    step_00000004/
      actor/                  megatron-core distributed checkpoint of the actor (model, optimizer,
                              lr scheduler): metadata.json, common.pt, .metadata, __<rank>_<i>.distcp
      critic/                 the same for the critic, when the job has one
      controller.json         step, weight version, dataloader position, KL controller state, and
                              which batches were queued ahead (trainer.off_policy_steps > 0)
      queued_batches.pt       those batches' samples (prompt indices, trajectories, scores, rewards,
                              the metrics sampling reported), when any were queued
      rng.pt                  python / numpy / torch RNG states of the controller
      job.yaml                the resolved job spec that wrote it
      manifest.json           every file above with its size and CRC-32; written last inside the folder
    .tmp-step_00000005/       a checkpoint being written: never read, removed by the next save

A checkpoint is written into ``.tmp-<name>``, its manifest last, then renamed to ``<name>`` (an atomic
rename on one filesystem), and only then does ``latest`` move to it (write-to-temp + ``os.replace``).
A crash at any point leaves either the old ``latest`` or the new one, never a half checkpoint under a
checkpoint's name. Resuming checks every file against the manifest (sizes, then CRC-32), so a
truncated or corrupted file is named before any worker loads it; the cost is one read of the
checkpoint per save and per resume.

With ``trainer.off_policy_steps = K > 0`` the batches after the step were sampled already, by
weight versions no checkpoint holds; the controller state carries them (``QUEUED_KEY``: per batch its
number, the loader position before it and its samples) and the samples go to ``queued_batches.pt``,
tensors only (trajectories, never logits), so a resumed run trains on exactly those batches.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import zlib
from typing import Callable, Optional

LATEST = "latest"
MANIFEST = "manifest.json"
CONTROLLER = "controller.json"
RNG = "rng.pt"
JOB = "job.yaml"
QUEUED = "queued_batches.pt"
QUEUED_KEY = "queued_batches"  # in the controller state: [{"batch", "loader_before", "samples"}]
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and what is wrong with it."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_dir_of(trainer_cfg) -> str:
    """``trainer.checkpoint_dir``, or ``<run_dir>/checkpoints`` when it is not set."""
    return trainer_cfg.checkpoint_dir or os.path.join(trainer_cfg.run_dir, "checkpoints")


def seed_everything(seed: int) -> None:
    """Seeds every random source of the controller (python, numpy, torch)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------ the manifest
def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * 1024 * 1024):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            out.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(f for f in out if f != MANIFEST)


def write_manifest(folder: str, step: int) -> None:
    files = {rel: {"size": os.path.getsize(os.path.join(folder, rel)), "crc32": _crc32(os.path.join(folder, rel))}
             for rel in _files(folder)}
    _write_atomic(os.path.join(folder, MANIFEST),
                  json.dumps({"format": FORMAT_VERSION, "step": step, "files": files}, indent=1))


def verify_checkpoint(folder: str) -> dict:
    """Checks every file of the checkpoint ``folder`` against its manifest; returns the controller
    state. Raises ``CheckpointError`` naming the first missing, truncated or corrupted file."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a checkpoint folder (it does not exist)")
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{manifest_path}: missing, so the checkpoint was never completed")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path}: corrupted ({e})") from e
    for rel, expected in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        size = os.path.getsize(path)
        if size != expected["size"]:
            raise CheckpointError(f"{path}: truncated or overwritten: {size} bytes, the manifest says "
                                  f"{expected['size']}")
        if _crc32(path) != expected["crc32"]:
            raise CheckpointError(f"{path}: corrupted: its CRC-32 differs from the manifest's")
    for rel in (CONTROLLER, RNG, JOB):
        if rel not in files:
            raise CheckpointError(f"{os.path.join(folder, rel)}: missing from the checkpoint")
    with open(os.path.join(folder, CONTROLLER)) as f:
        state = json.load(f)
    if state.get(QUEUED_KEY) and QUEUED not in files:
        raise CheckpointError(f"{os.path.join(folder, QUEUED)}: missing from the checkpoint, whose "
                              f"{CONTROLLER} lists queued batches {[q['batch'] for q in state[QUEUED_KEY]]}")
    return state


def load_queued_samples(folder: str, state: dict) -> dict:
    """``state`` (``folder``'s controller state) with each queued batch's samples read back from
    ``queued_batches.pt``."""
    queued = state.get(QUEUED_KEY)
    if not queued:
        return state
    import torch

    path = os.path.join(folder, QUEUED)
    samples = torch.load(path, weights_only=True)
    if not isinstance(samples, list) or len(samples) != len(queued):
        raise CheckpointError(f"{path}: holds {len(samples) if isinstance(samples, list) else type(samples).__name__} "
                              f"batches, {CONTROLLER} lists {len(queued)}")
    return {**state, QUEUED_KEY: [{**q, "samples": s} for q, s in zip(queued, samples)]}


# ---------------------------------------------------------------------------------------- saving
def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(checkpoint_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of every ``step_N`` folder, newest first; ``.tmp-*`` folders are never listed."""
    if not os.path.isdir(checkpoint_dir):
        return []
    found = []
    for name in os.listdir(checkpoint_dir):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(checkpoint_dir, name)):
            found.append((int(m.group(1)), os.path.join(checkpoint_dir, name)))
    return sorted(found, reverse=True)


def read_latest(checkpoint_dir: str) -> Optional[str]:
    """The folder ``latest`` names, or None when there is no (readable) pointer."""
    path = os.path.join(checkpoint_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    return os.path.join(checkpoint_dir, name) if _STEP_DIR.match(name) else None


def save_checkpoint(checkpoint_dir: str, step: int, roles: dict, controller: dict, job_yaml: str,
                    keep_last: int = 0, log: Callable[[str], None] = print) -> str:
    """Writes the checkpoint of ``step``: each role's ``save_checkpoint(folder)`` (a ``TrainableRole``),
    the controller state and the job spec; then renames it into place, moves ``latest`` and prunes
    all but the newest ``keep_last`` checkpoints (0 keeps all). Returns the checkpoint's folder."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    name = step_dir_name(step)
    final, tmp = os.path.join(checkpoint_dir, name), os.path.join(checkpoint_dir, TMP_PREFIX + name)
    for stale in os.listdir(checkpoint_dir):  # left by a crash during an earlier save
        if stale.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(checkpoint_dir, stale), ignore_errors=True)
    os.makedirs(tmp)
    for role, group in roles.items():
        group.save_checkpoint(os.path.join(tmp, role))
    import torch

    queued = controller.get(QUEUED_KEY)
    if queued:  # the samples to their tensor file; controller.json keeps which batches and where the loader was
        torch.save([q["samples"] for q in queued], os.path.join(tmp, QUEUED))
        controller = {**controller, QUEUED_KEY: [{k: v for k, v in q.items() if k != "samples"} for q in queued]}
    with open(os.path.join(tmp, CONTROLLER), "w") as f:
        json.dump({"format": FORMAT_VERSION, "roles": sorted(roles), **controller}, f, indent=1)
    torch.save(rng_states(), os.path.join(tmp, RNG))
    with open(os.path.join(tmp, JOB), "w") as f:
        f.write(job_yaml)
    write_manifest(tmp, step)
    if os.path.exists(final):  # a checkpoint of the same step from an earlier run (resume=never)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(checkpoint_dir)
    _write_atomic(os.path.join(checkpoint_dir, LATEST), name + "\n")
    if keep_last > 0:
        for _, old in list_checkpoints(checkpoint_dir)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
    log(f"checkpoint: saved step {step} to {final}")
    return final


# ------------------------------------------------------------------------------- controller state
def rng_states() -> dict:
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_states(states: dict) -> None:
    import numpy as np
    import torch

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def job_yaml(cfg) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# --------------------------------------------------------------------------------------- resuming
def find_resume_checkpoint(resume: str, checkpoint_dir: str, log: Callable[[str], None] = print
                           ) -> Optional[tuple[str, dict]]:
    """(folder, controller state) of the checkpoint to resume from, or None to start from scratch.

    - ``never``: None.
    - ``auto``: the checkpoint ``latest`` names (or, without a pointer, the newest one); one that fails
      verification is reported and the previous complete checkpoint is tried. None when there is
      no checkpoint at all; ``CheckpointError`` when checkpoints exist but none is usable.
    - a path: that checkpoint folder (or the one ``latest`` names, for a checkpoint_dir), strictly:
      a bad file is an error naming it, there is no fallback."""
    if resume == "never":
        return None
    if resume != "auto":
        folder = resume
        if os.path.isfile(os.path.join(resume, LATEST)):
            folder = read_latest(resume)
            if folder is None:
                raise CheckpointError(f"{os.path.join(resume, LATEST)}: does not name a step_N checkpoint")
        return folder, verify_checkpoint(folder)

    candidates = list_checkpoints(checkpoint_dir)
    latest = read_latest(checkpoint_dir)
    if latest is not None and os.path.isdir(latest):
        latest_step = int(_STEP_DIR.match(os.path.basename(latest)).group(1))
        # A folder newer than `latest` was renamed into place but never committed by the pointer.
        candidates = [(s, f) for s, f in candidates if s <= latest_step]
    elif candidates:
        log(f"checkpoint: {os.path.join(checkpoint_dir, LATEST)} is missing or names no checkpoint; "
            f"looking at the step_N folders instead")
    failures = []
    for _, folder in candidates:
        try:
            state = verify_checkpoint(folder)
        except CheckpointError as e:
            failures.append(str(e))
            log(f"checkpoint: cannot resume from {folder}: {e}")
            continue
        if failures:
            log(f"checkpoint: falling back to the previous complete checkpoint {folder}")
        return folder, state
    if failures:
        raise CheckpointError(f"no usable checkpoint in {checkpoint_dir}: " + "; ".join(failures))
    return None


def _spec_changes(old_yaml: str, cfg) -> list[str]:
    """Keys whose values differ between the saved job spec and this one (e.g. a new TP/PP layout)."""
    from omegaconf import OmegaConf

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    old = flat(OmegaConf.to_container(OmegaConf.create(old_yaml)))
    new = flat(OmegaConf.to_container(OmegaConf.structured(cfg)))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]


def trim_metrics(run_dir: str, step: int) -> None:
    """Drops the lines of steps after ``step`` from ``<run_dir>/metrics.jsonl``: the steps a killed
    run logged after its last checkpoint are run again, and each step must appear once."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by the kill
    if len(kept) != len(lines):
        _write_atomic(path, "".join(kept))


def resume(cfg, roles: dict, log: Callable[[str], None] = print) -> Optional[dict]:
    """Resumes per ``cfg.trainer.resume``: loads every trainable role of ``roles`` (name -> role with
    ``load_checkpoint``; any TP/PP layout) and the controller's RNG states, drops the metrics lines of
    the steps that will run again, and returns the saved controller state (the caller restores it and
    pushes the restored weights to the engines). None: nothing to resume, a fresh start."""
    import torch

    t = cfg.trainer
    found = find_resume_checkpoint(t.resume, checkpoint_dir_of(t), log)
    if found is None:
        return None
    folder, state = found
    state = load_queued_samples(folder, state)
    for name in roles:
        role_dir = os.path.join(folder, name)
        if not os.path.isdir(role_dir):
            raise CheckpointError(f"{role_dir}: missing; the checkpoint holds the roles {state.get('roles')} "
                                  f"but this job trains {sorted(roles)}")
    with open(os.path.join(folder, JOB)) as f:
        changes = _spec_changes(f.read(), cfg)
    if changes:
        log(f"checkpoint: the job spec differs from the one that saved {folder}: " + "; ".join(changes))
    for name, role in roles.items():
        role.load_checkpoint(os.path.join(folder, name))
    set_rng_states(torch.load(os.path.join(folder, RNG), weights_only=False))
    step = int(state["step"])
    trim_metrics(t.run_dir, step)
    log(f"checkpoint: resumed from {folder} (step {step}, weight version {state['weight_version']})")
    return state


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
