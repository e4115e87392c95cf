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


# exp(-87) = 1.6e-38, just above float32's smallest normal number (1.2e-38).
_EXP_FLUSH_BELOW = -87.0
_EXP_FLUSHED = float(torch.tensor(_EXP_FLUSH_BELOW).exp())
# Elements of exp s (forward) and p (backward) made at a time: 4 MB of fp32 on the CPU (21 rows of a
# 49152-wide vocabulary), a buffer its allocator reuses; 256 MB on a GPU, where each pass is a few
# kernel launches and one pass per ~400 rows keeps them few.
_CPU_ELEMENTS_PER_PASS, _GPU_ELEMENTS_PER_PASS = 1 << 20, 1 << 26


def rows_per_pass(vocab_local: int, device: torch.device) -> int:
    """Rows of a [rows, vocab_local] buffer that one pass of exp s or p covers on ``device``."""
    elements = _CPU_ELEMENTS_PER_PASS if device.type == "cpu" else _GPU_ELEMENTS_PER_PASS
    return max(1, elements // vocab_local)


def _exp_without_denormals(x: torch.Tensor) -> torch.Tensor:
    """``x.exp()`` on the CPU with every result at or below exp(-87) = 1.6e-38 set to 0 (denormal
    from 1.2e-38 down). Over a vocabulary most tokens' shifted logits lie far below the largest, and
    x86 computes an exp that underflows 15-40x slower than a normal one, and a product with a denormal
    operand ~4x slower (measured on an Intel Xeon, one thread, exp over [119, 49152]: 6 ms on inputs in
    [-20, 0], 231 ms in [-104, -88], 96 ms in [-150, -110]). What is flushed is below 1.6e-38: next to
    Z >= 1 it is nothing, and it moves a sum only where every term is that small (the entropy of a
    distribution with all but one token below it, < 1e-33 either way). One new buffer, no mask. On the
    GPU ``x.exp()`` as it is."""
    if x.device.type != "cpu":
        return x.exp()
    return F.threshold_(x.clamp_min(_EXP_FLUSH_BELOW).exp_(), _EXP_FLUSHED, 0.0)


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per position from this rank's slice of the logits at a temperature.

    With s = logits / T - max, Z = sum(exp s), p = exp(s) / Z, H = log Z - sum(p s):
    d log p(target) / d s_j = [j == target] - p_j and d H / d s_j = -p_j (log p_j + H), and
    d / d logits = (d / d s) / T.

    One [.., V/TP] buffer: logits / T, which becomes s, then the saved log-softmax, then (in the
    backward) the gradient. It is a new one, or with ``overwrite`` the caller's fp32 logits themselves
    (divided in place: no second vocabulary-wide buffer, ~90 MB and ~0.1 s of a SmolLM2 update on the
    CPU, where a fresh buffer is mostly page faults); autograd is not told, which is sound only because
    no node reads the logits afterwards (megatron's output layer saves its input and weight, not its
    output) and the caller never reads them again. exp s and p are made ``rows_per_pass`` rows at a
    time, a few MB that the allocator reuses: on the CPU every fresh vocabulary-wide buffer (~100 MB
    for 500 scored positions of a 49152 vocabulary) is pages the kernel faults in and zeroes, and glibc
    maps one above 32 MiB fresh every time; on a GPU it is memory. The same operations on every element in
    the same order as the out-of-place formulas: equal to the bit on the CPU (tested)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, temperature: float, tp_group, overwrite: bool):
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        tp_rank = dist.get_rank(tp_group) if tp_size > 1 else 0
        vocab_local = logits.shape[-1]
        local_target = target - tp_rank * vocab_local
        in_range = (local_target >= 0) & (local_target < vocab_local)
        local_target = torch.where(in_range, local_target, torch.zeros_like(local_target))

        if overwrite and logits.dtype == torch.float32 and logits.is_contiguous():
            scaled = logits.div_(temperature)
        else:  # a new fp32 buffer: the division, or the cast and then the division
            scaled = logits.div(temperature) if logits.dtype == torch.float32 else logits.float().div_(temperature)
        logits_max = scaled.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        shifted = scaled.sub_(logits_max.unsqueeze(-1))
        target_shifted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_range
        sums = torch.empty((3, *shifted.shape[:-1]), dtype=shifted.dtype, device=shifted.device)
        rows, row_sums = shifted.view(-1, vocab_local), sums.view(3, -1)
        step = rows_per_pass(vocab_local, rows.device)
        for begin in range(0, rows.shape[0], step):
            s = rows[begin:begin + step]
            exp = _exp_without_denormals(s)
            row_sums[0, begin:begin + len(s)] = exp.sum(-1)
            row_sums[1, begin:begin + len(s)] = exp.mul_(s).sum(-1)
        sums[2] = target_shifted
        if tp_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        sum_exp, sum_exp_shifted, target_shifted = sums
        log_z = sum_exp.log()
        logprob = target_shifted - log_z
        entropy = log_z - sum_exp_shifted / sum_exp

        log_softmax = shifted.sub_(log_z.unsqueeze(-1))  # the one [.., V/TP] buffer saved
        ctx.save_for_backward(log_softmax, entropy, local_target, in_range)
        ctx.temperature = temperature
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor):
        log_softmax, entropy, local_target, in_range = ctx.saved_tensors
        # -p (g_logprob + g_entropy (log p + H)), evaluated in the saved buffer (not needed after this
        # backward, which megatron runs once), which becomes the gradient.
        vocab_local = log_softmax.shape[-1]
        rows = log_softmax.view(-1, vocab_local)
        per_row = [t.reshape(-1, 1) for t in (entropy, grad_entropy, grad_logprob)]
        step = rows_per_pass(vocab_local, rows.device)
        for begin in range(0, rows.shape[0], step):
            end = begin + step
            log_p = rows[begin:end]
            probs = _exp_without_denormals(log_p)
            h, g_ent, g_lp = (t[begin:end] for t in per_row)
            log_p.add_(h).mul_(g_ent).add_(g_lp).mul_(probs).neg_()
        grad = log_softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (grad_logprob * in_range).unsqueeze(-1))
        return grad.div_(ctx.temperature), None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, tp_group=None, temperature: float = 1.0,
                            overwrite_logits: bool = False):
    """(log p(target), entropy), each shaped like ``target``, of the softmax of ``logits`` /
    ``temperature``, from ``logits`` [..., vocab / TP] that hold this TP rank's contiguous slice of the
    vocabulary (rank r: [r V/TP, (r+1) V/TP)). ``logits`` is not modified, unless ``overwrite_logits``:
    then contiguous fp32 logits become the function's working buffer (for a caller that hands over the
    model's fresh output and never reads it again; _VocabParallelLogProbEntropy)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _VocabParallelLogProbEntropy.apply(logits, target, float(temperature), tp_group, overwrite_logits)


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                               tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned [B, S] log-probs and entropies (rlcore/batch.py): ``x[b, t]`` belongs to
    ``input_ids[b, t]`` and comes from the logits at position t-1; position 0 holds 0.

    ``logits`` [B, S, vocab / TP] are the model's vocab-parallel output; they are divided by
    ``temperature`` first (the sampler's distribution) and never modified in place."""
    logprob, entropy = vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], tp_group, temperature)
    return F.pad(logprob, (1, 0)), F.pad(entropy, (1, 0))


def scored_logprobs_and_entropy(output: torch.Tensor, input_ids: torch.Tensor, inputs, temperature: float = 1.0,
                                tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``token_logprobs_and_entropy``, from the output at the scored positions of ``inputs``
    (packing.ModelInputs: ``output`` [1, N, vocab / TP], the n-th scoring token ``inputs.dst[n]``);
    positions nobody scored hold 0. ``inputs`` None or without a selection: every position.

    For the heads, whose ``output`` is the model's fresh output that megatron's schedule drops after
    the loss: it is overwritten (``vocab_parallel_logprobs(overwrite_logits=True)``)."""
    if inputs is None or inputs.src is None:
        return token_logprobs_and_entropy(output, input_ids, temperature, tp_group)
    from .packing import scatter_tokens

    target = input_ids.reshape(-1).index_select(0, inputs.dst)
    logprob, entropy = vocab_parallel_logprobs(output.reshape(-1, output.shape[-1]), target, tp_group, temperature,
                                               overwrite_logits=True)
    return scatter_tokens(logprob, inputs), scatter_tokens(entropy, inputs)
