"""Advantage estimators, policy/value losses, KL estimators and controllers, loss aggregation and the
DAPO / rollout-correction pieces against hand-computed values (with masks and uneven lengths), and
the loss normalisation contract: any micro-batch split of a batch gives the same loss and gradient."""
import math
import statistics

import pytest
import torch

from rlcore.algos import (ADV_ESTIMATORS, AGG_MODES, KL_CONTROLLERS, KL_ESTIMATORS, POLICY_LOSSES,
                          ROLLOUT_CORRECTIONS, AdaptiveKLController, AdvantageInputs, CriticLossConfig,
                          EstimatorNeeds, FixedKLController, LossConfig, actor_loss, aggregate, apply_kl_penalty,
                          compute_advantages, critic_loss, explained_variance, groups_with_variance,
                          grpo_advantages, kl_controller, kl_estimate, last_token_rewards, loss_weights,
                          overlong_penalty, ppo_clip_loss)
from rlcore.batch import Batch
from rlcore.config import ActorConfig
from rlcore.registry import DuplicateNameError, Registry, UnknownNameError

EPS = 1e-6  # grpo_advantages' default epsilon


def whiten(values):
    """Reference whitening of a plain list (unbiased std, as verl's masked_whiten), with statistics."""
    mean, std = statistics.mean(values), statistics.stdev(values)
    return [(v - mean) / math.sqrt(std ** 2 + 1e-8) for v in values]


def scatter(rows: list[list[float]], masks: list[list[int]]) -> torch.Tensor:
    """A [N, S] tensor holding each row's values at its mask's 1-positions, 0 elsewhere."""
    out = torch.zeros(len(masks), len(masks[0]))
    for i, (vals, m) in enumerate(zip(rows, masks)):
        out[i, [j for j, x in enumerate(m) if x]] = torch.tensor(vals, dtype=torch.float32)
    return out


def test_names_are_the_ones_users_type():
    assert sorted(ADV_ESTIMATORS) == sorted(["gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus",
                                            "reinforce_plus_plus_baseline", "remax"])
    assert list(POLICY_LOSSES) == ["vanilla", "dual_clip", "gspo", "cispo", "gmpo", "sapo", "gpg", "clip_cov", "kl_cov"]
    assert list(AGG_MODES) == ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# ------------------------------------------------------------------------------------- registries
def test_a_registry_refuses_a_second_entry_of_the_same_name():
    reg = Registry("algorithm.adv_estimator", meta=EstimatorNeeds)
    reg.add("mine", len, groups=True)
    with pytest.raises(DuplicateNameError, match="'mine' is already registered"):
        reg.register("mine")(max)
    assert reg["mine"] is len  # the first entry stays
    with pytest.raises(DuplicateNameError):
        ADV_ESTIMATORS.register("grpo")(len)  # the built-in ones too
    assert ADV_ESTIMATORS["grpo"] is not len


def test_an_unknown_name_lists_the_valid_ones_with_the_config_key():
    with pytest.raises(UnknownNameError) as info:
        POLICY_LOSSES["dpo"]
    assert str(info.value) == ("actor.loss.policy_loss='dpo' is not one of: vanilla, dual_clip, gspo, cispo, gmpo, "
                               "sapo, gpg, clip_cov, kl_cov")
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert "dpo" not in POLICY_LOSSES and POLICY_LOSSES.get("dpo") is None and len(POLICY_LOSSES) == 9
    with pytest.raises(ValueError, match="algorithm.kl_penalty='k4' is not one of: k1, k2, k3"):
        KL_ESTIMATORS.check("k4", key="algorithm.kl_penalty")
    with pytest.raises(TypeError):  # a misspelt declaration is an error, not a silent default
        Registry("x", meta=EstimatorNeeds).add("y", len, critc=True)


def test_estimators_declare_what_they_need():
    needs = {name: ADV_ESTIMATORS.meta(name) for name in ADV_ESTIMATORS}
    assert {n for n, d in needs.items() if d.critic} == {"gae"}
    assert {n for n, d in needs.items() if d.baseline_rollout} == {"remax"}
    assert {n for n, d in needs.items() if d.groups} == {"grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"}
    assert {n for n, d in needs.items() if d.token_rewards} == {"gae", "reinforce_plus_plus"}
    assert ADV_ESTIMATORS.meta("reinforce_plus_plus") == EstimatorNeeds(token_rewards=True)


def test_every_table_of_names_is_a_registry():
    for reg in (ADV_ESTIMATORS, POLICY_LOSSES, AGG_MODES, KL_ESTIMATORS, KL_CONTROLLERS, ROLLOUT_CORRECTIONS):
        assert isinstance(reg, Registry)
    assert list(KL_CONTROLLERS) == ["fixed", "adaptive"]
    assert list(ROLLOUT_CORRECTIONS) == ["none", "tis", "icepop", "seq_mask"]


def test_kl_controllers_keep_their_coefficient_in_a_state_dict():
    for ctrl in (kl_controller("fixed", 0.3, 0.1, 100), kl_controller("adaptive", 0.1, 0.05, 100)):
        ctrl.update(current_kl=0.06, n_steps=10)
        state = ctrl.state_dict()
        assert state == {"value": ctrl.value}
        fresh = kl_controller(type(ctrl).__name__.removesuffix("KLController").lower(), 1.0, 0.05, 100)
        fresh.load_state_dict(state)
        assert fresh.value == ctrl.value


# ------------------------------------------------------------------------------------ aggregation
# Prompt at position 0; row 0 has 3 response tokens, row 1 one, row 2 none (e.g. an empty response).
AGG_MASK = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.float32)


