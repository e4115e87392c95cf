"""Preference objectives: the losses trained on (chosen, rejected) pairs, in plain torch, and their registry.

A preference batch (``rlcore.preference_data.pair_batch``) holds 2P rows: row 2i is pair i's prompt +
chosen completion, row 2i+1 the same prompt + the rejected one. Micro-batches hold whole pairs, so a
loss reads the pairs of its micro-batch as ``x[0::2]`` (chosen) and ``x[1::2]`` (rejected).

As every loss of ``rlcore.algos``, a loss returns this micro-batch's share of the mini-batch aggregate:
``loss_weights`` [2P] carries each pair's weight (1 / pairs in the mini-batch, on both of its rows), so
the sums over micro-batches and DP ranks of the loss and of every metric are their means over the
mini-batch's pairs, whatever the split.

``PREFERENCE_OBJECTIVES`` maps ``algorithm.type`` to the objective: the head the trained role is built
with (``megatron_workers/heads.py``), whether the batch needs the reference's log-probs, the section of
``algorithm`` holding its loss knobs, and the function that computes its metrics on the controller from
the role's forward outputs (validation pairs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rlcore.algos import rm_metrics
from rlcore.batch import Batch
from rlcore.registry import Registry

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logprobs(logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] each row's log-probability of its completion: the token log-probs summed over ``response_mask``."""
    return (logprobs.float() * response_mask.float()).sum(dim=1)


def chosen_rejected(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) halves of a per-row tensor of consecutive pairs (rows 2i, 2i+1)."""
    if x.shape[0] % 2:
        raise ValueError(f"{x.shape[0]} rows are not whole (chosen, rejected) pairs: micro-batches must hold "
                         "rows 2i and 2i+1 together")
    return x[0::2], x[1::2]


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, pair_weights: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, sft_coeff: float = 0.0, chosen_tokens: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023) or IPO (Azar et al. 2023) on P pairs: every argument [P] (sequence
    log-probs of the completions under the policy and the reference; ``pair_weights`` the share of each
    pair in the aggregate). With the margin h = (pc - rc) - (pr - rr):

    - sigmoid: -(1 - ls) * logsigmoid(beta * h) - ls * logsigmoid(-beta * h)  (ls = label_smoothing, cDPO);
    - ipo: (h - 1 / (2 beta))^2;

    plus, with ``sft_coeff`` > 0, sft_coeff x the chosen completion's mean token NLL, -pc / chosen_tokens
    (RPO, Pang et al. 2024; TRL's rpo_alpha): it keeps the chosen completions likely, which DPO alone
    lets fall together with the rejected ones.

    Returns (sum(w * loss), metrics as weighted sums): dpo/loss, dpo/reward_accuracy (the implicit
    reward beta * (log pi - log pi_ref) of chosen above rejected's), dpo/margin (their difference),
    dpo/chosen_reward, dpo/rejected_reward, dpo/chosen_logprob_mean, dpo/rejected_logprob_mean."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"algorithm.dpo.loss_type={loss_type!r} is not one of: {', '.join(DPO_LOSS_TYPES)}")
    chosen_logratio = policy_chosen.float() - ref_chosen.float()
    rejected_logratio = policy_rejected.float() - ref_rejected.float()
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        per_pair = (-(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h))
    else:
        per_pair = (h - 1.0 / (2.0 * beta)) ** 2
    if sft_coeff:
        per_pair = per_pair + sft_coeff * -policy_chosen.float() / chosen_tokens.float()
    w = pair_weights.float()
    chosen_reward = (beta * chosen_logratio).detach()
    rejected_reward = (beta * rejected_logratio).detach()
    loss = (per_pair * w).sum()
    metrics = {
        "dpo/loss": loss.detach(),
        "dpo/reward_accuracy": ((chosen_reward > rejected_reward).float() * w).sum(),
        "dpo/margin": ((chosen_reward - rejected_reward) * w).sum(),
        "dpo/chosen_reward": (chosen_reward * w).sum(),
        "dpo/rejected_reward": (rejected_reward * w).sum(),
        "dpo/chosen_logprob_mean": (policy_chosen.detach().float() * w).sum(),
        "dpo/rejected_logprob_mean": (policy_rejected.detach().float() * w).sum(),
    }
    return loss, metrics


def dpo_batch_loss(logprobs: torch.Tensor, batch: Batch, loss_cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``dpo_loss`` of a batch of consecutive pairs: the policy's token-aligned ``logprobs`` [2P, S]; the
    batch's ``ref_logprobs``, ``response_mask`` and ``loss_weights`` [2P]; ``loss_cfg`` the
    ``algorithm.dpo`` section."""
    mask = batch["response_mask"]
    pc, pr = chosen_rejected(sequence_logprobs(logprobs, mask))
    rc, rr = chosen_rejected(sequence_logprobs(batch["ref_logprobs"], mask))
    weights, _ = chosen_rejected(batch["loss_weights"])
    chosen_tokens, _ = chosen_rejected(mask.float().sum(dim=1))
    return dpo_loss(pc, pr, rc, rr, weights, loss_cfg.beta, loss_cfg.loss_type, loss_cfg.label_smoothing,
                    loss_cfg.sft_coeff, chosen_tokens)


def pair_weights(rows: int) -> torch.Tensor:
    """``loss_weights`` [rows] of a mini-batch of rows/2 pairs: 1 / pairs on every row."""
    return torch.full((rows,), 2.0 / rows)


# --------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class PreferenceObjective:
    head: str  # the trained role's head (megatron_workers/heads.py HEADS)
    needs_reference: bool  # the batch carries the reference's ref_logprobs (a forward-only LM role)
    loss_section: str  # the field of AlgorithmConfig that is the loss's config (algorithm.<loss_section>)
    output: str  # what the trained role's forward returns that the metrics function reads


def dpo_metrics(outputs: dict[str, torch.Tensor], batch: Batch, loss_cfg) -> dict[str, float]:
    """The DPO loss and metrics of a whole batch of pairs (validation), from the policy's forward."""
    _, metrics = dpo_batch_loss(outputs["logprobs"], Batch({**batch, "loss_weights": pair_weights(batch.size)}),
                                loss_cfg)
    return {k: float(v) for k, v in metrics.items()}


# name -> the metrics function of a batch of pairs on the controller (outputs of the trained role's
# forward, the batch, the loss config) -> dict; the loss itself is the head's (megatron_workers/heads.py).
PREFERENCE_OBJECTIVES: Registry[Callable[..., dict[str, float]]] = Registry("algorithm.type", meta=PreferenceObjective)
PREFERENCE_OBJECTIVES.add("dpo", dpo_metrics, head="dpo", needs_reference=True, loss_section="dpo",
                          output="logprobs")
PREFERENCE_OBJECTIVES.add("rm", rm_metrics, head="score", needs_reference=False, loss_section="rm", output="scores")


def algorithm_types() -> tuple[str, ...]:
    """Every valid ``algorithm.type``: rl (the RL trainer, rlcore/trainer.py) and the objectives."""
    return ("rl", *PREFERENCE_OBJECTIVES)


def is_preference(cfg) -> bool:
    return cfg.algorithm.type != "rl"


def objective_loss_config(cfg):
    """The loss config of the job's preference objective (``algorithm.<loss_section>``)."""
    return getattr(cfg.algorithm, PREFERENCE_OBJECTIVES.meta(cfg.algorithm.type).loss_section)
