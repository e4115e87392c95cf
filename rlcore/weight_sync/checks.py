"""``rollout.check_weights``: per-tensor checksums of what the senders packed against what every engine
holds after a sync."""
from __future__ import annotations

import torch


def checksum(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Cheap per-tensor fingerprint: the float64 sum of the values plus their sum weighted by position
    (so a swap of two values changes it too). Equal tensors give bit-equal fingerprints."""
    out = {}
    for name, t in tensors:
        x = t.detach().double().reshape(-1)
        w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device) / x.numel()
        out[name] = float(x.sum() + (x * w).sum())
    return out


class WeightMismatchError(RuntimeError):
    """An engine's weights after a sync differ from the trainer's (``check_weights``)."""


def compare_checksums(expected: dict[str, float], got: dict[str, float], where: str,
                      order: list[str] | None = None, rel: float = 1e-9) -> None:
    """Raises ``WeightMismatchError`` naming the first tensor (in ``order``, default sorted names) whose
    checksum in ``got`` differs from ``expected`` by more than ``rel`` (relative to the tensor's scale)
    or is missing. ``where`` names the engine."""
    for name in order or sorted(expected):
        if name not in expected:
            continue
        want, have = expected[name], got.get(name)
        if have is None:
            raise WeightMismatchError(f"weight check: {where} has no tensor {name} after the sync")
        if abs(have - want) > rel * max(1.0, abs(want)):
            raise WeightMismatchError(f"weight check: {where} holds a different {name} than the trainer after "
                                      f"the sync (checksum {have!r}, trainer's {want!r})")


def check_engines(expected: dict[str, float], per_engine: list[dict[str, float]],
                  order: list[str] | None = None) -> None:
    """``compare_checksums`` for every engine's checksums (``WeightReceiver.weight_checksums()``)."""
    for e, got in enumerate(per_engine):
        compare_checksums(expected, got, f"rollout engine {e}", order)
