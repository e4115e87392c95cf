"""Vocab-parallel log-probs and entropy (one TP rank: the whole vocabulary) against torch's
log_softmax, in values and gradients; TP > 1 is covered by the TP2 tests of the workers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_workers.logprobs import token_logprobs_and_entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_log_softmax(temperature):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 9, 17, generator=g)).requires_grad_()
    input_ids = torch.randint(0, 17, (3, 9), generator=g)
    logprobs, entropy = token_logprobs_and_entropy(logits, input_ids, temperature)

    log_softmax = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    ref_logprobs = F.pad(log_softmax.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0))
    ref_entropy = F.pad(-(log_softmax.exp() * log_softmax).sum(-1), (1, 0))
    assert torch.all(logprobs[:, 0] == 0) and torch.all(entropy[:, 0] == 0)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-6, rtol=0)

    w_lp, w_ent = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    grad, = torch.autograd.grad((logprobs * w_lp).sum() + (entropy * w_ent).sum(), logits)
    ref_grad, = torch.autograd.grad((ref_logprobs * w_lp).sum() + (ref_entropy * w_ent).sum(), logits)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


def test_logits_are_not_modified():
    logits = torch.randn(2, 5, 7)
    copy = logits.clone()
    token_logprobs_and_entropy(logits, torch.randint(0, 7, (2, 5)), 0.5)
    assert torch.equal(logits, copy)


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(torch.randn(1, 3, 4), torch.zeros(1, 3, dtype=torch.int64), 0.0)
