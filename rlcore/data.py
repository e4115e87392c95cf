"""Prompt datasets in verl's schema (parquet or JSONL) and an exactly resumable batch loader.

Each row: ``prompt`` (a non-empty list of chat messages ``{role, content}``), ``reward_model``
(``{"ground_truth": ..., optionally "style"}``), ``data_source`` (str) and optionally ``extra_info``
(dict). Every row is checked and tokenized when the dataset loads, so a bad row fails the job at start-up
with its file and row number rather than hours into training.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch


class DataError(Exception):
    """A dataset file or row that cannot be used; the message names the file and the row."""


@dataclass
class PromptItem:
    index: int  # position in the dataset (all files, in order)
    prompt_ids: list[int]
    ground_truth: str
    data_source: str
    extra_info: dict = field(default_factory=dict)
    # The prompt's chat messages, which a reward model with its own chat template re-templates; not
    # compared (prompt_ids are the prompt).
    messages: list = field(default_factory=list, compare=False)


def read_rows(path: str) -> list[tuple[str, Any]]:
    """The rows of a parquet or JSONL file as (where, row) pairs; ``where`` is "file row N" (0-based
    rows; JSONL also gives the line, blank lines are skipped)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
            raise DataError(f"{path}: cannot read as parquet: {e}") from e
        # to_pylist turns nested columns (prompt, reward_model, extra_info) into lists and dicts.
        return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]
    if path.endswith(".jsonl"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path} row {len(rows)} (line {line_no})"
                try:
                    rows.append((where, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not valid JSON: {e}") from e
        return rows
    raise DataError(f"{path}: unsupported file type; expected .parquet or .jsonl")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """``messages`` through the tokenizer's chat template, as a flat list of ids."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    # transformers 5 returns a BatchEncoding (a dict) by default; older versions a list of ids.
    if hasattr(out, "keys"):
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if out and isinstance(out[0], list):  # a batch of one
        out = out[0]
    return [int(t) for t in out]


class RowDataset:
    """All rows of ``files``, each checked and tokenized at construction by the subclass's
    ``_parse_row(where, row, index)``."""

    def __init__(self, files: Sequence[str] | str, tokenizer, prompt_key: str = "prompt",
                 max_prompt_length: int = 512, apply_chat_template: bool = True):
        if isinstance(files, str):
            files = [files]
        if not files:
            raise DataError("no data files given")
        if apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"the tokenizer has no chat template, so prompts from {files[0]} cannot be "
                            "formatted; add one to the model folder or set data.apply_chat_template=false")
        self.files = list(files)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.apply_chat_template = apply_chat_template
        self.items: list = []
        for path in self.files:
            for where, row in read_rows(path):
                self.items.append(self._parse_row(where, row, index=len(self.items)))
        if not self.items:
            raise DataError(f"no rows in {', '.join(self.files)}")

    def _parse_row(self, where: str, row: Any, index: int):
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]

    def __iter__(self) -> Iterator:
        return iter(self.items)


class PromptDataset(RowDataset):
    """All prompt rows of ``files``, validated and tokenized at construction."""

    def _parse_row(self, where: str, row: Any, index: int) -> PromptItem:
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be a mapping of columns, got {_type_name(row)}")
        messages = row.get(self.prompt_key)
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           and isinstance(m.get("content"), str) for m in messages)):
            raise DataError(f"{where}: {self.prompt_key!r} must be a non-empty list of {{role, content}} "
                            f"messages, got {_describe(messages)}")
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise DataError(f"{where}: missing reward_model.ground_truth (reward_model is "
                            f"{_describe(reward_model)})")
        ground_truth = reward_model["ground_truth"]
        if not isinstance(ground_truth, (str, int, float)) or isinstance(ground_truth, bool):
            raise DataError(f"{where}: reward_model.ground_truth must be a string or a number, "
                            f"got {_type_name(ground_truth)}")
        data_source = row.get("data_source")
        if not isinstance(data_source, str) or not data_source:
            raise DataError(f"{where}: 'data_source' must be a non-empty string, got {_describe(data_source)}")
        extra_info = row.get("extra_info")
        if extra_info is None:
            extra_info = {}
        elif not isinstance(extra_info, dict):
            raise DataError(f"{where}: 'extra_info' must be a mapping, got {_type_name(extra_info)}")

        # Only role/content reach the template: parquet gives every message the union of keys.
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.apply_chat_template:
            prompt_ids = chat_ids(self.tokenizer, messages)
        else:
            prompt_ids = list(self.tokenizer.encode("".join(m["content"] for m in messages),
                                                    add_special_tokens=False))
        if not prompt_ids:
            raise DataError(f"{where}: the prompt tokenizes to no tokens")
        if len(prompt_ids) > self.max_prompt_length:
            raise DataError(f"{where}: the prompt is {len(prompt_ids)} tokens, longer than "
                            f"data.max_prompt_length={self.max_prompt_length}")
        return PromptItem(index=index, prompt_ids=prompt_ids, ground_truth=str(ground_truth),
                          data_source=data_source, extra_info=extra_info, messages=messages)


def _describe(value: Any) -> str:
    """A short description of a bad value for a message: its type, and its keys for a mapping."""
    if isinstance(value, dict):
        return f"a mapping with keys {sorted(map(str, value))}"
    if isinstance(value, list):
        return "an empty list" if not value else f"a list whose items are {sorted({_type_name(v) for v in value})}"
    return _type_name(value)


class PromptLoader:
    """An endless iterator over batches of ``PromptItem``: each epoch is one pass in a fresh order
    (a ``torch.Generator`` seeded from (seed, epoch), so the order depends on nothing else), and the
    last partial batch of an epoch is dropped. ``state_dict`` is (epoch, position): resuming from it
    yields exactly the batches the uninterrupted run would have."""

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        if len(dataset) < batch_size:
            raise DataError(f"the dataset has {len(dataset)} prompts, fewer than one batch of "
                            f"data.batch_size={batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next batch's first prompt
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            n = len(self.dataset)
            if self.shuffle:
                # A distinct, reproducible stream per (seed, epoch); masked to the 64-bit seed range.
                generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) & (2 ** 63 - 1))
                self._order = torch.randperm(n, generator=generator).tolist()
            else:
                self._order = list(range(n))
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self) -> Iterator[list[PromptItem]]:
        return self

    def __next__(self) -> list[PromptItem]:
        if self.position + self.batch_size > len(self.dataset):  # drop the partial batch
            self.epoch += 1
            self.position = 0
        order = self._epoch_order()
        batch = [self.dataset[i] for i in order[self.position:self.position + self.batch_size]]
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = {"epoch", "position"} - set(state)
        if missing:
            raise ValueError(f"loader state is missing {sorted(missing)}; it has {sorted(state)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0 or position > len(self.dataset) or position % self.batch_size:
            raise ValueError(f"loader state epoch={epoch} position={position} does not fit a dataset of "
                             f"{len(self.dataset)} prompts in batches of {self.batch_size}")
        self.epoch, self.position = epoch, position


def load_datasets(data_cfg, tokenizer) -> tuple[PromptDataset, PromptDataset | None]:
    """The job's training and (if any) validation prompts, every row checked (``DataError`` names the
    first bad one)."""
    def load(files):
        return PromptDataset(files, tokenizer, data_cfg.prompt_key, data_cfg.max_prompt_length,
                             data_cfg.apply_chat_template)

    return load(data_cfg.train_files), (load(data_cfg.val_files) if data_cfg.val_files else None)


@dataclass
class Task:
    """What a job trains on, loaded and checked before any role starts: the tokenizer (and its pad
    id), the reward function, the training prompts as a resumable loader, the validation prompts."""
    tokenizer: Any
    pad_id: int
    reward_fn: Any  # rlcore.reward.RewardFn
    loader: PromptLoader
    val_set: PromptDataset | None


def load_task(cfg) -> Task:
    """The job's ``Task``; a bad row, a dataset smaller than one batch or a reward function that cannot
    be loaded fails here, before any role starts."""
    from transformers import AutoTokenizer

    from rlcore.reward import load_reward_fn

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    # Padding sits right of every real token under a causal mask, so its id never matters.
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    reward_fn = load_reward_fn(cfg.reward.function)
    train, val = load_datasets(cfg.data, tokenizer)
    loader = PromptLoader(train, cfg.data.batch_size, cfg.data.shuffle, cfg.trainer.seed)
    return Task(tokenizer, pad_id, reward_fn, loader, val)
