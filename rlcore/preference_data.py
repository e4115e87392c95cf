"""Preference pairs (parquet or JSONL) for the preference objectives (DPO, reward-model training).

Each row: ``prompt`` (a non-empty list of chat messages ``{role, content}``, as an RL row's), ``chosen``
and ``rejected``: each the completion as a string, or a list of messages whose last is the
assistant's (any messages before it must be the row's prompt: TRL's conversational form). Every row
is checked and tokenised when the dataset loads, so a bad one fails the job at start-up naming its
file and row.

Tokens: the prompt goes through the policy's chat template with the generation prompt, exactly as an
RL prompt (``rlcore.data``), so the policy is trained on what it sees when it generates. A completion is
what the template adds after that prompt when the assistant's message follows it, up to and including
the end-of-sequence token (SmolLM2's ``...<|im_end|>``); when the template does not end the message
with it, the eos token is appended, as the policy stops by emitting it. Without the chat template
(``data.apply_chat_template=false``) prompt and completion are their plain tokens (+ eos).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlcore.batch import Batch
from rlcore.data import DataError, PromptLoader, RowDataset, _describe, _type_name, chat_ids


@dataclass
class PreferencePair:
    index: int  # position in the dataset (all files, in order)
    prompt_ids: list[int]
    chosen_ids: list[int]  # the completion's tokens, eos included
    rejected_ids: list[int]


def _is_messages(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value))


class PreferenceDataset(RowDataset):
    """All preference rows of ``files``, validated and tokenised at construction."""

    def __init__(self, files: Sequence[str] | str, tokenizer, prompt_key: str = "prompt", max_prompt_length: int = 512,
                 max_response_length: int = 256, apply_chat_template: bool = True, append_eos: bool = True):
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos token, so a completion cannot be ended as the policy ends one")
        self.max_response_length, self.append_eos = max_response_length, append_eos
        super().__init__(files, tokenizer, prompt_key, max_prompt_length, apply_chat_template)

    def _parse_row(self, where: str, row: Any, index: int) -> PreferencePair:
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be a mapping of columns, got {_type_name(row)}")
        messages = row.get(self.prompt_key)
        if not _is_messages(messages):
            raise DataError(f"{where}: {self.prompt_key!r} must be a non-empty list of {{role, content}} "
                            f"messages, got {_describe(messages)}")
        # Only role/content reach the template: parquet gives every message the union of keys.
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.apply_chat_template:
            prompt_ids = chat_ids(self.tokenizer, messages)
        else:
            prompt_ids = self._plain_ids("".join(m["content"] for m in messages))
        if not prompt_ids:
            raise DataError(f"{where}: the prompt tokenizes to no tokens")
        if len(prompt_ids) > self.max_prompt_length:
            raise DataError(f"{where}: the prompt is {len(prompt_ids)} tokens, longer than "
                            f"data.max_prompt_length={self.max_prompt_length}")
        chosen, rejected = (self._completion_ids(where, key, row, messages, prompt_ids)
                            for key in ("chosen", "rejected"))
        return PreferencePair(index, prompt_ids, chosen, rejected)

    def _plain_ids(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _completion_ids(self, where: str, key: str, row: dict, messages: list[dict],
                        prompt_ids: list[int]) -> list[int]:
        value = row.get(key)
        if isinstance(value, str):
            text = value
        elif _is_messages(value) and value[-1]["role"] == "assistant":
            earlier = [{"role": m["role"], "content": m["content"]} for m in value[:-1]]
            if earlier and earlier != messages:
                raise DataError(f"{where}: {key!r} has {len(earlier)} messages before the assistant's that are not "
                                f"the row's {self.prompt_key!r}; give the completion alone (a string or one "
                                "assistant message) or the whole conversation")
            text = value[-1]["content"]
        else:
            raise DataError(f"{where}: {key!r} must be the completion as a string or a list of messages whose last "
                            f"is the assistant's, got {'a list whose last message is not the assistant' if _is_messages(value) else _describe(value)}")
        if not text:
            raise DataError(f"{where}: {key!r} is empty")
        eos = self.tokenizer.eos_token_id
        if self.apply_chat_template:
            full = chat_ids(self.tokenizer, messages + [{"role": "assistant", "content": text}],
                            add_generation_prompt=False)
            if full[:len(prompt_ids)] != prompt_ids:
                raise DataError(f"{where}: the chat template renders the prompt differently when {key!r} follows it, "
                                "so the completion's tokens cannot be separated from the prompt's")
            ids = full[len(prompt_ids):]
            ids = ids[:ids.index(eos) + 1] if eos in ids else ids + [eos] * self.append_eos
        else:
            ids = self._plain_ids(text) + [eos] * self.append_eos
        if len(ids) > self.max_response_length:
            raise DataError(f"{where}: {key!r} is {len(ids)} tokens (eos included), longer than "
                            f"rollout.max_response_length={self.max_response_length}")
        return ids


def pair_batch(pairs: list[PreferencePair], pad_id: int) -> Batch:
    """2P right-padded rows: row 2i = pair i's prompt + chosen, row 2i+1 = its prompt + rejected;
    ``response_mask`` over each completion (rlcore/batch.py's conventions)."""
    rows = [(p.prompt_ids, c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    seq_len = max(len(a) + len(b) for a, b in rows)
    n = len(rows)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, seq_len), dtype=torch.long)
    response_mask = torch.zeros((n, seq_len))
    for i, (prompt, completion) in enumerate(rows):
        p, r = len(prompt), len(completion)
        input_ids[i, :p + r] = torch.tensor(prompt + completion)
        attention_mask[i, :p + r] = 1
        response_mask[i, p:p + r] = 1.0
    return Batch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask)


