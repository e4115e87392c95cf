"""Reward models in the RL loop: the score head (megatron_workers/score_head.py) against transformers'
own *ForSequenceClassification, and the reward sources (rlcore/reward_sources.py).

The reward model is the tiny Qwen2 loaded as ``Qwen2ForSequenceClassification`` (one label, a pad id)
with a seeded random ``score`` layer, saved as an HF SeqCls checkpoint in the test's own folder.
"""
from __future__ import annotations

import functools
import json
import math
import os

import pytest
import torch

from launch.assets import make_tiny_model
from rlcore.batch import Batch
from rlcore.roles import RoleSpec
from tests.batches import right_padded_rows

TOL = 1e-5
BATCH, SEQ, MICRO_BATCH = 6, 18, 2


def make_seqcls_checkpoint(out_dir: str, base_dir: str, seed: int = 0) -> str:
    """``base_dir``'s causal LM as a Qwen2ForSequenceClassification (num_labels 1, the tokenizer's pad
    id), its ``score`` drawn from ``seed``, saved with the base's tokenizer into ``out_dir``."""
    import transformers

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Unit-scale scores (std 1/sqrt(hidden)): 1e-5 is then a float32 tolerance, not a relative one.
        weight = model.score.weight
        weight.copy_(torch.randn(weight.shape, generator=g) * weight.shape[1] ** -0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)  # the policy's tokenizer and chat template
    return out_dir


@pytest.fixture(scope="module")
def seqcls_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    base = make_tiny_model(str(root / "base"), arch="qwen2")
    return make_seqcls_checkpoint(str(root / "rm"), base)


