"""Reward-model training (``algorithm.type: rm``): the Bradley-Terry loss against hand-computed
values and its split invariance, the tiny addition task's preference pairs, the spec's refusals, and
one short run: train, export as *ForSequenceClassification, transformers' scores == the trainer's."""
import math
import os

import pytest
import torch

from rlcore.algos import bradley_terry_loss

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RM_SPEC = os.path.join(REPO, "yaml_configs", "rm_train_cpu.yaml")


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


def test_rm_batch_loss_reads_last_tokens_and_sums_over_micro_batches():
    """Scores read at each row's last attention-mask position, rows 2i/2i+1 as pair i; with the
    mini-batch's pair weights, two micro-batches' shares add up to the whole batch's loss."""
    from rlcore.algos import rm_batch_loss
    from rlcore.config import RMConfig
    from rlcore.preference_losses import pair_weights

    scores = torch.tensor([[0.0, 5.0, 9.0], [0.0, 1.0, 0.0], [3.0, -1.0, 0.0], [2.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])  # last tokens: 5, 0 | 3, 7
    batch = {"attention_mask": mask, "loss_weights": pair_weights(4)}
    loss, m = rm_batch_loss(scores, batch, RMConfig())
    assert loss.item() == pytest.approx((nll(5.0) + nll(-4.0)) / 2, abs=1e-6)
    assert m["rm/accuracy"].item() == pytest.approx(0.5) and m["rm/margin"].item() == pytest.approx(0.5)
    halves = [rm_batch_loss(scores[i:i + 2], {k: v[i:i + 2] for k, v in batch.items()}, RMConfig())[0]
              for i in (0, 2)]
    assert sum(halves).item() == pytest.approx(loss.item(), abs=1e-6)
    with pytest.raises(ValueError, match="not whole"):
        rm_batch_loss(scores[:3], {k: v[:3] for k, v in batch.items()}, RMConfig())


@pytest.mark.parametrize("override, message", [
    ("algorithm.rm.center_coeff=-1", r"algorithm.rm.center_coeff=-1.0 must be >= 0"),
    ("actor.micro_batch_size=3", r"actor.micro_batch_size=3 must be even with algorithm.type=rm"),
])
def test_rm_spec_refusals(qwen2_untied, tmp_path, override, message):
    from launch.assets import make_addition_pairs
    from rlcore.job import ConfigError, load_job
    from rlcore.validate import validate

    train, val = make_addition_pairs(str(tmp_path))
    cfg = load_job(RM_SPEC, [f"model.path={qwen2_untied}", f"data.train_files=[{train}]",
                             f"data.val_files=[{val}]", override])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, require_files=True)


# ------------------------------------------------------------------------------------------- e2e
STEPS, PAIRS = 2, 8  # 8 pairs a step: 16 rows in two micro-batches of 8


@pytest.fixture(scope="module")
def rm_run(qwen2_untied, tmp_path_factory):
    """The rm spec for 2 steps on the tiny model (in this process: what `rlx train` runs), validation
    at steps 0 and 2, a checkpoint at step 2 exported with `rlx export`; the trained reward model's
    group is kept to score rows after training: (trainer, run_dir, export folder, held-out pairs)."""
    import subprocess
    import sys

    import ray

    from launch.assets import make_addition_pairs
    from launch.compose import build_trainer
    from rlcore.job import load_job
    from rlcore.validate import validate

    root = tmp_path_factory.mktemp("rm-train")
    train, val = make_addition_pairs(str(root / "pairs"))
    run_dir = root / "run"
    cfg = load_job(RM_SPEC, [f"model.path={qwen2_untied}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                             f"data.batch_size={PAIRS}", "actor.micro_batch_size=8", f"trainer.total_steps={STEPS}",
                             "actor.optim.lr_warmup_steps=null", "actor.optim.lr_decay_style=constant",
                             f"trainer.val_every={STEPS}", f"trainer.save_every={STEPS}", f"trainer.run_dir={run_dir}"])
    trainer = None
    try:
        trainer = build_trainer(cfg, validate(cfg, require_files=True))
        trainer.fit()
        out = root / "hf"
        proc = subprocess.run([sys.executable, "-m", "launch.cli", "export", str(run_dir / "checkpoints"), "--to",
                               "hf", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        yield trainer, run_dir, out, val
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()


@pytest.mark.e2e
def test_rm_training_exports_a_seqcls_model_with_the_trainers_scores(rm_run):
    """`rlx train` of an rm job: the Bradley-Terry metrics each step and the held-out pair accuracy
    (val/rm_accuracy) at steps 0 and 2; `rlx export` writes a Qwen2ForSequenceClassification that
    transformers loads, whose scores equal the trained Megatron role's (fp32, 1e-5) at every
    position and at each row's last token, and whose held-out metrics are the run's val/rm_*."""
    import json

    import pyarrow.parquet as pq
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlcore.algos import last_token_values, rm_metrics
    from rlcore.config import RMConfig
    from rlcore.preference_data import PreferenceDataset, pair_batch

    trainer, run_dir, out, val = rm_run
    lines = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(lines) == [0, 1, 2]
    for step in (1, 2):
        for key in ("rm/loss", "rm/accuracy", "rm/margin", "rm/chosen_score", "rm/rejected_score", "actor/grad_norm"):
            assert math.isfinite(lines[step][key]), (step, key)
    for step in (0, 2):
        assert 0.0 <= lines[step]["val/rm_accuracy"] <= 1.0
    assert lines[2]["val/rm_loss"] < lines[0]["val/rm_loss"]  # two Bradley-Terry steps already help

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["num_labels"] == 1
    assert config["pad_token_id"] == 0
    hf = AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32).eval()
    assert tuple(hf.score.weight.shape) == (1, 128) and hf.score.bias is None
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False) == "<s>1+2="

    # The held-out pairs as the trainer batches them (rows 2i chosen, 2i+1 rejected), one training shape.
    pairs = PreferenceDataset([val], tokenizer, max_prompt_length=16, max_response_length=2)
    batch = pair_batch(pairs.items[:PAIRS], trainer.task.pad_id)
    mask = batch["attention_mask"]
    megatron = trainer.actor.forward(batch)["scores"]
    with torch.no_grad():
        pooled = hf(input_ids=batch["input_ids"], attention_mask=mask).logits[:, 0]
        every = hf.score(hf.model(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state)[..., 0]
    gap = (megatron - every).abs()[mask.bool()].max().item()
    print(f"exported SeqCls vs the Megatron role: max |score diff| = {gap:.3g}")
    assert gap <= 1e-5
    torch.testing.assert_close(pooled, last_token_values(megatron, mask), atol=1e-5, rtol=0)

    # Every held-out pair scored by transformers gives the run's last validation metrics.
    every_pair = pair_batch(pairs.items, trainer.task.pad_id)
    with torch.no_grad():
        hf_scores = hf.score(hf.model(input_ids=every_pair["input_ids"]).last_hidden_state)[..., 0]
    got = rm_metrics({"scores": hf_scores}, every_pair, RMConfig())
    assert len(pq.read_table(val)) == len(pairs) == 50
    for key, value in got.items():
        assert abs(value - lines[2]["val/" + key.replace("/", "_")]) <= 1e-5, key
