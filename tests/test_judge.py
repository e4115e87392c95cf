"""The LLM judge (reward.judge, rlcore/judge.py): the score parsers, the template and pool checks of
`rlx validate`, and one judge engine (vLLM, a tiny Qwen2 built here) scoring trajectories: the scores
are the parser's reading of the judge's actual outputs and judge_unparsed counts what it could not read."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.config import JudgeConfig, RolloutConfig
from rlcore.job import ConfigError, load_job
from rlcore.judge import UNPARSED_METRIC, JudgeSource, parse_number, parse_yes_no, verdict_score
from rlcore.layout import RolloutLayout
from rlcore.reward import RewardError
from rlcore.validate import validate

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = "{prompt}{response}="  # the tiny tokenizer knows digits, + and = only


# ------------------------------------------------------------------------------------ parsers
@pytest.mark.parametrize("text, expected", [
    ("Score: 7", 7.0),
    ("I'd say 3, no, 8", 8.0),  # the last number
    ("3/4", 0.75),  # a fraction is one number
    ("\\frac{1}{2}", 0.5),
    ("-2", -2.0),
    ("The score is 1,000.", 1000.0),
    ("\\boxed{6} out of 10", 6.0),  # the last \boxed wins over later numbers
    ("2.5 points", 2.5),
    ("no number here", None),
    ("", None),
])
def test_number_parser_reads_the_final_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("7", 0.7), ("0", 0.0), ("10", 1.0),
    ("15", 1.0), ("-3", 0.0),  # out of the range: clamped
    ("7/10", 0.07),  # a fraction is its value (0.7) on the judge's 0..10 scale
    ("Score: 2.5", 0.25),
    ("none", None),
])
def test_number_scores_are_scaled_from_the_range_and_clamped(text, expected):
    score = verdict_score(JudgeConfig(parser="number", score_min=0, score_max=10), text)
    assert score == (None if expected is None else pytest.approx(expected))


def test_number_range_may_start_above_zero():
    cfg = JudgeConfig(parser="number", score_min=1, score_max=5)
    assert [verdict_score(cfg, t) for t in ("1", "3", "5", "0")] == [0.0, 0.5, 1.0, 0.0]


@pytest.mark.parametrize("text, expected", [
    ("Yes", 1.0), ("yes.", 1.0), ("YES, it is right", 1.0), ("Answer: yes", 1.0),
    ("No", 0.0), ("no!", 0.0), ("NO - wrong", 0.0),
    ("Yes/No: no", 1.0),  # the first yes/no word
    ("No, yes", 0.0),
    ("I know it is not right", None),  # whole words only: know, not
    ("nope", None), ("yeah", None), ("maybe", None), ("", None), ("7", None),
])
def test_yes_no_parser_reads_the_first_yes_or_no_word(text, expected):
    assert parse_yes_no(text) == expected
    assert verdict_score(JudgeConfig(parser="yes_no"), text) == expected


# ---------------------------------------------------------------------------------- validation
def judge_job(assets, *overrides):
    model, data = assets
    return load_job(None, [f"model.path={model}", f"data.train_files=[{data}]", "resources.device=cpu",
                           "resources.pools={actor: 1, rollout: 1, judge: 1}", "actor.tp=1",
                           "data.batch_size=4", "rollout.n=4", "data.max_prompt_length=16",
                           "rollout.max_response_length=1", f"reward.judge.model_path={model}",
                           f"reward.judge.template='{TEMPLATE}'", *overrides])


def judge_error(assets, *overrides) -> str:
    with pytest.raises(ConfigError) as info:
        validate(judge_job(assets, *overrides))
    return str(info.value)


def test_a_valid_judge_gets_its_own_pool(tiny_assets):
    layout = validate(judge_job(tiny_assets))
    assert layout.judge == RolloutLayout(pool="judge", gpus=1, engines=1, tp=1)
    assert validate(judge_job(tiny_assets, "reward.judge.model_path=null", "reward.judge.template=null")).judge is None


def test_a_template_without_the_response_placeholder_is_refused(tiny_assets, tmp_path):
    message = judge_error(tiny_assets, "reward.judge.template='Is {prompt} right?'")
    assert "reward.judge.template" in message and "{response}" in message
    template_file = tmp_path / "judge.txt"
    template_file.write_text("Question: {prompt}\nTruth: {ground_truth}\n")
    message = judge_error(tiny_assets, "reward.judge.template=null", f"reward.judge.template_file={template_file}")
    assert f"reward.judge.template_file={template_file}" in message and "{response}" in message


@pytest.mark.parametrize("overrides, parts", [
    (["reward.judge.template='{answer} {response}'"], ["reward.judge.template", "{answer}", "{prompt}"]),
    (["reward.judge.template='{response:>5}'"], ["reward.judge.template", "{response:>5}"]),
    (["reward.judge.template='{response'"], ["reward.judge.template", "not a valid template", "{{"]),
    (["reward.judge.template=null"], ["reward.judge.template_file", "neither"]),
    (["reward.judge.template_file=/nowhere/judge.txt"], ["reward.judge.template_file", "both"]),
    (["reward.judge.template=null", "reward.judge.template_file=/nowhere/judge.txt"],
     ["reward.judge.template_file=/nowhere/judge.txt", "not found"]),
    (["reward.judge.model_path=null"], ["reward.judge.template", "reward.judge.model_path"]),
    (["reward.judge.parser=likert"], ["reward.judge.parser='likert'", "number, yes_no"]),
    (["reward.judge.score_min=5", "reward.judge.score_max=5"], ["reward.judge.score_min=5", "score_max"]),
    (["reward.judge.max_tokens=0"], ["reward.judge.max_tokens=0", "positive"]),
    (["reward.judge.temperature=-1"], ["reward.judge.temperature=-1"]),
    (["reward.judge.pool=nowhere"], ["reward.judge.pool='nowhere'", "resources.pools"]),
    (["reward.judge.pool=rollout"], ["reward.judge.pool", "rollout.pool", "'rollout'"]),
    (["reward.judge.engines=2"], ["reward.judge.engines*reward.judge.tp=2*1=2", "resources.pools.judge=1"]),
    (["resources.pools={actor: 1, rollout: 1, judge: 3}", "reward.judge.engines=1", "reward.judge.tp=3"],
     ["reward.judge.tp=3", "attention heads"]),
    (["reward.judge.max_model_len=4096"], ["reward.judge.max_model_len=4096", "max_position_embeddings=64"]),
    (["reward.judge.max_tokens=64"], ["reward.judge.max_tokens=64", "no room"]),
])
def test_bad_judge_keys_are_one_sentence_naming_the_key(tiny_assets, overrides, parts):
    message = judge_error(tiny_assets, *overrides)
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


def test_a_judge_without_a_chat_template_is_refused_unless_told(tiny_assets, tmp_path):
    bare = tmp_path / "bare-judge"
    shutil.copytree(tiny_assets[0], bare)
    (bare / "chat_template.jinja").unlink()
    message = judge_error(tiny_assets, f"reward.judge.model_path={bare}")
    assert f"reward.judge.model_path={bare}" in message and "reward.judge.apply_chat_template=false" in message
    assert validate(judge_job(tiny_assets, f"reward.judge.model_path={bare}",
                              "reward.judge.apply_chat_template=false")).judge is not None


def test_rlx_validate_names_the_template_without_the_response(tiny_assets):
    model, data = tiny_assets
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "validate", "yaml_configs/quickstart_cpu.yaml", f"model.path={model}",
         f"data.train_files=[{data}]", f"data.val_files=[{data}]", "resources.pools={actor: 2, rollout: 1, judge: 1}",
         f"reward.judge.model_path={model}", "reward.judge.template='Rate: {prompt}'"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlx validate: reward.judge.template has no {response}"), lines


# ------------------------------------------------------------------------ a real judge engine
@pytest.fixture(scope="module")
def judge_pool(tmp_path_factory, ray_pools):
    """One vLLM engine of a tiny random Qwen2 (the judge), on a pool of its own."""
    from launch.assets import make_tiny_model
    from rollout import RolloutPool

    model = make_tiny_model(str(tmp_path_factory.mktemp("judge") / "qwen2"), seed=3)
    pools = ray_pools({"judge": 1}, {"judge": "judge"})
    pool = RolloutPool(model, RolloutConfig(pool="judge", kv_cache_gb=0.1), pools.placement("judge"), "cpu",
                       "float32", seed=0, name="judge")
    yield model, pool
    pool.shutdown()


def policy_samples(model, data, responses):
    """The tiny task's first prompts, ``len(responses) // 2`` of them with two responses each."""
    from transformers import AutoTokenizer

    from rlcore.batch import Trajectory
    from rlcore.data import PromptDataset

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset([data], tokenizer, max_prompt_length=16).items[:len(responses) // 2]
    trajs = [Trajectory(prompt_index=i // 2, prompt_ids=prompts[i // 2].prompt_ids,
                        response_ids=tokenizer.encode(r, add_special_tokens=False), response_logprobs=[0.0] * len(r),
                        finish_reason="stop", weight_version=0) for i, r in enumerate(responses)]
    return prompts, trajs, [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajs]


@pytest.mark.e2e
def test_a_judge_engine_scores_responses_by_the_parsers_reading_of_its_outputs(judge_pool, tiny_assets):
    from transformers import AutoTokenizer

    model, pool = judge_pool
    _, data = tiny_assets
    responses = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "="] * 2
    prompts, trajs, texts = policy_samples(model, data, responses)

    def source(*overrides):
        cfg = load_job(None, [f"model.path={model}", f"reward.judge.model_path={model}",
                              f"reward.judge.template='{TEMPLATE}'", "reward.judge.max_tokens=2",
                              "reward.judge.score_max=9", *overrides])
        return JudgeSource.load(cfg, pool)

    number = source("reward.judge.parser=number")
    scored = number.score(prompts, trajs, texts)

    # The judge's prompts built here by hand: the prompt's text and the response in the template, as
    # one user message of the JUDGE's chat template; its greedy outputs decoded by the judge's tokenizer.
    judge_tok = AutoTokenizer.from_pretrained(model)
    by_hand = [judge_tok.apply_chat_template([{"role": "user", "content": f"{p}{r}="}], add_generation_prompt=True,
                                             tokenize=False)
               for p, r in zip([f"{x['a']}+{x['b']}=" for x in (prompts[t.prompt_index].extra_info for t in trajs)],
                               texts)]
    ids = [judge_tok.encode(text, add_special_tokens=False) for text in by_hand]
    assert ids == number.prompt_ids([prompts[t.prompt_index] for t in trajs], texts)
    outputs = [judge_tok.decode(t.response_ids, skip_special_tokens=True)
               for t in pool.generate(ids, n=1, temperature=0.0, max_tokens=2)]
    read = [parse_number(o) for o in outputs]
    expected = [0.0 if x is None else min(1.0, max(0.0, x / 9)) for x in read]
    assert scored.sequence.tolist() == pytest.approx(expected)
    assert scored.sequence.shape == (len(trajs),) and scored.token is None
    unread = sum(x is None for x in read)
    assert scored.metrics == {UNPARSED_METRIC: unread / len(trajs)}
    assert 0 < unread < len(trajs), f"this judge's outputs {outputs} should hold both cases"

    # The same verdicts read as yes/no: a judge whose vocabulary has no words never says yes or no.
    yes_no = source("reward.judge.parser=yes_no").score(prompts, trajs, texts)
    assert yes_no.sequence.tolist() == [0.0] * len(trajs) and yes_no.metrics == {UNPARSED_METRIC: 1.0}

    # Sampled verdicts (temperature > 0) are seeded by the judge prompts: the same batch, the same verdicts.
    sampled = source("reward.judge.temperature=1.0")
    items = [prompts[t.prompt_index] for t in trajs]
    assert sampled.verdicts(items, texts) == sampled.verdicts(items, texts)

    # A judge prompt that cannot fit the judge's context is a sentence naming the key, not a crash in vLLM.
    with pytest.raises(RewardError, match=r"reward\.judge\.max_tokens=2 exceeds the judge's context of 8"):
        source("reward.judge.max_model_len=8").score(prompts, trajs, texts)
