"""The critic's value model: the GPTModel of ``model.py`` whose last stage ends in a scalar head.

``build_gpt_model(..., value_head_seed=...)`` builds the usual GPTModel (untied: the critic has no
vocabulary projection to tie) and puts a ``ValueHead`` where the output layer was. GPTModel's
post-processing still applies the final norm and calls ``output_layer(hidden, weight=..., ...)``, so
the last stage returns values [b, s, 1] instead of logits, through megatron's own forward and its
pipeline schedules.

The head is HF's ``score`` of ``*ForTokenClassification`` with ``num_labels=1`` (``score.weight``
[1, hidden], ``score.bias`` [1]), so a critic exported with ``critic_hf_config`` loads in transformers.
It is replicated on every TP rank: each TP rank sees the full hidden state and the same loss, so
the head's gradient is the same on all of them and megatron's DDP reduces it over DP like any other
parameter (it counts it once in the gradient norm: it has no ``tensor_model_parallel`` attribute).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

HF_WEIGHT, HF_BIAS = "score.weight", "score.bias"


class ValueHead(torch.nn.Module):
    """Linear(hidden -> 1) standing in for GPTModel's ``output_layer``; computed in float32."""

    def __init__(self, config, seed: int, bias: bool = True):
        super().__init__()
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        hidden = config.hidden_size
        self.weight = torch.nn.Parameter(torch.empty(1, hidden, dtype=config.params_dtype, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device))
        else:  # a reward model's SeqCls score has none
            self.register_parameter("bias", None)
        # A generator of its own: the same initial head on every rank and in every layout (megatron's
        # init draws from the global RNG in a layout-dependent order). Kept when the checkpoint has
        # no score.weight (a critic started from the actor's checkpoint).
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(1, hidden, generator=g) * config.init_method_std)
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        """[s, b, h] (or [s/TP, b, h] under sequence parallel) -> ([s, b, 1], None), as the output
        layer's signature."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # The head is replicated, so the computation after the gather is duplicated on every TP
            # rank: the backward must split the gradient, not reduce-scatter (sum) it.
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states.float(), self.weight.float(), None if self.bias is None else self.bias.float()), None


def is_value_model(model) -> bool:
    return type(getattr(model, "output_layer", None)) is ValueHead  # not a reward model's ScoreLayer


def token_values(output: torch.Tensor) -> torch.Tensor:
    """Token-aligned [b, s] values from the value model's output [b, s, 1]: ``values[:, t]`` is the
    value of the state before token t, the head's output at position t-1 (rlcore/batch.py); position
    0 holds 0, like the log-probs."""
    return F.pad(output[..., 0][:, :-1].float(), (1, 0))


def scored_values(output: torch.Tensor, inputs) -> torch.Tensor:
    """Token-aligned [b, S] values from the value model's output: [1, N, 1] at the scored positions
    of ``inputs`` (packing.ModelInputs; zeros at the other positions), or [b, s, 1] everywhere."""
    if inputs is None or inputs.src is None:
        return token_values(output)
    from .packing import scatter_tokens

    return scatter_tokens(output.reshape(-1).float(), inputs)


def critic_hf_config(causal_lm_config: dict) -> dict:
    """The config.json of an exported critic, from its base model's *ForCausalLM config.json: the
    *ForTokenClassification architecture with one label, which transformers and ``read_hf_config``
    both load."""
    return one_label_hf_config(causal_lm_config, "ForTokenClassification")


def one_label_hf_config(causal_lm_config: dict, head: str) -> dict:
    """A *ForCausalLM (or already *<head>) config.json as the *<head> architecture with one label."""
    archs = causal_lm_config.get("architectures") or []
    if not archs or not all(a.endswith("ForCausalLM") or a.endswith(head) for a in archs):
        raise ValueError(f"architectures {archs}: expected *ForCausalLM or *{head}")
    out = dict(causal_lm_config)
    out["architectures"] = [a.removesuffix("ForCausalLM") + head if a.endswith("ForCausalLM") else a for a in archs]
    out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return out
