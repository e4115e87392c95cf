"""Reward-model training (``algorithm.type: rm``): the Bradley-Terry loss against hand-computed
values and its split invariance, the tiny addition task's preference pairs."""
import math

import pytest
import torch

from rlcore.algos import bradley_terry_loss


def nll(x: float) -> float:
    """-log sigmoid(x), by hand."""
    return math.log(1.0 + math.exp(-x))


CHOSEN = torch.tensor([2.0, 0.0, -1.0])
REJECTED = torch.tensor([1.0, 0.0, 1.0])  # differences 1, 0 (a tie: not a win), -2


def test_bradley_terry_loss_and_metrics_by_hand():
    loss, m = bradley_terry_loss(CHOSEN, REJECTED)
    want = (nll(1.0) + nll(0.0) + nll(-2.0)) / 3  # 0.313262 + 0.693147 + 2.126928
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert want == pytest.approx(1.0444456, abs=1e-6)
    assert m["rm/loss"].item() == pytest.approx(want, abs=1e-6)
    assert m["rm/accuracy"].item() == pytest.approx(1 / 3, abs=1e-6)  # only the first pair wins
    assert m["rm/margin"].item() == pytest.approx(-1 / 3, abs=1e-6)
    assert m["rm/chosen_score"].item() == pytest.approx(1 / 3, abs=1e-6)
    assert m["rm/rejected_score"].item() == pytest.approx(2 / 3, abs=1e-6)


def test_bradley_terry_margin_and_centering_by_hand():
    loss, m = bradley_terry_loss(CHOSEN, REJECTED, margin=1.0)
    assert loss.item() == pytest.approx((nll(0.0) + nll(-1.0) + nll(-3.0)) / 3, abs=1e-6)
    assert m["rm/margin"].item() == pytest.approx(-1 / 3, abs=1e-6)  # the metric is the raw difference
    loss, m = bradley_terry_loss(CHOSEN, REJECTED, center_coeff=0.1)
    bt = (nll(1.0) + nll(0.0) + nll(-2.0)) / 3
    assert loss.item() == pytest.approx(bt + 0.1 * (9.0 + 0.0 + 0.0) / 3, abs=1e-6)  # (c + r)^2 = 9, 0, 0
    assert m["rm/loss"].item() == pytest.approx(bt, abs=1e-6)


def test_bradley_terry_gradient_by_hand():
    c, r = CHOSEN.clone().requires_grad_(), REJECTED.clone().requires_grad_()
    bradley_terry_loss(c, r)[0].backward()
    # d/dc -log sigmoid(c - r) = -(1 - sigmoid(c - r)) = -sigmoid(r - c), over 3 pairs.
    want = [-1 / (1 + math.exp(d)) / 3 for d in (1.0, 0.0, -2.0)]
    assert c.grad.tolist() == pytest.approx(want, abs=1e-6)
    assert r.grad.tolist() == pytest.approx([-g for g in want], abs=1e-6)


def test_bradley_terry_shares_of_a_split_sum_to_the_whole():
    """Weights 1/P of the whole batch on each part: the parts' losses and metrics add up to the
    whole batch's mean (how micro-batches and DP ranks combine)."""
    gen = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    whole_loss, whole = bradley_terry_loss(chosen, rejected)
    w = torch.full((8,), 1 / 8)
    parts = [bradley_terry_loss(chosen[i:j], rejected[i:j], w[i:j]) for i, j in ((0, 2), (2, 3), (3, 8))]
    assert sum(p[0] for p in parts).item() == pytest.approx(whole_loss.item(), abs=1e-6)
    for key, value in whole.items():
        assert sum(p[1][key] for p in parts).item() == pytest.approx(value.item(), abs=1e-6)


def test_bradley_terry_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"chosen \(3,\) and rejected \(2,\)"):
        bradley_terry_loss(CHOSEN, REJECTED[:2])


def test_addition_pairs(tmp_path):
    """Every prompt in both splits, the right answer always chosen, every wrong answer rejected once
    per prompt, no held-out pair among the training pairs."""
    import pyarrow.parquet as pq

    from launch.assets import addition_rows, make_addition_pairs

    train_path, val_path = make_addition_pairs(str(tmp_path))
    train, val = pq.read_table(train_path).to_pylist(), pq.read_table(val_path).to_pylist()
    prompts = {r["prompt"][0]["content"]: r["reward_model"]["ground_truth"] for r in addition_rows()}
    assert (len(train), len(val)) == (25 * 9, 25 * 2)
    for rows in (train, val):
        assert {r["prompt"][0]["content"] for r in rows} == set(prompts)
        for r in rows:
            assert r["chosen"] == prompts[r["prompt"][0]["content"]] != r["rejected"]
            assert r["prompt"] == [{"role": "user", "content": r["prompt"][0]["content"]}]
    pairs = [(r["prompt"][0]["content"], r["rejected"]) for r in train + val]
    assert len(set(pairs)) == len(pairs) == 25 * 11
    assert {r["rejected"] for r in train + val} == set("0123456789+=")
