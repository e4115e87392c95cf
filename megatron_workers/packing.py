"""What the model runs for one micro-batch, and which of its outputs the head reads.

The controller's batch is token-aligned [B, S] (rlcore/batch.py): every per-token quantity
``x[b, t]`` belongs to ``input_ids[b, t]``, and the output that scores token t is the model's output
at position t - 1. Two savings change what the model runs without changing that contract:

- **Outputs only where they are used** (always, when the micro-batch has a ``response_mask``): the
  output layer (the 49152-wide vocabulary projection on SmolLM2, or the value head) and the
  log-softmax run only at the positions whose output scores a response token. Prompt positions never
  enter a loss, an advantage or a metric.
- **The prompt once per group** (``shared_prompt``): the ``rollout.n`` rows that answer one prompt
  share it, so they run as ONE row: the prompt, then each response in turn. An explicit attention
  mask lets each response token see the prompt and its own response's earlier tokens only, and the
  rotary positions restart after the prompt for every response, so every response token computes
  exactly what it computes in its own unpacked row (up to float summation order). The first token
  of every response is scored by the prompt's last position, once per response.

``ModelInputs.src`` are the flat positions (into the packed [G, L] rows) whose outputs the head
reads, ``dst`` the flat token positions (into the micro-batch's [B, S]) they score; the head scatters
its per-token results back to [B, S], zeros elsewhere, and the losses run unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from rlcore.batch import Batch


@dataclass
class ModelInputs:
    tokens: torch.Tensor  # [G, L] int64: the rows the model runs
    position_ids: torch.Tensor  # [G, L] int64: each token's rotary position
    attention_mask: Optional[torch.Tensor]  # [G, 1, L, L] bool, True = masked out; None: plain causal
    src: Optional[torch.Tensor]  # [N] int64 flat into G*L: the outputs the head reads; None: all of them
    dst: Optional[torch.Tensor]  # [N] int64 flat into B*S: the token each of them scores
    rows: int  # B: the micro-batch's rows
    seq_len: int  # S: the micro-batch's (token-aligned) sequence length

    @property
    def masked(self) -> bool:
        """The rows bring their own attention mask and rotary positions (the model was built with
        ``explicit_mask``: model.py)."""
        return self.attention_mask is not None


def _first_response_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] the first response position of each row (S where a row has no response token)."""
    s = response_mask.shape[1]
    has = response_mask > 0
    first = torch.where(has, torch.arange(s).expand_as(has), torch.full_like(has, s, dtype=torch.long))
    return first.min(dim=1).values


def unpacked_inputs(micro_batch: Batch) -> ModelInputs:
    """The micro-batch's own rows; outputs read only where they score a response token (all
    positions when the micro-batch has no ``response_mask``)."""
    input_ids = micro_batch["input_ids"]
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).expand(b, s)
    if "response_mask" not in micro_batch:
        return ModelInputs(input_ids, positions, None, None, None, b, s)
    mask = micro_batch["response_mask"].clone()
    mask[:, 0] = 0  # position 0 has no earlier output to score it
    dst = mask.reshape(-1).nonzero().squeeze(1).to(input_ids.device)
    return ModelInputs(input_ids, positions, None, dst - 1, dst, b, s)


