"""Builds the quickstart's model and data locally: nothing is downloaded.

- ``make_tiny_model``: a randomly initialised Qwen2 (or Llama) model in HuggingFace format
  (config.json, model.safetensors) with a character-level tokenizer built by the ``tokenizers``
  library and a one-line chat template.
- ``make_addition_data``: "a+b=" prompts with one-digit answers in verl's schema (parquet).
  The vocabulary is 16 tokens, so a random policy already answers ~1/16 of prompts right and a GRPO
  group of 16 usually holds a success: the group-relative signal is not empty from step one.
- ``make_addition_pairs``: the same prompts as preference pairs (``prompt``, ``chosen`` = the right
  answer, ``rejected`` = a wrong one) for reward-model training, with a held-out split.
"""
from __future__ import annotations

import json
import os
import random

DIGITS = [str(i) for i in range(10)]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
SYMBOLS = ["+", "="]
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def make_tokenizer(out_dir: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + DIGITS + SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per char
    tok.decoder = decoders.Fuse()  # join tokens with no separator
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def make_tiny_model(out_dir: str, arch: str = "qwen2", hidden_size: int = 128, num_layers: int = 4,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 256,
                    tie_word_embeddings: bool = False, seed: int = 0, max_position_embeddings: int = 64) -> str:
    """Writes the model and tokenizer to ``out_dir`` (idempotent: an existing model is kept)."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import torch
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = make_tokenizer(out_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    if arch == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        raise ValueError(f"arch {arch!r}: expected qwen2 or llama")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    if arch == "qwen2":
        # HF initialises biases to zero; random biases make the qkv-bias path observable in tests.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.02)
    # One small shard: transformers' "Writing model shards" bar would only add a line to every
    # quickstart, test and --calibrate run.
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    # vLLM reads the generation config; keep sampling defaults neutral.
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id}, f)
    return out_dir


def addition_rows(max_operand: int = 4, seed: int = 0):
    rows = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            if a + b > 9:
                continue
            rows.append({
                "data_source": "tiny_addition",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"a": a, "b": b},
            })
    random.Random(seed).shuffle(rows)
    return rows


def make_addition_data(out_dir: str, max_operand: int = 4) -> str:
    """Writes ``train.parquet`` (every a+b with a, b <= max_operand) into ``out_dir``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "train.parquet")
    if not os.path.exists(path):
        pq.write_table(pa.Table.from_pylist(addition_rows(max_operand)), path)
    return path



# Wrong answers a tiny policy can give: every other digit and the two symbols of its vocabulary.
WRONG_ANSWERS = DIGITS + SYMBOLS


def addition_pairs(max_operand: int = 4, held_out_per_prompt: int = 2, seed: int = 0
                   ) -> tuple[list[dict], list[dict]]:
    """(train, held-out) preference rows for every prompt of ``addition_rows``: ``chosen`` is the
    answer as the policy gives it (the one-token sum), ``rejected`` each of the 11 wrong answers
    (other digits, ``+``, ``=``). Per prompt, ``held_out_per_prompt`` wrong answers drawn at random
    go to the held-out split only: it asks whether the model ranks the right answer above wrong
    answers it was never shown against that prompt (every prompt is in both splits, as every prompt
    is scored when the model rewards the tiny policy)."""
    rng = random.Random(seed)
    train, held_out = [], []
    for row in addition_rows(max_operand, seed):
        right = row["reward_model"]["ground_truth"]
        wrong = [w for w in WRONG_ANSWERS if w != right]
        rng.shuffle(wrong)
        if not 0 <= held_out_per_prompt < len(wrong):
            raise ValueError(f"held_out_per_prompt={held_out_per_prompt}: expected 0..{len(wrong) - 1}")
        for i, rejected in enumerate(wrong):
            pair = {"prompt": row["prompt"], "chosen": right, "rejected": rejected}
            (held_out if i < held_out_per_prompt else train).append(pair)
    rng.shuffle(train)
    return train, held_out


def make_addition_pairs(out_dir: str, max_operand: int = 4) -> tuple[str, str]:
    """Writes ``pairs_train.parquet`` and ``pairs_validation.parquet`` (``addition_pairs``) into
    ``out_dir`` (kept if both exist). Returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, "pairs_train.parquet"), os.path.join(out_dir, "pairs_validation.parquet")
    if not all(os.path.exists(p) for p in paths):
        for rows, path in zip(addition_pairs(max_operand), paths):
            pq.write_table(pa.Table.from_pylist(rows), path + ".part")
            os.replace(path + ".part", path)  # a killed write never looks complete
    return paths


# ------------------------------------------------------------------ the two-step task (a process RM)
# "a+b+c=" answered in two steps, "d=e": d = a+b (the first step, ended by the "=" token) and e = d+c
# (the last step). The numeric verifier reads the final number, e; a process reward model
# (reward.process with separator_token_id = the "=" token's id) scores the first step at its "=" and
# the last step at the response's last token.
TWO_STEP_SEPARATOR = "="


def two_step_rows(max_operand: int = 2, seed: int = 0) -> list[dict]:
    """Every "a+b+c=" with a, b, c <= max_operand and a+b+c <= 9, in verl's schema: ``ground_truth``
    the sum e, ``extra_info`` the operands and the first step's value d = a+b."""
    rows = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            for c in range(max_operand + 1):
                if a + b + c > 9:
                    continue
                rows.append({
                    "data_source": "tiny_two_step_addition",
                    "prompt": [{"role": "user", "content": f"{a}+{b}+{c}="}],
                    "reward_model": {"style": "rule", "ground_truth": str(a + b + c)},
                    "extra_info": {"a": a, "b": b, "c": c, "first_step": str(a + b)},
                })
    random.Random(seed).shuffle(rows)
    return rows