def score_rows(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    input_ids, response_mask = right_padded_rows(g, BATCH, SEQ, vocab=16, min_response=1)
    return Batch(input_ids=input_ids, attention_mask=(input_ids != 0).long())


@functools.lru_cache(maxsize=4)
def transformers_seqcls(path: str):
    import transformers

    return transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


def transformers_scores(path: str, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(SeqCls logits [B] (the last non-pad token's), the score at every position [B, S])."""
    model = transformers_seqcls(path)
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.score.bias is None
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits[:, 0]
        hidden = model.model(batch["input_ids"]).last_hidden_state
        every = model.score(hidden)[..., 0]
    return logits, every


@pytest.fixture
def placement(ray_pools):
    """Four logical GPUs for one test, released after it (the end-to-end test's roles need them)."""
    pools = ray_pools({"rm": 4}, {"rm": "rm"})
    yield pools.placement("rm")
    pools.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_score_head_matches_transformers_seqcls(seqcls_path, placement, tp, pp):
    """The score head's [B, S] scores are the SeqCls score at every real position (not shifted), and
    at each row's last attention-mask position they are transformers' SeqCls logits; the export
    gives the checkpoint's tensors back (score.weight, no bias, no lm_head)."""
    from safetensors.torch import load_file

    from megatron_workers.group import MegatronGroup
    from rlcore.reward_sources import last_token_scores

    batch = score_rows()
    group = MegatronGroup(RoleSpec("rm", seqcls_path, tp=tp, pp=pp, dp=1, micro_batch_size=MICRO_BATCH,
                                   profile="cpu", dtype="float32", seed=0, head="score"), placement)
    try:
        scores = group.forward(batch)["scores"]
        exported = group.hf_state_dict() if (tp, pp) == (1, 1) else None
    finally:
        group.shutdown()
    logits, every = transformers_scores(seqcls_path, batch)
    mask = batch["attention_mask"].bool()
    assert scores.shape == (BATCH, SEQ) and scores.dtype == torch.float32
    torch.testing.assert_close(scores[mask], every[mask], atol=TOL, rtol=0)
    torch.testing.assert_close(last_token_scores(scores, batch["attention_mask"]), logits, atol=TOL, rtol=0)
    assert logits.abs().min() > 10 * TOL  # the seeded score layer was loaded, not left near 0
    if exported is not None:
        saved = load_file(os.path.join(seqcls_path, "model.safetensors"))
        assert sorted(exported) == sorted(saved) and "score.weight" in saved and "lm_head.weight" not in saved
        for name, tensor in saved.items():
            torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0, msg=name)


# ------------------------------------------------------------------------- PRM step placement
@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from launch.assets import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


def ids_of(tokenizer, text: str, eos: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])


def test_step_ends_on_uneven_steps(tiny_tokenizer):
    """A two-character separator ends a step at the token that completes it; the response's last token
    (here EOS) ends the last step; a separator with nothing after it starts no new step."""
    from rlcore.reward_sources import step_ends

    tok = tiny_tokenizer
    response = ids_of(tok, "12+=345+=6")  # steps "12+=" | "345+=" | "6</s>": 4, 5 and 2 tokens
    assert step_ends(response, tok, separator="+=") == [3, 8, 10]
    assert step_ends(ids_of(tok, "7+=8+="), tok, separator="+=") == [2, 6]  # trailing separator: one step less
    assert step_ends(ids_of(tok, "789", eos=False), tok, separator="+=") == [2]  # no separator: one step
    assert step_ends([], tok, separator="+=") == []
    plus = tok.convert_tokens_to_ids("+")
    assert step_ends(ids_of(tok, "1+23+4"), tok, separator_token_id=plus) == [1, 4, 6]
    assert step_ends(ids_of(tok, "1+23+"), tok, separator_token_id=plus) == [1, 5]


class PositionScores:
    """A scoring role whose score at (row, position) is 100 * row + position + the row's first token:
    which positions a source reads is then visible in the scores it returns (and padded rows too)."""

    def __init__(self):
        self.batches = []

    def forward(self, batch):
        self.batches.append(batch)
        b, s = batch["input_ids"].shape
        scores = 100.0 * torch.arange(b)[:, None] + torch.arange(s)[None, :] + batch["input_ids"][:, :1]
        return {"scores": scores * batch["attention_mask"]}


def trajectories(tokenizer, prompts: list[str], responses: list[tuple[int, str, bool]]):
    from rlcore.batch import Trajectory
    from rlcore.data import PromptItem

    items = [PromptItem(index=i, prompt_ids=tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                                          add_generation_prompt=True)["input_ids"],
                        ground_truth="0", data_source="t", messages=[{"role": "user", "content": p}])
             for i, p in enumerate(prompts)]
    trajs = [Trajectory(k, items[k].prompt_ids, ids_of(tokenizer, text, eos), [0.0] * len(ids_of(tokenizer, text, eos)),
                        "stop", 0) for k, text, eos in responses]
    texts = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajs]
    return items, trajs, texts


def scoring_model(tokenizer, role, rows_multiple=4, policy_tokenizer=None):
    from rlcore.reward_sources import _ScoringModel

    return _ScoringModel(role, "reward.process.path", tokenizer, policy_tokenizer or tokenizer, rows_multiple, 64)


