"""Reward sources and their combination: what turns a batch of responses into the rewards it trains on.

A reward source scores every trajectory of a batch (``RewardSource.score``) with one score each and,
for a process reward model, rewards on response tokens. The job's sources are the ones its spec
configures (``REWARD_SOURCES``: a name -> a builder and whether the spec asks for it):

- ``rule``: the reward function (``reward.function``, rlcore/reward.py), always there;
- ``rm``: an outcome reward model (``reward.model``), a forward-only Megatron role with the score head:
  each prompt+response's score at its last token;
- ``prm``: a process reward model (``reward.process``), the same kind of role read at the last token
  of every step of the response: token rewards on those tokens (``aggregate: token``), or their
  min/last/mean as one score.

``RewardCombination`` adds them up with ``reward.weights`` (each source optionally z-scored over the
batch first, ``reward.normalize: batch``): the outcome sources into one score per trajectory (the
trainer puts it on the last response token), the token sources into token rewards. Metrics:
``reward/<name>_mean`` per source (its raw scores), the rule function's own ``reward/<key>`` entries,
and ``reward/mean`` (the combined reward a trajectory trains on, summed over its tokens).

A scoring role is known here only as a ``rlcore.roles.ForwardRole`` whose ``forward`` returns
``scores`` [B, S] (``scores[:, t]``: the score having read tokens 0..t, megatron_workers/score_head.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from rlcore.batch import Batch, Trajectory
from rlcore.data import PromptItem
from rlcore.judge import JudgeSource
from rlcore.registry import Registry
from rlcore.reward import RewardError, compute_rewards

NORMALIZE = ("none", "batch")
PRM_AGGREGATES = ("token", "min", "last", "mean")


@dataclass
class SourceScores:
    sequence: torch.Tensor  # [N] one score per trajectory
    token: Optional[list[torch.Tensor]] = None  # per trajectory, len(response_ids) rewards (a PRM); None: outcome only
    metrics: dict[str, float] = field(default_factory=dict)


class RewardSource(Protocol):
    name: str  # "rule" | "rm" | "prm" | "judge": its reward.weights key; metric reward/<name>_mean

    def score(self, prompts: list[PromptItem], trajs: list[Trajectory], texts: list[str]) -> SourceScores:
        """``prompts``: the prompts of the generate() request, ``trajs[i]`` answering
        ``prompts[trajs[i].prompt_index]``; ``texts``: the responses decoded with the POLICY tokenizer
        (skip_special_tokens). With ``token`` set, ``sequence`` is a summary for the metric only:
        the token rewards are what trains."""
        ...


@dataclass(frozen=True)
class SourceSpec:
    """What a registered source declares: whether a job spec asks for it (the rule function always)."""
    configured: Callable[[Any], bool]


# name -> builder(cfg: JobConfig, task: rlcore.data.Task, role) -> RewardSource, where ``role`` is the
# role the composition root built for that source (``Roles.reward[name]``; None for the rule).
REWARD_SOURCES: Registry[Callable[..., RewardSource]] = Registry("reward.weights", meta=SourceSpec)


def configured_sources(cfg) -> list[str]:
    """The names of the sources ``cfg`` asks for, in registration order."""
    return [name for name in REWARD_SOURCES if REWARD_SOURCES.meta(name).configured(cfg)]


def source_weights(cfg) -> dict[str, float]:
    """Each configured source's weight (``reward.weights``; empty: 1 each). A ``ValueError`` sentence
    for weights that name a source the spec does not configure, or leave one out."""
    names = configured_sources(cfg)
    given = dict(cfg.reward.weights or {})
    if not given:
        return {name: 1.0 for name in names}
    for name, weight in given.items():
        if name not in names:
            what = (f"configured: {', '.join(names)}" if name in REWARD_SOURCES
                    else f"the sources are: {', '.join(REWARD_SOURCES)}")
            raise ValueError(f"reward.weights.{name}: no such reward source in this job ({what})")
        if not isinstance(weight, (int, float)) or not math.isfinite(float(weight)):
            raise ValueError(f"reward.weights.{name}={weight!r} must be a finite number")
    missing = [name for name in names if name not in given]
    if missing:
        raise ValueError(f"reward.weights names {', '.join(given)} but not {', '.join(missing)}, which this job "
                         "configures; give every configured source a weight (0 keeps its metric only)")
    if all(float(w) == 0 for w in given.values()):
        raise ValueError("reward.weights are all 0: nothing would reward the policy")
    return {name: float(given[name]) for name in names}


# ------------------------------------------------------------------------------ the combination
def _zscore(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return (x - x.mean()) / (x.std(unbiased=False) + eps) if x.numel() else x


class RewardCombination:
    """The job's sources, weighted (``reward.weights``) and optionally z-scored per batch."""

    def __init__(self, sources: Sequence[RewardSource], weights: dict[str, float], normalize: str = "none"):
        if normalize not in NORMALIZE:
            raise ValueError(f"reward.normalize={normalize!r} is not one of: {', '.join(NORMALIZE)}")
        self.sources, self.weights, self.normalize = list(sources), dict(weights), normalize
        self.by_name = {s.name: s for s in self.sources}

    @classmethod
    def for_job(cls, cfg, task, roles: dict[str, Any]) -> "RewardCombination":
        """Every configured source of ``cfg``, built with its role from ``roles`` (``Roles.reward``)."""
        weights = source_weights(cfg)
        return cls([REWARD_SOURCES[name](cfg, task, roles.get(name)) for name in weights], weights,
                   cfg.reward.normalize)

    def score(self, prompts: list[PromptItem], trajs: list[Trajectory], texts: list[str]) -> SourceScores:
        """The combined rewards: ``sequence`` [N] (the outcome sources, weighted), ``token`` (the token
        sources, weighted; None when there are none) and every source's metrics."""
        n = len(trajs)
        sequence, token, metrics = torch.zeros(n), None, {}
        for source in self.sources:
            got = source.score(prompts, trajs, texts)
            _check_scores(source.name, got, trajs)
            metrics[f"reward/{source.name}_mean"] = float(got.sequence.mean()) if n else 0.0
            metrics.update(got.metrics)
            w = self.weights[source.name]
            if got.token is None:
                seq = _zscore(got.sequence.float()) if self.normalize == "batch" else got.sequence.float()
                sequence = sequence + w * seq
                continue
            rewards = [t.float() for t in got.token]
            if self.normalize == "batch":  # over the batch's placed (non-zero) rewards: a PRM's step scores
                placed = torch.cat([t[t != 0] for t in rewards]) if rewards else torch.zeros(0)
                mean, std = (placed.mean(), placed.std(unbiased=False)) if placed.numel() else (0.0, 0.0)
                rewards = [torch.where(t != 0, (t - mean) / (std + 1e-6), t) for t in rewards]
            token = [w * t for t in rewards] if token is None else [a + w * t for a, t in zip(token, rewards)]
        metrics["reward/mean"] = float(total_rewards(sequence, token).mean()) if n else 0.0
        return SourceScores(sequence, token, metrics)


