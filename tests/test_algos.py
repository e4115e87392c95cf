"""Advantage, KL and policy-loss math against hand-computed values, and the loss normalisation
contract: any micro-batch split of a batch gives the same loss and gradient as one pass."""
import math

import pytest
import torch

from rlcore.algos import LossConfig, actor_loss, grpo_advantages, kl_estimate, ppo_clip_loss
from rlcore.batch import Batch

EPS = 1e-6  # grpo_advantages' default epsilon


# --------------------------------------------------------------------------------------- GRPO
def test_grpo_advantages_two_groups_hand_computed():
    # Group 7 (interleaved, non-contiguous ids): scores 1, 2, 3 -> mean 2, unbiased std 1
    # (a biased std would be sqrt(2/3) and give +-1.22). Group 3: all equal -> all zeros.
    scores = torch.tensor([1.0, 0.5, 2.0, 0.5, 3.0])
    groups = torch.tensor([7, 3, 7, 3, 7])
    adv = grpo_advantages(scores, groups)
    expected = torch.tensor([-1 / (1 + EPS), 0.0, 0.0, 0.0, 1 / (1 + EPS)])
    torch.testing.assert_close(adv, expected)


def test_grpo_advantages_without_std_normalisation_is_centred_score():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = grpo_advantages(scores, groups, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_grpo_advantages_group_of_one_gets_zero():
    adv = grpo_advantages(torch.tensor([5.0, 1.0, 0.0]), torch.tensor([0, 1, 1]))
    assert adv[0].item() == 0.0
    # Group 1: scores 1, 0 -> centred +-0.5, unbiased variance 0.5 / 1.
    torch.testing.assert_close(adv[1:], torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + EPS))


# ----------------------------------------------------------------------------------------- KL
def test_kl_estimators_hand_computed():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    log_ratio = math.log(2.0)  # logp - ref
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([log_ratio]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * log_ratio ** 2]))
    # k3 = exp(ref - logp) - (ref - logp) - 1 = 0.5 + ln 2 - 1
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 + log_ratio - 1.0]))


def test_kl_k3_is_zero_on_equal_and_non_negative():
    torch.manual_seed(0)
    logp, ref = torch.randn(100), torch.randn(100)
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert kl_estimate(logp, logp, "k3").abs().max().item() == 0.0


def test_kl_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


# ------------------------------------------------------------------------------------ PPO clip
def test_ppo_clip_loss_hand_computed():
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0]])
    loss, clipped = ppo_clip_loss(ratio.log(), torch.zeros_like(ratio), adv, LossConfig())
    # max(-A r, -A clip(r, 0.8, 1.2)) token by token:
    #   A=+1 r=1.5: max(-1.5, -1.2) = -1.2 (clipped)   A=+1 r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1 r=1.5: max( 1.5,  1.2) =  1.5             A=-1 r=0.5: max( 0.5,  0.8) =  0.8 (clipped)
    #   A=+2 r=1.0: -2
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 1.5, 0.8, -2.0]]))
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0]]


def test_ppo_clip_loss_asymmetric_clip_range():
    ratio = torch.tensor([[1.5, 0.5]])
    adv = torch.tensor([[1.0, -1.0]])
    cfg = LossConfig(clip_ratio_low=0.1, clip_ratio_high=0.28)
    loss, clipped = ppo_clip_loss(ratio.log(), torch.zeros_like(ratio), adv, cfg)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.9]]))
    assert clipped.tolist() == [[1.0, 1.0]]


# ----------------------------------------------------------------------- normalisation contract
def _random_batch(seed: int = 0, rows: int = 8, seq: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 5, 3, 4, 2, 5, 1, 3])[:rows]
    mask = (torch.arange(seq)[None, :] >= seq - lengths[:, None]).float()  # responses at the end
    logprobs = -torch.rand(rows, seq, generator=g) * 2
    batch = Batch(
        response_mask=mask,
        old_logprobs=logprobs + 0.3 * torch.randn(rows, seq, generator=g),
        ref_logprobs=logprobs + 0.3 * torch.randn(rows, seq, generator=g),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, seq).clone(),
    )
    entropy = torch.rand(rows, seq, generator=g)
    return logprobs, entropy, batch


def _summed_loss_and_grad(logprobs, entropy, batch, cfg, chunks: int):
    logprobs = logprobs.clone().requires_grad_(True)
    global_tokens = float(batch["response_mask"].sum())  # counted once, over the whole batch
    size = batch.size // chunks
    total, metrics = torch.zeros(()), {}
    for i in range(chunks):
        rows = slice(i * size, (i + 1) * size)
        loss, m = actor_loss(logprobs[rows], entropy[rows], batch.slice(rows.start, rows.stop), cfg,
                             global_tokens)
        total = total + loss
        for key, value in m.items():
            metrics[key] = metrics.get(key, 0.0) + value
    total.backward()
    return total.detach(), logprobs.grad, metrics


@pytest.mark.parametrize("chunks", [2, 4])
def test_micro_batch_splits_give_the_same_loss_gradient_and_metrics(chunks):
    logprobs, entropy, batch = _random_batch()
    cfg = LossConfig(kl_coeff=0.1, entropy_coeff=0.01, kl_estimator="k3")
    ref_loss, ref_grad, ref_metrics = _summed_loss_and_grad(logprobs, entropy, batch, cfg, chunks=1)
    loss, grad, metrics = _summed_loss_and_grad(logprobs, entropy, batch, cfg, chunks=chunks)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert metrics.keys() == ref_metrics.keys()
    for key in metrics:
        torch.testing.assert_close(metrics[key], ref_metrics[key])


def test_one_chunk_loss_is_the_global_token_mean():
    logprobs, entropy, batch = _random_batch()
    cfg = LossConfig(kl_coeff=0.1, entropy_coeff=0.01, kl_estimator="k3")
    loss, _, metrics = _summed_loss_and_grad(logprobs, entropy, batch, cfg, chunks=1)
    mask = batch["response_mask"]
    pg, _ = ppo_clip_loss(logprobs, batch["old_logprobs"], batch["advantages"], cfg)
    kl = kl_estimate(logprobs, batch["ref_logprobs"], "k3")

    def token_mean(x):
        return (x * mask).sum() / mask.sum()

    expected = token_mean(pg) - 0.01 * token_mean(entropy) + 0.1 * token_mean(kl)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics["actor/kl_ref"], token_mean(kl))


def test_on_policy_ratio_is_one_and_ppo_kl_and_clip_frac_are_zero():
    logprobs, entropy, batch = _random_batch()
    batch["old_logprobs"] = logprobs.clone()
    cfg = LossConfig()
    loss, metrics = actor_loss(logprobs, entropy, batch, cfg, float(batch["response_mask"].sum()))
    mask = batch["response_mask"]
    assert metrics["actor/ppo_kl"].item() == 0.0
    assert metrics["actor/clip_frac"].item() == 0.0
    # ratio == 1 exactly, so the surrogate is -A on every response token.
    torch.testing.assert_close(metrics["actor/pg_loss"], -(batch["advantages"] * mask).sum() / mask.sum())
    assert "actor/kl_ref" not in metrics  # kl_coeff == 0: no reference term