def test_prm_scores_land_on_each_steps_last_token(tiny_tokenizer):
    """Uneven steps in three responses of two prompts: each step's reward is the role's score at the
    step's last token (prompt offset included), on that response token, 0 elsewhere; the batch reaching
    the role is padded to the rows multiple; min/last/mean give one score per response instead."""
    from rlcore.reward_sources import ProcessRewardSource, placed_token_rewards

    tok = tiny_tokenizer
    items, trajs, texts = trajectories(tok, ["1+2=", "33+4="], [(0, "12+=345+=6", True), (1, "7", True),
                                                                 (1, "8+=90+=", False)])
    role = PositionScores()
    got = ProcessRewardSource(scoring_model(tok, role), "+=", None, "token").score(items, trajs, texts)
    assert role.batches[0]["input_ids"].shape[0] == 4  # 3 rows padded to a multiple of 4
    first = [t.prompt_ids[0] for t in trajs]
    expected_ends = [[3, 8, 10], [1], [2, 6]]
    for i, (tr, ends) in enumerate(zip(trajs, expected_ends)):
        want = torch.zeros(len(tr.response_ids))
        for e in ends:
            want[e] = 100 * i + len(tr.prompt_ids) + e + first[i]
        torch.testing.assert_close(got.token[i], want)
        assert got.sequence[i] == pytest.approx(float(want[ends].mean()))
    assert got.metrics["reward/prm_steps_mean"] == pytest.approx(2.0)

    # On the trainer's batch: right-padded rows, the rewards on those response positions.
    from rlcore.batch import build_batch

    batch = build_batch(trajs, pad_id=0)
    placed = placed_token_rewards(got.token, batch["response_mask"])
    for i, tr in enumerate(trajs):
        p = len(tr.prompt_ids)
        torch.testing.assert_close(placed[i, p:p + len(tr.response_ids)], got.token[i])
        assert placed[i, :p].abs().sum() == 0 and placed[i, p + len(tr.response_ids):].abs().sum() == 0

    for aggregate, pick in (("min", min), ("last", lambda v: v[-1]), ("mean", lambda v: sum(v) / len(v))):
        agg = ProcessRewardSource(scoring_model(tok, PositionScores()), "+=", None, aggregate).score(items, trajs, texts)
        assert agg.token is None
        want = [pick([float(got.token[i][e]) for e in ends]) for i, ends in enumerate(expected_ends)]
        torch.testing.assert_close(agg.sequence, torch.tensor(want))


def test_rm_reads_the_last_token_and_retokenises_with_its_own_chat_template(tiny_tokenizer, tmp_path):
    """Same tokenizer: the policy's ids as they are; another chat template: the prompt's messages and
    the response text through the reward model's template (prompt as user, response as assistant)."""
    from transformers import AutoTokenizer

    from rlcore.reward_sources import RewardModelSource

    tok = tiny_tokenizer
    items, trajs, texts = trajectories(tok, ["1+2="], [(0, "3", True), (0, "45", True)])
    role = PositionScores()
    got = RewardModelSource(scoring_model(tok, role, rows_multiple=1)).score(items, trajs, texts)
    rows = [t.prompt_ids + t.response_ids for t in trajs]
    assert role.batches[0]["input_ids"][1].tolist() == rows[1]
    torch.testing.assert_close(got.sequence, torch.tensor([0 + len(rows[0]) - 1 + rows[0][0],
                                                           100 + len(rows[1]) - 1 + rows[1][0]], dtype=torch.float32))

    tok.save_pretrained(tmp_path / "rm-tok")
    other = AutoTokenizer.from_pretrained(tmp_path / "rm-tok")
    other.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"  # differs from the policy's
    role = PositionScores()
    RewardModelSource(scoring_model(other, role, rows_multiple=1, policy_tokenizer=tok)).score(items, trajs, texts)
    assert role.batches[0]["input_ids"][1][:6].tolist() == other.encode("1+2==45=", add_special_tokens=False)[:6]
    assert role.batches[0]["attention_mask"][1].sum() == len("1+2==45=")


# ------------------------------------------------------------------------------ the combination
class FixedSource:
    def __init__(self, name, sequence, token=None):
        self.name, self.sequence, self.token = name, torch.tensor(sequence), token

    def score(self, prompts, trajs, texts):
        from rlcore.reward_sources import SourceScores

        return SourceScores(self.sequence, self.token, {f"reward/{self.name}_extra": 7.0})