@pytest.mark.parametrize("mode,row0,row1", [
    ("token-mean", 1 / 4, 1 / 4),  # 4 response tokens
    ("seq-mean-token-sum", 1 / 2, 1 / 2),  # 2 sequences with tokens (row 2 does not count)
    ("seq-mean-token-mean", 1 / (3 * 2), 1 / (1 * 2)),  # 1 / (len_i * n_seqs)
    ("seq-mean-token-sum-norm", 1 / (2 * 5), 1 / (2 * 5)),  # 1 / (n_seqs * norm_length=5)
])
def test_loss_weights_hand_computed(mode, row0, row1):
    w = loss_weights(AGG_MASK, mode, norm_length=5)
    expected = torch.tensor([[0, row0, row0, row0], [0, 0, row1, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(w, expected)


def test_aggregate_with_seq_mean_token_mean_is_the_mean_of_row_means():
    x = torch.tensor([[9.0, 1.0, 2.0, 6.0], [9.0, 9.0, 4.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    # row means over response tokens: 3 and 4 -> 3.5; masked 9s never count.
    agg = aggregate(x, loss_weights(AGG_MASK, "seq-mean-token-mean", 5))
    torch.testing.assert_close(agg, torch.tensor(3.5))


def test_unknown_agg_mode_is_an_error():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        loss_weights(AGG_MASK, "seq-mean", 5)


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


# --------------------------------------------------------------------- estimators on token rewards
# Four samples of two prompts with uneven responses (prompt positions and right padding are 0).
MASKS = [[0, 1, 1, 1, 0],  # prompt 0, 3 response tokens
         [0, 0, 1, 0, 0],  # prompt 0, 1 token
         [0, 1, 1, 0, 0],  # prompt 1, 2 tokens
         [0, 0, 0, 1, 1]]  # prompt 1, 2 tokens
MASK = torch.tensor(MASKS, dtype=torch.float32)
GROUPS = torch.tensor([0, 0, 1, 1])
SCORES = torch.tensor([1.0, 0.0, 3.0, 2.0])


def outcome_inputs(scores=SCORES, **kw) -> AdvantageInputs:
    return AdvantageInputs(last_token_rewards(scores, MASK), MASK, GROUPS, **kw)


def test_last_token_rewards_puts_the_score_on_the_last_response_token():
    rewards = last_token_rewards(torch.tensor([2.0, 5.0]), torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0.]]))
    torch.testing.assert_close(rewards, torch.tensor([[0, 0, 2.0, 0], [0, 0, 0, 0]]))


def test_grpo_estimator_broadcasts_over_each_response():
    adv, returns = compute_advantages("grpo", outcome_inputs())
    # groups (1, 0) and (3, 2): centred +-0.5, unbiased std sqrt(0.5)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(adv, scatter([[a] * 3, [-a], [a] * 2, [-a] * 2], MASKS))
    torch.testing.assert_close(returns, adv)


@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_drgrpo_never_divides_by_the_std(norm_adv_by_std):
    adv, _ = compute_advantages("drgrpo", outcome_inputs(), norm_adv_by_std=norm_adv_by_std)
    torch.testing.assert_close(adv, scatter([[0.5] * 3, [-0.5], [0.5] * 2, [-0.5] * 2], MASKS))


def test_rloo_subtracts_the_mean_of_the_other_samples():
    masks = [[1, 1], [1, 0], [0, 1], [1, 1], [1, 1], [1, 0]]
    mask = torch.tensor(masks, dtype=torch.float32)
    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, 1.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])  # group 2 is a single sample: no baseline -> 0
    adv, _ = compute_advantages("rloo", AdvantageInputs(last_token_rewards(scores, mask), mask, groups))
    # 1 - (2+6)/2 = -3;  2 - (1+6)/2 = -1.5;  6 - (1+2)/2 = 4.5;  0 - 1 = -1;  1 - 0 = 1
    torch.testing.assert_close(adv, scatter([[-3.0] * 2, [-1.5], [4.5], [-1.0] * 2, [1.0] * 2, [0.0]], masks))


def test_reinforce_plus_plus_discounts_token_rewards_and_whitens_over_the_batch():
    # Row 0: a KL penalty of -0.1 on each of its 3 tokens and the score 1 on the last; row 1: score 2
    # on its only token. gamma = 0.5 -> returns (right to left) 0.9, -0.1 + 0.5*0.9 = 0.35,
    # -0.1 + 0.5*0.35 = 0.075.
    masks = [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]
    mask = torch.tensor(masks, dtype=torch.float32)
    rewards = scatter([[-0.1, -0.1, 0.9], [2.0]], masks)
    adv, returns = compute_advantages("reinforce_plus_plus",
                                      AdvantageInputs(rewards, mask, torch.tensor([0, 1])), gamma=0.5)
    torch.testing.assert_close(returns, scatter([[0.075, 0.35, 0.9], [2.0]], masks))
    w = whiten([0.075, 0.35, 0.9, 2.0])
    torch.testing.assert_close(adv, scatter([w[:3], w[3:]], masks))


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_then_whitens_tokens():
    adv, returns = compute_advantages("reinforce_plus_plus_baseline", outcome_inputs())
    # centred scores 0.5, -0.5, 0.5, -0.5 repeated over 3, 1, 2, 2 tokens, whitened over those 8 tokens
    w = whiten([0.5] * 3 + [-0.5] + [0.5] * 2 + [-0.5] * 2)
    torch.testing.assert_close(adv, scatter([w[0:3], w[3:4], w[4:6], w[6:8]], MASKS))
    torch.testing.assert_close(returns, adv)


def test_remax_subtracts_the_greedy_baseline_from_the_reward_to_go():
    rewards = last_token_rewards(SCORES, MASK)
    rewards[0, 1:4] += -0.1  # a per-token KL penalty on row 0: reward-to-go 0.7, 0.8, 0.9
    baseline = torch.tensor([0.5, 0.5, 2.0, 2.0])
    adv, _ = compute_advantages("remax", AdvantageInputs(rewards, MASK, GROUPS, baseline_scores=baseline))
    torch.testing.assert_close(adv, scatter([[0.2, 0.3, 0.4], [-0.5], [1.0, 1.0], [0.0, 0.0]], MASKS))


def test_gae_hand_computed_with_gamma_and_lambda():
    # Row 0: prompt at 0, response tokens at 1..3, padding at 4. Row 1: prompt 0..1, response 2..3.
    # Values at non-response positions are junk (9) and must not leak in.
    masks = [[0, 1, 1, 1, 0], [0, 0, 1, 1, 0]]
    mask = torch.tensor(masks, dtype=torch.float32)
    values = torch.tensor([[9, 0.5, 0.2, 0.4, 9], [9, 9, 0.3, 0.6, 9]])
    rewards = scatter([[0, 0, 1.0], [0, 0.5]], masks)
    adv, returns = compute_advantages("gae", AdvantageInputs(rewards, mask, torch.tensor([0, 1]), values=values),
                                      gamma=0.9, lam=0.8)
    # Row 0: delta = 1 - 0.4 = 0.6;  0.9*0.4 - 0.2 = 0.16;  0.9*0.2 - 0.5 = -0.32
    #        A = 0.6;  0.16 + 0.72*0.6 = 0.592;  -0.32 + 0.72*0.592 = 0.10624
    # Row 1: delta = 0.5 - 0.6 = -0.1;  0.9*0.6 - 0.3 = 0.24  ->  A = -0.1;  0.24 - 0.072 = 0.168
    raw = [[0.10624, 0.592, 0.6], [0.168, -0.1]]
    torch.testing.assert_close(returns, scatter([[0.60624, 0.792, 1.0], [0.468, 0.5]], masks))
    w = whiten(raw[0] + raw[1])
    torch.testing.assert_close(adv, scatter([w[:3], w[3:]], masks))


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    masks = [[0, 1, 1, 1]]
    mask = torch.tensor(masks, dtype=torch.float32)
    values = torch.tensor([[0, 0.1, 0.2, 0.3]])
    _, returns = compute_advantages("gae", AdvantageInputs(scatter([[0, 0, 1.0]], masks), mask, torch.tensor([0]),
                                                           values=values))
    torch.testing.assert_close(returns, torch.tensor([[0, 1.0, 1.0, 1.0]]))


def test_estimators_need_their_inputs_and_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", outcome_inputs())
    with pytest.raises(ValueError, match="greedy baseline"):
        compute_advantages("remax", outcome_inputs())
    with pytest.raises(ValueError, match="gae, grpo, drgrpo, rloo"):
        compute_advantages("ppo", outcome_inputs())


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


def test_kl_penalty_in_reward_hand_computed():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0.]])
    rewards = torch.tensor([[0, 0, 1.0, 0], [0, 0, 2.0, 0]])
    logp = torch.tensor([[5.0, 0.2, -0.1, 5.0], [5.0, 5.0, 0.4, 5.0]])  # 5s: outside the mask
    ref = torch.zeros_like(logp)
    penalised, mean_kl = apply_kl_penalty(rewards, logp, ref, mask, coef=0.5, kind="k1")
    torch.testing.assert_close(penalised, torch.tensor([[0, -0.1, 1.05, 0], [0, 0, 1.8, 0]]))
    # mean over sequences of each sequence's token-mean KL: ((0.2 - 0.1)/2 + 0.4) / 2
    assert mean_kl == pytest.approx(0.225)


