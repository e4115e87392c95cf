"""Token rows the Megatron tests share: prompts of 3-6 tokens, then a response up to a random end,
then right padding (id 0; real tokens are >= 3), so every micro-batch mixes lengths."""
from __future__ import annotations

import torch


def right_padded_rows(g: torch.Generator, rows: int, seq: int, vocab: int = 16,
                      min_response: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [rows, seq], response_mask [rows, seq]) drawn from ``g``; each response has at
    least ``min_response`` tokens."""
    input_ids = torch.zeros(rows, seq, dtype=torch.int64)
    response_mask = torch.zeros(rows, seq)
    for i in range(rows):
        prompt = int(torch.randint(3, 7, (), generator=g))
        length = int(torch.randint(prompt + min_response, seq + 1, (), generator=g))
        input_ids[i, :length] = torch.randint(3, vocab, (length,), generator=g)
        response_mask[i, prompt:length] = 1
    return input_ids, response_mask