def test_weights_combine_sources_and_batch_normalisation_z_scores_each(tiny_tokenizer):
    from rlcore.reward_sources import RewardCombination, RuleSource

    tok = tiny_tokenizer
    items, trajs, texts = trajectories(tok, ["1+2=", "2+2="], [(0, "3", True), (0, "4", True), (1, "4", True),
                                                               (1, "9", True)])
    items[0].ground_truth, items[1].ground_truth = "3", "4"
    rule = RuleSource(lambda data_source, solution_str, ground_truth, extra_info:
                      {"score": float(solution_str == ground_truth), "acc": 1.0}, "fn")
    rm = FixedSource("rm", [2.0, -1.0, 0.5, 0.5])
    token = [torch.tensor([0.0, 1.0]), torch.tensor([0.0, -1.0]), torch.tensor([0.0, 2.0]), torch.tensor([0.0, 0.0])]
    prm = FixedSource("prm", [1.0, -1.0, 2.0, 0.0], token)
    got = RewardCombination([rule, rm, prm], {"rule": 0.7, "rm": 0.3, "prm": 0.5}).score(items, trajs, texts)
    torch.testing.assert_close(got.sequence, 0.7 * torch.tensor([1.0, 0.0, 1.0, 0.0]) + 0.3 * rm.sequence)
    for mine, theirs in zip(got.token, token):
        torch.testing.assert_close(mine, 0.5 * theirs)
    assert got.metrics["reward/rule_mean"] == 0.5 and got.metrics["reward/rm_mean"] == pytest.approx(0.5)
    assert got.metrics["reward/prm_mean"] == pytest.approx(0.5)
    assert got.metrics["reward/acc"] == 1.0 and got.metrics["reward/rm_extra"] == 7.0  # the sources' own metrics
    total = got.sequence + torch.stack([t.sum() for t in got.token])
    assert got.metrics["reward/mean"] == pytest.approx(float(total.mean()))

    z = RewardCombination([rule, rm, prm], {"rule": 1.0, "rm": 2.0, "prm": 1.0}, "batch").score(items, trajs, texts)

    def zs(x):
        return (x - x.mean()) / (x.std(unbiased=False) + 1e-6)

    torch.testing.assert_close(z.sequence, zs(torch.tensor([1.0, 0.0, 1.0, 0.0])) + 2.0 * zs(rm.sequence))
    steps = zs(torch.tensor([1.0, -1.0, 2.0]))  # the placed (non-zero) step rewards
    torch.testing.assert_close(torch.stack([t[1] for t in z.token]), torch.cat([steps, torch.zeros(1)]))

    # Only the rule, weight 1, no normalisation: the rule function's scores exactly (today's reward).
    alone = RewardCombination([rule], {"rule": 1.0}).score(items, trajs, texts)
    assert alone.token is None and alone.sequence.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert alone.metrics["reward/mean"] == alone.metrics["reward/rule_mean"] == 0.5


def test_a_source_with_wrong_shapes_is_one_sentence(tiny_tokenizer):
    from rlcore.reward import RewardError
    from rlcore.reward_sources import RewardCombination

    items, trajs, texts = trajectories(tiny_tokenizer, ["1+2="], [(0, "3", True), (0, "4", True)])
    with pytest.raises(RewardError, match=r"reward source 'rm' returned sequence scores of shape \(3,\), expected \(2,\)"):
        RewardCombination([FixedSource("rm", [1.0, 2.0, 3.0])], {"rm": 1.0}).score(items, trajs, texts)
    with pytest.raises(RewardError, match="trajectory 1's token rewards have shape"):
        RewardCombination([FixedSource("prm", [1.0, 2.0], [torch.zeros(2), torch.zeros(5)])],
                          {"prm": 1.0}).score(items, trajs, texts)
    with pytest.raises(RewardError, match="non-finite score for trajectory 0"):
        RewardCombination([FixedSource("rm", [float("nan"), 2.0])], {"rm": 1.0}).score(items, trajs, texts)


def test_estimators_that_take_token_rewards():
    from rlcore.algos import ADV_ESTIMATORS

    assert {n for n in ADV_ESTIMATORS if ADV_ESTIMATORS.meta(n).token_rewards} == {"gae", "reinforce_plus_plus"}