def test_adaptive_kl_controller_moves_towards_the_target():
    ctrl = AdaptiveKLController(init=0.1, target=0.05, horizon=100)
    ctrl.update(current_kl=0.06, n_steps=10)  # error 0.2 (= the clip): 0.1 * (1 + 0.2 * 10/100)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.045, n_steps=10)  # error -0.1: * (1 - 0.01)
    assert ctrl.value == pytest.approx(0.102 * 0.99)
    ctrl.update(current_kl=1.0, n_steps=100)  # error 19 clipped to 0.2
    assert ctrl.value == pytest.approx(0.102 * 0.99 * 1.2)
    fixed = FixedKLController(0.3)
    fixed.update(5.0, 100)
    assert fixed.value == 0.3
    assert isinstance(kl_controller("adaptive", 0.1, 0.05, 100), AdaptiveKLController)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        kl_controller("pid", 0.1, 0.05, 100)


# --------------------------------------------------------------------------------- policy losses
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


def test_dual_clip_bounds_negative_advantage_losses():
    ratio = torch.tensor([[5.0, 2.0, 5.0, 0.5]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    loss, stats = POLICY_LOSSES["dual_clip"](ratio.log(), torch.zeros_like(ratio), adv, torch.ones_like(ratio),
                                             LossConfig(clip_ratio_c=3.0))
    # A=-1 r=5: PPO gives max(5, 1.2) = 5, dual-clip caps it at -A*c = 3;  A=-1 r=2: 2 < 3 stays;
    # A=+1 r=5: -1.2 (positive advantages are not dual-clipped);  A=-1 r=0.5: max(0.5, 0.8) = 0.8.
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2, 0.8]]))
    assert stats["clip_frac_lower"].tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_gspo_uses_one_clipped_ratio_per_sequence():
    # Row 0: token log-ratios 0.2 and -0.4 -> s = exp(-0.1) inside [0.8, 1.2]; row 1: one token with
    # log-ratio 0.5 -> s = exp(0.5) = 1.65, clipped at 1.2. Position 0 is a prompt token with a wild ratio.
    mask = torch.tensor([[0, 1, 1], [0, 1, 0.]])
    old = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    logp = (old + torch.tensor([[7.0, 0.2, -0.4], [7.0, 0.5, 0.0]])).requires_grad_(True)
    adv = torch.ones(2, 3)
    loss, stats = POLICY_LOSSES["gspo"](logp, old, adv, mask, LossConfig())
    s = math.exp(-0.1)
    torch.testing.assert_close((loss * mask).detach(), torch.tensor([[0, -s, -s], [0, -1.2, 0]]))
    assert (stats["clip_frac"] * mask).tolist() == [[0, 0, 0], [0, 1, 0]]
    # The gradient of each token's loss is -A * s_i (the sequence's ratio, not the token's own
    # ratio exp(0.2) / exp(-0.4)); the clipped sequence gets none.
    (loss * mask).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0, -s, -s], [0, 0, 0]]))


