"""Reading a HuggingFace config.json into the facts the Megatron model needs, and the layout checks
(rlcore's, which `rlx validate` runs too)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_workers.model import read_hf_config
from rlcore.layout import check_model_split


@pytest.fixture(scope="module")
def qwen2(qwen2_untied):
    return qwen2_untied


def test_reads_qwen2_and_llama(qwen2, llama_tied):
    q = read_hf_config(qwen2)
    assert (q.family, q.qkv_bias, q.tie_word_embeddings) == ("qwen2", True, False)
    assert (q.num_attention_heads, q.num_kv_heads, q.head_dim, q.heads_per_kv_group) == (4, 2, 32, 2)
    assert (q.vocab_size, q.hidden_size, q.ffn_hidden_size, q.num_layers) == (16, 128, 256, 4)
    assert (q.rope_theta, q.rope_scaling_factor, q.rms_norm_eps) == (10000.0, None, 1e-6)
    l = read_hf_config(llama_tied)
    assert (l.family, l.qkv_bias, l.tie_word_embeddings) == ("llama", False, True)


def _edited_copy(src, dst, **changes):
    dst.mkdir()
    with open(f"{src}/config.json") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(dst / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_refuses_what_it_cannot_reproduce(qwen2, tmp_path):
    with pytest.raises(ValueError, match="not supported"):
        read_hf_config(_edited_copy(qwen2, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="RoPE type 'yarn'"):
        read_hf_config(_edited_copy(qwen2, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert read_hf_config(_edited_copy(qwen2, tmp_path / "llama3", rope_parameters=llama3)).rope_scaling_factor == 32.0
    with pytest.raises(ValueError, match="high_freq_factor"):
        read_hf_config(_edited_copy(qwen2, tmp_path / "llama3-other",
                                    rope_parameters={**llama3, "high_freq_factor": 2.0}))
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(str(tmp_path))


def test_layout_checks_explain_the_failure(qwen2):
    hf = read_hf_config(qwen2)
    check_model_split(hf, tp=2, pp=4)
    with pytest.raises(ValueError, match="2 key-value heads"):
        check_model_split(hf, tp=4, pp=1)
    with pytest.raises(ValueError, match="vocabulary of 17"):
        check_model_split(dataclasses.replace(hf, vocab_size=17), tp=2, pp=1)
    with pytest.raises(ValueError, match="pp=3"):
        check_model_split(hf, tp=1, pp=3)
    with pytest.raises(ValueError, match="intermediate_size=255"):
        check_model_split(dataclasses.replace(hf, ffn_hidden_size=255), tp=2, pp=1)
    with pytest.raises(ValueError, match="vpp=2 needs pp=1 > 1"):
        check_model_split(hf, tp=1, pp=1, vpp=2)


def test_the_megatron_guard_is_the_validators_check(qwen2):
    """transformer_config runs the same check as `rlx validate`, and says the same sentence (without
    the role's section, which the workers do not know)."""
    from megatron_workers.model import transformer_config

    hf = dataclasses.replace(read_hf_config(qwen2), ffn_hidden_size=255)
    with pytest.raises(ValueError) as info:
        transformer_config(hf, "cpu", "float32", tp=2, pp=1)
    assert str(info.value) == f"tp=2 does not divide the model's intermediate_size=255 ({hf.source}: intermediate_size)"


def test_validate_and_the_role_groups_refuse_the_same_layout_with_the_same_sentence(tmp_path):
    """One layout check: `rlx validate` and the Megatron group (and the rollout pool) run the same
    function on the same parsed config.json, so a TP that does not divide intermediate_size (or the
    heads, for vLLM) is refused by both, before any Ray actor starts."""
    from launch.assets import make_addition_data, make_tiny_model
    from megatron_workers.group import MegatronGroup
    from rlcore.config import RolloutConfig
    from rlcore.job import ConfigError, load_job
    from rlcore.roles import RoleSpec
    from rlcore.validate import validate
    from rollout.pool import RolloutPool

    model = make_tiny_model(str(tmp_path / "model"), intermediate_size=255)  # 255 % 2 != 0
    data = make_addition_data(str(tmp_path / "data"))
    cfg = load_job("yaml_configs/quickstart_cpu.yaml", [f"model.path={model}", f"data.train_files=[{data}]",
                                                         f"data.val_files=[{data}]", "actor.tp=2", "actor.micro_batch_size=16"])
    with pytest.raises(ConfigError, match="actor.tp=2 does not divide the model's intermediate_size=255") as by_validate:
        validate(cfg)
    spec = RoleSpec("actor", model, tp=2, pp=1, dp=1, micro_batch_size=16, profile="cpu", dtype="float32", seed=0)
    with pytest.raises(ConfigError, match="does not divide the model's intermediate_size=255") as by_group:
        MegatronGroup(spec, placement=None)  # refused before the placement is even looked at
    assert str(by_group.value).split(" (")[0] == str(by_validate.value).split(" (")[0]
    with pytest.raises(ConfigError, match="rollout.tp=3 does not divide the model's 4 attention heads"):
        RolloutPool(model, RolloutConfig(tp=3), placement=None, profile="cpu", dtype="float32", seed=0)


# ----------------------------------------------------------- shared-prompt rows: the explicit mask
@pytest.mark.parametrize("profile, dtype", [("cpu", "float32"), ("gpu", "bfloat16")])
def test_an_explicit_mask_model_runs_rope_unfused_on_either_profile(qwen2, profile, dtype):
    """Shared-prompt rows carry per-row rotary positions ([s, b, 1, d]), which TE's fused RoPE refuses;
    without them the gpu profile keeps it fused (here, without TransformerEngine, megatron says it is
    unavailable: it was asked for)."""
    from megatron_workers.model import transformer_config

    hf = read_hf_config(qwen2)
    assert transformer_config(hf, profile, dtype, tp=1, pp=1, explicit_mask=True).apply_rope_fusion is False
    if profile == "cpu":
        assert transformer_config(hf, profile, dtype, tp=1, pp=1).apply_rope_fusion is False
    else:
        try:
            assert transformer_config(hf, profile, dtype, tp=1, pp=1).apply_rope_fusion is True
        except ValueError as err:  # no TransformerEngine on this machine
            assert "apply_rope_fusion is not available" in str(err)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_an_explicit_mask_spec_takes_the_arbitrary_mask_type(profile):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_workers.model import layer_spec

    if profile == "gpu":
        pytest.importorskip("transformer_engine.pytorch", reason="the gpu spec is TransformerEngine's")
    assert layer_spec(profile).submodules.self_attention.params["attn_mask_type"] == AttnMaskType.causal
    masked = layer_spec(profile, explicit_mask=True).submodules.self_attention
    assert masked.params["attn_mask_type"] == AttnMaskType.arbitrary
    assert layer_spec(profile).submodules.self_attention.params["attn_mask_type"] == AttnMaskType.causal  # no leak


def test_an_explicit_mask_model_refuses_a_config_with_fused_rope(qwen2):
    from megatron_workers.model import build_gpt_model, transformer_config

    hf = read_hf_config(qwen2)
    config = transformer_config(hf, "cpu", "float32", tp=1, pp=1)
    config.apply_rope_fusion = True  # as the gpu profile's config without explicit_mask
    with pytest.raises(ValueError, match="explicit_mask=True"):
        build_gpt_model(hf, config, "cpu", explicit_mask=True)
