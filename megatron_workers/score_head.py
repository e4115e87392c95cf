"""The reward model's score: the GPTModel of ``model.py`` whose last stage ends in HF
``*ForSequenceClassification``'s ``score`` (Linear(hidden, 1, bias=False), ``score.weight`` [1, hidden]).

Built like the critic (value_head.py: untied, the vocabulary projection dropped, the scalar layer in
the output layer's place, so megatron's own forward and pipeline schedules run it), with two
differences:
- the HF names are ``*ForSequenceClassification``'s (no bias), so a SeqCls checkpoint loads as it is;
- the outputs are NOT shifted: ``scores[:, t]`` is the layer's output AT position t (having read tokens
  0..t). A row's outcome score is ``scores`` at its last attention-mask position, which is what
  transformers' SeqCls returns for a right-padded row (its last non-pad token;
  ``rlcore.reward_sources.last_token_scores``).

A checkpoint without ``score.weight`` (a causal LM a reward model starts training from) keeps the
seeded initial layer, as the critic does.
"""
from __future__ import annotations

import torch

from .value_head import ValueHead, one_label_hf_config

HF_SCORE_WEIGHT = "score.weight"


class ScoreLayer(ValueHead):
    """Linear(hidden -> 1, no bias) standing in for GPTModel's ``output_layer``; computed in float32.
    Replicated on every TP rank, as the value head (value_head.py explains the gradient)."""

    def __init__(self, config, seed: int):
        super().__init__(config, seed, bias=False)


def build_score_model(hf, config, profile: str, vp_stage, seed: int, explicit_mask: bool = False):
    """This rank's stage of the scoring GPTModel: the critic's untied build, whose last stage then
    gets the ``ScoreLayer`` in place of the value head (a transient [1, hidden] allocation)."""
    from .model import build_gpt_model

    model = build_gpt_model(hf, config, profile, vp_stage=vp_stage, value_head_seed=seed, explicit_mask=explicit_mask)
    if getattr(model, "post_process", False):
        model.output_layer = ScoreLayer(config, seed)
    return model


def is_score_model(model) -> bool:
    return isinstance(getattr(model, "output_layer", None), ScoreLayer)


def token_scores(output: torch.Tensor, inputs) -> torch.Tensor:
    """[b, s] float32 scores from the model's output [b, s, 1] at every position (not shifted).

    The score head runs its rows unpacked and without a response mask (``ScoreHead.forward_keys``),
    so the output layer sees every position; a selection of positions would be a caller's error."""
    if inputs is not None and inputs.src is not None:
        raise ValueError("the score head reads every position: its micro-batches must not carry a "
                         "response_mask (packing selects the positions that score response tokens)")
    return output[..., 0].float()


def seqcls_hf_config(causal_lm_config: dict, pad_token_id: int | None = None) -> dict:
    """The config.json of a reward model, from its base model's *ForCausalLM (or already SeqCls)
    config.json: the *ForSequenceClassification architecture with one label and a pad id (transformers
    finds a row's last token by it)."""
    out = one_label_hf_config(causal_lm_config, "ForSequenceClassification")
    if pad_token_id is not None:
        out["pad_token_id"] = pad_token_id
    if out.get("pad_token_id") is None:
        raise ValueError("a sequence-classification config needs a pad_token_id (transformers finds each "
                         "row's last token by it)")
    return out