def test_cispo_clips_the_is_weight_and_keeps_every_tokens_gradient():
    ratio = torch.tensor([[1.5, 0.5, 1.1]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp = (old + ratio.log()).requires_grad_(True)
    loss, stats = POLICY_LOSSES["cispo"](logp, old, adv, torch.ones_like(adv), LossConfig())
    # -sg(clip(r, 0.8, 1.2)) * A * logp: weights 1.2, 0.8, 1.1
    expected = -torch.tensor([[1.2, 0.8, 1.1]]) * adv * logp.detach()
    torch.testing.assert_close(loss.detach(), expected)
    assert stats["clip_frac"].tolist() == [[1.0, 1.0, 0.0]]
    loss.sum().backward()
    # d/dlogp = -w * A, even for the clipped tokens (PPO clip would give them 0)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2, 0.8, -2.2]]))


def test_gmpo_hand_computed_is_the_geometric_mean_objective():
    # Position 0 is a prompt token with a wild ratio. clip range 0.4 on the log-ratio (the paper's).
    # Row 0, A = +1, log-ratios 0.1, 0.6, -0.8: for A > 0 only the top is clipped: 0.1, 0.4, -0.8,
    #   mean -0.1, R_0 = exp(-0.1); every token's loss is -A R_0.
    # Row 1, A = -2 (one padding position), log-ratios -0.6, 0.3: for A < 0 only the bottom is clipped:
    #   -0.4, 0.3, mean -0.05, R_1 = exp(-0.05); loss +2 R_1.
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0.]])
    old = torch.tensor([[-1.0, -1.0, -2.0, -0.5], [-1.0, -1.5, -1.0, -1.0]])
    log_ratio = torch.tensor([[6.0, 0.1, 0.6, -0.8], [6.0, -0.6, 0.3, 0.0]])
    logp = (old + log_ratio).requires_grad_(True)
    adv = torch.tensor([[1.0], [-2.0]]).expand(2, 4) * mask
    cfg = LossConfig(clip_ratio_low=0.4, clip_ratio_high=0.4)
    loss, stats = POLICY_LOSSES["gmpo"](logp, old, adv, mask, cfg)
    r0, r1 = math.exp(-0.1), math.exp(-0.05)
    torch.testing.assert_close((loss * mask).detach(), torch.tensor([[0, -r0, -r0, -r0], [0, 2 * r1, 2 * r1, 0]]))
    assert (stats["clip_frac"] * mask).tolist() == [[0, 0, 1, 0], [0, 1, 0, 0]]
    # Aggregated as the paper does (mean over sequences: seq-mean-token-mean), the value is
    # mean_i(-A_i R_i) and the gradient d/dlogp_t of it: -A_i R_i / |o_i| / 2 on unclipped tokens, 0 on clipped.
    weights = loss_weights(mask, "seq-mean-token-mean", 4)
    total = aggregate(loss, weights)
    assert total.item() == pytest.approx((-r0 + 2 * r1) / 2)
    total.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0, -r0 / 3 / 2, 0, -r0 / 3 / 2], [0, 0, 2 * r1 / 2 / 2, 0]]))


def test_gmpo_is_less_moved_by_one_outlier_ratio_than_the_arithmetic_mean():
    # One sequence, A = +1, ratios 1, 1, 1 and one outlier 8 (log 2.08), no clip (bounds of 10):
    # the arithmetic mean of the ratios is 11/4 = 2.75, the geometric one 8^(1/4) = 1.68.
    mask = torch.ones(1, 4)
    old = torch.zeros(1, 4)
    logp = torch.tensor([[0.0, 0.0, 0.0, math.log(8.0)]])
    cfg = LossConfig(clip_ratio_low=0.99, clip_ratio_high=10.0)
    gmpo, _ = POLICY_LOSSES["gmpo"](logp, old, mask, mask, cfg)
    assert gmpo[0, 0].item() == pytest.approx(-(8.0 ** 0.25))
    arithmetic, _ = ppo_clip_loss(logp, old, mask, LossConfig(clip_ratio_low=0.99, clip_ratio_high=10.0))
    assert arithmetic.mean().item() == pytest.approx(-2.75)


