"""A megatron-core GPTModel built from a HuggingFace config.json (Qwen2 and Llama families).

The device profile is the only switch between the two ways the same model runs:
- ``cpu``: gloo, megatron-core's local layer spec (torch RMSNorm, unfused attention), fp32, no fusions
  but megatron's weight-gradient accumulation into DDP's main_grad (its kernel from cpu_compat.py);
- ``gpu``: NCCL, the TransformerEngine layer spec, bf16 or fp32, sequence parallel when TP > 1, fusions.
TransformerEngine is imported only on the gpu profile. The HF config is read, and the layout checked,
by rlcore (rlcore/hf_config.py, rlcore/layout.py): the same code `rlx validate` runs.

A model built with ``explicit_mask`` (the roles with ``shared_prompt``: packing.py's rows, where each
response sees the prompt and itself only) takes its attention mask from every forward: megatron-core's
``AttnMaskType.arbitrary`` in either spec (on the gpu profile TransformerEngine then runs its unfused
attention, the only backend that takes such a mask), and RoPE unfused, so that the per-token rotary
positions packing.py gives every row apply (TE's fused RoPE takes one ``[s, 1, 1, d]`` table for the
whole batch).
"""
from __future__ import annotations

import os

import torch

from rlcore import hf_config
from rlcore.hf_config import HFModelSpec  # noqa: F401  (the workers and hf_weights.py type with it)
from rlcore.layout import check_model_split, first_last_stage_layers

PROFILES = ("cpu", "gpu")
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def read_hf_config(model_path: str) -> HFModelSpec:
    """Reads ``model_path/config.json`` with rlcore's one reader (rlcore/hf_config.py), which refuses
    what this Megatron model would not reproduce exactly (a ``ConfigError``, a ValueError)."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"model {model_path!r} has no config.json: expected a HuggingFace folder")
    return hf_config.read_hf_config(model_path, key=None)


def transformer_config(hf: HFModelSpec, profile: str, dtype: str, tp: int, pp: int, vpp: int = 1,
                       pp_layers=None, explicit_mask: bool = False):
    """The TransformerConfig of ``hf`` under TP=``tp``, PP=``pp`` (each PP rank holding ``vpp`` model
    chunks: the interleaved 1F1B schedule when ``vpp`` > 1) on the given device profile; ``pp_layers``:
    the transformer layers of each PP stage (None: megatron's even split); ``explicit_mask``: the model
    takes per-row masks and positions (module docstring), so RoPE runs unfused. Every layer index elsewhere
    (HF names, weight sync, checkpoints) comes from megatron's own offsets, so an uneven split needs
    nothing else."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: expected one of {PROFILES}")
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(MODEL_DTYPES)}")
    if profile == "cpu" and dtype != "float32":
        raise ValueError(f"the cpu profile runs in float32 (got dtype {dtype!r})")
    # The same check `rlx validate` ran on the job spec, again as a guard: the two cannot disagree.
    check_model_split(hf, tp, pp, vpp, pp_layers=pp_layers)
    first_stage_layers, last_stage_layers = first_last_stage_layers(pp, pp_layers)
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
        # An uneven split: megatron-core's first/last stage counts, the middle stages share the rest.
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
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
        # Weight gradients accumulated into DDP's main_grad by the GEMM itself: TE's on gpu, the cpu
        # compat layer's GEMM in slabs on cpu (cpu_compat.py, step 7).
        gradient_accumulation_fusion=True,
        masked_softmax_fusion=gpu,
        # SwiGLU as megatron's one autograd function that keeps only its input: torch.compile'd on gpu,
        # eager with the cpu compat layer's backward on cpu (cpu_compat.py, step 10).
        bias_activation_fusion=True,
        bias_dropout_fusion=gpu,
        # TE's fused RoPE refuses a per-row table ([s, b, 1, d] with b > 1: "expected the second and third
        # dims of the freqs tensor equal 1"); megatron's unfused RoPE broadcasts it.
        apply_rope_fusion=gpu and not explicit_mask,
        persist_layer_norm=gpu,
    )


def layer_spec(profile: str, explicit_mask: bool = False):
    """The profile's transformer layer spec; with ``explicit_mask`` its self-attention takes the mask
    each forward brings (``AttnMaskType.arbitrary``, as megatron-core's modelopt spec does for
    ``use_arbitrary_attention_mask``) instead of building the causal one. Under the causal type TE's
    attention ignores a given mask, and so does megatron's fused softmax on GPU."""
    from megatron.core.transformer.enums import AttnMaskType

    if profile == "gpu":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if explicit_mask:
        attention = spec.submodules.self_attention
        attention.params = {**attention.params, "attn_mask_type": AttnMaskType.arbitrary}
    return spec


def build_gpt_model(hf: HFModelSpec, config, profile: str, value_head_seed: int | None = None,
                    vp_stage: int | None = None, explicit_mask: bool = False):
    """This rank's pipeline stage of the GPTModel (parallel_state must be initialised); with virtual
    pipeline stages, its model chunk ``vp_stage`` (layers offset by megatron's
    ``get_transformer_layer_offset``; pre/post-processing only on the first chunk of the first PP
    rank and the last chunk of the last PP rank).

    ``parallel_output=True``: the last stage returns vocab-parallel logits [b, s, vocab / TP], which
    ``logprobs.vocab_parallel_logprobs`` consumes without gathering the vocabulary.

    ``explicit_mask``: every forward brings its attention mask (module docstring; ``config`` must have
    been made with the same ``explicit_mask``).

    ``value_head_seed`` given: the critic's value model, whose last stage returns values [b, s, 1]
    from a ``value_head.ValueHead`` (initialised from that seed) instead of the vocabulary projection."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if explicit_mask and config.apply_rope_fusion:
        raise ValueError("an explicit-mask model needs a config made with explicit_mask=True (unfused RoPE: "
                         "its rows carry their own positions)")
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(profile, explicit_mask),
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
