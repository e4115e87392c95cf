"""Role heads: what a Megatron role's last pipeline stage computes from the model's output.

The engine (``engine.MegatronEngine``) is the same for every role; the head is the part plugged in:
- how the model chunk is built (the vocabulary projection, or the scalar value head);
- what a forward-only pass returns per micro-batch (``outputs``);
- the loss hook of the update (``loss``), with the keys of the batch it reads.
A new scoring model (e.g. a reward model's last-token score) is one new head class and one
``HEADS.add`` line.

Every head's loss returns this micro-batch's share of the global aggregate (rlcore.algos: the
controller's ``loss_weights`` are normalised over the whole mini-batch), so the engine can sum the
shares over micro-batches and DP ranks, plus the token-aligned outputs it keeps for the caller.

The model's output reaches a head for the scored positions only (``packing.ModelInputs``: ``src``
set, output [1, N, .]), or for every position (``src`` None, output [b, s, .]); either way the head
hands rlcore token-aligned [b, S] tensors.
"""
from __future__ import annotations

from typing import Optional

import torch

from rlcore.batch import Batch
from rlcore.registry import Registry


class LMHead:
    """The causal LM's vocabulary logits: per-token log-probs and entropy; trained with the policy
    loss (``rlcore.algos.actor_loss``)."""

    forward_keys = ("input_ids", "attention_mask", "response_mask")  # the masks: which outputs are read, packing
    train_keys: Optional[tuple[str, ...]] = None  # the policy loss may read any key: send the whole batch

    @staticmethod
    def build(hf, config, profile: str, vp_stage, seed: int, explicit_mask: bool = False):
        from .model import build_gpt_model

        return build_gpt_model(hf, config, profile, vp_stage=vp_stage, explicit_mask=explicit_mask)

    @staticmethod
    def outputs(output: torch.Tensor, micro_batch: Batch, inputs, tp_group, temperature: float = 1.0) -> dict:
        from .logprobs import scored_logprobs_and_entropy

        lp, ent = scored_logprobs_and_entropy(output, micro_batch["input_ids"], inputs, temperature, tp_group)
        return {"logprobs": lp, "entropy": ent}

    @staticmethod
    def check_update(batch: Batch, role: str, temperature: float = 1.0, on_policy: bool = False) -> None:
        if float(batch["response_mask"].sum()) <= 0:
            raise ValueError(f"{role} update: the batch has no response tokens (response_mask is all 0)")
        if "loss_weights" not in batch:
            raise ValueError(f"{role} update: the batch has no 'loss_weights' (set batch['loss_weights'] = "
                             "rlcore.algos.loss_weights(response_mask, loss_agg_mode, max_response_length) on the "
                             "whole mini-batch before the update)")
        if not on_policy and "old_logprobs" not in batch:
            raise ValueError(f"{role} update: the batch has no 'old_logprobs' (compute them with a forward pass, "
                             "or pass on_policy=True when this update is the first use of the weights on it)")

    @staticmethod
    def loss(output: torch.Tensor, micro_batch: Batch, inputs, loss_cfg, tp_group, temperature: float = 1.0,
             on_policy: bool = False):
        """``on_policy``: the update is the first use of these weights on this batch (one epoch, one
        mini-batch), so the old policy IS this forward: ``old_logprobs`` are its own log-probs,
        detached (ratio exactly 1), and they are kept for the caller instead of a separate pass."""
        from rlcore.algos import actor_loss

        from .logprobs import scored_logprobs_and_entropy

        logprobs, entropy = scored_logprobs_and_entropy(output, micro_batch["input_ids"], inputs, temperature,
                                                        tp_group)
        kept = {}
        if on_policy:
            kept["logprobs"] = logprobs.detach()
            micro_batch = Batch({**micro_batch, "old_logprobs": kept["logprobs"]})
        loss, metrics = actor_loss(logprobs, entropy, micro_batch, loss_cfg)
        return loss, metrics, kept

    @staticmethod
    def hf_config(causal_lm_config: dict) -> dict:
        return causal_lm_config


class ValueHead:
    """A scalar per token (PPO's critic, ``value_head.py``): token-aligned values; trained with the
    clipped value loss (``rlcore.algos.critic_loss``)."""

    forward_keys = ("input_ids", "attention_mask", "response_mask")
    train_keys = ("input_ids", "attention_mask", "response_mask", "returns", "old_values", "loss_weights")  # what critic_loss reads

    @staticmethod
    def build(hf, config, profile: str, vp_stage, seed: int, explicit_mask: bool = False):
        from .model import build_gpt_model

        return build_gpt_model(hf, config, profile, vp_stage=vp_stage, value_head_seed=seed,
                               explicit_mask=explicit_mask)

    @staticmethod
    def outputs(output: torch.Tensor, micro_batch: Batch, inputs, tp_group) -> dict:
        from .value_head import scored_values

        return {"values": scored_values(output, inputs)}

    @staticmethod
    def check_update(batch: Batch, role: str) -> None:
        pass  # critic_loss names any missing key itself

    @staticmethod
    def loss(output: torch.Tensor, micro_batch: Batch, inputs, loss_cfg, tp_group):
        from rlcore.algos import critic_loss

        from .value_head import scored_values

        loss, metrics = critic_loss(scored_values(output, inputs), micro_batch, loss_cfg)
        return loss, metrics, {}

    @staticmethod
    def hf_config(causal_lm_config: dict) -> dict:
        from .value_head import critic_hf_config

        return critic_hf_config(causal_lm_config)


