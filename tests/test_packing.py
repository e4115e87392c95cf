"""Fewer FLOPs, the same numbers: response-only outputs, shared-prompt rows and the on-policy update.

- The packing itself (megatron_workers/packing.py), without a model: every scored output is the one
  the unpacked row would read (the same previous token, at the same rotary position), and a packed
  response sees exactly the prompt and its own earlier tokens.
- Through megatron-core (one actor group, TP1PP1, PP2 and PP2 VPP2): shared-prompt rows give the same
  log-probs, loss, metrics and updated weights as the unpacked rows (1e-6 in fp32 on the loss and the
  gradient's norm, 1e-5 on log-probs and weights); prompt positions hold 0.
- The on-policy update (``on_policy=True``, no ``old_logprobs``) equals the update after a separate
  forward pass: the same metrics and weights, ppo_kl exactly 0, and the log-probs it keeps are the
  forward's.
"""
from __future__ import annotations

import pytest
import torch

from launch.assets import make_tiny_model
from megatron_workers.group import MegatronGroup
from megatron_workers.packing import (model_inputs, prompt_groups, shared_prompt_inputs, token_budget_micro_batches,
                                     trimmed, unpacked_inputs)
from rlcore.algos import LossConfig, loss_weights
from rlcore.batch import Batch, Trajectory, build_batch
from rlcore.config import OptimConfig
from rlcore.roles import RoleSpec

LOSS = LossConfig(entropy_coeff=0.01, kl_coeff=0.0)
OPTIM = OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0)


