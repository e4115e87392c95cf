"""The numeric verifier, loading reward functions from a spec, and scoring a batch with clear errors."""
import math

import pytest
import torch

from rlcore.data import PromptItem
from rlcore.reward import RewardError, compute_rewards, extract_final_answer, load_reward_fn, numeric_verifier


# ---------------------------------------------------------------------------- numeric verifier
@pytest.mark.parametrize("response, ground_truth, expected", [
    ("so the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{41} wait, no: \\boxed{42}", "42", 1.0),  # the last \boxed wins
    ("\\boxed{42} and then 7 more words 9", "42", 1.0),  # a \boxed beats later numbers
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),  # LaTeX fraction, nested braces
    ("\\boxed{x = -5}", "-5", 1.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("#### 1,000 dollars, 3 times", "1000", 1.0),  # the number right after the last ####
    ("First 3, then 5, finally 12", "12", 1.0),  # no marker: the last number
    ("it costs $1,234.50 in total", "1234.5", 1.0),
    ("the ratio is 3/4", "0.75", 1.0),
    ("the result is -3.", "-3", 1.0),
    ("10-3 leaves 7", "7", 1.0),
    ("answer: 72", "72.0000000001", 1.0),  # within 1e-6 relative
    ("answer: 72", "72.001", 0.0),  # outside it
    ("the answer is 71", "72", 0.0),
    ("I do not know", "72", 0.0),
    ("\\boxed{}", "0", 0.0),
    ("answer 1000", "1,000", 1.0),  # the ground truth is parsed the same way
])
def test_numeric_verifier(response, ground_truth, expected):
    assert numeric_verifier("gsm8k", response, ground_truth, {}) == expected


def test_extract_final_answer_returns_none_without_a_number():
    assert extract_final_answer("#### none here") is None
    assert extract_final_answer("plain words") is None


def test_numeric_verifier_rejects_a_ground_truth_that_is_not_a_number():
    with pytest.raises(ValueError, match="not a single number"):
        numeric_verifier("toy", "42", "forty-two")


# ----------------------------------------------------------------------------------- loading
def test_load_builtin_numeric():
    assert load_reward_fn("numeric") is numeric_verifier


def test_load_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text("def length_score(ds, sol, gt, extra=None):\n"
                                                "    return float(len(sol))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("my_rewards_mod:length_score")
    assert fn("toy", "abc", "0", {}) == 3.0


def test_load_function_from_file(tmp_path):
    path = tmp_path / "reward_file.py"
    path.write_text("def exact(ds, sol, gt, extra=None):\n    return sol.strip() == gt\n")
    fn = load_reward_fn(f"{path}:exact")
    assert fn("toy", " 7 ", "7", {}) is True


@pytest.mark.parametrize("spec, expected", [
    ("numeric_v2", "expected one of 'numeric', 'package.module:function' or 'path/to/file.py:function'"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("rlcore.reward:no_such_fn", "module 'rlcore.reward' has no attribute 'no_such_fn'"),
    ("rlcore.reward:BUILTIN_REWARDS", "'BUILTIN_REWARDS' in 'rlcore.reward' is not callable (it is a dict)"),
    ("missing_dir/rewards.py:fn", "file 'missing_dir/rewards.py' not found"),
])
def test_load_errors_name_the_key_spec_and_cause(spec, expected):
    with pytest.raises(RewardError) as info:
        load_reward_fn(spec)
    assert f"reward.function={spec!r}: " in str(info.value)
    assert expected in str(info.value)


def test_load_error_from_a_file_that_raises_on_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(RewardError, match="loading .*broken.py.* failed: RuntimeError: boom at import"):
        load_reward_fn(f"{path}:fn")


# ----------------------------------------------------------------------------------- scoring
def items(*ground_truths, data_source="toy"):
    return [PromptItem(index=10 + i, prompt_ids=[1], ground_truth=gt, data_source=data_source,
                       extra_info={"i": i}) for i, gt in enumerate(ground_truths)]


def test_compute_rewards_with_the_numeric_verifier():
    scores, metrics = compute_rewards(numeric_verifier, items("1", "2", "3", "4"),
                                      ["#### 1", "\\boxed{5}", "it is 3", "none"])
    assert scores.dtype == torch.float32
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics == {"reward/mean": 0.5}


def test_compute_rewards_accepts_bools_ints_and_dicts_and_averages_extras():
    returns = iter([True, 0, {"score": 0.5, "acc": 1.0, "format": True, "pred": "42"},
                    {"score": 1, "acc": 0.0}])

    def fn(data_source, solution_str, ground_truth, extra_info):
        return next(returns)

    scores, metrics = compute_rewards(fn, items("a", "b", "c", "d"), ["", "", "", ""])
    assert scores.tolist() == [1.0, 0.0, 0.5, 1.0]
    # Extras are averaged over the rows that report them; non-numeric extras ("pred") are not metrics.
    assert metrics == {"reward/mean": 0.625, "reward/acc": 0.5, "reward/format": 1.0}


def test_compute_rewards_passes_the_item_fields():
    seen = []

    def fn(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 0.0

    compute_rewards(fn, items("7", data_source="gsm8k"), ["resp"])
    assert seen == [("gsm8k", "resp", "7", {"i": 0})]


def test_a_raising_reward_function_names_row_source_spec_and_chains_the_cause():
    def fn(data_source, solution_str, ground_truth, extra_info):
        if ground_truth == "bad":
            raise KeyError("answer")
        return 1.0

    with pytest.raises(RewardError) as info:
        compute_rewards(fn, items("ok", "bad", data_source="math"), ["x", "y"], spec="my_mod:fn")
    message = str(info.value)
    assert "'my_mod:fn'" in message and "dataset row 11" in message and "data_source='math'" in message
    assert "raised KeyError: 'answer'" in message
    assert isinstance(info.value.__cause__, KeyError)


def test_the_default_spec_is_the_functions_module_and_name():
    def grader(data_source, solution_str, ground_truth, extra_info):
        raise ValueError("nope")

    with pytest.raises(RewardError, match="test_reward:.*grader"):
        compute_rewards(grader, items("1"), ["x"])
    with pytest.raises(RewardError, match="reward function 'numeric'.*not a single number"):
        compute_rewards(numeric_verifier, items("forty"), ["40"])


@pytest.mark.parametrize("bad, expected", [
    (math.nan, "returned nan"),
    (math.inf, "returned inf"),
    ("1.0", "returned '1.0'"),
    (None, "returned None"),
    ({"score": math.nan}, "returned nan"),
    ({"acc": 1.0}, "without a 'score' key"),
    ({"score": 1.0, "mean": 0.3}, "'mean', which is reserved"),
])
def test_a_bad_return_value_names_the_row(bad, expected):
    def fn(data_source, solution_str, ground_truth, extra_info):
        return bad if ground_truth == "2" else 1.0

    with pytest.raises(RewardError) as info:
        compute_rewards(fn, items("1", "2"), ["a", "b"])
    assert "dataset row 11" in str(info.value)
    assert expected in str(info.value)


def test_compute_rewards_needs_one_response_per_item():
    with pytest.raises(ValueError, match="2 items but 1 responses"):
        compute_rewards(numeric_verifier, items("1", "2"), ["1"])