def check_pair_batch(batch: Batch, role: str, keys: tuple[str, ...], sets: str) -> None:
    """A preference update's batch: every key the head's loss reads, and whole (chosen, rejected) pairs."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"{role} update: the preference batch has no {missing} (rlcore/preference.py sets {sets})")
    if batch.size % 2:
        raise ValueError(f"{role} update: {batch.size} rows are not whole (chosen, rejected) pairs")


class ScoreHead:
    """A reward model's scalar score (``score_head.py``, HF ``*ForSequenceClassification``'s ``score``):
    ``scores[:, t]`` is the output AT position t (not shifted); a row's outcome score is at its last
    attention-mask position. Forward-only in the RL loop (a reward model scoring rollouts); trained
    with the Bradley-Terry loss by reward-model training (algorithm.type=rm)."""

    # No response mask: every position's score is computed (a PRM reads the steps' last tokens, an
    # outcome RM the last token), and the rows run unpacked.
    forward_keys = ("input_ids", "attention_mask")
    # Trained as a reward model (algorithm.type=rm): Bradley-Terry on the micro-batch's pairs.
    train_keys = ("input_ids", "attention_mask", "loss_weights")

    @staticmethod
    def build(hf, config, profile: str, vp_stage, seed: int, explicit_mask: bool = False):
        from .score_head import build_score_model

        return build_score_model(hf, config, profile, vp_stage, seed, explicit_mask)

    @staticmethod
    def outputs(output: torch.Tensor, micro_batch: Batch, inputs, tp_group) -> dict:
        from .score_head import token_scores

        return {"scores": token_scores(output, inputs)}

    @staticmethod
    def check_update(batch: Batch, role: str) -> None:
        check_pair_batch(batch, role, ScoreHead.train_keys, "loss_weights over the mini-batch's pairs")

    @staticmethod
    def loss(output: torch.Tensor, micro_batch: Batch, inputs, loss_cfg, tp_group):
        """Bradley-Terry (``rlcore.algos.rm_batch_loss``) on the rows' last-token scores: rows 2i, 2i+1
        of the micro-batch are pair i's chosen and rejected; ``loss_weights`` carry each pair's share
        of the mini-batch mean, so the engine's sum over micro-batches and DP ranks is that mean."""
        from rlcore.algos import rm_batch_loss

        from .score_head import token_scores

        loss, metrics = rm_batch_loss(token_scores(output, inputs), micro_batch, loss_cfg)
        return loss, metrics, {}

    @staticmethod
    def hf_config(causal_lm_config: dict) -> dict:
        from .score_head import seqcls_hf_config

        return seqcls_hf_config(causal_lm_config)


class DPOHead(LMHead):
    """The policy trained on preference pairs (algorithm.type=dpo): the LM head's build, forward and
    export; the loss is DPO's or IPO's (``rlcore.preference_losses.dpo_batch_loss``) on the sequence
    log-probs of the micro-batch's pairs (rows 2i, 2i+1) against the reference's ``ref_logprobs``."""

    train_keys = ("input_ids", "attention_mask", "response_mask", "ref_logprobs", "loss_weights")

    @staticmethod
    def check_update(batch: Batch, role: str) -> None:
        check_pair_batch(batch, role, DPOHead.train_keys,
                         "ref_logprobs from the reference and loss_weights over the mini-batch's pairs")

    @staticmethod
    def loss(output: torch.Tensor, micro_batch: Batch, inputs, loss_cfg, tp_group):
        from rlcore.preference_losses import dpo_batch_loss

        from .logprobs import scored_logprobs_and_entropy

        logprobs, _ = scored_logprobs_and_entropy(output, micro_batch["input_ids"], inputs, 1.0, tp_group)
        loss, metrics = dpo_batch_loss(logprobs, micro_batch, loss_cfg)
        return loss, metrics, {}


HEADS = Registry("RoleSpec.head")
HEADS.add("lm", LMHead)
HEADS.add("value", ValueHead)
HEADS.add("score", ScoreHead)
HEADS.add("dpo", DPOHead)
