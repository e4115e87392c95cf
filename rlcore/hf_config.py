"""The one reader of a model's HuggingFace ``config.json``: validation, ``rlx plan`` and the Megatron
workers all read the model's shape through ``read_hf_config``, so they cannot disagree about it.

It also refuses what the Megatron model (megatron_workers/model.py) would not reproduce exactly
(architectures other than Qwen2/Llama, activations other than SiLU, sliding windows, biases Llama's
attention or MLP would need, RoPE variants megatron-core does not implement): ``rlx validate`` then
fails on such a model before any worker starts. Nothing here imports Megatron.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from rlcore.job import ConfigError

# *ForTokenClassification: a critic checkpoint (value_head.py), *ForSequenceClassification: a reward
# model (score_head.py); the same body with a scalar head.
SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
                           "Qwen2ForTokenClassification": "qwen2", "LlamaForTokenClassification": "llama",
                           "Qwen2ForSequenceClassification": "qwen2", "LlamaForSequenceClassification": "llama"}

# The llama3 RoPE scaling megatron-core implements has these constants built in
# (models/common/embeddings/rotary_pos_embedding.py:_apply_scaling); other values are refused.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class HFModelSpec:
    """The architecture facts of a HuggingFace checkpoint: what the layout checks, the planner and the
    Megatron model need."""

    family: str  # "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int  # config.json: intermediate_size
    num_layers: int  # num_hidden_layers
    num_attention_heads: int
    num_kv_heads: int  # num_key_value_heads (absent: multi-head attention)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: Optional[float]  # llama3-style scaling factor; None: plain RoPE
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    # Not compared: a critic checkpoint (*ForTokenClassification, read from another folder) is the
    # same model as the actor's.
    architecture: str = field(default="", compare=False)  # e.g. Qwen2ForCausalLM, as `rlx plan` prints it
    source: str = field(default="config.json", compare=False)  # where it was read, as messages name it

    @property
    def heads_per_kv_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads


def read_hf_config(path: str, hf_config: Any = None, key: Optional[str] = "model.path") -> HFModelSpec:
    """The model at ``path`` (a HuggingFace folder), or, when ``path`` is not a folder here,
    ``hf_config`` (model.hf_config: a config.json path or the dict inline). ``key`` is the config key
    messages name the folder by (None: the file's path alone, as the workers report it)."""
    if os.path.isdir(path) or hf_config is None:
        where = f"{key}={path}" if key else path
        if not os.path.isdir(path):
            raise ConfigError(f"{where} is not a folder (expected a HuggingFace model folder, or "
                              "model.hf_config for a spec that runs on another machine)")
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ConfigError(f"{where} has no config.json (expected a HuggingFace model folder)")
        source = f"{key}={config_path}" if key else config_path
    elif isinstance(hf_config, dict):
        return parse_hf_config(hf_config, "model.hf_config (inline)")
    elif isinstance(hf_config, str):
        config_path, source = hf_config, f"model.hf_config={hf_config}"
        if not os.path.isfile(config_path):
            raise ConfigError(f"{source} not found (expected a HuggingFace config.json)")
    else:
        raise ConfigError(f"model.hf_config must be a path to a config.json or a mapping, got {hf_config!r}")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must hold a JSON object (a HuggingFace config.json)")
    return parse_hf_config(raw, source)


def parse_hf_config(raw: dict, source: str) -> HFModelSpec:
    """``raw``: a config.json's contents; ``source``: where it came from (it begins every message)."""

    def need(name: str) -> int:
        value = raw.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{source} needs a positive integer {name!r}, got {value!r}")
        return value

    archs = raw.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        raise ConfigError(f"{source}: architectures {archs} are not supported; "
                          f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (SwiGLU needs silu)")
    if family == "qwen2" and raw.get("use_sliding_window", False):
        raise ConfigError(f"{source}: use_sliding_window=true (sliding-window attention) is not supported")
    if family == "llama":
        if raw.get("attention_bias", False):
            raise ConfigError(f"{source}: attention_bias=true (bias on o_proj too) is not supported")
        if raw.get("mlp_bias", False):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")

    heads = need("num_attention_heads")
    # HF convention: no num_key_value_heads (or null) means multi-head attention.
    kv_heads = need("num_key_value_heads") if raw.get("num_key_value_heads") is not None else heads
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} do not split into "
                          f"num_key_value_heads={kv_heads} groups")
    hidden = need("hidden_size")
    if raw.get("head_dim") is not None:
        head_dim = need("head_dim")
    elif hidden % heads:
        raise ConfigError(f"{source}: hidden_size={hidden} is not a multiple of "
                          f"num_attention_heads={heads} and there is no head_dim")
    else:
        head_dim = hidden // heads
    rope_theta, rope_scaling_factor = _rope(raw, source)
    return HFModelSpec(
        family=family,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        ffn_hidden_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling_factor=rope_scaling_factor,
        max_position_embeddings=need("max_position_embeddings"),
        qkv_bias=family == "qwen2",  # Qwen2 always has q/k/v biases; Llama's attention_bias is refused above
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        architecture=next(a for a in archs if a in SUPPORTED_ARCHITECTURES),
        source=source,
    )


def _rope(raw: dict, source: str) -> tuple[float, Optional[float]]:
    """(rope_theta, the llama3 scaling factor or None). transformers 5 keeps both in rope_parameters;
    older configs use rope_theta and rope_scaling at top level."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(f"{source}: RoPE type {rope_type!r} is not supported (default or llama3)")
    for name, want in _MEGATRON_LLAMA3_ROPE.items():
        if float(rope.get(name, want)) != want:
            raise ConfigError(f"{source}: llama3 RoPE scaling with {name}={rope[name]} is not supported; "
                              f"megatron-core implements {name}={want}")
    if not isinstance(rope.get("factor"), (int, float)):
        raise ConfigError(f"{source}: llama3 RoPE scaling needs a number 'factor', got {rope.get('factor')!r}")
    return theta, float(rope["factor"])