def test_sapo_soft_gate_hand_computed():
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau, loss -f(r) A; tau_pos = 2 for A > 0, tau_neg = 3 for A <= 0.
    #   A=+1 r=1  : sigmoid(0) = 0.5      -> -0.5 * 4/2 = -1
    #   A=+1 r=0.5: sigmoid(-1) = 0.268941 -> -0.268941 * 2 = -0.537883
    #   A=-1 r=2  : sigmoid(3) = 0.952574  -> +0.952574 * 4/3 = 1.270099
    #   A=-1 r=1  : sigmoid(0)             -> +0.5 * 4/3 = 0.666667
    ratio = torch.tensor([[1.0, 0.5, 2.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -0.5, -2.0, -0.3]])
    logp = (old + ratio.log()).requires_grad_(True)
    cfg = LossConfig(sapo_tau_pos=2.0, sapo_tau_neg=3.0)
    loss, stats = POLICY_LOSSES["sapo"](logp, old, adv, torch.ones_like(adv), cfg)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.0, -0.537883, 1.270099, 0.666667]]))
    # The gradient's factor 4 s (1 - s): 1 on-policy, 4 * 0.268941 * 0.731059 = 0.786448, 4 * 0.952574 * 0.047426
    # = 0.180707 for the off-policy tokens.
    torch.testing.assert_close(stats["sapo_gate"], torch.tensor([[1.0, 0.786448, 0.180707, 1.0]]))
    loss.sum().backward()
    # d loss / d logp = -A r * 4 s (1 - s): -1 and +1 on-policy (vanilla's), -0.5 * 0.786448, +2 * 0.180707:
    # descent raises the log-prob of the A > 0 tokens and lowers the A < 0 ones', less the farther off-policy.
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.393224, 0.361414, 1.0]]))


def test_sapo_default_temperatures_fade_negative_updates_sooner():
    # The same ratio 1.5 for A = +1 and A = -1: tau_neg = 1.05 > tau_pos = 1 gives the negative token the smaller gate.
    ratio = torch.tensor([[1.5, 1.5]])
    _, stats = POLICY_LOSSES["sapo"](ratio.log(), torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2),
                                     LossConfig())
    s_pos, s_neg = 1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(-0.525))
    torch.testing.assert_close(stats["sapo_gate"], torch.tensor([[4 * s_pos * (1 - s_pos), 4 * s_neg * (1 - s_neg)]]))
    assert stats["sapo_gate"][0, 1] < stats["sapo_gate"][0, 0]


def test_gpg_is_the_plain_policy_gradient():
    # -A logp, whatever the old policy: logp -0.5, -2, -1 with A 1, -3, 0.5 -> 0.5, -6, 0.5; gradient -A.
    logp = torch.tensor([[-0.5, -2.0, -1.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -3.0, 0.5]])
    for old in (torch.zeros(1, 3), torch.full((1, 3), -7.0)):
        loss, stats = POLICY_LOSSES["gpg"](logp, old, adv, torch.ones_like(adv), LossConfig())
        torch.testing.assert_close(loss.detach(), torch.tensor([[0.5, -6.0, 0.5]]))
        assert stats == {}
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 3.0, -0.5]]))


# Two sequences of 3 response tokens after a prompt token with wild values (outside the mask).
# Row 0: A = +2, row 1: A = -1 -> mean A over the 6 tokens 0.5, centred +1.5 / -1.5.
# logp of both rows -0.2, -1.0, -2.4 -> mean -1.2, centred +1.0, +0.2, -1.2.
# Covariances: row 0 1.5, 0.3, -1.8; row 1 -1.5, -0.3, 1.8.
COV_MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1.]])
COV_LOGP = torch.tensor([[-30.0, -0.2, -1.0, -2.4], [-30.0, -0.2, -1.0, -2.4]])
COV_ADV = torch.tensor([[100.0, 2, 2, 2], [100.0, -1, -1, -1]])