def shared_prompt_inputs(micro_batch: Batch, multiple: int = 1) -> ModelInputs:
    """The micro-batch's rows packed by prompt: consecutive rows with the same prompt tokens become
    one row [prompt, response_1, ..., response_k] (see the module docstring), padded to the longest
    rounded up to a ``multiple`` (sequence parallelism splits the sequence over TP). Needs
    ``response_mask`` and ``attention_mask`` (rlcore.batch.build_batch's rows)."""
    input_ids = micro_batch["input_ids"].cpu()
    response_mask = micro_batch["response_mask"].cpu()
    lengths = micro_batch["attention_mask"].cpu().sum(1)
    b, s = input_ids.shape
    first = _first_response_positions(response_mask)
    groups = prompt_groups(Batch(input_ids=input_ids, response_mask=response_mask))

    packed_tokens, packed_pos, packed_seg = [], [], []
    src_group, src_local, dst = [], [], []  # src is flat into G*L once L (the longest row) is known
    for g, members in enumerate(groups):
        p = min(int(first[members[0]]), int(lengths[members[0]]))
        tokens, pos, seg = [input_ids[members[0], :p]], [torch.arange(p)], [torch.zeros(p, dtype=torch.long)]
        offset = p
        for k, row in enumerate(members, start=1):
            end = int(lengths[row])
            r = end - p
            if r <= 0:
                continue
            tokens.append(input_ids[row, p:end])
            pos.append(torch.arange(p, end))
            seg.append(torch.full((r,), k, dtype=torch.long))
            # Token p + j of `row` is scored by the previous token of this response in the packed
            # row, or for j = 0 by the prompt's last position (shared by every response).
            j = torch.arange(r)
            local = torch.where(j == 0, torch.full_like(j, p - 1), offset + j - 1)
            keep = local >= 0  # without a prompt, the first token has no earlier output (it holds 0)
            src_group.append(torch.full((int(keep.sum()),), g, dtype=torch.long))
            src_local.append(local[keep])
            dst.append((row * s + p + j)[keep])
            offset += r
        packed_tokens.append(torch.cat(tokens))
        packed_pos.append(torch.cat(pos))
        packed_seg.append(torch.cat(seg))

    length = -(-max(len(t) for t in packed_tokens) // multiple) * multiple
    n_rows = len(groups)
    tokens = torch.zeros((n_rows, length), dtype=torch.long)  # the filler is never read: any valid id
    positions = torch.zeros((n_rows, length), dtype=torch.long)
    segments = torch.full((n_rows, length), -1, dtype=torch.long)  # -1: padding
    for g in range(n_rows):
        n = len(packed_tokens[g])
        tokens[g, :n], positions[g, :n], segments[g, :n] = packed_tokens[g], packed_pos[g], packed_seg[g]
    q, k = segments.unsqueeze(2), segments.unsqueeze(1)
    # A query sees the earlier keys of the prompt (segment 0) and of its own segment (its response;
    # padding sees padding and the prompt, and nothing reads its outputs).
    visible = torch.ones(length, length, dtype=torch.bool).tril() & ((k == 0) | (k == q))
    empty = torch.zeros(0, dtype=torch.long)
    src = torch.cat(src_group or [empty]) * length + torch.cat(src_local or [empty])
    device = micro_batch["input_ids"].device
    return ModelInputs(tokens.to(device), positions.to(device), (~visible).unsqueeze(1).to(device),
                       src.to(device), torch.cat(dst or [empty]).to(device), b, s)


def model_inputs(micro_batch: Batch, shared_prompt: bool, multiple: int = 1) -> ModelInputs:
    """The rows to run for ``micro_batch``: packed by prompt when ``shared_prompt`` (and the
    micro-batch carries the masks that needs; their length a ``multiple``), its own rows otherwise. A
    ``shared_prompt`` model takes its mask from every forward (model.py ``explicit_mask``: with none it
    would attend everywhere), so rows it cannot pack bring the plain causal mask."""
    if shared_prompt and "response_mask" in micro_batch and "attention_mask" in micro_batch:
        return shared_prompt_inputs(micro_batch, multiple)
    inputs = unpacked_inputs(micro_batch)
    if shared_prompt:
        s = inputs.tokens.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=inputs.tokens.device).tril()
        inputs.attention_mask = (~causal).view(1, 1, s, s)
    return inputs