# ------------------------------------------------------------------------------- validation
@pytest.fixture(scope="module")
def job(tiny_assets, tmp_path_factory):
    """``job(*overrides)``: `rlx validate` on the quickstart spec with the tiny model and data, an RM
    (the tiny model as a SeqCls checkpoint) at ``rm``."""
    from rlcore.job import load_job
    from rlcore.validate import validate

    model, data = tiny_assets
    rm = make_seqcls_checkpoint(str(tmp_path_factory.mktemp("job-rm") / "rm"), model)

    def run(*overrides):
        cfg = load_job("yaml_configs/quickstart_cpu.yaml",
                       [f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
                        *[o.replace("RM", rm).replace("POLICY", model) for o in overrides]])
        return cfg, validate(cfg)

    return run


def test_valid_reward_model_layouts(job):
    cfg, layout = job("reward.model.path=RM", "reward.process.path=RM", "reward.process.aggregate=mean",
                      "reward.weights={rule: 0.5, rm: 0.3, prm: 0.2}")
    assert sorted(layout.reward) == ["prm", "rm"]
    assert layout.reward["rm"].pool == "actor" and layout.reward["rm"].dp == 2  # the actor's pool by default
    cfg, layout = job("reward.model.path=RM", "reward.model.tp=2", "algorithm.adv_estimator=reinforce_plus_plus",
                      "reward.process.path=RM", "reward.process.pp=2")
    assert (layout.reward["rm"].tp, layout.reward["rm"].dp) == (2, 1) and layout.reward["prm"].pp == 2
    assert job()[1].reward == {}


@pytest.mark.parametrize("overrides,message", [
    (["reward.model.path=POLICY"], r"reward\.model\.path=\S+ is not a sequence-classification checkpoint: its "
                                   r"config\.json has architectures \['Qwen2ForCausalLM'\]"),
    (["reward.process.path=POLICY", "algorithm.adv_estimator=reinforce_plus_plus"],
     r"reward\.process\.path=\S+ is not a sequence-classification checkpoint"),
    (["reward.model.path=RM", "reward.model.tp=3"], r"reward\.model\.tp\*reward\.model\.pp=3\*1=3 does not divide"),
    (["reward.model.path=RM", "resources.pools.rm=3", "reward.model.pool=rm", "reward.model.pp=3"],
     r"reward\.model\.pp=3 does not divide the model's 4 layers"),
    (["reward.model.path=RM", "reward.model.pool=rollout"], r"reward\.model\.pool and rollout\.pool are both"),
    (["reward.model.path=RM", "reward.model.pool=nope"], r"reward\.model\.pool='nope' is not a pool"),
    (["reward.process.path=RM"], r"reward\.process\.aggregate=token puts step rewards on tokens, which "
                                 r"algorithm\.adv_estimator=grpo cannot use .* use gae or reinforce_plus_plus"),
    (["reward.process.path=RM", "reward.process.aggregate=max"], r"reward\.process\.aggregate='max' is not one of"),
    (["reward.model.path=RM", "reward.weights={rule: 1.0}"], r"reward\.weights names rule but not rm"),
    (["reward.weights={rm: 1.0}"], r"reward\.weights\.rm: no such reward source in this job \(configured: rule\)"),
    (["reward.weights={rule: 0.0}"], r"reward\.weights are all 0"),
    (["reward.normalize=group"], r"reward\.normalize='group' is not one of: none, batch"),
])
def test_bad_reward_keys_are_one_sentence(job, overrides, message):
    from rlcore.job import ConfigError

    with pytest.raises(ConfigError, match=message) as info:
        job(*overrides)
    assert len(str(info.value).splitlines()) == 1