def test_clip_cov_detaches_the_picked_high_covariance_tokens_hand_computed():
    # Row 0's first token has ratio 1.5 (PPO clips it: A > 0); every other ratio is 1. In the band
    # (1, 5): row 0 token 1 (1.5, but PPO-clipped: not eligible) and row 1 token 3 (1.8): the budget is
    # int(0.34 * 6) = 2, but only that one is eligible, so it alone is picked.
    old = COV_LOGP - torch.tensor([[0.0, math.log(1.5), 0, 0], [0, 0, 0, 0]])
    logp = COV_LOGP.clone().requires_grad_(True)
    loss, stats = POLICY_LOSSES["clip_cov"](logp, old, COV_ADV, COV_MASK, LossConfig(clip_cov_ratio=0.34))
    # PPO's values: row 0: max(-3, -2.4) = -2.4, then -2, -2; row 1: +1 each (the picked one keeps its value).
    torch.testing.assert_close((loss * COV_MASK).detach(), torch.tensor([[0, -2.4, -2, -2], [0, 1.0, 1, 1]]))
    assert (stats["clip_frac"] * COV_MASK).tolist() == [[0, 1, 0, 0], [0, 0, 0, 0]]
    assert stats["cov_clip_frac"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    (loss * COV_MASK).sum().backward()
    # -A r where not clipped; 0 for the PPO-clipped token and for the picked one.
    torch.testing.assert_close(logp.grad, torch.tensor([[0, 0, -2.0, -2], [0, 1, 1, 0]]))


def test_clip_cov_picks_its_budget_at_random_in_the_band_and_the_same_on_every_call():
    # 200 on-policy tokens: A = +4, -4 alternating (mean 0); logp -1, -1, -3, -3 repeated (mean -2, centred
    # +1, +1, -1, -1): covariances 4, -4, -4, 4, ... Half are in the band (1, 5); a 5% budget picks 10 of them.
    adv = torch.tensor([4.0, -4.0]).repeat(100)[None, :]
    logp = torch.tensor([-1.0, -1.0, -3.0, -3.0]).repeat(50)[None, :]
    in_band = (adv * (logp + 2.0)) == 4.0
    mask = torch.ones_like(adv)
    cfg = LossConfig(clip_cov_ratio=0.05)
    _, first = POLICY_LOSSES["clip_cov"](logp, logp.clone(), adv, mask, cfg)
    _, again = POLICY_LOSSES["clip_cov"](logp, logp.clone(), adv, mask, cfg)
    picked = first["cov_clip_frac"].bool()
    assert int(picked.sum()) == 10 and int(in_band.sum()) == 100
    assert bool(in_band[picked].all())  # only tokens in the band
    assert torch.equal(first["cov_clip_frac"], again["cov_clip_frac"])  # every TP rank, every rerun: the same pick


def test_kl_cov_penalises_the_top_covariance_tokens_hand_computed():
    # kl_cov_ratio 0.34 of 6 tokens: int(2.04) = 2 picked, the two largest covariances: row 1 token 3
    # (1.8) and row 0 token 1 (1.5). Ratios: row 0 token 1 1.5, row 1 token 3 0.5, the rest 1.
    log_r = torch.tensor([[0.0, math.log(1.5), 0, 0], [0, 0, 0, math.log(0.5)]])
    logp = COV_LOGP.clone().requires_grad_(True)
    cfg = LossConfig(kl_cov_ratio=0.34, kl_cov_coef=1.0)
    loss, stats = POLICY_LOSSES["kl_cov"](logp, COV_LOGP - log_r, COV_ADV, COV_MASK, cfg)
    # Picked: -A r + |log r|: -2 * 1.5 + 0.405465 = -2.594535 and 1 * 0.5 + 0.693147 = 1.193147; the rest -A r
    # unclipped: -2, -2 and 1, 1.
    torch.testing.assert_close((loss * COV_MASK).detach(),
                               torch.tensor([[0, -2.594535, -2, -2], [0, 1, 1, 1.193147]]))
    assert stats["kl_cov_frac"].tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    (loss * COV_MASK).sum().backward()
    # -A r + sign(log r): -3 + 1 = -2 (PPO would clip it to 0), 0.5 - 1 = -0.5 (pulled back up to the old
    # policy, whose ratio is 1); -A elsewhere.
    torch.testing.assert_close(logp.grad, torch.tensor([[0, -2.0, -2, -2], [0, 1, 1, -0.5]]))


def test_cov_losses_declare_micro_batch_statistics():
    per_micro_batch = {name for name in POLICY_LOSSES if POLICY_LOSSES.meta(name).micro_batch_statistics}
    assert per_micro_batch == {"clip_cov", "kl_cov"}


# -------------------------------------------------------------------------------- actor_loss
def _on_policy_batch(mode: str, advantages, masks, norm_length=4):
    mask = torch.tensor(masks, dtype=torch.float32)
    logprobs = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(0))
    batch = Batch(response_mask=mask, old_logprobs=logprobs.clone(), advantages=scatter(advantages, masks),
                  loss_weights=loss_weights(mask, mode, norm_length))
    return logprobs, torch.zeros_like(logprobs), batch


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", -(1 + 5 + 2) / 3),
    ("seq-mean-token-sum", -((1 + 5) + 2) / 2),
    ("seq-mean-token-mean", -((1 + 5) / 2 + 2) / 2),
    ("seq-mean-token-sum-norm", -((1 + 5) + 2) / (2 * 4)),
])
def test_pg_loss_per_agg_mode_hand_computed(mode, expected):
    # On-policy (ratio 1): the surrogate is -A per token. Row 0: A = 1, 5; row 1: A = 2.
    logprobs, entropy, batch = _on_policy_batch(mode, [[1.0, 5.0], [2.0]], [[0, 1, 1], [0, 1, 0]])
    loss, metrics = actor_loss(logprobs, entropy, batch, LossConfig(kl_coeff=0.0))
    assert metrics["actor/pg_loss"].item() == pytest.approx(expected)
    assert loss.item() == pytest.approx(expected)


def test_actor_loss_needs_loss_weights():
    logprobs, entropy, batch = _on_policy_batch("token-mean", [[1.0, 5.0], [2.0]], [[0, 1, 1], [0, 1, 0]])
    del batch["loss_weights"]
    with pytest.raises(KeyError, match="loss_weights"):
        actor_loss(logprobs, entropy, batch, LossConfig(kl_coeff=0.0))


# Engine-vs-trainer ratios pi_old / pi_rollout: row 0 tokens 3.0, 1.5, 0.25 (geometric mean
# 1.125^(1/3) = 1.04, kept by seq_mask); row 1 one token 2.5 (outside [0.5, 2]).
IS_MASKS = [[0, 1, 1, 1], [0, 1, 0, 0]]
IS_RATIOS = [[3.0, 1.5, 0.25], [2.5]]


