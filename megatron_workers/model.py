"""A megatron-core GPTModel built from a HuggingFace config.json (Qwen2 and Llama families).

The device profile is the only switch between the two ways the same model runs:
- ``cpu``: gloo, megatron-core's local layer spec (torch RMSNorm, unfused attention), fp32, no fusions
  (shared/notes/megatron-core-on-cpu.md lists the settings that work);
- ``gpu``: NCCL, the TransformerEngine layer spec, bf16 or fp32, sequence parallel when TP > 1, fusions.
TransformerEngine is imported only on the gpu profile.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

PROFILES = ("cpu", "gpu")
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# *ForTokenClassification: a critic checkpoint (value_head.py), the same body with a scalar head.
SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
                           "Qwen2ForTokenClassification": "qwen2", "LlamaForTokenClassification": "llama"}

# The llama3 RoPE scaling megatron-core implements has these constants built in
# (models/common/embeddings/rotary_pos_embedding.py:_apply_scaling); other values are refused.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class HFModelSpec:
    """The architecture facts of a HuggingFace checkpoint that the Megatron model must reproduce."""

    family: str  # "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling factor; None: plain RoPE
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool

    @property
    def heads_per_kv_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads


def read_hf_config(model_path: str) -> HFModelSpec:
    """Reads ``model_path/config.json``; refuses what the Megatron model would not reproduce exactly."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model {model_path!r} has no config.json: expected a HuggingFace folder")
    with open(path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        raise ValueError(f"{path}: architectures {archs} are not supported; "
                         f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU needs silu)")
    if family == "qwen2" and cfg.get("use_sliding_window", False):
        raise ValueError(f"{path}: sliding-window attention is not supported")
    if family == "llama":
        if cfg.get("attention_bias", False):
            raise ValueError(f"{path}: attention_bias=true (bias on o_proj too) is not supported")
        if cfg.get("mlp_bias", False):
            raise ValueError(f"{path}: mlp_bias=true is not supported")

    # transformers 5 keeps rope_theta and the scaling in rope_parameters; older configs use
    # rope_theta and rope_scaling at top level.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling_factor = None
    if rope_type == "llama3":
        for key, want in _MEGATRON_LLAMA3_ROPE.items():
            if float(rope.get(key, want)) != want:
                raise ValueError(f"{path}: llama3 RoPE scaling with {key}={rope[key]} is not supported; "
                                 f"megatron-core implements {key}={want}")
        rope_scaling_factor = float(rope["factor"])
    elif rope_type != "default":
        raise ValueError(f"{path}: RoPE type {rope_type!r} is not supported (default or llama3)")

    num_heads = int(cfg["num_attention_heads"])
    num_kv = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv:
        raise ValueError(f"{path}: {num_heads} attention heads do not split into {num_kv} KV groups")
    hidden = int(cfg["hidden_size"])
    return HFModelSpec(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling_factor=rope_scaling_factor,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        qkv_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def check_layout(hf: HFModelSpec, tp: int, pp: int, vpp: int = 1) -> None:
    """The divisibility the Megatron model needs, each failure explained in one sentence."""
    if hf.num_attention_heads % tp:
        raise ValueError(f"TP={tp} does not divide the {hf.num_attention_heads} attention heads")
    if hf.num_kv_heads % tp:
        raise ValueError(f"TP={tp} does not divide the {hf.num_kv_heads} KV groups")
    if hf.ffn_hidden_size % tp:
        raise ValueError(f"TP={tp} does not divide the MLP size {hf.ffn_hidden_size}")
    # The vocabulary is not padded, so that HF tensors map 1:1 onto the shards.
    if hf.vocab_size % tp:
        raise ValueError(f"TP={tp} does not divide the vocabulary of {hf.vocab_size} tokens")
    if hf.num_layers % pp:
        raise ValueError(f"PP={pp} does not divide the {hf.num_layers} layers")
    if vpp < 1 or (vpp > 1 and pp == 1):
        raise ValueError(f"VPP={vpp}: virtual pipeline stages need VPP >= 1, and VPP > 1 needs PP > 1")
    if hf.num_layers % (pp * vpp):
        raise ValueError(f"PP*VPP={pp}*{vpp} does not divide the {hf.num_layers} layers")


def transformer_config(hf: HFModelSpec, profile: str, dtype: str, tp: int, pp: int, vpp: int = 1):
    """The TransformerConfig of ``hf`` under TP=``tp``, PP=``pp`` (each PP rank holding ``vpp`` model
    chunks: the interleaved 1F1B schedule when ``vpp`` > 1) on the given device profile."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: expected one of {PROFILES}")
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(MODEL_DTYPES)}")
    if profile == "cpu" and dtype != "float32":
        raise ValueError(f"the cpu profile runs in float32 (got dtype {dtype!r})")
    check_layout(hf, tp, pp, vpp)
    torch_dtype = MODEL_DTYPES[dtype]
    gpu = profile == "gpu"
    return TransformerConfig(
        num_layers=hf.num_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.ffn_hidden_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_kv_heads,
        kv_channels=hf.head_dim,
        add_bias_linear=False,
        add_qkv_bias=hf.qkv_bias,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 holds [gate; up]
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        # Every layout must compute the same function from the same HF weights: no randomness.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Every weight is overwritten from the HF checkpoint, but megatron's init must still run: with
        # perform_initialization=False the local spec leaves the weights without their
        # tensor_model_parallel attributes (tensor_parallel/layers.py:244,855), and the gradient norm
        # would then count only TP rank 0's shard of them.
        perform_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # None (not 1) without interleaving: megatron picks its schedule and layer offsets from it.
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        # Interleaved: point-to-point ops per direction, as Megatron-LM's defaults for it. Batched ops
        # would mismatch tensors at PP=2, where the previous and the next stage are the same rank (a
        # chunk's activations and another's gradients, same shape, cross in one batch); _p2p_ops puts
        # the two directions on different process groups there.
        overlap_p2p_comm=vpp > 1,
        batch_p2p_comm=vpp == 1,
        sequence_parallel=gpu and tp > 1,  # the local spec's torch norm rejects sequence parallel
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not gpu,
        gradient_accumulation_fusion=gpu,  # TE's fused wgrad accumulation into main_grad
        masked_softmax_fusion=gpu,
        bias_activation_fusion=gpu,
        bias_dropout_fusion=gpu,
        apply_rope_fusion=gpu,
        persist_layer_norm=gpu,
    )


def layer_spec(profile: str):
    if profile == "gpu":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization="RMSNorm")


def build_gpt_model(hf: HFModelSpec, config, profile: str, value_head_seed: int | None = None,
                    vp_stage: int | None = None):
    """This rank's pipeline stage of the GPTModel (parallel_state must be initialised); with virtual
    pipeline stages, its model chunk ``vp_stage`` (layers offset by megatron's
    ``get_transformer_layer_offset``; pre/post-processing only on the first chunk of the first PP
    rank and the last chunk of the last PP rank).

    ``parallel_output=True``: the last stage returns vocab-parallel logits [b, s, vocab / TP], which
    ``logprobs.vocab_parallel_logprobs`` consumes without gathering the vocabulary.

    ``value_head_seed`` given: the critic's value model, whose last stage returns values [b, s, 1]
    from a ``value_head.ValueHead`` (initialised from that seed) instead of the vocabulary projection."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(profile),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=hf.tie_word_embeddings and value_head_seed is None,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=hf.rope_theta,
        rope_scaling=hf.rope_scaling_factor is not None,
        rope_scaling_factor=hf.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    if value_head_seed is not None and last:
        from .value_head import ValueHead

        # GPTModel has no switch for its output layer; the vocabulary projection it built is dropped
        # here (a transient [vocab / TP, hidden] allocation).
        model.output_layer = ValueHead(config, value_head_seed)
    return model  # on the gpu profile megatron allocated it on the current device already