def load_preference_datasets(cfg, tokenizer) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """The job's training and (if any) validation pairs, every row checked (``DataError`` names the first bad one)."""
    d = cfg.data

    def load(files):
        return PreferenceDataset(files, tokenizer, d.prompt_key, d.max_prompt_length, cfg.rollout.max_response_length,
                                 d.apply_chat_template, cfg.algorithm.type != "rm" or cfg.algorithm.rm.append_eos)

    return load(d.train_files), (load(d.val_files) if d.val_files else None)


@dataclass
class PreferenceTask:
    """What a preference job trains on, loaded and checked before any role starts: the tokenizer (and
    pad id), the training pairs as a resumable loader (``rlcore.data.PromptLoader``: batches of
    data.batch_size pairs), the validation pairs, and for the greedy held-out accuracy
    (algorithm.dpo.greedy_val_files) the prompts and the reward function that scores them."""
    tokenizer: Any
    pad_id: int
    loader: PromptLoader
    val_pairs: PreferenceDataset | None
    greedy_val_set: Any = None  # rlcore.data.PromptDataset
    reward_fn: Any = None  # rlcore.reward.RewardFn, with greedy_val_set


def load_preference_task(cfg) -> PreferenceTask:
    """The job's ``PreferenceTask``; a bad row or a dataset smaller than one batch fails here, before any
    role starts."""
    from transformers import AutoTokenizer

    from rlcore.data import PromptDataset

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    train, val = load_preference_datasets(cfg, tokenizer)
    loader = PromptLoader(train, cfg.data.batch_size, cfg.data.shuffle, cfg.trainer.seed)
    greedy_files = cfg.algorithm.dpo.greedy_val_files if cfg.algorithm.type == "dpo" else []
    greedy, reward_fn = None, None
    if greedy_files:
        from rlcore.reward import load_reward_fn

        greedy = PromptDataset(greedy_files, tokenizer, cfg.data.prompt_key, cfg.data.max_prompt_length,
                               cfg.data.apply_chat_template)
        reward_fn = load_reward_fn(cfg.reward.function)
    return PreferenceTask(tokenizer, pad_id, loader, val, greedy, reward_fn)