@pytest.mark.parametrize("kind,weights,touched", [
    ("tis", [[2.0, 1.5, 0.25], [2.0]], [[1, 0, 0], [1]]),  # min(ratio, 2)
    ("icepop", [[0, 1, 0], [0]], [[1, 0, 1], [1]]),  # 1 inside [0.5, 2], else 0
    ("seq_mask", [[1, 1, 1], [0]], [[0, 0, 0], [1]]),  # per sequence, by the geometric mean
])
def test_rollout_correction_weights_the_pg_loss(kind, weights, touched):
    logprobs, entropy, batch = _on_policy_batch("token-mean", [[1.0] * 3, [1.0]], IS_MASKS)
    batch["rollout_logprobs"] = batch["old_logprobs"] - scatter([[math.log(r) for r in row] for row in IS_RATIOS],
                                                                IS_MASKS)
    cfg = LossConfig(rollout_correction=kind, rollout_is_threshold=2.0, rollout_is_threshold_low=0.5, kl_coeff=0.0)
    _, metrics = actor_loss(logprobs, entropy, batch, cfg)
    # A = 1 and ratio 1: the surrogate is -1 per token, times the weight; token-mean over 4 tokens.
    assert metrics["actor/pg_loss"].item() == pytest.approx(-sum(sum(r) for r in weights) / 4)
    assert metrics["actor/tis_clip_frac"].item() == pytest.approx(sum(sum(r) for r in touched) / 4)
    assert metrics["actor/tis_ratio_mean"].item() == pytest.approx((3.0 + 1.5 + 0.25 + 2.5) / 4)


def test_kl_loss_term_and_entropy_bonus():
    logprobs, _, batch = _on_policy_batch("token-mean", [[1.0, 5.0], [2.0]], [[0, 1, 1], [0, 1, 0]])
    batch["ref_logprobs"] = logprobs - scatter([[0.2, -0.1], [0.4]], [[0, 1, 1], [0, 1, 0]])
    entropy = scatter([[0.3, 0.6], [0.9]], [[0, 1, 1], [0, 1, 0]])
    loss, metrics = actor_loss(logprobs, entropy, batch, LossConfig(kl_coeff=0.5, kl_estimator="k1",
                                                                    entropy_coeff=0.1))
    assert metrics["actor/kl_ref"].item() == pytest.approx((0.2 - 0.1 + 0.4) / 3)
    assert metrics["actor/entropy"].item() == pytest.approx((0.3 + 0.6 + 0.9) / 3)
    assert loss.item() == pytest.approx(-8 / 3 - 0.1 * 0.6 + 0.5 * 0.5 / 3)


def test_the_actor_loss_section_is_the_loss_config_the_workers_get():
    from rlcore import config

    assert LossConfig is config.LossConfig and CriticLossConfig is config.CriticLossConfig  # defined once
    actor = ActorConfig(loss=LossConfig(policy_loss="dual_clip", clip_ratio_c=5.0, rollout_correction="tis",
                                        kl_coeff=0.0))
    cfg = actor.loss
    assert (cfg.policy_loss, cfg.clip_ratio_c, cfg.rollout_correction, cfg.kl_coeff) == ("dual_clip", 5.0, "tis", 0.0)
    assert ActorConfig().loss.kl_coeff == LossConfig().kl_coeff == 0.001  # one default per key


# ----------------------------------------------------------------------- normalisation contract
def _random_batch(seed: int = 0, rows: int = 8, seq: int = 6, mode: str = "token-mean"):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 5, 3, 4, 2, 5, 1, 3])[:rows]
    mask = (torch.arange(seq)[None, :] >= seq - lengths[:, None]).float()  # responses at the end
    logprobs = -torch.rand(rows, seq, generator=g) * 2
    batch = Batch(
        response_mask=mask,
        old_logprobs=logprobs + 0.3 * torch.randn(rows, seq, generator=g),
        ref_logprobs=logprobs + 0.3 * torch.randn(rows, seq, generator=g),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, seq).clone(),
        loss_weights=loss_weights(mask, mode, norm_length=seq),  # once, over the whole batch
    )
    entropy = torch.rand(rows, seq, generator=g)
    return logprobs, entropy, batch


def _summed_loss_and_grad(logprobs, entropy, batch, cfg, chunks: int):
    logprobs = logprobs.clone().requires_grad_(True)
    size = batch.size // chunks
    total, metrics = torch.zeros(()), {}
    for i in range(chunks):
        rows = slice(i * size, (i + 1) * size)
        loss, m = actor_loss(logprobs[rows], entropy[rows], batch.slice(rows.start, rows.stop), cfg)
        total = total + loss
        for key, value in m.items():
            metrics[key] = metrics.get(key, 0.0) + value
    total.backward()
    return total.detach(), logprobs.grad, metrics


SPLIT_INVARIANT_LOSSES = [name for name in POLICY_LOSSES if not POLICY_LOSSES.meta(name).micro_batch_statistics]


@pytest.mark.parametrize("policy_loss", SPLIT_INVARIANT_LOSSES)
@pytest.mark.parametrize("chunks", [2, 4])
def test_micro_batch_splits_give_the_same_loss_gradient_and_metrics(chunks, policy_loss):
    logprobs, entropy, batch = _random_batch(mode="seq-mean-token-mean")
    cfg = LossConfig(policy_loss=policy_loss, kl_coeff=0.1, entropy_coeff=0.01, kl_estimator="k3")
    ref_loss, ref_grad, ref_metrics = _summed_loss_and_grad(logprobs, entropy, batch, cfg, chunks=1)
    loss, grad, metrics = _summed_loss_and_grad(logprobs, entropy, batch, cfg, chunks=chunks)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert metrics.keys() == ref_metrics.keys()
    for key in metrics:
        torch.testing.assert_close(metrics[key], ref_metrics[key])


