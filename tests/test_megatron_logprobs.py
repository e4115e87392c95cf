"""Vocab-parallel log-probs and entropy (one TP rank: the whole vocabulary) against torch's
log_softmax, in values and gradients; TP > 1 is covered by the TP2 tests of the workers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_workers.logprobs import _exp_without_denormals, token_logprobs_and_entropy


@pytest.mark.parametrize("temperature,scale", [(1.0, 3.0), (0.7, 3.0), (0.7, 60.0)],
                         ids=["T1", "T0.7", "T0.7-peaked"])
def test_logprobs_and_entropy_match_log_softmax(temperature, scale):
    """``peaked``: most of each row's logits lie more than 87 below its largest, where the CPU flushes
    exp to 0 (logprobs.py: _exp_without_denormals)."""
    g = torch.Generator().manual_seed(0)
    logits = (scale * torch.randn(3, 9, 17, generator=g)).requires_grad_()
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


def test_exp_is_torchs_above_exp_minus_87_and_zero_at_or_below():
    """No denormal result leaves it (x86 computes them 15-40x slower); every other value is torch's exp."""
    x = torch.cat([torch.linspace(-200.0, 10.0, 19995), torch.tensor([-87.0, -87.0001, -87.3, -103.9, float("-inf")])])
    out = _exp_without_denormals(x)
    kept = x.exp() > torch.tensor(-87.0).exp()
    assert kept[x > -86.99].all() and not kept[x <= -87.0].any()
    assert torch.equal(out[kept], x[kept].exp()) and torch.all(out[~kept] == 0)
    assert not torch.any((out != 0) & (out.abs() < torch.finfo(torch.float32).tiny))
    assert torch.equal(_exp_without_denormals(x.view(5, -1)).view(-1), out)


def test_row_passes_equal_the_whole_buffer_formulas_to_the_bit():
    """exp s and p are made a few rows at a time (logprobs.py: rows_per_pass); every value and
    gradient equals the out-of-place formulas over the whole [rows, V] buffer, bit for bit (rows not
    a multiple of the pass; a vocabulary of 4096 keeps each thread's share of an elementwise op a
    multiple of the vector width, as 49152 does, so no element falls to the scalar tail)."""
    from megatron_workers.logprobs import rows_per_pass, vocab_parallel_logprobs

    g = torch.Generator().manual_seed(1)
    vocab, temperature = 4096, 0.7
    assert rows_per_pass(49152, torch.device("cpu")) == 21 and rows_per_pass(1 << 21, torch.device("cpu")) == 1
    rows = 3 * rows_per_pass(vocab, torch.device("cpu")) - 3
    logits = (40.0 * torch.randn(rows, vocab, generator=g)).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=g)
    w_lp, w_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    logprob, entropy = vocab_parallel_logprobs(logits, target, None, temperature)
    grad, = torch.autograd.grad((logprob * w_lp).sum() + (entropy * w_ent).sum(), logits)

    with torch.no_grad():
        scaled = logits / temperature
        shifted = scaled - scaled.max(-1).values.unsqueeze(-1)
        exp = _exp_without_denormals(shifted)
        sum_exp, sum_exp_shifted = exp.sum(-1), (exp * shifted).sum(-1)
        log_z = sum_exp.log()
        ref_logprob = shifted.gather(-1, target[:, None]).squeeze(-1) - log_z
        ref_entropy = log_z - sum_exp_shifted / sum_exp
        log_softmax = shifted - log_z[:, None]
        factor = (log_softmax + ref_entropy[:, None]) * w_ent[:, None] + w_lp[:, None]
        ref_grad = -(factor * _exp_without_denormals(log_softmax))
        ref_grad.scatter_add_(-1, target[:, None], w_lp[:, None])
        ref_grad /= temperature
    assert (exp == 0).float().mean() > 0.5  # most of the vocabulary flushed: the peaked case
    assert torch.equal(logprob, ref_logprob) and torch.equal(entropy, ref_entropy)
    assert torch.equal(grad, ref_grad)


def test_overwriting_the_logits_gives_the_same_values_and_gradients_to_the_bit():
    """The heads hand over the output layer's fresh logits (overwrite_logits=True): they become the
    working buffer instead of a second vocabulary-wide one. Values and the gradients that reach the
    projection's input and weight are those of the copying path, bit for bit; the handed-over buffer
    no longer holds the logits (the caller's side of the contract), and logits that are not contiguous
    are left as they were."""
    from megatron_workers.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(45, 16, generator=g).requires_grad_()
    weight = (3.0 * torch.randn(4096, 16, generator=g)).requires_grad_()
    target = torch.randint(0, 4096, (45,), generator=g)
    w_lp, w_ent = torch.randn(45, generator=g), torch.randn(45, generator=g)
    results = []
    for overwrite in (False, True):
        logits = hidden @ weight.t()
        before = logits.detach().clone()
        logprob, entropy = vocab_parallel_logprobs(logits, target, None, 0.7, overwrite_logits=overwrite)
        grads = torch.autograd.grad((logprob * w_lp).sum() + (entropy * w_ent).sum(), (hidden, weight))
        results.append((logprob, entropy, *grads))
        assert torch.equal(logits.detach(), before) != overwrite
    for copied, overwritten in zip(*results):
        assert torch.equal(copied, overwritten)

    strided = torch.randn(8, 5, 7, generator=g)[:, :-1]
    copy = strided.clone()
    vocab_parallel_logprobs(strided, torch.randint(0, 7, (8, 4), generator=g), None, 0.5, overwrite_logits=True)
    assert torch.equal(strided, copy)