def two_step_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The numeric verifier's score (the final number is e) and two metrics that do not train
    (``reward/first_step``: the response starts with the right first step "d="; ``reward/two_step``:
    it is exactly "d=e"), for ``reward.function: launch.assets.tiny:two_step_reward``."""
    from rlcore.reward import numeric_verifier

    if not isinstance(extra_info, dict) or "first_step" not in extra_info:
        raise ValueError("extra_info has no 'first_step': two_step_reward scores launch.assets.tiny.two_step_rows' rows")
    first = f"{extra_info['first_step']}{TWO_STEP_SEPARATOR}"
    return {"score": numeric_verifier(data_source, solution_str, ground_truth),
            "first_step": float(solution_str.startswith(first)),
            "two_step": float(solution_str == f"{first}{ground_truth}")}


def make_two_step_data(out_dir: str, max_operand: int = 2) -> str:
    """Writes ``train.parquet`` (``two_step_rows``) into ``out_dir`` (kept if it exists)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "train.parquet")
    if not os.path.exists(path):
        pq.write_table(pa.Table.from_pylist(two_step_rows(max_operand)), path + ".part")
        os.replace(path + ".part", path)
    return path


def two_step_pairs(max_operand: int = 2, held_out_per_kind: int = 1, random_rejected: int = 40, seed: int = 0
                   ) -> tuple[list[dict], list[dict]]:
    """(train, held-out) preference rows for a process reward model on ``two_step_rows``, each
    completion ending where the PRM reads a step's score (its last token; train with
    ``algorithm.rm.append_eos: false``). Per prompt, four kinds of pair:

    - ``first``: the first step alone, ``chosen`` "d=", ``rejected`` "x=" for each of the 11 other
      tokens x a policy can write there (other digits, ``+``, ``=``);
    - ``final``: the whole answer with a wrong last step, "d=e" over "d=y" (11 others y);
    - ``process``: the whole answer with the right final number reached by a wrong first step, "d=e"
      over "x=e": a verifier cannot tell them apart, a process reward model must;
    - ``random``: ``random_rejected`` random three-token answers (none "?=e") below "d=e", so
      responses of any other shape score low too (a policy would otherwise find the unscored ones).

    Per prompt, ``held_out_per_kind`` more rejected of each kind go to the held-out split only."""
    rng = random.Random(seed)
    train, held_out = [], []
    if not 0 <= held_out_per_kind < len(WRONG_ANSWERS) - 1:
        raise ValueError(f"held_out_per_kind={held_out_per_kind}: expected 0..{len(WRONG_ANSWERS) - 2}")
    sep = TWO_STEP_SEPARATOR
    for row in two_step_rows(max_operand, seed):
        d, e, prompt = row["extra_info"]["first_step"], row["reward_model"]["ground_truth"], row["prompt"]
        answer = f"{d}{sep}{e}"
        kinds = {"first": (f"{d}{sep}", [f"{x}{sep}" for x in WRONG_ANSWERS if x != d]),
                 "final": (answer, [f"{d}{sep}{y}" for y in WRONG_ANSWERS if y != e]),
                 "process": (answer, [f"{x}{sep}{e}" for x in WRONG_ANSWERS if x != d])}
        for chosen, rejected in kinds.values():
            rng.shuffle(rejected)
            for i, r in enumerate(rejected):
                (held_out if i < held_out_per_kind else train).append(
                    {"prompt": prompt, "chosen": chosen, "rejected": r})
        drawn = []
        while len(drawn) < held_out_per_kind + random_rejected:
            r = "".join(rng.choice(WRONG_ANSWERS) for _ in range(3))
            if r[1:] != f"{sep}{e}" and r not in drawn:
                drawn.append(r)
        for i, r in enumerate(drawn):
            (held_out if i < held_out_per_kind else train).append({"prompt": prompt, "chosen": answer, "rejected": r})
    rng.shuffle(train)
    return train, held_out


def make_two_step_pairs(out_dir: str, max_operand: int = 2) -> tuple[str, str]:
    """Writes ``prm_pairs_train.parquet`` and ``prm_pairs_validation.parquet`` (``two_step_pairs``)
    into ``out_dir`` (kept if both exist). Returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, "prm_pairs_train.parquet"), os.path.join(out_dir, "prm_pairs_validation.parquet")
    if not all(os.path.exists(p) for p in paths):
        for rows, path in zip(two_step_pairs(max_operand), paths):
            pq.write_table(pa.Table.from_pylist(rows), path + ".part")
            os.replace(path + ".part", path)
    return paths
