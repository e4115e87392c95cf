"""Log-probabilities and entropy of the target tokens from vocab-parallel logits.

The output layer's logits stay split over tensor parallelism ([b, s, vocab / TP] per rank); the
log-softmax needs two TP all-reductions (the max; then sum-exp, sum of exp * logit and the target's
logit, stacked in one), and the gradient is local to each rank's vocabulary slice. megatron-core 0.16.1
has no such helper (``vocab_parallel_cross_entropy`` gives log-probs but no entropy and overwrites
fp32 logits in place).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per position from this rank's slice of the logits.

    With s = logits - max, Z = sum(exp s), p = exp(s) / Z, H = log Z - sum(p s):
    d log p(target) / d s_j = [j == target] - p_j and d H / d s_j = -p_j (log p_j + H)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp_group):
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        tp_rank = dist.get_rank(tp_group) if tp_size > 1 else 0
        vocab_local = logits.shape[-1]
        local_target = target - tp_rank * vocab_local
        in_range = (local_target >= 0) & (local_target < vocab_local)
        local_target = torch.where(in_range, local_target, torch.zeros_like(local_target))

        logits_max = logits.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        target_shifted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_range
        sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1), target_shifted])
        if tp_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        sum_exp, sum_exp_shifted, target_shifted = sums
        log_z = sum_exp.log()
        logprob = target_shifted - log_z
        entropy = log_z - sum_exp_shifted / sum_exp

        log_softmax = shifted.sub_(log_z.unsqueeze(-1))  # reuse the buffer: one [.., V/TP] is saved
        ctx.save_for_backward(log_softmax, entropy, local_target, in_range)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor):
        log_softmax, entropy, local_target, in_range = ctx.saved_tensors
        probs = log_softmax.exp()
        grad = -probs * (grad_logprob.unsqueeze(-1) + grad_entropy.unsqueeze(-1) *
                         (log_softmax + entropy.unsqueeze(-1)))
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (grad_logprob * in_range).unsqueeze(-1))
        return grad, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, tp_group=None):
    """(log p(target), entropy), each shaped like ``target``, from ``logits`` [..., vocab / TP] that
    hold this TP rank's contiguous slice of the vocabulary (rank r: [r V/TP, (r+1) V/TP))."""
    return _VocabParallelLogProbEntropy.apply(logits.float(), target, tp_group)


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                               tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned [B, S] log-probs and entropies (rlcore/batch.py): ``x[b, t]`` belongs to
    ``input_ids[b, t]`` and comes from the logits at position t-1; position 0 holds 0.

    ``logits`` [B, S, vocab / TP] are the model's vocab-parallel output; they are divided by
    ``temperature`` first (the sampler's distribution) and never modified in place."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits[:, :-1].float() / temperature
    logprob, entropy = vocab_parallel_logprobs(scaled, input_ids[:, 1:], tp_group)
    return F.pad(logprob, (1, 0)), F.pad(entropy, (1, 0))


def scored_logprobs_and_entropy(output: torch.Tensor, input_ids: torch.Tensor, inputs, temperature: float = 1.0,
                                tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``token_logprobs_and_entropy``, from the output at the scored positions of ``inputs``
    (packing.ModelInputs: ``output`` [1, N, vocab / TP], the n-th scoring token ``inputs.dst[n]``);
    positions nobody scored hold 0. ``inputs`` None or without a selection: every position."""
    if inputs is None or inputs.src is None:
        return token_logprobs_and_entropy(output, input_ids, temperature, tp_group)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    from .packing import scatter_tokens

    logits = output.reshape(-1, output.shape[-1]).float() / temperature
    target = input_ids.reshape(-1).index_select(0, inputs.dst)
    logprob, entropy = vocab_parallel_logprobs(logits, target, tp_group)
    return scatter_tokens(logprob, inputs), scatter_tokens(entropy, inputs)
