"""The LLM judge (``reward.judge``): a reward source whose scores a judge model writes.

For each trajectory the template is rendered with ``{response}`` (the response decoded with the
POLICY's tokenizer), ``{prompt}`` (the prompt's user messages, joined by newlines: the question as
its author wrote it, not the policy's chat markup) and ``{ground_truth}``. The rendered text goes
through the JUDGE's own tokenizer, as one user message of the judge's chat template (unless
``apply_chat_template`` is false), and the judge's own vLLM pool generates a verdict: greedy by
default, never weight-synced (the judge does not train). The parser reads a score in [0, 1] from the
verdict; a verdict it cannot read scores 0 and is counted in ``reward/judge_unparsed`` (the FRACTION
of the batch's responses whose verdict was unreadable).

The pool is any ``rlcore.roles.Generator`` (launch/compose.py builds a ``rollout.RolloutPool`` of
the judge model on ``reward.judge.pool``); this module does not import ``rollout``.
"""
from __future__ import annotations

import math
import os
import re
import string
import zlib
from typing import Optional

import torch

from rlcore.config import JobConfig, JudgeConfig, RolloutConfig
from rlcore.data import PromptItem, _chat_ids
from rlcore.hf_config import read_hf_config
from rlcore.job import ConfigError
from rlcore.layout import RolloutLayout, check_rollout_split
from rlcore.reward import RewardError, extract_final_answer
from rlcore.roles import Generator

PLACEHOLDERS = ("prompt", "response", "ground_truth")
PARSERS = ("number", "yes_no")
UNPARSED_METRIC = "reward/judge_unparsed"
_YES_NO_RE = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


# ------------------------------------------------------------------------------------ parsers
def parse_number(text: str) -> Optional[float]:
    """The verdict's final number as the numeric verifier reads it (the last ``\\boxed{}``, else the
    first number after ``####``, else the last number; "3/4" is 0.75), or None when it has none."""
    return extract_final_answer(text)


def parse_yes_no(text: str) -> Optional[float]:
    """1.0 when the verdict's first yes/no word (any case, a whole word) is yes, 0.0 when it is no,
    None when it has neither."""
    match = _YES_NO_RE.search(text)
    if match is None:
        return None
    return 1.0 if match.group(1).lower() == "yes" else 0.0


def verdict_score(cfg: JudgeConfig, text: str) -> Optional[float]:
    """The score in [0, 1] that ``cfg.parser`` reads from one verdict, or None when it reads none.
    ``number``: (x - score_min) / (score_max - score_min), clamped to [0, 1]."""
    if cfg.parser == "yes_no":
        return parse_yes_no(text)
    if cfg.parser != "number":
        raise ValueError(f"reward.judge.parser={cfg.parser!r} is not one of: {', '.join(PARSERS)}")
    value = parse_number(text)
    if value is None:
        return None
    return min(1.0, max(0.0, (value - cfg.score_min) / (cfg.score_max - cfg.score_min)))


# ----------------------------------------------------------------------------------- template
def _template_key(cfg: JudgeConfig) -> str:
    return "reward.judge.template" if cfg.template is not None else f"reward.judge.template_file={cfg.template_file}"


def template_fields(template: str, key: str) -> list[str]:
    """The placeholders of a template: a Python format string over PLACEHOLDERS, {response} among them."""
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ConfigError(f"{key} is not a valid template ({e}); write a literal brace as {{{{ or }}}}") from e
    for name, spec, conv in fields:
        if name not in PLACEHOLDERS or spec or conv:
            raise ConfigError(f"{key} has the placeholder {{{name}{'!' + conv if conv else ''}"
                              f"{':' + spec if spec else ''}}}; expected only "
                              f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)} (a literal brace is {{{{ or }}}})")
    names = [name for name, _, _ in fields]
    if "response" not in names:
        raise ConfigError(f"{key} has no {{response}} placeholder: the judge would never see the response it "
                          "scores (placeholders: {response}, {prompt}, {ground_truth})")
    return names


def load_template(cfg: JudgeConfig, require_file: bool = True) -> Optional[str]:
    """The judge's template from ``template`` or ``template_file`` (exactly one), checked. None only
    when the file is not on this machine and ``require_file`` is false (a spec for another machine)."""
    if (cfg.template is None) == (cfg.template_file is None):
        raise ConfigError("reward.judge: give the judge's prompt as reward.judge.template (inline) or "
                          "reward.judge.template_file (a file), exactly one of them"
                          + (" (both are set)" if cfg.template is not None else " (neither is set)"))
    if cfg.template is not None:
        template = cfg.template
    elif not os.path.isfile(cfg.template_file):
        if require_file:
            raise ConfigError(f"reward.judge.template_file={cfg.template_file} not found "
                              f"(relative to {os.getcwd()})")
        return None
    else:
        with open(cfg.template_file, encoding="utf-8") as f:
            template = f.read()
    template_fields(template, _template_key(cfg))
    return template


