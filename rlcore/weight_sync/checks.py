"""``rollout.check_weights``: per-tensor checksums of what the senders packed against what every engine
holds after a sync."""
from __future__ import annotations

import torch


CHECKSUM_CHUNK = 1 << 18  # elements on CPU: 2 MiB of float64 per temporary, kept in the cache
CHECKSUM_CHUNK_GPU = 1 << 24  # on a GPU: 128 MiB per temporary, few kernel launches, bounded memory


def checksum(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Cheap per-tensor fingerprint: the float64 sum of the values plus their sum weighted by position
    (value i times i / numel, 1-based, so a swap of two values changes it too). Equal tensors give
    bit-equal fingerprints on one kind of device (across CPU and GPU they agree to rounding, well
    within ``compare_checksums``' tolerance). Taken a chunk of elements at a time: on CPU, the float64 copy and the
    weights of a whole tensor (SmolLM2's 28M-element embedding: two 226 MB temporaries) are made and
    faulted in for one pass each, ~8x slower than chunks that stay in the cache; on a GPU, a large
    vocabulary's would take gigabytes."""
    out = {}
    for name, t in tensors:
        x = t.detach().reshape(-1)
        n = x.numel()
        chunk = CHECKSUM_CHUNK if x.device.type == "cpu" else CHECKSUM_CHUNK_GPU
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for start in range(0, n, chunk):
            part = x[start:start + chunk].double()
            w = torch.arange(start + 1, start + part.numel() + 1, dtype=torch.float64, device=x.device) / n
            total += part.sum() + (part * w).sum()
        out[name] = float(total)
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
