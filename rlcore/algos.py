"""Advantage estimators, KL estimators and controllers, policy and value losses, loss aggregation and
the DAPO / rollout-correction pieces: plain torch on small CPU tensors, unit-testable without a model.

Token alignment (``rlcore/batch.py``): every per-token tensor is [B, S] over the whole right-padded
prompt+response row; ``response_mask`` is 1 on response tokens and everything here is 0 elsewhere.

Loss normalisation contract (why the numbers are right under any micro-batch, DP or PP split): the
controller computes per-token ``loss_weights`` (``loss_weights()``) once over the WHOLE (mini-)batch
before it is sharded, and every micro-batch returns ``sum(per_token_loss * loss_weights)``. The
aggregate is a plain sum, so summing the micro-batches' contributions over micro-batches and DP ranks
gives exactly the global aggregate of the chosen ``loss_agg_mode``, and so does its gradient. Metrics
follow the same contract, so they are additive across micro-batches and ranks too. A loss that needs
more than one row's statistics must say so: clip_cov and kl_cov pick tokens by a covariance over the
micro-batch they are given and declare ``micro_batch_statistics`` (``PolicyLossTraits``); the weights
are still the whole mini-batch's, but which tokens are picked depends on the split.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlcore.config import CriticLossConfig, LossConfig
from rlcore.registry import Registry


# ------------------------------------------------------------------------------------ aggregation
def _seq_norm(response_mask: torch.Tensor) -> torch.Tensor:
    return response_mask / (response_mask.sum(-1, keepdim=True) > 0).sum().clamp(min=1)


# Each mode: (response mask [B, S] as float, norm_length) -> per-token weights [B, S].
AGG_MODES: Registry[Callable[[torch.Tensor, int], torch.Tensor]] = Registry("actor.loss_agg_mode")


@AGG_MODES.register("token-mean")
def _token_mean(m, norm_length):
    """Every response token of the batch counts the same."""
    return m / m.sum().clamp(min=1)


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(m, norm_length):
    """A sequence counts by its summed token losses, the batch by the mean over sequences."""
    return _seq_norm(m)


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(m, norm_length):
    """Every sequence counts the same whatever its length (the GRPO paper's)."""
    return _seq_norm(m) / m.sum(-1, keepdim=True).clamp(min=1)


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(m, norm_length):
    """Dr. GRPO: token sums divided by a constant (the longest response allowed), no length bias."""
    return _seq_norm(m) / norm_length


def loss_weights(response_mask: torch.Tensor, mode: str, norm_length: int) -> torch.Tensor:
    """Per-token weights [B, S] whose weighted sum ``(x * w).sum()`` over the whole batch is the
    ``mode`` aggregate of ``x``; 0 outside ``response_mask``. Compute it on the whole (mini-)batch
    before splitting it (see the module docstring). ``norm_length`` is ``rollout.max_response_length``
    (used by seq-mean-token-sum-norm only). Rows without response tokens get weight 0 and are not
    counted as sequences."""
    fn = AGG_MODES[mode]  # an unknown mode raises, listing the valid ones
    return fn(response_mask.float(), norm_length)


def aggregate(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the global aggregate: ``sum(values * weights)``."""
    return (values * weights).sum()


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased variance, as verl), 0 elsewhere."""
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


# --------------------------------------------------------------------------------------- advantages
@dataclass
class AdvantageInputs:
    token_rewards: torch.Tensor  # [N, S]: the score on the last response token, plus any per-token KL penalty
    response_mask: torch.Tensor  # [N, S]
    group_index: torch.Tensor  # [N] long: samples of the same prompt share an index
    values: Optional[torch.Tensor] = None  # [N, S] critic values, token-aligned (gae)
    baseline_scores: Optional[torch.Tensor] = None  # [N] score of the greedy response to the same prompt (remax)


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs besides the token rewards, declared where it is registered;
    validation and the trainer ask ``ADV_ESTIMATORS.meta(name)``."""
    critic: bool = False  # the critic's values (AdvantageInputs.values): the job gets a critic
    groups: bool = False  # its baseline is the other samples of the same prompt: rollout.n >= 2
    baseline_rollout: bool = False  # a greedy response per prompt (AdvantageInputs.baseline_scores)
    # Uses rewards on any response token, not only their sum (a process reward model's step scores:
    # reward.process.aggregate=token); the outcome estimators see only each sample's total.
    token_rewards: bool = False


AdvantageFn = Callable[[AdvantageInputs, float, float, bool], tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("algorithm.adv_estimator", meta=EstimatorNeeds)


def compute_advantages(estimator: str, inputs: AdvantageInputs, gamma: float = 1.0, lam: float = 1.0,
                       norm_adv_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N, S], returns [N, S]) of ``estimator``, both 0 outside ``response_mask``.

    Outcome estimators (grpo, drgrpo, rloo, reinforce_plus_plus_baseline, remax) use each sample's
    score = the sum of its token rewards, and return returns == advantages (no critic to train)."""
    needs = ADV_ESTIMATORS.meta(estimator)  # an unknown estimator raises, listing the valid ones
    if needs.critic and inputs.values is None:
        raise ValueError(f"adv_estimator {estimator!r} needs the critic's values (AdvantageInputs.values)")
    if needs.baseline_rollout and inputs.baseline_scores is None:
        raise ValueError(f"adv_estimator {estimator!r} needs the greedy baseline's scores "
                         "(AdvantageInputs.baseline_scores)")
    return ADV_ESTIMATORS[estimator](inputs, gamma, lam, norm_adv_by_std)


def last_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N, S] token rewards holding each sample's scalar score on its last response token."""
    mask = response_mask.float()
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values  # -1: no response token
    out = torch.zeros_like(mask)
    has = last >= 0
    out[has.nonzero().squeeze(-1), last[has]] = scores.float()[has]
    return out


def _group_stats(scores: torch.Tensor, group_index: torch.Tensor):
    """(count, mean, unbiased std) of each sample's group, each [N]."""
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups).index_add_(0, inv, torch.ones_like(scores))
    mean = torch.zeros(n_groups).index_add_(0, inv, scores) / count
    var = torch.zeros(n_groups).index_add_(0, inv, (scores - mean[inv]) ** 2) / (count - 1).clamp(min=1)
    return count[inv], mean[inv], var.sqrt()[inv]