def prompt_text(item: PromptItem) -> str:
    """``{prompt}``: the contents of the prompt's user messages, joined by newlines."""
    return "\n".join(m["content"] for m in item.messages if m["role"] == "user")


def render(template: str, item: PromptItem, response: str) -> str:
    """The judge's prompt text for one response to ``item``."""
    return template.format(prompt=prompt_text(item), response=response, ground_truth=item.ground_truth)


# ---------------------------------------------------------------------------------- validation
def validate_judge(cfg: JobConfig, device: str, require_files: bool, role_pools: dict[str, str]) -> Optional[RolloutLayout]:
    """``reward.judge`` checked before start-up (``role_pools``: the other roles' pools, by role);
    the judge pool's layout, or None when there is no judge."""
    j = cfg.reward.judge
    if j.model_path is None:
        for key in ("template", "template_file"):
            if getattr(j, key) is not None:
                raise ConfigError(f"reward.judge.{key} is set but reward.judge.model_path is not: "
                                  "name the judge model's folder (or drop the judge's keys)")
        return None
    if j.parser not in PARSERS:
        raise ConfigError(f"reward.judge.parser={j.parser!r} is not one of: {', '.join(PARSERS)}")
    positive = {"engines": j.engines, "tp": j.tp, "max_tokens": j.max_tokens, "kv_cache_gb": j.kv_cache_gb}
    if j.max_model_len is not None:
        positive["max_model_len"] = j.max_model_len
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"reward.judge.{key}={value} must be positive")
    if not (j.temperature >= 0 and math.isfinite(j.temperature)):
        raise ConfigError(f"reward.judge.temperature={j.temperature} must not be negative (0: greedy)")
    if not 0 < j.gpu_memory_utilization <= 1:
        raise ConfigError(f"reward.judge.gpu_memory_utilization={j.gpu_memory_utilization} must be in (0, 1]")
    if j.parser == "number" and not j.score_min < j.score_max:
        raise ConfigError(f"reward.judge.score_min={j.score_min} must be below reward.judge.score_max="
                          f"{j.score_max} (the judge's scale, mapped onto [0, 1])")
    load_template(j, require_files)
    layout = _judge_pool(cfg, role_pools)
    if require_files or os.path.isdir(j.model_path):
        _check_judge_model(cfg, device)
    return layout


def _judge_pool(cfg: JobConfig, role_pools: dict[str, str]) -> RolloutLayout:
    j, pools = cfg.reward.judge, cfg.resources.pools
    if j.pool not in pools:
        raise ConfigError(f"reward.judge.pool={j.pool!r} is not a pool in resources.pools (pools: {', '.join(pools)})")
    for role, pool in role_pools.items():
        if pool == j.pool:
            raise ConfigError(f"reward.judge.pool and {role}.pool are both {pool!r}: the judge's engines need a "
                              "pool of their own (add one to resources.pools)")
    if j.engines * j.tp != pools[j.pool]:
        raise ConfigError(f"reward.judge.engines*reward.judge.tp={j.engines}*{j.tp}={j.engines * j.tp} does not "
                          f"equal the {pools[j.pool]} GPUs of pool {j.pool!r} (resources.pools.{j.pool}={pools[j.pool]})")
    return RolloutLayout(pool=j.pool, gpus=pools[j.pool], engines=j.engines, tp=j.tp)


def _check_judge_model(cfg: JobConfig, device: str) -> None:
    j = cfg.reward.judge
    model = read_hf_config(j.model_path, key="reward.judge.model_path")
    if not any(name.endswith(".safetensors") for name in os.listdir(j.model_path)):
        raise ConfigError(f"reward.judge.model_path={j.model_path} has no *.safetensors weights")
    check_rollout_split(model, j.tp, device, key="reward.judge.tp")
    if j.apply_chat_template and not _has_chat_template(j.model_path):
        raise ConfigError(f"reward.judge.model_path={j.model_path} has no chat template (no chat_template.jinja, "
                          "no chat_template in tokenizer_config.json); add one or set "
                          "reward.judge.apply_chat_template=false")
    context = j.max_model_len or model.max_position_embeddings
    if context > model.max_position_embeddings:
        raise ConfigError(f"reward.judge.max_model_len={j.max_model_len} exceeds the judge's "
                          f"max_position_embeddings={model.max_position_embeddings} ({model.source})")
    if j.max_tokens >= context:
        raise ConfigError(f"reward.judge.max_tokens={j.max_tokens} leaves no room for the judge's prompt in its "
                          f"context of {context} tokens (reward.judge.max_model_len, default the judge's "
                          "max_position_embeddings)")