def test_reward_model_with_two_labels_or_an_unusable_tokenizer(job, tmp_path):
    """num_labels 2 is refused; a PRM whose chat template differs from the policy's is refused (its
    step scores land on the policy's tokens); an RM with a different one is re-tokenised (valid)."""
    import transformers

    from rlcore.job import ConfigError

    rm = job("reward.model.path=RM")[0].reward.model.path
    with open(os.path.join(rm, "config.json")) as f:
        config = json.load(f)
    tokenizer = transformers.AutoTokenizer.from_pretrained(rm)

    def variant(name: str, change: dict, chat_template=None) -> str:
        folder = tmp_path / name
        folder.mkdir()
        os.symlink(os.path.join(rm, "model.safetensors"), folder / "model.safetensors")
        with open(folder / "config.json", "w") as f:
            json.dump({**config, **change}, f)
        tokenizer.chat_template = chat_template or tokenizer.chat_template
        tokenizer.save_pretrained(folder)
        return str(folder)

    two = variant("two", {"num_labels": 2, "id2label": {"0": "A", "1": "B"}})
    with pytest.raises(ConfigError, match=r"reward\.model\.path=\S+two has 2 labels"):
        job(f"reward.model.path={two}")
    other = variant("other", {}, "{% for m in messages %}{{ m['content'] }}={% endfor %}")
    assert job(f"reward.model.path={other}")[1].reward["rm"].tp == 1
    with pytest.raises(ConfigError, match=r"reward\.process\.path: the process reward model's tokenizer or chat "
                                          r"template differs from the policy's"):
        job(f"reward.process.path={other}", "algorithm.adv_estimator=reinforce_plus_plus")


# ----------------------------------------------------------------------------------- end to end
RM_TEMPLATE = "{% for m in messages %}{{ m['content'] }}={% endfor %}"  # not the policy's: the RM re-tokenises


@pytest.fixture(scope="module")
def rm_trainer(tiny_assets, tmp_path_factory):
    """REINFORCE++ on the tiny task (4 prompts x 4 samples, up to 6 tokens) rewarded by the verifier,
    an outcome RM with its own chat template and a PRM on the policy's tokenizer (steps end with "+"),
    both SeqCls checkpoints of the tiny model sharing the actor's pool; one in-process Trainer."""
    import ray
    import transformers

    from launch.compose import build_trainer
    from rlcore.job import load_job
    from rlcore.validate import validate

    model, data = tiny_assets
    root = tmp_path_factory.mktemp("rm-e2e")
    rm = make_seqcls_checkpoint(str(root / "rm"), model, seed=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(rm)
    tokenizer.chat_template = RM_TEMPLATE
    tokenizer.save_pretrained(rm)
    prm = make_seqcls_checkpoint(str(root / "prm"), model, seed=2)
    cfg = load_job("yaml_configs/quickstart_cpu.yaml", [
        f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]", "trainer.val_every=0",
        f"trainer.run_dir={root / 'run'}", "trainer.logger=[jsonl]", "resources.pools={actor: 1, rollout: 1}",
        "resources.num_cpus=2",  # one rank per Megatron role, one role at a time: 2 math threads each
        "actor.tp=1", "actor.loss.kl_coeff=0", "actor.micro_batch_size=8", "data.batch_size=4", "rollout.n=4",
        "rollout.max_response_length=6", "algorithm.adv_estimator=reinforce_plus_plus",
        f"reward.model.path={rm}", "reward.model.micro_batch_size=4", f"reward.process.path={prm}",
        "reward.process.separator=+", "reward.process.micro_batch_size=8",
        "reward.weights={rule: 1.0, rm: 0.5, prm: 0.25}"])
    trainer = None
    try:
        trainer = build_trainer(cfg, validate(cfg))
        yield trainer, rm, prm
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()