def grouped_batch(groups: int = 4, n: int = 4, vocab: int = 16, seed: int = 0) -> Batch:
    """``groups`` prompts (3-7 tokens) with ``n`` responses each (1-6 tokens), as build_batch makes them."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for p in range(groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 8, (), generator=g)),), generator=g).tolist()
        for _ in range(n):
            response = torch.randint(3, vocab, (int(torch.randint(1, 7, (), generator=g)),), generator=g).tolist()
            trajs.append(Trajectory(p, prompt, response, [0.0] * len(response), "stop", 0))
    batch = build_batch(trajs, pad_id=0)
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["loss_weights"] = loss_weights(mask, "token-mean", mask.shape[1])
    return batch


# ------------------------------------------------------------------------------ packing alone
def test_unpacked_rows_read_only_the_outputs_that_score_response_tokens():
    batch = grouped_batch()
    inputs = unpacked_inputs(batch)
    mask = batch["response_mask"].reshape(-1)
    assert inputs.attention_mask is None and torch.equal(inputs.tokens, batch["input_ids"])
    assert torch.equal(inputs.dst, mask.nonzero().squeeze(1)) and torch.equal(inputs.src, inputs.dst - 1)
    no_mask = unpacked_inputs(Batch(input_ids=batch["input_ids"]))
    assert no_mask.src is None and no_mask.dst is None  # every position, as before


def test_shared_prompt_rows_score_the_same_tokens_from_the_same_context():
    batch = grouped_batch(groups=3, n=4)
    ids, mask = batch["input_ids"], batch["response_mask"]
    b, s = ids.shape
    inputs = shared_prompt_inputs(batch)
    g, length = inputs.tokens.shape
    assert g == 3  # one row per prompt
    # Each row: the prompt once, then its 4 responses.
    prompt = (mask.argmax(1)).view(3, 4)[:, 0]
    response = mask.sum(1).view(3, 4).sum(1).long()
    assert length == int((prompt + response).max())
    assert int((inputs.tokens[:, :] != 0).sum()) == int((prompt + response).sum())  # real tokens are >= 3
    # Every response token is scored exactly once.
    assert torch.equal(inputs.dst.sort().values, mask.reshape(-1).nonzero().squeeze(1))
    # The output that scores token t of row r sits on the token t - 1 of that row, at position t - 1.
    assert torch.equal(inputs.tokens.reshape(-1)[inputs.src], ids.reshape(-1)[inputs.dst - 1])
    assert torch.equal(inputs.position_ids.reshape(-1)[inputs.src], inputs.dst % s - 1)

    # What each scored output sees: exactly the tokens (and positions) before it in its own row.
    visible = ~inputs.attention_mask[:, 0]  # [G, L, L]
    for src, dst in zip(inputs.src.tolist(), inputs.dst.tolist()):
        row, t = divmod(dst, s)
        grp, q = divmod(src, length)
        seen = visible[grp, q].nonzero().squeeze(1)
        assert inputs.tokens[grp, seen].tolist() == ids[row, :t].tolist()
        assert inputs.position_ids[grp, seen].tolist() == list(range(t))


def test_shared_prompt_rows_pad_to_a_multiple_for_sequence_parallelism():
    """Under sequence parallelism (the gpu profile at TP > 1) a packed row's length is a multiple of TP;
    the padding is never read and no real token sees it."""
    batch = grouped_batch(groups=3, n=4)
    plain = shared_prompt_inputs(batch)
    padded = model_inputs(batch, shared_prompt=True, multiple=4)
    length = plain.tokens.shape[1]
    assert padded.tokens.shape[1] == -(-length // 4) * 4 > length
    assert torch.equal(padded.tokens[:, :length], plain.tokens) and torch.equal(padded.dst, plain.dst)
    grp, q = plain.src // length, plain.src % length
    assert torch.equal(padded.src, grp * padded.tokens.shape[1] + q)
    assert torch.equal(padded.attention_mask[:, :, :length, :length], plain.attention_mask)
    assert bool(padded.attention_mask[grp, 0, q][:, length:].all())  # scored outputs never see the padding


def test_rows_with_different_prompts_are_not_packed_together():
    batch = grouped_batch(groups=4, n=1)  # every row its own prompt
    assert shared_prompt_inputs(batch).tokens.shape[0] == 4
    # Without the masks there is nothing to pack by: the micro-batch's own rows, under the plain causal
    # mask (a shared-prompt model takes its mask from every forward).
    own = model_inputs(Batch(input_ids=batch["input_ids"]), shared_prompt=True)
    s = batch["input_ids"].shape[1]
    assert torch.equal(own.tokens, batch["input_ids"])
    assert torch.equal(own.attention_mask, ~torch.ones(s, s, dtype=torch.bool).tril().view(1, 1, s, s))
    assert model_inputs(Batch(input_ids=batch["input_ids"]), shared_prompt=False).attention_mask is None


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_token_budget_plan_covers_every_row_once_within_the_budget(shared_prompt):
    batch = grouped_batch(groups=5, n=3, seed=1)
    lengths = batch["attention_mask"].sum(1)
    budget = 30
    plan = token_budget_micro_batches(batch, budget, shared_prompt)
    assert sorted(r for rows in plan for r in rows) == list(range(batch.size))
    assert plan == token_budget_micro_batches(batch, budget, shared_prompt)  # every PP stage plans the same
    for rows in plan:
        mb = trimmed(Batch({k: v[torch.tensor(rows)] for k, v in batch.items()}))
        assert mb["input_ids"].shape[1] == int(lengths[rows].max())  # padded to its own longest only
        tokens = model_inputs(mb, shared_prompt).tokens
        assert tokens.numel() <= budget or (len(rows) == 1 or (shared_prompt and len(prompt_groups(mb)) == 1))
    if shared_prompt:  # a prompt's rows stay together
        for group in prompt_groups(batch):
            assert any(set(group) <= set(rows) for rows in plan)


# ------------------------------------------------------------------------- through megatron-core
@pytest.fixture(scope="module")
def placement(ray_pools):
    return ray_pools({"actor": 2}, {"actor": "actor"}).placement("actor")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2-packing")), arch="qwen2", tie_word_embeddings=True)


def run_update(model_path, placement, batch, pp=1, shared_prompt=False, on_policy=False, micro_batch_size=4,
               max_tokens=None, refusal=None, vpp=1):
    """(log-probs before, metrics, kept outputs, HF weights after) of one update. ``refusal``: a dict
    that gets the exception (or None) of an update asked for first without old log-probs and without
    ``on_policy`` (refused before anything reaches the workers)."""
    group = MegatronGroup(RoleSpec("actor", model_path, tp=1, pp=pp, dp=1, micro_batch_size=micro_batch_size,
                                   profile="cpu", dtype="float32", seed=0, optim=OPTIM, vpp=vpp,
                                   shared_prompt=shared_prompt, max_tokens_per_micro_batch=max_tokens), placement)
    try:
        if refusal is not None:
            try:
                group.update(Batch(batch), LOSS)
                refusal["error"] = None
            except ValueError as err:
                refusal["error"] = err
        batch = Batch(batch)
        before = group.forward(batch)["logprobs"]
        if on_policy:
            result = group.update(batch, LOSS, on_policy=True)
        else:
            batch["old_logprobs"] = before
            result = group.update(batch, LOSS)
        return before, dict(result), result.outputs, group.hf_state_dict()
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def refused() -> dict:
    """What the reference run's group raised when first asked for an update without old log-probs."""
    return {}