def _has_chat_template(path: str) -> bool:
    import json

    if os.path.isfile(os.path.join(path, "chat_template.jinja")):
        return True
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config):
        return False
    with open(config, encoding="utf-8") as f:
        return bool(json.load(f).get("chat_template"))


def judge_rollout_config(cfg: JobConfig) -> RolloutConfig:
    """The judge pool's engine settings (``rollout.RolloutPool`` reads a ``RolloutConfig``): the
    judge's pool, engines, tp and memory; the rollout's timeout for one engine call."""
    j = cfg.reward.judge
    return RolloutConfig(pool=j.pool, engines=j.engines, tp=j.tp, kv_cache_gb=j.kv_cache_gb,
                         gpu_memory_utilization=j.gpu_memory_utilization, enforce_eager=cfg.rollout.enforce_eager,
                         engine_timeout_s=cfg.rollout.engine_timeout_s, seed=cfg.rollout.seed)


# --------------------------------------------------------------------------------- the source
class JudgeSource:
    """The ``judge`` reward source (rlcore/reward_sources.py's ``RewardSource``)."""

    name = "judge"

    def __init__(self, cfg: JudgeConfig, generator: Generator, tokenizer, template: str, max_model_len: int):
        self.cfg, self.generator, self.tokenizer, self.template = cfg, generator, tokenizer, template
        self.max_model_len = max_model_len
        self.uses_prompt = "prompt" in template_fields(template, "reward.judge.template")

    @classmethod
    def load(cls, cfg: JobConfig, generator: Generator) -> "JudgeSource":
        """The job's judge on ``generator`` (the judge pool), with the judge model's own tokenizer."""
        from transformers import AutoTokenizer

        j = cfg.reward.judge
        model = read_hf_config(j.model_path, key="reward.judge.model_path")
        return cls(j, generator, AutoTokenizer.from_pretrained(j.model_path), load_template(j),
                   j.max_model_len or model.max_position_embeddings)

    def prompt_ids(self, items: list[PromptItem], texts: list[str]) -> list[list[int]]:
        """The judge's prompt for each (prompt, response), in the judge's tokens."""
        out = []
        for item, text in zip(items, texts):
            if self.uses_prompt and not any(m["role"] == "user" for m in item.messages):
                raise RewardError(f"reward.judge: dataset row {item.index} has no user message to fill the "
                                  "template's {prompt}")
            rendered = render(self.template, item, text)
            if self.cfg.apply_chat_template:
                ids = _chat_ids(self.tokenizer, [{"role": "user", "content": rendered}])
            else:
                ids = list(self.tokenizer.encode(rendered, add_special_tokens=False))
            if len(ids) + self.cfg.max_tokens > self.max_model_len:
                raise RewardError(f"reward.judge: the judge's prompt for a response to dataset row {item.index} is "
                                  f"{len(ids)} tokens, which with reward.judge.max_tokens={self.cfg.max_tokens} exceeds "
                                  f"the judge's context of {self.max_model_len} (reward.judge.max_model_len, default "
                                  "the judge's max_position_embeddings)")
            out.append(ids)
        return out

    def verdicts(self, items: list[PromptItem], texts: list[str]) -> list[str]:
        """The judge's output for each response, decoded with the judge's tokenizer."""
        ids = self.prompt_ids(items, texts)
        # Sampling (temperature > 0) is seeded by the batch's judge prompts: a resumed run's verdicts repeat.
        seed = zlib.crc32(repr(ids).encode()) if self.cfg.temperature > 0 else None
        out = self.generator.generate(ids, n=1, temperature=self.cfg.temperature, top_p=1.0, top_k=-1,
                                      max_tokens=self.cfg.max_tokens, seed=seed)
        return [self.tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in out]

    def score(self, prompts: list[PromptItem], trajs, texts: list[str]):
        """One score per trajectory (``prompts[traj.prompt_index]`` is its prompt): the parser's reading
        of the judge's verdict, 0 where it reads none; a ``SourceScores``."""
        from rlcore.reward_sources import SourceScores  # here: reward_sources imports this module to register it
        items = [prompts[t.prompt_index] for t in trajs]
        read = [verdict_score(self.cfg, v) for v in self.verdicts(items, texts)]
        unparsed = sum(r is None for r in read)
        return SourceScores(sequence=torch.tensor([0.0 if r is None else r for r in read], dtype=torch.float32),
                            metrics={UNPARSED_METRIC: unparsed / len(read) if read else 0.0})