def grpo_advantages(scores: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage of each sample: (score - group mean) / (group std + eps).

    ``scores`` [N] float (one scalar reward per sample); ``group_index`` [N] int64, samples of the same
    prompt share an index. The std is the unbiased one (as in the GRPO paper and verl); a group of one
    sample gets advantage 0.
    """
    scores = scores.float()
    count, mean, std = _group_stats(scores, group_index)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def _scores(inputs: AdvantageInputs) -> torch.Tensor:
    return (inputs.token_rewards * inputs.response_mask).sum(-1).float()


def _per_token(per_sample: torch.Tensor, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    adv = per_sample[:, None] * inputs.response_mask
    return adv, adv.clone()


@ADV_ESTIMATORS.register("gae", critic=True, token_rewards=True)
def gae_advantages(inputs: AdvantageInputs, gamma: float, lam: float, norm_adv_by_std: bool):
    """Generalised advantage estimation over the response tokens, then whitened over the batch.

    delta_t = r_t + gamma V_{t+1} - V_t (V after the last response token is 0), A_t = sum_k (gamma
    lam)^k delta_{t+k}; returns = A + V (before whitening) are the critic's targets."""
    mask = inputs.response_mask.float()
    values = inputs.values.float() * mask
    rewards = inputs.token_rewards.float() * mask
    n, s = mask.shape
    adv = torch.zeros_like(mask)
    next_value = torch.zeros(n)
    next_adv = torch.zeros(n)
    for t in reversed(range(s)):  # non-response positions carry the running values through unchanged
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m
        next_value = values[:, t] * m + next_value * (1 - m)
        next_adv = a * m + next_adv * (1 - m)
    returns = (adv + values) * mask
    return masked_whiten(adv, mask), returns


@ADV_ESTIMATORS.register("grpo", groups=True)
def _grpo(inputs: AdvantageInputs, gamma: float, lam: float, norm_adv_by_std: bool):
    """(score - group mean) / (group std + eps); ``algorithm.norm_adv_by_std=false`` drops the std."""
    return _per_token(grpo_advantages(_scores(inputs), inputs.group_index, norm_adv_by_std), inputs)


@ADV_ESTIMATORS.register("drgrpo", groups=True)
def _drgrpo(inputs: AdvantageInputs, gamma: float, lam: float, norm_adv_by_std: bool):
    """Dr. GRPO: score - group mean, never divided by the std (pair with seq-mean-token-sum-norm)."""
    return _per_token(grpo_advantages(_scores(inputs), inputs.group_index, norm_by_std=False), inputs)


@ADV_ESTIMATORS.register("rloo", groups=True)
def _rloo(inputs: AdvantageInputs, gamma: float, lam: float, norm_adv_by_std: bool):
    """REINFORCE leave-one-out: score - mean of the OTHER samples of the group = n/(n-1) (score - mean)."""
    scores = _scores(inputs)
    count, mean, _ = _group_stats(scores, inputs.group_index)
    adv = (scores - mean) * count / (count - 1).clamp(min=1)
    return _per_token(torch.where(count > 1, adv, torch.zeros_like(adv)), inputs)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{t+1} over the response tokens of each row (0 elsewhere)."""
    mask = mask.float()
    rewards = token_rewards.float() * mask
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        g = rewards[:, t] + gamma * running
        out[:, t] = g * m
        running = g * m + running * (1 - m)
    return out


@ADV_ESTIMATORS.register("reinforce_plus_plus", token_rewards=True)
def _reinforce_pp(inputs: AdvantageInputs, gamma: float, lam: float, norm_adv_by_std: bool):
    """REINFORCE++: token-level discounted returns (per-token KL penalty included), whitened over the batch."""
    returns = discounted_returns(inputs.token_rewards, inputs.response_mask, gamma)
    return masked_whiten(returns, inputs.response_mask.float()), returns


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline", groups=True)
def _reinforce_pp_baseline(inputs: AdvantageInputs, gamma: float, lam: float, norm_adv_by_std: bool):
    """REINFORCE++ with baseline: score - group mean on every response token, whitened over the batch."""
    scores = _scores(inputs)
    _, mean, _ = _group_stats(scores, inputs.group_index)
    mask = inputs.response_mask.float()
    adv = masked_whiten((scores - mean)[:, None] * mask, mask)
    return adv, adv.clone()


@ADV_ESTIMATORS.register("remax", baseline_rollout=True)
def _remax(inputs: AdvantageInputs, gamma: float, lam: float, norm_adv_by_std: bool):
    """ReMax: reward-to-go minus the reward of the greedy response to the same prompt."""
    mask = inputs.response_mask.float()
    to_go = (inputs.token_rewards.float() * mask).flip(-1).cumsum(-1).flip(-1)
    adv = (to_go - inputs.baseline_scores.float()[:, None]) * mask
    return adv, adv.clone()


# --------------------------------------------------------------------------------------------- KL
# Schulman's estimators of KL(pi || pi_ref) from samples of pi: log_ratio = logp - ref -> per-token KL.
# Two keys name one: actor.loss.kl_estimator (the loss term) and algorithm.kl_penalty (in the reward).
KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("actor.loss.kl_estimator")


@KL_ESTIMATORS.register("k1")
def _k1(log_ratio):
    return log_ratio


@KL_ESTIMATORS.register("k2")
def _k2(log_ratio):
    return 0.5 * log_ratio ** 2


@KL_ESTIMATORS.register("k3")
def _k3(log_ratio):
    """exp(ref - logp) - (ref - logp) - 1: unbiased and always >= 0 (the low-variance one)."""
    # Clamped as verl does: a huge exp() from one far-off token would swamp the batch.
    neg = (-log_ratio).clamp(-20.0, 20.0)
    return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi with estimator ``kind`` (k1/k2/k3)."""
    estimator = KL_ESTIMATORS[kind]  # an unknown kind raises, listing the valid ones
    return estimator(logprobs - ref_logprobs)


def apply_kl_penalty(token_rewards: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                     mask: torch.Tensor, coef: float, kind: str = "k1") -> tuple[torch.Tensor, float]:
    """KL as a reward penalty: (token_rewards - coef * kl on response tokens, mean KL).

    The mean KL (what the adaptive controller tracks) is the mean over sequences of each sequence's
    token-mean KL."""
    mask = mask.float()
    kl = kl_estimate(logprobs, ref_logprobs, kind) * mask
    lengths = mask.sum(-1)
    has = lengths > 0
    per_seq = kl.sum(-1)[has] / lengths[has]
    mean_kl = float(per_seq.mean()) if per_seq.numel() else 0.0
    return token_rewards - coef * kl, mean_kl


# algorithm.kl_ctrl.type -> a controller class, built by kl_controller(); its ``value`` is the
# coefficient, ``update`` runs after every step, the state is what a checkpoint keeps.
KL_CONTROLLERS: Registry[type] = Registry("algorithm.kl_ctrl.type")


class _KLController:
    value: float

    def state_dict(self) -> dict:
        # Only the coefficient changes during training; target and horizon come from the job spec.
        return {"value": float(self.value)}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


@KL_CONTROLLERS.register("fixed")
class FixedKLController(_KLController):
    """A constant in-reward KL coefficient."""

    def __init__(self, coef: float):
        self.value = coef

    @classmethod
    def create(cls, coef: float, target: float, horizon: int) -> "FixedKLController":
        return cls(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKLController(_KLController):
    """Ziegler et al. (2019): move the coefficient so the KL tracks ``target``, by at most 20% of
    ``n_steps / horizon`` per update (``n_steps``: the sequences in the batch just trained on)."""

    def __init__(self, init: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init, target, horizon

    @classmethod
    def create(cls, coef: float, target: float, horizon: int) -> "AdaptiveKLController":
        return cls(coef, target, horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_controller(kind: str, coef: float, target: float, horizon: int):
    """The in-reward KL coefficient's controller named by ``algorithm.kl_ctrl.type``."""
    return KL_CONTROLLERS[kind].create(coef, target, horizon)  # an unknown kind raises, listing the valid ones


# --------------------------------------------------------------------------------- policy losses
# LossConfig (actor.loss) and CriticLossConfig (critic.loss) are defined once, in the schema
# (rlcore/config.py), and imported above: the job spec's sections are what the losses read.
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossConfig],
                        tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class PolicyLossTraits:
    """What a policy loss declares where it is registered; ask ``POLICY_LOSSES.meta(name)``."""
    # The loss picks tokens by statistics over the tokens it is given (one micro-batch on one DP rank),
    # so, unlike the others, its value and gradient depend on how the mini-batch is split into
    # micro-batches and ranks: the normalisation contract holds for the weights, not for the pick.
    micro_batch_statistics: bool = False


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("actor.loss.policy_loss", meta=PolicyLossTraits)


def _clip_surrogate(ratio, advantages, cfg: LossConfig):
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).

    Returns (loss [B,S], clipped [B,S] as 0/1 float)."""
    return _clip_surrogate(torch.exp(logprobs - old_logprobs), advantages, cfg)


@POLICY_LOSSES.register("vanilla")
def _vanilla(logprobs, old_logprobs, advantages, mask, cfg):
    """PPO clip with asymmetric clip-low / clip-high (DAPO's clip-higher when high > low)."""
    loss, clipped = ppo_clip_loss(logprobs, old_logprobs, advantages, cfg)
    return loss, {"clip_frac": clipped}


@POLICY_LOSSES.register("dual_clip")
def dual_clip_loss(logprobs, old_logprobs, advantages, mask, cfg):
    """Dual-clip PPO (Ye et al. 2020): for A < 0 the clipped loss is also bounded above by -A * c, so
    a huge ratio on a bad token cannot blow up the update."""
    loss, clipped = ppo_clip_loss(logprobs, old_logprobs, advantages, cfg)
    bound = -advantages * cfg.clip_ratio_c
    lower_clipped = ((advantages < 0) & (loss > bound)).float()
    loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, {"clip_frac": clipped, "clip_frac_lower": lower_clipped}


@POLICY_LOSSES.register("gspo")
def gspo_loss(logprobs, old_logprobs, advantages, mask, cfg):
    """GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean_t (logp - old)), clipped as
    PPO clips. Per token it is written sg(s_i) * pi/sg(pi) (GSPO-token), the same value and gradient,
    so it fits the per-token aggregation (the paper aggregates with seq-mean-token-mean and uses
    clip ranges of ~3e-4 / 4e-4)."""
    mask = mask.float()
    log_ratio = (logprobs - old_logprobs) * mask
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))  # the clamp only guards exp() overflow
    loss, clipped = _clip_surrogate(ratio, advantages, cfg)
    return loss, {"clip_frac": clipped}


@POLICY_LOSSES.register("cispo")
def cispo_loss(logprobs, old_logprobs, advantages, mask, cfg):
    """CISPO (MiniMax-M1): -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp. The IS weight is clipped,
    not the token's gradient: every token keeps contributing (MiniMax leaves the low side open: set
    clip_ratio_low close to 1)."""
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss = -weight * advantages * logprobs
    return loss, {"clip_frac": (weight != ratio).float()}


@POLICY_LOSSES.register("gmpo")
def gmpo_loss(logprobs, old_logprobs, advantages, mask, cfg):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): a sequence's objective is A_i times the GEOMETRIC
    mean of its token ratios, R_i = exp(mean_t c_t), instead of their arithmetic mean, so one outlier
    token ratio moves it far less. c_t is the token log-ratio clipped pessimistically, on one side only:
    at most clip_ratio_high when A_i > 0, at least -clip_ratio_low when A_i < 0 (the paper: 0.4, 0.4,
    bounds on the LOG-ratio here, as verl's geo_mean). A_i is the sequence's mean advantage (one per
    sequence with the outcome estimators).

    Per token it is written -A_i sg(R_i) exp(c_t - sg(c_t)): the value is -A_i R_i on every token and,
    aggregated with seq-mean-token-mean (the paper's mean over sequences), the gradient is exactly
    that of mean_i(-A_i R_i); other modes weight the sequences as they weight any per-token loss. Only
    row statistics are used, so the micro-batch contract holds."""
    mask = mask.float()
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_adv = (advantages * mask).sum(-1, keepdim=True) / lengths
    log_ratio = (logprobs - old_logprobs) * mask
    bounded = log_ratio.clamp(-cfg.clip_ratio_low, cfg.clip_ratio_high)
    clipped_log_ratio = torch.where(seq_adv > 0, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    seq_log_ratio = (clipped_log_ratio * mask).sum(-1, keepdim=True) / lengths
    seq_ratio = torch.exp(seq_log_ratio.clamp(max=20.0)).detach()  # the clamp only guards exp() overflow
    loss = -seq_adv * seq_ratio * torch.exp(clipped_log_ratio - clipped_log_ratio.detach())
    return loss, {"clip_frac": (clipped_log_ratio != log_ratio).float()}


@POLICY_LOSSES.register("sapo")
def sapo_loss(logprobs, old_logprobs, advantages, mask, cfg):
    """SAPO (Qwen, Gao et al. 2025, arXiv 2511.20347): PPO's hard clip replaced by a soft gate,
    -f(r) * A with f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = sapo_tau_pos where A > 0 else
    sapo_tau_neg. Its gradient is -A r * 4 s (1 - s) (s the sigmoid): exactly vanilla's -A r at r = 1,
    fading smoothly as the ratio leaves 1, faster for a larger tau (the paper takes tau_neg > tau_pos:
    negative-advantage updates, which spread probability over the vocabulary, fade sooner). The value
    at r = 1 is -2A / tau. Metric ``sapo_gate``: the gradient's factor 4 s (1 - s), 1 on-policy."""
    tau = torch.where(advantages > 0, torch.full_like(advantages, cfg.sapo_tau_pos),
                      torch.full_like(advantages, cfg.sapo_tau_neg))
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))  # the clamp only guards exp() overflow
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * advantages
    return loss, {"sapo_gate": (4.0 * gate * (1.0 - gate)).detach()}


