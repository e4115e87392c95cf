"""Reward functions: the built-in numeric verifier, loading a user function, scoring a batch.

A reward function has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info)`` and
returns a number (float/int/bool) or a dict with a ``"score"`` key; the dict's other numeric entries are
averaged into the step's metrics as ``reward/<key>``.

This module does not import ``rlcore.validate`` (which imports it to validate ``reward.function``): its
errors are ``RewardError`` and the validator turns a bad spec into a ``ConfigError``.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
import re
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

RewardFn = Callable[..., Any]


class RewardError(Exception):
    """A reward function that cannot be loaded, raised, or returned something that is not a score."""


# -------------------------------------------------------------------------------- numeric verifier
# A number: optional sign, digits with proper thousands commas (1,000) or plain digits, optional
# decimals, optionally "/ denominator" (3/4). The comma branch comes first so 1,000 is one number.
# A sign counts only when it does not follow a word or a closing bracket ("10-3" is 10 and 3).
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)}\]])[-+])?"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?(?!\d)|\.\d+)"
)
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
                j += 1
        # An unclosed or brace-less \boxed: look at the one before it.
        start = text.rfind("\\boxed", 0, start)
    return None


def _to_float(token: str) -> Optional[float]:
    token = token.replace(",", "").replace(" ", "")
    if "/" in token:
        num, den = token.split("/", 1)
        den_value = float(den)
        if den_value == 0:
            return None
        return float(num) / den_value
    return float(token)


def _numbers(text: str) -> list[float]:
    """Every number in ``text`` in order (LaTeX fractions and unicode minus normalised)."""
    text = text.replace("\u2212", "-").replace("\\!", "").replace("$", "")
    text = _LATEX_FRAC_RE.sub(r"\1/\2", text)
    values = []
    for match in _NUMBER_RE.finditer(text):
        value = _to_float(match.group(0))
        if value is not None:
            values.append(value)
    return values


def extract_final_answer(text: str) -> Optional[float]:
    """The response's final answer as a number, or None when it has none.

    The last ``\\boxed{...}`` wins (its last number, so ``\\boxed{x = 5}`` is 5); else the first number
    after the last ``####`` (GSM8K's format); else the last number anywhere in the text."""
    boxed = _last_boxed(text)
    if boxed is not None:
        found = _numbers(boxed)
        return found[-1] if found else None
    marker = text.rfind("####")
    if marker != -1:
        found = _numbers(text[marker + 4:])
        return found[0] if found else None
    found = _numbers(text)
    return found[-1] if found else None


def numeric_verifier(data_source: str, solution_str: str, ground_truth: str,
                     extra_info: Optional[dict] = None) -> float:
    """1.0 when the response's final answer equals ``ground_truth`` numerically (relative tolerance
    1e-6), else 0.0. A ground truth that is not a number is a data error, not a wrong answer."""
    expected = _numbers(str(ground_truth))
    if len(expected) != 1:
        raise ValueError(f"ground_truth {ground_truth!r} is not a single number")
    answer = extract_final_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if math.isclose(answer, expected[0], rel_tol=1e-6) else 0.0


# ------------------------------------------------------------------------------------------ loading
BUILTIN_REWARDS: dict[str, RewardFn] = {"numeric": numeric_verifier}


def _spec_error(spec: str, cause: str) -> RewardError:
    return RewardError(f"reward.function={spec!r}: {cause}")


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve ``reward.function``: a built-in name ("numeric"), "package.module:function", or
    "path/to/file.py:function" (a path relative to the working directory)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise _spec_error(spec, f"expected one of {', '.join(map(repr, BUILTIN_REWARDS))}, "
                                "'package.module:function' or 'path/to/file.py:function'")
    if module_part.endswith(".py"):
        module = _load_module_from_file(spec, module_part)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise _spec_error(spec, f"cannot import module {module_part!r} ({e})") from e
        except Exception as e:  # the module itself raised while importing
            raise _spec_error(spec, f"importing module {module_part!r} failed: "
                                    f"{type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        raise _spec_error(spec, f"module {module_part!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise _spec_error(spec, f"{attr!r} in {module_part!r} is not callable "
                                f"(it is a {type(fn).__name__})")
    return fn


def _load_module_from_file(spec: str, path: str):
    if not os.path.isfile(path):
        raise _spec_error(spec, f"file {path!r} not found (relative to {os.getcwd()})")
    # A stable, unique module name per file so pickling and tracebacks name the user's file.
    name = "rlx_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise _spec_error(spec, f"cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise _spec_error(spec, f"loading {path!r} failed: {type(e).__name__}: {e}") from e
    return module


def describe_reward_fn(fn: RewardFn) -> str:
    """A readable name for error messages: the built-in's name or ``module:qualname``."""
    for name, builtin in BUILTIN_REWARDS.items():
        if fn is builtin:
            return name
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"


# ------------------------------------------------------------------------------------------ scoring
def _as_number(value: Any) -> Optional[float]:
    """``value`` as a float when it is a real number (bool, int, float, numpy or 0-d tensor)."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    return None


def compute_rewards(fn: RewardFn, items: Sequence[Any], responses: Sequence[str],
                    spec: Optional[str] = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Score every (item, response) pair: returns the scores [N] float32 and the batch's reward metrics
    (``reward/mean`` and the average of each extra numeric dict entry as ``reward/<key>``).

    ``items`` carry ``index``, ``data_source``, ``ground_truth`` and ``extra_info`` (``PromptItem``);
    ``spec`` names the function in errors (default: its module and name)."""
    if len(items) != len(responses):
        raise ValueError(f"{len(items)} items but {len(responses)} responses")
    name = spec or describe_reward_fn(fn)
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    for item, response in zip(items, responses):
        where = f"reward function {name!r} on dataset row {item.index} (data_source={item.data_source!r})"
        try:
            result = fn(item.data_source, response, item.ground_truth, item.extra_info)
        except Exception as e:
            raise RewardError(f"{where} raised {type(e).__name__}: {e}") from e
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardError(f"{where} returned a dict without a 'score' key "
                                  f"(keys: {sorted(map(str, result))})")
            score = _as_number(result["score"])
            for key, value in result.items():
                if key == "score":
                    continue
                if key == "mean":
                    raise RewardError(f"{where} returned the key 'mean', which is reserved for "
                                      "reward/mean (the average score)")
                number = _as_number(value)
                if number is not None and math.isfinite(number):  # non-numeric extras are not metrics
                    extras.setdefault(str(key), []).append(number)
        else:
            score = _as_number(result)
        if score is None or not math.isfinite(score):
            shown = result["score"] if isinstance(result, dict) else result
            raise RewardError(f"{where} returned {shown!r}; expected a finite number "
                              "(or a dict with a finite 'score')")
        scores.append(score)
    scores_tensor = torch.tensor(scores, dtype=torch.float32)
    metrics = {"reward/mean": float(scores_tensor.mean())} if scores else {}
    metrics.update({f"reward/{key}": sum(v) / len(v) for key, v in extras.items()})
    return scores_tensor, metrics
