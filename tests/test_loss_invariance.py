"""The aggregated loss and its gradient do not depend on how the batch is split: into 1, 2 or 4
micro-batches, or over 2 DP shards, for every loss aggregation mode (``rlcore.algos.loss_weights``
computed once on the whole batch).

The first tests check the aggregation itself with a tiny ``torch.nn.Linear`` as the parameter source
(log-probs and entropies are functions of its outputs). The ``slow`` test runs the real thing: one
Megatron actor update with micro_batch_size 4 on DP1 vs micro_batch_size 2 on DP2 gives the same
loss, grad norm and weights.
"""
from __future__ import annotations

import os

import pytest
import torch

from rlcore.algos import AGG_MODES, LossConfig, actor_loss, loss_weights
from rlcore.batch import Batch
from tests.batches import right_padded_rows

ROWS, SEQ, FEATURES = 8, 7, 5
CFG = LossConfig(policy_loss="vanilla", clip_ratio_high=0.28, kl_coeff=0.1, kl_estimator="k3", entropy_coeff=0.01)


def _batch(mode: str) -> tuple[torch.Tensor, Batch]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 6, 3, 5, 2, 6, 1, 4])  # uneven: micro-batches hold different token counts
    prompt = 1
    positions = torch.arange(SEQ)[None, :]
    mask = ((positions >= prompt) & (positions < prompt + lengths[:, None])).float()
    features = torch.randn(ROWS, SEQ, FEATURES, generator=g)
    batch = Batch(response_mask=mask,
                  old_logprobs=-torch.rand(ROWS, SEQ, generator=g) - 0.5,
                  ref_logprobs=-torch.rand(ROWS, SEQ, generator=g) - 0.5,
                  advantages=torch.randn(ROWS, 1, generator=g) * mask,
                  loss_weights=loss_weights(mask, mode, norm_length=SEQ))
    return features, batch


def _loss(model: torch.nn.Linear, features: torch.Tensor, batch: Batch) -> torch.Tensor:
    out = model(features)
    logprobs = -torch.nn.functional.softplus(out[..., 0])  # a log-probability: <= 0
    entropy = torch.nn.functional.softplus(out[..., 1])
    return actor_loss(logprobs, entropy, batch, CFG)[0]


def _grads(model: torch.nn.Linear, features: torch.Tensor, batch: Batch, dp: int, micro_batches: int,
           local_weights: str | None = None) -> list[torch.Tensor]:
    """The gradient summed over ``micro_batches`` per DP shard and over the ``dp`` shards (what the
    worker's loss scaling and DDP's all-reduce add up to). ``local_weights``: recompute the weights
    per micro-batch in that mode (the wrong way, for the control)."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for d in range(dp):
        shard_x = features.chunk(dp)[d]
        shard = batch.shard(d, dp)
        size = shard.size // micro_batches
        for i in range(micro_batches):
            mb = shard.slice(i * size, (i + 1) * size)
            if local_weights is not None:
                mb["loss_weights"] = loss_weights(mb["response_mask"], local_weights, SEQ)
            grads = torch.autograd.grad(_loss(model, shard_x[i * size:(i + 1) * size], mb), list(model.parameters()))
            total = [t + g for t, g in zip(total, grads)]
    return total


@pytest.mark.parametrize("mode", list(AGG_MODES))
@pytest.mark.parametrize("dp,micro_batches", [(1, 2), (1, 4), (2, 1), (2, 2)])
def test_gradient_is_independent_of_the_split(mode, dp, micro_batches):
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 2)
    features, batch = _batch(mode)
    full = torch.autograd.grad(_loss(model, features, batch), list(model.parameters()))
    split = _grads(model, features, batch, dp, micro_batches)
    for f, s in zip(full, split):
        torch.testing.assert_close(s, f, rtol=1e-5, atol=1e-7)
    # The control: normalising each micro-batch on its own gives a different gradient, so the test
    # can tell a right aggregation from a wrong one.
    wrong = _grads(model, features, batch, dp, micro_batches, local_weights=mode)
    assert any((w - f).abs().max() > 1e-4 for w, f in zip(wrong, full))


# ------------------------------------------------------------------------------ Megatron actor
MEGATRON_BATCH, MEGATRON_SEQ = 8, 20


@pytest.fixture(scope="module")
def placement(ray_pools):
    return ray_pools({"actor": 2}, {"actor": "actor"}).placement("actor")


def _megatron_batch(vocab: int = 16, seed: int = 0) -> Batch:
    """Prompts of 3-6 tokens, responses of very uneven length, right padding; seq-mean-token-mean weights."""
    g = torch.Generator().manual_seed(seed)
    input_ids, mask = right_padded_rows(g, MEGATRON_BATCH, MEGATRON_SEQ, vocab, min_response=1)
    return Batch(input_ids=input_ids, attention_mask=(input_ids != 0).long(), response_mask=mask,
                 advantages=torch.randn(MEGATRON_BATCH, 1, generator=g) * mask,
                 loss_weights=loss_weights(mask, "seq-mean-token-mean", MEGATRON_SEQ))


@pytest.mark.slow
def test_megatron_update_is_independent_of_micro_batch_size_and_dp(qwen2_untied, placement):
    from safetensors.torch import load_file

    from megatron_workers import MegatronGroup
    from rlcore.roles import RoleSpec
    from rlcore.config import OptimConfig

    loss_cfg = LossConfig(entropy_coeff=0.01, kl_coeff=0.0)
    batch = _megatron_batch()
    results = {}
    # (4, 1): the whole batch in 2 micro-batches of 4 in one process; (2, 2): 2 DP ranks of 2
    # micro-batches of 2 each. (A third run, (2, 1), would add ~25 s and passes too.)
    for micro_batch_size, dp in [(4, 1), (2, 2)]:
        # lr / eps as in test_megatron_layouts: Adam's first step must not amplify float noise.
        optim = OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0, use_distributed_optimizer=dp > 1)
        group = MegatronGroup(RoleSpec("actor", qwen2_untied, tp=1, pp=1, dp=dp, micro_batch_size=micro_batch_size,
                                       profile="cpu", dtype="float32", seed=0, optim=optim), placement)
        try:
            if "old_logprobs" not in batch:  # on-policy, from the same checkpoint for every run
                batch["old_logprobs"] = group.forward(batch)["logprobs"] * batch["response_mask"]
            metrics = group.update(Batch(batch), loss_cfg)
            results[(micro_batch_size, dp)] = metrics, group.hf_state_dict()
        finally:
            group.shutdown()

    ref_metrics, ref_weights = results[(4, 1)]
    # On-policy, the surrogate is -A: the loss is the seq-mean-token-mean of -A over the whole batch.
    expected_pg = float((-batch["advantages"] * batch["loss_weights"]).sum())
    assert ref_metrics["actor/pg_loss"] == pytest.approx(expected_pg, abs=1e-6)
    for key in [(2, 2)]:
        metrics, weights = results[key]
        for name, value in ref_metrics.items():  # the grad norm catches a wrongly scaled gradient
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, name)
        for name, ref in ref_weights.items():
            torch.testing.assert_close(weights[name], ref, atol=1e-5, rtol=0, msg=f"{key} {name}")
    # ... and the update did move the weights, by far more than the tolerance.
    initial = load_file(os.path.join(qwen2_untied, "model.safetensors"))
    assert max(float((ref_weights[n] - initial[n]).abs().max()) for n in ref_weights) > 1e-4
