"""The batch passed between roles: named tensors that share a leading batch dimension.

Conventions (every role relies on them):
- ``input_ids`` [B, S] int64: prompt tokens then response tokens, right-padded with the pad id.
- ``attention_mask`` [B, S] int64: 1 on real (prompt or response) tokens.
- ``response_mask`` [B, S] float32: 1 where token ``t`` is a response token, i.e. a token the policy
  chose and the loss trains on.
- Per-token quantities (``old_logprobs``, ``ref_logprobs``, ``rollout_logprobs``, ``advantages``) are
  aligned with the tokens: ``x[b, t]`` belongs to ``input_ids[b, t]`` (for log-probs: log p(token t |
  tokens < t)). Position 0 holds 0. Right padding with a causal mask never changes real positions, so
  no attention mask needs to reach the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class Batch(dict):
    """A ``dict[str, Tensor]`` whose tensors share dimension 0."""

    @property
    def size(self) -> int:
        return next(iter(self.values())).shape[0] if self else 0

    def select(self, *keys: str) -> "Batch":
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no {missing}; it has {sorted(self)}")
        return Batch({k: self[k] for k in keys})

    def slice(self, start: int, end: int) -> "Batch":
        return Batch({k: v[start:end] for k, v in self.items()})

    def split(self, chunk_size: int) -> list["Batch"]:
        """Consecutive chunks of ``chunk_size`` rows (the last one may be smaller)."""
        return [self.slice(i, i + chunk_size) for i in range(0, self.size, chunk_size)]

    def shard(self, rank: int, world: int) -> "Batch":
        """The ``rank``-th of ``world`` equal consecutive shards (data parallelism)."""
        if self.size % world:
            raise ValueError(f"batch of {self.size} rows does not split evenly over {world} ranks")
        per = self.size // world
        return self.slice(rank * per, (rank + 1) * per)

    @staticmethod
    def cat(parts: list["Batch"]) -> "Batch":
        return Batch({k: torch.cat([p[k] for p in parts]) for k in parts[0]})


@dataclass
class Trajectory:
    """One sampled response, as the rollout engine returns it."""

    prompt_index: int  # which prompt of the generate() request it answers
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]  # the engine's log-prob of each response token
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    weight_version: int  # the weight-sync version that sampled its first token: the oldest of its tokens
    # The version that sampled each response token (non-decreasing). More than one version only with
    # rollout.partial_rollouts, where a weight sync lands mid-generation; None: all by weight_version.
    token_versions: Optional[list[int]] = None

    @property
    def spans_versions(self) -> bool:
        """Whether weights of more than one version sampled its tokens (a partial rollout)."""
        return self.token_versions is not None and len(set(self.token_versions)) > 1


def build_batch(trajs: list[Trajectory], pad_id: int) -> Batch:
    """Right-padded prompt+response tokens with token-aligned masks and engine log-probs."""
    seq_len = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    n = len(trajs)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, seq_len), dtype=torch.long)
    response_mask = torch.zeros((n, seq_len))
    rollout_logprobs = torch.zeros((n, seq_len))
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        attention_mask[i, :p + r] = 1
        response_mask[i, p:p + r] = 1.0
        rollout_logprobs[i, p:p + r] = torch.tensor(t.response_logprobs)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                 rollout_logprobs=rollout_logprobs)