def scatter_tokens(values: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """[N] per-scored-token values -> token-aligned [B, S], 0 at the positions nobody scored."""
    out = values.new_zeros(inputs.rows * inputs.seq_len)
    return out.index_copy(0, inputs.dst, values).view(inputs.rows, inputs.seq_len)


# ------------------------------------------------------------------------------- model hooks
class ActiveInputs:
    """The ``ModelInputs`` of the micro-batch the engine is running now, read by the hooks below.
    Set right before each ``model(...)`` call: a micro-batch's forward runs entirely inside it (its
    backward, later in the pipeline schedule, needs no hook)."""
    current: Optional[ModelInputs] = None


def _select_outputs(active: ActiveInputs, module, args, kwargs):
    """Pre-hook of the output layer: only the hidden states at ``src`` reach it ([s, b, h] ->
    [N, 1, h]; GPTModel then returns [1, N, out])."""
    inputs = active.current
    if inputs is None or inputs.src is None:
        return None
    hidden = args[0]
    if getattr(module, "sequence_parallel", False):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # Gather the sequence first (as megatron's own last-token inference path does), then run the
        # layer without its sequence-parallel gather. Its input then goes through
        # copy_to_tensor_model_parallel_region (the dgrad all-reduce over TP), so the gather's
        # backward must only split, not reduce-scatter again.
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        module.sequence_parallel = False
        module._sequence_parallel_restore = True
    h = hidden.shape[-1]
    selected = hidden.transpose(0, 1).reshape(-1, h).index_select(0, inputs.src).unsqueeze(1)
    return (selected, *args[1:]), kwargs


def _restore_sequence_parallel(module, args, output):
    if getattr(module, "_sequence_parallel_restore", False):
        module.sequence_parallel = True
        module._sequence_parallel_restore = False
    return None


def _positioned_rotary(active: ActiveInputs, module, args, output):
    """Hook of the rotary embedding: GPTModel computes the rotary angles of positions 0..L-1 whatever
    the position ids; a packed row needs each token's own position ([L, 1, 1, d] -> [L, G, 1, d])."""
    inputs = active.current
    if inputs is None or not inputs.masked:
        return None
    table = output[:, 0, 0, :]  # [L, d]: the angles of positions 0..L-1 (a packed position is < L)
    return table[inputs.position_ids.t()].unsqueeze(2)


def attach_input_hooks(chunk, active: ActiveInputs) -> None:
    """Makes a GPTModel chunk run ``active.current``'s selection and positions."""
    if getattr(chunk, "post_process", False):
        chunk.output_layer.register_forward_pre_hook(partial(_select_outputs, active), with_kwargs=True)
        chunk.output_layer.register_forward_hook(_restore_sequence_parallel)
    rotary = getattr(chunk, "rotary_pos_emb", None)
    if rotary is not None:
        rotary.register_forward_hook(partial(_positioned_rotary, active))


# --------------------------------------------------------------------------- micro-batch plans
def prompt_groups(batch: Batch) -> list[list[int]]:
    """Runs of consecutive rows with the same prompt tokens (rows without a response mask: each its own)."""
    if "response_mask" not in batch:
        return [[r] for r in range(batch.size)]
    ids = batch["input_ids"]
    first = _first_response_positions(batch["response_mask"].cpu())
    groups: list[list[int]] = []
    for row in range(batch.size):
        p = int(first[row])
        if groups:
            lead = groups[-1][0]
            if int(first[lead]) == p and torch.equal(ids[lead, :p], ids[row, :p]):
                groups[-1].append(row)
                continue
        groups.append([row])
    return groups


def _row_lengths(batch: Batch) -> torch.Tensor:
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(1).cpu()
    return torch.full((batch.size,), batch["input_ids"].shape[1])


def token_budget_micro_batches(batch: Batch, max_tokens: int, shared_prompt: bool) -> list[list[int]]:
    """Row indices of each micro-batch under a budget of ``max_tokens`` model tokens (rows x the
    micro-batch's longest row, as it runs): units (rows; with ``shared_prompt``, a prompt's rows
    together) sorted longest first and packed first-fit. A unit over the budget alone runs alone.
    Deterministic: the same batch always gives the same plan (every PP stage computes it)."""
    lengths = _row_lengths(batch)
    if shared_prompt and "response_mask" in batch:
        first = _first_response_positions(batch["response_mask"].cpu())
        units = [(rows, int(first[rows[0]]) + sum(int(lengths[r]) - int(first[r]) for r in rows))
                 for rows in prompt_groups(batch)]
    else:
        units = [([r], int(lengths[r])) for r in range(batch.size)]
    units.sort(key=lambda u: (-u[1], u[0][0]))
    bins: list[tuple[list[int], int, int]] = []  # (rows, units in it, its longest unit)
    for rows, cost in units:
        for i, (b_rows, count, longest) in enumerate(bins):
            if (count + 1) * max(longest, cost) <= max_tokens:
                bins[i] = (b_rows + rows, count + 1, max(longest, cost))
                break
        else:
            bins.append((list(rows), 1, cost))
    return [sorted(rows) for rows, _, _ in bins]


def trimmed(micro_batch: Batch, multiple: int = 1) -> Batch:
    """The micro-batch cut to its own longest row, rounded up to a ``multiple`` (sequence parallelism
    splits the sequence over TP); right padding beyond the longest row is never read."""
    longest = int(_row_lengths(micro_batch).max())
    longest = min(-(-longest // multiple) * multiple, micro_batch["input_ids"].shape[1])
    return Batch({k: v[:, :longest] if v.dim() >= 2 else v for k, v in micro_batch.items()})