def total_rewards(sequence: torch.Tensor, token: Optional[list[torch.Tensor]]) -> torch.Tensor:
    """[N] each trajectory's whole reward: its outcome score plus its token rewards' sum."""
    if token is None:
        return sequence
    return sequence + torch.stack([t.sum() for t in token]) if token else sequence


def _check_scores(name: str, got: SourceScores, trajs: list[Trajectory]) -> None:
    n = len(trajs)
    if not isinstance(got.sequence, torch.Tensor) or tuple(got.sequence.shape) != (n,):
        raise RewardError(f"reward source {name!r} returned sequence scores of shape "
                          f"{tuple(getattr(got.sequence, 'shape', ()))}, expected ({n},) (one per trajectory)")
    bad = (~torch.isfinite(got.sequence.float())).nonzero()
    if len(bad):
        raise RewardError(f"reward source {name!r} returned a non-finite score for trajectory {int(bad[0])}")
    if got.token is None:
        return
    if len(got.token) != n:
        raise RewardError(f"reward source {name!r} returned token rewards for {len(got.token)} of {n} trajectories")
    for i, (t, tr) in enumerate(zip(got.token, trajs)):
        if tuple(t.shape) != (len(tr.response_ids),) or not bool(torch.isfinite(t.float()).all()):
            raise RewardError(f"reward source {name!r}: trajectory {i}'s token rewards have shape {tuple(t.shape)} "
                              f"(expected ({len(tr.response_ids)},), finite: one per response token)")


def placed_token_rewards(token: list[torch.Tensor], response_mask: torch.Tensor) -> torch.Tensor:
    """[N, S] the per-trajectory token rewards on their response tokens (rlcore.batch.build_batch's
    rows: row i's response tokens are its ``response_mask`` positions, in order)."""
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    for i, t in enumerate(token):
        positions = response_mask[i].nonzero().squeeze(1)
        if len(positions) != len(t):
            raise ValueError(f"row {i}: {len(t)} token rewards for {len(positions)} response tokens")
        out[i, positions] = t.float()
    return out


