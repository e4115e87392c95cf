"""Advantage estimators, KL estimators, policy losses and loss aggregation: plain torch.

Loss normalisation contract (why the numbers are right under any micro-batching, DP or PP split):
the controller counts the loss denominator over the *global* batch (``global_tokens``) before the
update; every micro-batch returns ``sum(per_token_loss * mask) / global_tokens``. Summing those
contributions over micro-batches and DP ranks gives exactly the token-mean over the global batch, and
so does its gradient. Metrics use the same contract, so they are additive across micro-batches and
ranks too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# --------------------------------------------------------------------------------------- advantages
ADV_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}


def register_adv_estimator(name: str):
    def deco(fn):
        ADV_ESTIMATORS[name] = fn
        return fn

    return deco


@register_adv_estimator("grpo")
def grpo_advantages(scores: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage of each sample: (score - group mean) / (group std + eps).

    ``scores`` [N] float (one scalar reward per sample); ``group_index`` [N] int64, samples of the same
    prompt share an index. The std is the unbiased one (as in the GRPO paper and verl); a group of one
    sample gets advantage 0.
    """
    scores = scores.float()
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups).index_add_(0, inv, torch.ones_like(scores))
    mean = torch.zeros(n_groups).index_add_(0, inv, scores) / count
    centred = scores - mean[inv]
    if not norm_by_std:
        return centred
    var = torch.zeros(n_groups).index_add_(0, inv, centred ** 2) / (count - 1).clamp(min=1)
    std = var.sqrt()
    adv = centred / (std[inv] + eps)
    return torch.where(count[inv] > 1, adv, torch.zeros_like(adv))


# --------------------------------------------------------------------------------------------- KL
def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    k3 = exp(ref - logp) - (ref - logp) - 1 is unbiased and always >= 0 (the low-variance one)."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind == "k3":
        # Clamped as verl does: a huge exp() from one far-off token would swamp the batch.
        neg = (-log_ratio).clamp(-20.0, 20.0)
        return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of k1, k2, k3")


# ------------------------------------------------------------------------------------ aggregation
AGG_MODES = ("token-mean",)


def aggregate(values: torch.Tensor, mask: torch.Tensor, denominator: float, mode: str = "token-mean") -> torch.Tensor:
    """This micro-batch's share of the global aggregate (see the module docstring)."""
    if mode == "token-mean":
        return (values * mask).sum() / denominator
    raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(AGG_MODES)}")


# --------------------------------------------------------------------------------- policy losses
@dataclass
class LossConfig:
    policy_loss: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    entropy_coeff: float = 0.0
    kl_coeff: float = 0.0  # > 0 adds the KL to the reference as a loss term
    kl_estimator: str = "k3"
    loss_agg_mode: str = "token-mean"


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def register_policy_loss(name: str):
    def deco(fn):
        POLICY_LOSSES[name] = fn
        return fn

    return deco


@register_policy_loss("vanilla")
def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).

    Returns (loss [B,S], clipped [B,S] as 0/1 float)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def actor_loss(logprobs: torch.Tensor, entropy: torch.Tensor, batch, cfg: LossConfig,
               global_tokens: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss for one micro-batch, and its additive metric contributions.

    ``logprobs``/``entropy`` [B,S] come from the model being trained (aligned with tokens); ``batch``
    holds ``response_mask``, ``old_logprobs``, ``advantages`` and, when ``cfg.kl_coeff > 0``,
    ``ref_logprobs``. ``global_tokens`` is the number of response tokens in the global batch.
    """
    mask = batch["response_mask"]
    old = batch["old_logprobs"]
    pg_mat, clipped = POLICY_LOSSES[cfg.policy_loss](logprobs, old, batch["advantages"], cfg)

    def agg(x):
        return aggregate(x, mask, global_tokens, cfg.loss_agg_mode)

    pg_loss = agg(pg_mat)
    ent = agg(entropy)
    loss = pg_loss - cfg.entropy_coeff * ent
    metrics = {
        "actor/pg_loss": pg_loss.detach(),
        "actor/entropy": ent.detach(),
        "actor/clip_frac": agg(clipped).detach(),
        # k1 of old vs new on the sampled tokens, as verl/slime report ppo_kl: 0 on the first step.
        "actor/ppo_kl": agg((old - logprobs).detach()),
    }
    if cfg.kl_coeff > 0:
        kl = agg(kl_estimate(logprobs, batch["ref_logprobs"], cfg.kl_estimator))
        loss = loss + cfg.kl_coeff * kl
        metrics["actor/kl_ref"] = kl.detach()
    return loss, metrics