@POLICY_LOSSES.register("gpg")
def gpg_loss(logprobs, old_logprobs, advantages, mask, cfg):
    """GPG (Chu et al. 2025, arXiv 2504.02546): the plain policy gradient, -A * logp per token: no
    importance ratio, no clip, no critic (old_logprobs are not used). On-policy its gradient is
    vanilla's; it suits one epoch of one mini-batch per step. The paper's advantage is the group-mean
    centred score (``algorithm.adv_estimator=grpo`` or ``drgrpo``); its rescaling for groups whose
    rewards are all equal is what ``algorithm.dynamic_sampling`` achieves by dropping them."""
    return -advantages * logprobs, {}


def _token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean A) * (logp - mean logp) per token, the means over the response tokens given (one
    micro-batch on a worker); no gradient. Cui et al. show a token's share of the entropy change is
    this covariance: confident tokens with high advantage collapse the entropy."""
    n = mask.sum().clamp(min=1)
    logprobs = logprobs.detach()
    mean_adv = (advantages * mask).sum() / n
    mean_logp = (logprobs * mask).sum() / n
    return (advantages - mean_adv) * (logprobs - mean_logp)


def _token_budget(ratio: float, mask: torch.Tensor) -> int:
    """How many of the given response tokens a cov loss picks: ratio of them, at least one (as verl)."""
    n = int(mask.sum().item())
    return max(1, int(ratio * n)) if n > 0 else 0


def _random_pick(eligible: torch.Tensor, count: int, key: torch.Tensor) -> torch.Tensor:
    """bool like ``eligible``: ``count`` of its True positions, uniformly at random (all when there are
    fewer). The generator is seeded from ``key`` (this micro-batch's old log-probs), not from the
    global RNG: every TP rank computes the same loss on the same tensors and must pick the same
    tokens, and a rerun picks the same."""
    positions = eligible.flatten().nonzero().squeeze(-1)
    if positions.numel() > count:
        seed = zlib.crc32(key.detach().float().cpu().numpy().tobytes())
        order = torch.randperm(positions.numel(), generator=torch.Generator().manual_seed(seed))
        positions = positions[order[:count].to(positions.device)]
    picked = torch.zeros(eligible.numel(), dtype=torch.bool, device=eligible.device)
    picked[positions] = True
    return picked.view_as(eligible)


@POLICY_LOSSES.register("clip_cov", micro_batch_statistics=True)
def clip_cov_loss(logprobs, old_logprobs, advantages, mask, cfg):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617):
    PPO clip, plus the gradient of a few high-covariance tokens detached to slow the entropy collapse:
    among the response tokens PPO did not clip whose covariance (``_token_covariance``) lies in
    (clip_cov_lb, clip_cov_ub), clip_cov_ratio of the tokens (at least one) are picked at random and
    keep their loss value with no gradient (verl zeroes the value too; the gradient is the same).

    The covariance's means, the token count and the pick are this call's, i.e. one micro-batch's on
    one rank, as in verl and the paper's code: the loss is NOT invariant to the micro-batch/DP split
    (declared ``micro_batch_statistics``); with no token in the band it is exactly vanilla."""
    mask = mask.float()
    loss, ppo_clipped = ppo_clip_loss(logprobs, old_logprobs, advantages, cfg)
    cov = _token_covariance(logprobs, advantages, mask)
    eligible = (mask > 0) & (ppo_clipped == 0) & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    picked = _random_pick(eligible, _token_budget(cfg.clip_cov_ratio, mask), old_logprobs)
    loss = torch.where(picked, loss.detach(), loss)
    return loss, {"clip_frac": ppo_clipped, "cov_clip_frac": picked.float()}


@POLICY_LOSSES.register("kl_cov", micro_batch_statistics=True)
def kl_cov_loss(logprobs, old_logprobs, advantages, mask, cfg):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped surrogate -A r on every token, plus
    kl_cov_coef * |logp - old| on the kl_cov_ratio of the response tokens (at least one) with the
    largest covariance (``_token_covariance``): those are pulled back towards the old policy instead
    of being clipped.

    As clip_cov, the covariance and the top-k are one micro-batch's on one rank (verl does the same),
    so the loss is NOT invariant to the split (declared ``micro_batch_statistics``); on-policy (the
    first mini-batch step, old == logp) the penalty and its gradient are 0 and any split agrees."""
    mask = mask.float()
    log_ratio = logprobs - old_logprobs
    loss = -advantages * torch.exp(log_ratio)
    count = _token_budget(cfg.kl_cov_ratio, mask)
    cov = _token_covariance(logprobs, advantages, mask).masked_fill(mask == 0, -torch.inf)
    picked = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    picked[cov.flatten().topk(count).indices] = True
    picked = picked.view_as(cov)
    loss = torch.where(picked, loss + cfg.kl_cov_coef * log_ratio.abs(), loss)
    return loss, {"kl_cov_frac": picked.float()}


# actor.loss.rollout_correction: (ratio, log_ratio, mask, threshold, threshold_low) -> (weight, touched).
ROLLOUT_CORRECTIONS: Registry[Callable] = Registry("actor.loss.rollout_correction")


@ROLLOUT_CORRECTIONS.register("none")
def _no_correction(ratio, log_ratio, mask, hi, lo):
    # actor_loss skips the correction altogether; this entry makes "none" a valid name.
    return torch.ones_like(ratio), torch.zeros_like(ratio)


@ROLLOUT_CORRECTIONS.register("tis")
def _tis(ratio, log_ratio, mask, hi, lo):
    """min(ratio, threshold) per token (truncated importance sampling)."""
    return ratio.clamp(max=hi), (ratio > hi).float()


@ROLLOUT_CORRECTIONS.register("icepop")
def _icepop(ratio, log_ratio, mask, hi, lo):
    """1 if low <= ratio <= threshold else 0, per token."""
    weight = ((ratio >= lo) & (ratio <= hi)).float()
    return weight, 1.0 - weight


@ROLLOUT_CORRECTIONS.register("seq_mask")
def _seq_mask(ratio, log_ratio, mask, hi, lo):
    """1 for a whole sequence if low <= its geometric-mean ratio <= threshold else 0."""
    seq_ratio = torch.exp(log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
    weight = ((seq_ratio >= lo) & (seq_ratio <= hi)).float().expand_as(ratio)
    return weight, 1.0 - weight


def rollout_correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                               cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token weights that correct for the rollout engine sampling from a slightly different
    distribution than the trainer's old policy: (weight [B,S] (no gradient), ratio pi_old/pi_rollout,
    1 where the token was truncated or masked out), by ``ROLLOUT_CORRECTIONS[cfg.rollout_correction]``."""
    correction = ROLLOUT_CORRECTIONS[cfg.rollout_correction]  # an unknown one raises, listing the valid ones
    mask = mask.float()
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    weight, touched = correction(ratio, log_ratio, mask, cfg.rollout_is_threshold, cfg.rollout_is_threshold_low)
    return weight * mask, ratio * mask, touched * mask


def actor_loss(logprobs: torch.Tensor, entropy: torch.Tensor, batch, cfg: LossConfig
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss for one micro-batch, and its additive metric contributions.

    ``logprobs``/``entropy`` [B,S] come from the model being trained (aligned with tokens); ``batch``
    holds ``response_mask``, ``loss_weights`` (``loss_weights()`` of the whole mini-batch),
    ``old_logprobs``, ``advantages``; ``ref_logprobs`` when ``cfg.kl_coeff > 0``; ``rollout_logprobs``
    when ``cfg.rollout_correction != "none"``.

    Metrics are aggregated with the loss's weights too (that keeps them additive): under token-mean
    and seq-mean-token-mean the fractions (clip_frac, ...) are fractions; under the token-sum modes
    they are per-sequence sums.
    """
    if "loss_weights" not in batch:
        raise KeyError("actor_loss: the batch has no 'loss_weights' (rlcore.algos.loss_weights of the whole "
                       "mini-batch, computed by the controller before sharding)")
    mask = batch["response_mask"]
    weights = batch["loss_weights"]
    old = batch["old_logprobs"]
    pg_mat, pg_stats = POLICY_LOSSES[cfg.policy_loss](logprobs, old, batch["advantages"], mask, cfg)

    def agg(x):
        return aggregate(x, weights)

    metrics = {}
    if cfg.rollout_correction != "none":
        is_weight, is_ratio, touched = rollout_correction_weights(old, batch["rollout_logprobs"], mask, cfg)
        pg_mat = pg_mat * is_weight
        metrics["actor/tis_ratio_mean"] = agg(is_ratio).detach()
        metrics["actor/tis_clip_frac"] = agg(touched).detach()

    pg_loss = agg(pg_mat)
    ent = agg(entropy)
    loss = pg_loss - cfg.entropy_coeff * ent
    metrics.update({
        "actor/pg_loss": pg_loss.detach(),
        "actor/entropy": ent.detach(),
        # k1 of old vs new on the sampled tokens, as verl/slime report ppo_kl: 0 on the first step.
        "actor/ppo_kl": agg((old - logprobs).detach()),
    })
    for name, per_token in pg_stats.items():
        metrics[f"actor/{name}"] = agg(per_token).detach()
    if cfg.kl_coeff > 0:
        kl = agg(kl_estimate(logprobs, batch["ref_logprobs"], cfg.kl_estimator))
        loss = loss + cfg.kl_coeff * kl
        metrics["actor/kl_ref"] = kl.detach()
    return loss, metrics


# ----------------------------------------------------------------------------------- value loss
def critic_loss(values: torch.Tensor, batch, cfg: CriticLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss for one micro-batch: 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2),
    aggregated with ``batch["loss_weights"]`` (additive like ``actor_loss``). ``batch`` holds
    ``old_values``, ``returns``, ``loss_weights``, ``response_mask``."""
    weights = batch["loss_weights"]
    old, returns = batch["old_values"], batch["returns"]
    clipped_values = old + (values - old).clamp(-cfg.cliprange_value, cfg.cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    vf_loss = aggregate(0.5 * torch.maximum(unclipped_loss, clipped_loss), weights)
    metrics = {
        "critic/vf_loss": vf_loss.detach(),
        "critic/vf_clipfrac": aggregate((clipped_loss > unclipped_loss).float(), weights).detach(),
        "critic/vpred_mean": aggregate(values.detach(), weights),
    }
    return vf_loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over the masked tokens: 1 is a perfect critic, 0 no better than the
    mean, negative worse. NaN when the returns do not vary."""
    mask = mask.float()
    n = mask.sum()
    if n == 0:
        return float("nan")

    def var(x):
        mean = (x * mask).sum() / n
        return (((x - mean) * mask) ** 2).sum() / n

    var_returns = var(returns.float())
    if var_returns == 0:
        return float("nan")
    return float(1.0 - var(returns.float() - values.float()) / var_returns)


# ------------------------------------------------------------------------------------ DAPO pieces
def groups_with_variance(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """bool [N]: True for samples whose group's scores are not all equal (DAPO's dynamic sampling keeps
    those: an all-equal group has zero group-relative advantage and no gradient). A group of one
    sample is all-equal."""
    scores = scores.float()
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    hi = torch.full((n_groups,), -torch.inf).scatter_reduce(0, inv, scores, "amax")
    lo = torch.full((n_groups,), torch.inf).scatter_reduce(0, inv, scores, "amin")
    return (hi > lo)[inv]


def overlong_penalty(response_lengths: torch.Tensor, max_len: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment [N] (<= 0, added to the score): 0 up to max_len - buffer_len,
    then falling linearly to -penalty_factor at max_len."""
    exceed = response_lengths.float() - (max_len - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


# ---------------------------------------------------------------------------- reward-model training
def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, pair_weights: Optional[torch.Tensor] = None,
                       margin: float | torch.Tensor = 0.0, center_coeff: float = 0.0
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reward model's Bradley-Terry loss on P pairs and its additive metric contributions.

    ``chosen``/``rejected`` [P]: the model's scores of each pair's chosen and rejected response. Per
    pair ``-log sigmoid(chosen - rejected - margin)`` (the margin as in Llama 2's RM: the chosen must
    win by at least that much), plus TRL's ``center_coeff * (chosen + rejected)^2``, which pins the
    scores' free offset near 0. ``pair_weights`` [P] (default ``1/P``): each pair's share of the
    mini-batch's mean; the result is ``sum(per_pair * pair_weights)``, so the shares of micro-batches
    and DP ranks sum to the mini-batch mean (the module's contract), and so do the metrics:
    ``rm/accuracy`` (chosen scored strictly above rejected), ``rm/margin`` (mean chosen - rejected),
    ``rm/chosen_score``, ``rm/rejected_score``, ``rm/loss`` (the Bradley-Terry term alone)."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"bradley_terry_loss: chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} "
                         "must be the same [P] shape")
    chosen, rejected = chosen.float(), rejected.float()
    if pair_weights is None:
        pair_weights = torch.full_like(chosen, 1.0 / max(1, chosen.numel()))
    w = pair_weights.float()
    diff = chosen - rejected
    bt = (-torch.nn.functional.logsigmoid(diff - margin) * w).sum()
    loss = bt + center_coeff * (((chosen + rejected) ** 2) * w).sum() if center_coeff else bt
    metrics = {
        "rm/loss": bt.detach(),
        "rm/accuracy": ((diff > 0).float() * w).sum().detach(),
        "rm/margin": (diff * w).sum().detach(),
        "rm/chosen_score": (chosen * w).sum().detach(),
        "rm/rejected_score": (rejected * w).sum().detach(),
    }
    return loss, metrics


def last_token_values(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] each right-padded row's ``x`` [B, S] at its last attention-mask position: a reward model's
    outcome score (what transformers' *ForSequenceClassification returns for the row)."""
    last = attention_mask.long().sum(1) - 1
    if bool((last < 0).any()):
        raise ValueError("a row has no tokens (attention_mask all 0): it has no last token to score")
    return x.gather(1, last.unsqueeze(1)).squeeze(1)


def rm_batch_loss(scores: torch.Tensor, batch, loss_cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``bradley_terry_loss`` of a micro-batch of consecutive pairs (row 2i chosen, 2i+1 rejected,
    rlcore/preference_data.py): the score head's ``scores`` [2P, S] read at each row's last token; the
    batch's ``attention_mask`` and ``loss_weights`` [2P] (each pair's share of the mini-batch, on both
    of its rows); ``loss_cfg`` the ``algorithm.rm`` section."""
    outcome = last_token_values(scores, batch["attention_mask"])
    if outcome.shape[0] % 2:
        raise ValueError(f"{outcome.shape[0]} rows are not whole (chosen, rejected) pairs: micro-batches must "
                         "hold rows 2i and 2i+1 together")
    weights = batch["loss_weights"].float()
    if weights.dim() != 1:
        raise ValueError(f"loss_weights of shape {tuple(weights.shape)}: a preference batch weighs rows, [2P]")
    return bradley_terry_loss(outcome[0::2], outcome[1::2], weights[0::2], loss_cfg.margin, loss_cfg.center_coeff)


def rm_metrics(outputs: dict[str, torch.Tensor], batch, loss_cfg) -> dict[str, float]:
    """The Bradley-Terry loss and metrics (means over the pairs) of a whole batch of pairs from the
    reward model's forward ``outputs["scores"]``: the validation pairs' ``val/rm_accuracy``, ..."""
    weights = torch.full((batch["attention_mask"].shape[0],), 2.0 / batch["attention_mask"].shape[0])
    _, metrics = rm_batch_loss(outputs["scores"], {"attention_mask": batch["attention_mask"],
                                                   "loss_weights": weights}, loss_cfg)
    return {k: float(v) for k, v in metrics.items()}