@pytest.fixture(scope="module")
def reference_run(model_path, placement, refused):
    """TP1PP1, unpacked rows, a separate old-log-prob pass (first: ``refused``)."""
    batch = grouped_batch()
    return batch, run_update(model_path, placement, batch, refusal=refused)


def assert_same_update(a, b, tol=1e-5):
    before_a, metrics_a, _, weights_a = a
    before_b, metrics_b, _, weights_b = b
    torch.testing.assert_close(before_a, before_b, atol=tol, rtol=0)
    assert metrics_a.keys() == metrics_b.keys()
    for k in metrics_a:
        assert metrics_a[k] == pytest.approx(metrics_b[k], abs=1e-6, rel=1e-6), k
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], atol=tol, rtol=0, msg=name)


def test_response_only_logprobs_equal_transformers_and_prompt_positions_hold_zero(model_path, reference_run):
    import transformers

    batch, (before, *_) = reference_run
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    log_softmax = torch.log_softmax(model(batch["input_ids"]).logits[:, :-1], -1)
    logprobs = torch.nn.functional.pad(log_softmax.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1), (1, 0))
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(before[mask], logprobs.detach()[mask], atol=1e-5, rtol=0)
    assert torch.all(before[~mask] == 0)


@pytest.mark.parametrize("pp,vpp,micro_batch_size", [(1, 1, 4), (1, 1, 8), (2, 1, 2), (2, 2, 4)])
def test_shared_prompt_rows_give_the_same_update(model_path, placement, reference_run, pp, vpp, micro_batch_size):
    """One group per micro-batch, two, and half a group (PP2: variable-length packed rows between
    stages); and one group per micro-batch through the interleaved schedule (PP2 VPP2: each packed
    row at its own length too)."""
    batch, expected = reference_run
    got = run_update(model_path, placement, batch, pp=pp, vpp=vpp, shared_prompt=True,
                     micro_batch_size=micro_batch_size)
    assert_same_update(got, expected)


@pytest.mark.parametrize("pp,shared_prompt", [(1, False), (2, True)])
def test_token_budget_micro_batches_give_the_same_update(model_path, placement, reference_run, pp, shared_prompt):
    batch, expected = reference_run
    got = run_update(model_path, placement, batch, pp=pp, shared_prompt=shared_prompt, max_tokens=40)
    assert_same_update(got, expected)


def test_on_policy_update_equals_the_update_after_a_separate_pass(model_path, placement, reference_run):
    batch, expected = reference_run
    before, metrics, kept, weights = run_update(model_path, placement, batch, on_policy=True)
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/clip_frac"] == 0.0
    torch.testing.assert_close(kept["logprobs"], before, atol=1e-6, rtol=0)
    assert_same_update((before, metrics, kept, weights), expected, tol=1e-6)


def test_update_without_old_logprobs_must_say_on_policy(reference_run, refused):
    """Asked of the reference run's group before its update (the refusal changes nothing: that update
    is the one every other test compares with)."""
    import re

    assert refused["error"] is not None and re.search("no 'old_logprobs'.*on_policy=True", str(refused["error"]))