# ------------------------------------------------------------------------------------ the rule
class RuleSource:
    """The reward function (``reward.function``): the verifier, or the user's function."""
    name = "rule"

    def __init__(self, fn, spec: str):
        self.fn, self.spec = fn, spec

    def score(self, prompts: list[PromptItem], trajs: list[Trajectory], texts: list[str]) -> SourceScores:
        items = [prompts[tr.prompt_index] for tr in trajs]
        scores, metrics = compute_rewards(self.fn, items, texts, spec=self.spec)
        metrics.pop("reward/mean", None)  # the source's mean is reward/rule_mean; reward/mean is the combined
        return SourceScores(scores, None, metrics)


# ----------------------------------------------------------------------------- reward models
def last_token_scores(scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] each right-padded row's score at its last attention-mask position (what transformers'
    *ForSequenceClassification returns for it)."""
    last = attention_mask.long().sum(1) - 1
    if bool((last < 0).any()):
        raise ValueError("a row has no tokens (attention_mask all 0): it has no last token to score")
    return scores.gather(1, last.unsqueeze(1)).squeeze(1)


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers turn a chat into the same ids: the same vocabulary and chat template."""
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if hasattr(out, "keys"):  # transformers 5: a BatchEncoding
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def role_dp(cfg, section) -> int:
    """DP of a scoring role (``reward.model`` / ``reward.process``): its pool's GPUs / (tp * pp)."""
    pool = section.pool or cfg.actor.pool
    return cfg.resources.pools[pool] // (section.tp * section.pp)


class _ScoringModel:
    """A scoring role and how its rows are made: the policy's ids as they are when the model shares the
    policy's tokenizer (and chat template), else the chat re-tokenised with the model's own."""

    def __init__(self, role, key: str, tokenizer, policy_tokenizer, rows_multiple: int, max_positions: int):
        self.role, self.key, self.tokenizer = role, key, tokenizer
        # The same tokenizer: the policy's ids are exactly what the model would tokenise (no decode and
        # re-encode round trip, which need not give the sampled ids back).
        self.same = same_tokenizer(tokenizer, policy_tokenizer)
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        self.rows_multiple, self.max_positions = rows_multiple, max_positions

    def rows(self, prompts: list[PromptItem], trajs: list[Trajectory], texts: list[str]) -> list[list[int]]:
        if self.same:
            return [list(tr.prompt_ids) + list(tr.response_ids) for tr in trajs]
        out = []
        for tr, text in zip(trajs, texts):
            item = prompts[tr.prompt_index]
            if not item.messages:
                raise RewardError(f"{self.key}: dataset row {item.index} has no chat messages to re-tokenise "
                                  "with the reward model's tokenizer")
            out.append(_chat_ids(self.tokenizer, [*item.messages, {"role": "assistant", "content": text}]))
        return out

    def forward(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, S] the role's scores of ``rows``, their attention mask) (right-padded; padded with copies of the last row to a
        multiple of DP x micro_batch_size, which are dropped again)."""
        for i, r in enumerate(rows):
            if len(r) > self.max_positions:
                raise RewardError(f"{self.key}: trajectory {i} is {len(r)} tokens for the reward model, more than "
                                  f"its max_position_embeddings={self.max_positions}")
        n = len(rows)
        padded = rows + [rows[-1]] * (-n % self.rows_multiple)
        seq = max(len(r) for r in padded)
        input_ids = torch.full((len(padded), seq), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(padded), seq), dtype=torch.long)
        for i, r in enumerate(padded):
            input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, :len(r)] = 1
        scores = self.role.forward(Batch(input_ids=input_ids, attention_mask=attention_mask))["scores"]
        return scores[:n].float(), attention_mask[:n]


class RewardModelSource:
    """An outcome reward model: each prompt+response's score at its last token."""
    name = "rm"

    def __init__(self, model: _ScoringModel):
        self.model = model

    def score(self, prompts: list[PromptItem], trajs: list[Trajectory], texts: list[str]) -> SourceScores:
        if not trajs:
            return SourceScores(torch.zeros(0))
        rows = self.model.rows(prompts, trajs, texts)
        if self.model.same:  # scored as reward-model training saw completions: ending in eos (preference_data.py)
            eos = self.model.tokenizer.eos_token_id
            rows = [r if eos is None or (tr.response_ids and tr.response_ids[-1] == eos) else r + [eos]
                    for r, tr in zip(rows, trajs)]
        scores, attention_mask = self.model.forward(rows)
        return SourceScores(last_token_scores(scores, attention_mask))