@pytest.mark.e2e
def test_rm_and_prm_score_a_reinforce_plus_plus_step(rm_trainer):
    """The RM's score of each trajectory is transformers' SeqCls logit on the RM's own chat of it; the
    PRM's rewards sit on the last token of each step (and the response's last token) with the SeqCls
    score there; the trained reward is rule + 0.5 rm (last token) + 0.25 prm (those tokens), which
    REINFORCE++'s returns add up; then a whole step runs and reports every source's mean."""
    import transformers

    from rlcore.batch import build_batch
    from rlcore.reward_sources import last_token_scores
    from rlcore.reward import compute_rewards

    trainer, rm, prm = rm_trainer
    m: dict = {}
    s = trainer.sample(1, m)
    tok = trainer.tokenizer
    texts = [tok.decode(t.response_ids, skip_special_tokens=True) for t in s.trajs]

    rm_tok = transformers.AutoTokenizer.from_pretrained(rm)
    rows = [rm_tok.apply_chat_template([*s.prompts[t.prompt_index].messages, {"role": "assistant", "content": x}],
                                       tokenize=True)["input_ids"] for t, x in zip(s.trajs, texts)]
    eos = rm_tok.eos_token_id  # scored at the chat's last eos, where reward-model training scores
    rows = [r[:len(r) - r[::-1].index(eos)] if eos in r else r for r in rows]
    rm_scores = torch.tensor([transformers_scores(rm, Batch(input_ids=torch.tensor([r]),
                                                            attention_mask=torch.ones(1, len(r))))[0][0]
                              for r in rows])
    assert rows[0] != s.trajs[0].prompt_ids + s.trajs[0].response_ids  # really re-tokenised
    rule, _ = compute_rewards(trainer.reward_fn, [s.prompts[t.prompt_index] for t in s.trajs], texts)
    torch.testing.assert_close(s.scores, rule + 0.5 * rm_scores, atol=TOL, rtol=0)
    assert m["reward/rm_mean"] == pytest.approx(float(rm_scores.mean()), abs=TOL)
    assert m["reward/rule_mean"] == pytest.approx(float(rule.mean()))

    plus = tok.convert_tokens_to_ids("+")
    multi_step = 0
    for t, token in zip(s.trajs, s.token_rewards):
        ids = t.prompt_ids + t.response_ids
        every = transformers_scores(prm, Batch(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))))[1][0]
        ends = [k for k, x in enumerate(t.response_ids[:-1]) if x == plus] + [len(t.response_ids) - 1]
        want = torch.zeros(len(t.response_ids))
        want[ends] = every[[len(t.prompt_ids) + k for k in ends]]
        torch.testing.assert_close(token, 0.25 * want, atol=TOL, rtol=0)  # weighted by reward.weights.prm
        multi_step += len(ends) > 1
    assert multi_step > 0  # some sampled response has more than one step

    batch = build_batch(s.trajs, trainer.task.pad_id)
    trainer.compute_advantages(batch, s)
    first = batch["response_mask"].argmax(1)
    totals = s.scores + torch.stack([t.sum() for t in s.token_rewards])  # gamma 1: the first token's return
    torch.testing.assert_close(batch["returns"][torch.arange(batch.size), first], totals, atol=1e-5, rtol=0)

    step = trainer.train_step(1)
    for key in ("reward/rule_mean", "reward/rm_mean", "reward/prm_mean", "reward/prm_steps_mean", "reward/mean",
                "reward/trained_mean", "actor/pg_loss"):
        assert math.isfinite(step[key]), key


@pytest.mark.e2e
def test_a_megatron_rank_computes_with_its_share_of_the_cores(rm_trainer):
    """resources.num_cpus=2 and the synchronous loop: the actor, the RM and the PRM (one rank each,
    computing one role at a time) each get both cores (launch/compose.py job_threads), and their
    ranks compute with 2 torch threads, not the one a Ray worker starts with (the group also checks
    this itself when it starts)."""
    trainer, _, _ = rm_trainer
    roles = {"actor": trainer.roles.actor, **trainer.roles.reward}
    assert sorted(roles) == ["actor", "prm", "rm"]
    assert {name: role.math_threads() for name, role in roles.items()} == {name: [2] for name in roles}