@pytest.mark.parametrize("chunks", [2, 4])
def test_cov_losses_split_invariance_where_it_holds(chunks):
    # kl_cov on-policy (old == logp): |log r| and its gradient are 0 on the picked tokens, so any split agrees.
    logprobs, entropy, batch = _random_batch(mode="seq-mean-token-mean")
    on_policy = batch.slice(0, batch.size)
    on_policy["old_logprobs"] = logprobs.clone()
    cfg = LossConfig(policy_loss="kl_cov", kl_cov_ratio=0.2, kl_cov_coef=1.0, kl_coeff=0.0)
    whole = _summed_loss_and_grad(logprobs, entropy, on_policy, cfg, chunks=1)
    split = _summed_loss_and_grad(logprobs, entropy, on_policy, cfg, chunks=chunks)
    torch.testing.assert_close(split[0], whole[0])
    torch.testing.assert_close(split[1], whole[1])
    # clip_cov with no covariance in its band is vanilla, for any split.
    cfg = LossConfig(policy_loss="clip_cov", clip_cov_lb=1e3, clip_cov_ub=1e4, kl_coeff=0.0)
    vanilla = _summed_loss_and_grad(logprobs, entropy, batch, LossConfig(kl_coeff=0.0), chunks=1)
    split = _summed_loss_and_grad(logprobs, entropy, batch, cfg, chunks=chunks)
    torch.testing.assert_close(split[0], vanilla[0])
    torch.testing.assert_close(split[1], vanilla[1])


@pytest.mark.parametrize("chunks", [2, 4])
def test_cov_losses_pick_per_micro_batch(chunks):
    # What does not hold, stated: each call picks its own budget (at least one token) by its own
    # statistics, so a split into micro-batches picks more tokens in all than the whole batch does.
    logprobs, _, batch = _random_batch()
    mask, old, adv = batch["response_mask"], batch["old_logprobs"], batch["advantages"]
    cfg = LossConfig(kl_cov_ratio=0.05)  # 24 response tokens: max(1, int(1.2)) = 1 per call
    _, whole = POLICY_LOSSES["kl_cov"](logprobs, old, adv, mask, cfg)
    size = batch.size // chunks
    picked = sum(POLICY_LOSSES["kl_cov"](logprobs[i:i + size], old[i:i + size], adv[i:i + size], mask[i:i + size],
                                         cfg)[1]["kl_cov_frac"].sum() for i in range(0, batch.size, size))
    assert whole["kl_cov_frac"].sum().item() == 1
    assert picked.item() == chunks


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
    cfg = LossConfig(kl_coeff=0.0)
    loss, metrics = actor_loss(logprobs, entropy, batch, cfg)
    mask = batch["response_mask"]
    assert metrics["actor/ppo_kl"].item() == 0.0
    assert metrics["actor/clip_frac"].item() == 0.0
    # ratio == 1 exactly, so the surrogate is -A on every response token.
    torch.testing.assert_close(metrics["actor/pg_loss"], -(batch["advantages"] * mask).sum() / mask.sum())
    assert "actor/kl_ref" not in metrics  # kl_coeff == 0: no reference term


# ---------------------------------------------------------------------------------- value loss
def test_critic_loss_clips_the_value_hand_computed():
    # old value 0, return 1, cliprange 0.5, token-mean over 3 tokens (a 4th position is padding):
    #   v = 1.0: unclipped 0, clipped value 0.5 -> 0.25: max 0.25 -> 0.125 (clipped, no gradient)
    #   v = 0.3: both 0.49 -> 0.245;   v = -1: unclipped 4, clipped value -0.5 -> 2.25: max 4 -> 2.0
    mask = torch.tensor([[1, 1, 1, 0.]])
    values = torch.tensor([[1.0, 0.3, -1.0, 7.0]], requires_grad=True)
    batch = Batch(response_mask=mask, old_values=torch.zeros(1, 4), returns=torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
                  loss_weights=loss_weights(mask, "token-mean", 4))
    loss, metrics = critic_loss(values, batch, CriticLossConfig(cliprange_value=0.5))
    assert loss.item() == pytest.approx((0.125 + 0.245 + 2.0) / 3)
    assert metrics["critic/vf_loss"].item() == pytest.approx(loss.item())
    assert metrics["critic/vf_clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["critic/vpred_mean"].item() == pytest.approx((1.0 + 0.3 - 1.0) / 3)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.7 / 3, -2.0 / 3, 0.0]]))


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0.]])  # the 50 is outside the mask
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask) == pytest.approx(0.0)
    # R - V = -0.5, 0.5, -0.5, 0.5: variance 0.25 against Var[R] = 1.25
    values = torch.tensor([[1.5, 1.5, 3.5, 3.5, 0.0]])
    assert explained_variance(values, returns, mask) == pytest.approx(1 - 0.25 / 1.25)
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask))


# ------------------------------------------------------------------------------------ DAPO pieces
def test_groups_with_variance_drops_all_equal_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 3 is a single sample: all equal
    assert groups_with_variance(scores, groups).tolist() == [False, False, True, True, False, False, False]


def test_overlong_penalty_is_linear_over_the_buffer():
    lengths = torch.tensor([5, 6, 7, 8, 10])
    # max 10, buffer 4: free up to 6, then -1/4 per token, -1 at 10
    torch.testing.assert_close(overlong_penalty(lengths, max_len=10, buffer_len=4, penalty_factor=1.0),
                               torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 0.5)[-1], torch.tensor(-0.5))