def step_ends(response_ids: Sequence[int], tokenizer, separator: Optional[str] = None,
              separator_token_id: Optional[int] = None) -> list[int]:
    """The response-relative index of the last token of every step: a step ends with the separator
    (the token ``separator_token_id``, or the token that completes the ``separator`` text in the decoded
    response), and the last step with the response's last token. A separator with nothing but special
    tokens after it ends the last step, which then ends at the response's end."""
    ids = list(response_ids)
    if not ids:
        return []

    def text_of(k: int) -> str:  # the response's first k tokens, decoded as the policy's texts are
        return tokenizer.decode(ids[:k], skip_special_tokens=True)

    full = text_of(len(ids))
    ends = []
    if separator_token_id is not None:
        ends = [k for k, t in enumerate(ids[:-1]) if t == separator_token_id
                and tokenizer.decode(ids[k + 1:], skip_special_tokens=True) != ""]
    else:
        start = full.find(separator)
        while start != -1:
            end = start + len(separator)
            if end < len(full):  # something follows: this separator ends a step
                lo, hi = 0, len(ids) - 1  # the first token whose prefix covers the separator's end
                while lo < hi:
                    mid = (lo + hi) // 2
                    if len(text_of(mid + 1)) >= end:
                        hi = mid
                    else:
                        lo = mid + 1
                ends.append(lo)
            start = full.find(separator, end)
    return sorted(set(ends) | {len(ids) - 1})


class ProcessRewardSource:
    """A process reward model: the score at the last token of every step (``step_ends``), as token
    rewards on those tokens (``aggregate: token``) or their min/last/mean as the trajectory's score."""
    name = "prm"

    def __init__(self, model: _ScoringModel, separator: Optional[str], separator_token_id: Optional[int],
                 aggregate: str):
        if aggregate not in PRM_AGGREGATES:
            raise ValueError(f"reward.process.aggregate={aggregate!r} is not one of: {', '.join(PRM_AGGREGATES)}")
        if not model.same:
            raise ValueError("reward.process.path: the process reward model must share the policy's tokenizer "
                             "and chat template (its step scores are placed on the policy's tokens)")
        self.model, self.separator, self.separator_token_id = model, separator, separator_token_id
        self.aggregate = aggregate

    def score(self, prompts: list[PromptItem], trajs: list[Trajectory], texts: list[str]) -> SourceScores:
        if not trajs:
            return SourceScores(torch.zeros(0), [] if self.aggregate == "token" else None)
        scores, _ = self.model.forward(self.model.rows(prompts, trajs, texts))
        token, summary, steps = [], [], []
        for i, tr in enumerate(trajs):
            ends = step_ends(tr.response_ids, self.model.tokenizer, self.separator, self.separator_token_id)
            values = scores[i, [len(tr.prompt_ids) + e for e in ends]]
            rewards = torch.zeros(len(tr.response_ids))
            rewards[ends] = values
            token.append(rewards)
            steps.append(len(ends))
            if not len(values):  # an empty response has no step
                summary.append(0.0)
            elif self.aggregate in ("token", "mean"):
                summary.append(float(values.mean()))
            else:
                summary.append(float(values.min() if self.aggregate == "min" else values[-1]))
        metrics = {"reward/prm_steps_mean": sum(steps) / len(steps)}
        return SourceScores(torch.tensor(summary), token if self.aggregate == "token" else None, metrics)


def _scoring_model(cfg, task, role, section, key: str) -> _ScoringModel:
    from transformers import AutoTokenizer

    from rlcore.hf_config import read_hf_config

    model = read_hf_config(section.path, key=key)
    return _ScoringModel(role, key, AutoTokenizer.from_pretrained(section.path), task.tokenizer,
                         role_dp(cfg, section) * section.micro_batch_size, model.max_position_embeddings)


REWARD_SOURCES.add("rule", lambda cfg, task, role: RuleSource(task.reward_fn, cfg.reward.function),
                   configured=lambda cfg: True)
REWARD_SOURCES.add("rm", lambda cfg, task, role: RewardModelSource(
    _scoring_model(cfg, task, role, cfg.reward.model, "reward.model.path")),
    configured=lambda cfg: cfg.reward.model.path is not None)
REWARD_SOURCES.add("prm", lambda cfg, task, role: ProcessRewardSource(
    _scoring_model(cfg, task, role, cfg.reward.process, "reward.process.path"), cfg.reward.process.separator,
    cfg.reward.process.separator_token_id, cfg.reward.process.aggregate),
    configured=lambda cfg: cfg.reward.process.path is not None)
REWARD_SOURCES.add("judge", lambda cfg, task, role: JudgeSource.load(cfg, role),
                   configured=lambda cfg: cfg.reward.judge.model_path is not None)
