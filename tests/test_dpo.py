"""DPO / IPO: the losses against hand-computed values, preference rows (a bad one named before anything
starts), the checks of a preference job spec, the DPO update under TP2 and PP2 equal to TP1PP1's through
the real engines, and one short `rlx train` of a DPO job with greedy validation, saved and resumed."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from rlcore.batch import Batch
from rlcore.config import DPOConfig, OptimConfig
from rlcore.data import DataError
from rlcore.metrics import is_measurement
from rlcore.preference_data import PreferenceDataset, pair_batch
from rlcore.preference_losses import dpo_batch_loss, dpo_loss, pair_weights


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# ------------------------------------------------------------------------------------------ losses
# Two pairs: policy / reference sequence log-probs of (chosen, rejected).
PC, PR, RC, RR = [-1.0, -3.0], [-2.0, -1.0], [-1.5, -2.0], [-1.5, -1.5]
# h = (pc - rc) - (pr - rr): pair 0: 0.5 - (-0.5) = 1.0; pair 1: -1.0 - 0.5 = -1.5


def _loss(beta, loss_type, label_smoothing=0.0):
    t = [torch.tensor(x) for x in (PC, PR, RC, RR)]
    return dpo_loss(*t, torch.tensor([0.5, 0.5]), beta, loss_type, label_smoothing)


def test_dpo_sigmoid_loss_and_metrics_match_hand_computed_values():
    loss, m = _loss(0.1, "sigmoid")
    # -logsigmoid(beta h) = softplus(-beta h)
    expected = 0.5 * softplus(-0.1) + 0.5 * softplus(0.15)
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert float(m["dpo/loss"]) == pytest.approx(expected, abs=1e-6)
    assert float(m["dpo/reward_accuracy"]) == pytest.approx(0.5)  # pair 0 only: 0.05 > -0.05
    assert float(m["dpo/margin"]) == pytest.approx(0.5 * 0.1 + 0.5 * -0.15, abs=1e-7)
    assert float(m["dpo/chosen_reward"]) == pytest.approx(0.5 * 0.05 + 0.5 * -0.1, abs=1e-7)
    assert float(m["dpo/rejected_reward"]) == pytest.approx(0.5 * -0.05 + 0.5 * 0.05, abs=1e-7)
    assert float(m["dpo/chosen_logprob_mean"]) == pytest.approx(-2.0)
    assert float(m["dpo/rejected_logprob_mean"]) == pytest.approx(-1.5)


def test_dpo_label_smoothing_and_ipo_match_hand_computed_values():
    loss, _ = _loss(0.1, "sigmoid", label_smoothing=0.2)
    expected = 0.5 * (0.8 * softplus(-0.1) + 0.2 * softplus(0.1)) + 0.5 * (0.8 * softplus(0.15) + 0.2 * softplus(-0.15))
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    loss, m = _loss(0.25, "ipo")  # (h - 1 / (2 beta))^2 with 1 / (2 beta) = 2
    assert float(loss) == pytest.approx(0.5 * (1.0 - 2.0) ** 2 + 0.5 * (-1.5 - 2.0) ** 2, abs=1e-6)
    assert float(m["dpo/margin"]) == pytest.approx(0.5 * 0.25 + 0.5 * -0.375, abs=1e-7)


def test_dpo_sft_term_adds_the_chosen_mean_token_nll():
    t = [torch.tensor(x) for x in (PC, PR, RC, RR)]
    plain, _ = dpo_loss(*t, torch.tensor([0.5, 0.5]), 0.1)
    loss, m = dpo_loss(*t, torch.tensor([0.5, 0.5]), 0.1, sft_coeff=2.0, chosen_tokens=torch.tensor([2.0, 3.0]))
    assert float(loss - plain) == pytest.approx(2.0 * (0.5 * 1.0 / 2 + 0.5 * 3.0 / 3), abs=1e-6)
    assert float(m["dpo/loss"]) == pytest.approx(float(loss))


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    pc, pr = torch.tensor([-1.0], requires_grad=True), torch.tensor([-1.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor([-1.0]), torch.tensor([-1.0]), torch.ones(1), 0.5)
    loss.backward()
    assert float(pc.grad) == pytest.approx(-0.25) and float(pr.grad) == pytest.approx(0.25)  # -beta sigmoid(0)


def test_dpo_batch_loss_sums_over_micro_batches_to_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    rows, seq = 8, 7
    mask = (torch.rand(rows, seq, generator=g) > 0.4).float()
    batch = Batch(response_mask=mask, ref_logprobs=-torch.rand(rows, seq, generator=g), loss_weights=pair_weights(rows))
    logprobs = -torch.rand(rows, seq, generator=g)
    whole, whole_m = dpo_batch_loss(logprobs, batch, DPOConfig())
    parts = [dpo_batch_loss(logprobs[i:i + 2], batch.slice(i, i + 2), DPOConfig()) for i in range(0, rows, 2)]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), abs=1e-6)
    for k, v in whole_m.items():
        assert float(sum(p[1][k] for p in parts)) == pytest.approx(float(v), abs=1e-6), k
    with pytest.raises(ValueError, match="whole"):
        dpo_batch_loss(logprobs[:3], batch.slice(0, 3), DPOConfig())


# --------------------------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from launch.assets import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("dpo-model")))


def addition_pairs(count: int = 25) -> list[dict]:
    """a+b= prompts (the tiny model's vocabulary): chosen the sum's last digit, rejected the next digit."""
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "chosen": str((a + b) % 10),
             "rejected": str((a + b + 1) % 10)} for a in range(5) for b in range(5)]
    return rows[:count]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_pairs_tokenise_as_the_template_ends_a_completion(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [{"prompt": [{"role": "user", "content": "1+2="}], "chosen": "3",
             "rejected": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "45"}]}]
    pair = PreferenceDataset(write_jsonl(tmp_path / "p.jsonl", rows), tok)[0]
    assert pair.prompt_ids == tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert pair.chosen_ids == tok.encode("3", add_special_tokens=False) + [tok.eos_token_id]
    assert pair.rejected_ids == tok.encode("45", add_special_tokens=False) + [tok.eos_token_id]
    b = pair_batch([pair, pair], pad_id=0)
    assert b["input_ids"].shape == (4, len(pair.prompt_ids) + 3)
    assert b["response_mask"].sum(1).tolist() == [2, 3, 2, 3]
    assert b["input_ids"][1, len(pair.prompt_ids):].tolist() == pair.rejected_ids


@pytest.mark.parametrize("row, expected", [
    ({"prompt": [{"role": "user", "content": "1+2="}], "rejected": "4"}, "'chosen' must be the completion"),
    ({"prompt": [{"role": "user", "content": "1+2="}], "chosen": "3", "rejected": [{"role": "user", "content": "4"}]},
     "'rejected' must be the completion as a string or a list of messages whose last is the assistant's, got a list"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": "4"}, "'prompt' must be a non-empty list"),
    ({"prompt": [{"role": "user", "content": "1+2="}], "chosen": "3333", "rejected": "4"}, "longer than rollout.max_response_length=3"),
])
def test_a_bad_row_is_named_by_file_and_row(tiny_model, tmp_path, row, expected):
    from transformers import AutoTokenizer

    path = write_jsonl(tmp_path / "pairs.jsonl", addition_pairs(3) + [row])
    with pytest.raises(DataError, match=expected) as e:
        PreferenceDataset(path, AutoTokenizer.from_pretrained(tiny_model), max_response_length=3)
    assert str(e.value).startswith(f"{path} row 3 (line 4): ")


def dpo_spec(tmp_path, model: str, train: str, **extra) -> str:
    """A tiny DPO job spec (one actor GPU, the reference on it) as a YAML file; ``extra``: top-level sections."""
    import yaml

    spec = {"model": {"path": model}, "resources": {"device": "cpu", "pools": {"actor": 1}},
            "actor": {"micro_batch_size": 4, "optim": {"lr": 1e-3}}, "rollout": {"max_response_length": 2},
            "data": {"train_files": [train], "batch_size": 4, "max_prompt_length": 16},
            "algorithm": {"type": "dpo"}, "trainer": {"total_steps": 2, "run_dir": str(tmp_path / "run"),
                                                      "logger": ["jsonl"]}}
    for section, keys in extra.items():
        spec[section] = {**spec.get(section, {}), **keys}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_rlx_validate_and_train_name_a_row_missing_chosen_before_anything_starts(tiny_model, tmp_path, capsys):
    from launch.cli import main

    rows = addition_pairs(5)
    del rows[2]["chosen"]
    train = write_jsonl(tmp_path / "pairs.jsonl", rows)
    spec = dpo_spec(tmp_path, tiny_model, train)
    assert main(["validate", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rlx validate: {train} row 2 (line 3): 'chosen' must be the completion as a string or a list "
                   "of messages whose last is the assistant's, got null")
    assert main(["train", spec]) == 1  # the task loads before any role starts
    assert f"{train} row 2 (line 3): 'chosen'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("overrides, expected", [
    (["actor.micro_batch_size=3"], "actor.micro_batch_size=3 must be even with algorithm.type=dpo"),
    (["actor.max_tokens_per_micro_batch=64"], "actor.max_tokens_per_micro_batch is not supported with algorithm.type=dpo"),
    (["actor.shared_prompt=true"], "actor.shared_prompt is not supported with algorithm.type=dpo"),
    (["algorithm.dpo.loss_type=hinge"], "algorithm.dpo.loss_type='hinge' is not one of: sigmoid, ipo"),
    (["algorithm.dpo.beta=0"], "algorithm.dpo.beta=0.0 must be positive"),
    (["algorithm.dpo.loss_type=ipo", "algorithm.dpo.label_smoothing=0.1"], "applies to loss_type=sigmoid only"),
    (["algorithm.dpo.sft_coeff=-1"], "algorithm.dpo.sft_coeff=-1.0 must not be negative"),
    (["algorithm.type=sft"], "algorithm.type='sft' is not one of: rl, dpo"),
    (["data.batch_size=3"], "2*data.batch_size=2*3=6 sequences do not split into equal micro-batches for the actor"),
    (["algorithm.dpo.greedy_val_files=[x.parquet]"], "algorithm.dpo.greedy_val_files[0]=x.parquet not found"),
    (["algorithm.dpo.greedy_val_files=[x.parquet]", "rollout.pool=actor"], "actor.pool and rollout.pool are both"),
])
def test_preference_spec_errors_are_one_sentence(tiny_model, tmp_path, overrides, expected):
    from rlcore.job import ConfigError, load_job
    from rlcore.validate import validate

    spec = dpo_spec(tmp_path, tiny_model, write_jsonl(tmp_path / "pairs.jsonl", addition_pairs(8)),
                    resources={"device": "cpu", "pools": {"actor": 1}})
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate(load_job(spec, overrides))


def test_rlx_plan_gives_a_preference_jobs_memory(tiny_model, tmp_path, capsys):
    """A DPO step holds what an RL update of two samples per prompt holds (a chosen and a rejected
    row per pair), with the reference beside it and no engines; a reward model trains the score head
    (a [1, hidden] layer, no vocabulary logits); --suggest, whose cost model times rollouts, refuses."""
    from launch import plan
    from launch.cli import main
    from rlcore.job import load_job
    from rlcore.validate import validate

    spec = dpo_spec(tmp_path, tiny_model, write_jsonl(tmp_path / "pairs.jsonl", addition_pairs(8)))
    cfg = load_job(spec, [])
    dpo = plan.estimate(cfg, validate(cfg))
    assert [r.role for r in dpo.roles] == ["actor", "reference"] and dpo.sequences == 2 * cfg.data.batch_size
    rl = load_job(spec, ["algorithm.type=rl", "rollout.n=2", "resources.pools={actor: 1, rollout: 1}"])
    rl_plan = plan.estimate(rl, validate(rl))
    assert [r.role for r in rl_plan.roles] == ["actor", "reference", "rollout"]
    for got, want in zip(dpo.roles, rl_plan.roles):
        assert (got.params, got.weights, got.grads, got.optimizer, got.activations) == \
            (want.params, want.weights, want.grads, want.optimizer, want.activations)

    rm = load_job(spec, ["algorithm.type=rm"])
    (actor,) = plan.estimate(rm, validate(rm)).roles
    m = dpo.model
    assert actor.params == m.stage_params(1, 1, 0, value_head=True) < dpo.roles[0].params
    assert actor.activations < dpo.roles[0].activations  # no fp32 vocabulary logits

    assert main(["plan", spec]) == 0
    out = capsys.readouterr().out
    assert "batch: 4 pairs x (chosen, rejected) = 8 sequences" in out and "rollout" not in out.split("batch:")[1]
    assert "~0.5 GB per Megatron rank" in out and "vLLM engine" not in out  # no engines in this job
    assert main(["plan", "--suggest", spec]) == 2
    assert "rlx plan --suggest ranks RL layouts only" in capsys.readouterr().err


# -------------------------------------------------------------------------- layouts (real engines)
DPO_OPTIM = OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0)  # as test_megatron_layouts: Adam's first step
LAYOUT_TOL = 1e-5                                                # must not amplify float noise


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    from launch.assets import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("dpo-qwen2-tied")), arch="qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def layout_runs(tied_model, ray_pools):
    """One DPO update of the same batch from the same checkpoint under TP1PP1, TP2 and PP2 (micro-batches
    of one pair, so every layout sums 4 micro-batches): the metrics, the updated weights, and the policy's
    log-probs before the update."""
    from megatron_workers.group import MegatronGroup
    from rlcore.preference_data import PreferencePair
    from rlcore.roles import RoleSpec

    placement = ray_pools({"actor": 2}, {"actor": "actor"}).placement("actor")
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(3, 16, (n,), generator=g).tolist()

    pairs = [PreferencePair(i, tokens(3 + i), tokens(1 + 2 * i), tokens(4 - i)) for i in range(4)]
    batch = pair_batch(pairs, pad_id=0)
    runs = {}
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        group = MegatronGroup(RoleSpec("actor", tied_model, tp=tp, pp=pp, dp=1, micro_batch_size=2, profile="cpu",
                                       dtype="float32", seed=0, head="dpo", optim=DPO_OPTIM), placement)
        try:
            before = group.forward(batch)["logprobs"]
            if "ref_logprobs" not in batch:  # a reference that differs from the policy, so the margins are not 0
                batch["ref_logprobs"] = (before + 0.3 * torch.randn(before.shape, generator=g)) * batch["response_mask"]
                batch["loss_weights"] = pair_weights(batch.size)
            metrics = group.update(Batch(batch), DPOConfig(beta=0.5))
            runs[(tp, pp)] = metrics, group.hf_state_dict(), before
        finally:
            group.shutdown()
    return batch, runs


@pytest.mark.slow
def test_dpo_update_under_tp2_and_pp2_equals_tp1pp1(layout_runs, tied_model):
    batch, runs = layout_runs
    ref_metrics, ref_weights, ref_before = runs[(1, 1)]
    # The engine's loss is the plain-torch DPO loss of the policy's own log-probs before the step.
    _, expected = dpo_batch_loss(ref_before, batch, DPOConfig(beta=0.5))
    for name, value in expected.items():
        assert ref_metrics[name] == pytest.approx(float(value), abs=1e-6), name
    assert abs(ref_metrics["dpo/margin"]) > 1e-3 and ref_metrics["actor/grad_norm"] > 0  # not a zero-margin start
    for layout in [(2, 1), (1, 2)]:
        metrics, weights, before = runs[layout]
        torch.testing.assert_close(before, ref_before, atol=LAYOUT_TOL, rtol=0)
        for name, value in ref_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (layout, name)
        for name, ref in ref_weights.items():
            torch.testing.assert_close(weights[name], ref, atol=LAYOUT_TOL, rtol=0, msg=f"{layout} {name}")
    # ... and the step did move the weights, by far more than the tolerance.
    from safetensors.torch import load_file

    initial = load_file(os.path.join(tied_model, "model.safetensors"))
    assert max(float((ref_weights[n] - initial[n]).abs().max()) for n in ref_weights if n in initial) > 1e-4


# ------------------------------------------------------------------------------------- rlx train
def _rlx(*args: str) -> None:
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=repo, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _metrics(run_dir) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def dpo_runs(tiny_model, tmp_path_factory):
    """`rlx train` of a 2-step DPO job (checkpoints every step, held-out pairs and greedy validation at
    steps 0 and 2), then a second run resumed from its step-1 checkpoint; and the step-2 checkpoint exported."""
    from launch.assets import make_addition_data

    root = tmp_path_factory.mktemp("dpo-e2e")
    pairs = write_jsonl(root / "pairs.jsonl", addition_pairs())
    prompts = make_addition_data(str(root / "prompts"))
    a, b = root / "a", root / "b"
    spec = dpo_spec(root, tiny_model, pairs, resources={"device": "cpu", "pools": {"actor": 1, "rollout": 1}},
                    data={"val_files": [pairs]}, rollout={"kv_cache_gb": 0.25},
                    algorithm={"type": "dpo", "dpo": {"greedy_val_files": [prompts]}},
                    trainer={"save_every": 1, "val_every": 2, "run_dir": str(a)})
    _rlx("train", spec)
    _rlx("train", spec, f"trainer.run_dir={b}", f"trainer.resume={a / 'checkpoints' / 'step_00000001'}")
    _rlx("export", str(a / "checkpoints" / "step_00000002"), "--to", "hf", str(root / "hf"))
    return _metrics(a), _metrics(b), pairs, str(root / "hf")


@pytest.mark.e2e
def test_rlx_train_dpo_validates_and_resumes_exactly(dpo_runs):
    uninterrupted, resumed, _, _ = dpo_runs
    assert sorted(uninterrupted) == [0, 1, 2] and sorted(resumed) == [2]
    first = uninterrupted[1]
    # Step 1 starts from the reference's weights: every margin is 0, the loss log 2.
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6) and first["dpo/margin"] == pytest.approx(0, abs=1e-6)
    for step in (0, 2):
        assert 0 <= uninterrupted[step]["val/reward_mean"] <= 1 and "val/dpo_reward_accuracy" in uninterrupted[step]
    assert uninterrupted[2]["val/dpo_margin"] != 0  # trained away from the reference
    # The resumed step 2 (weights, Adam state and loader position from the checkpoint; the engines synced
    # before the greedy validation) is the uninterrupted run's.
    keys = [k for k in uninterrupted[2] if not is_measurement(k)]
    assert keys == [k for k in resumed[2] if not is_measurement(k)]
    for k in keys:
        assert resumed[2][k] == pytest.approx(uninterrupted[2][k], rel=1e-6, abs=1e-7), k


@pytest.mark.e2e
def test_exported_dpo_policy_scores_the_held_out_pairs_as_the_run_did(dpo_runs):
    """transformers' own model on the exported step-2 checkpoint gives the held-out chosen completions
    the mean log-probability the run's validation reported after step 2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    uninterrupted, _, pairs, exported = dpo_runs
    tok = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)
    total, data = 0.0, PreferenceDataset(pairs, tok, max_response_length=2)
    with torch.no_grad():
        for p in data:
            ids = torch.tensor([p.prompt_ids + p.chosen_ids])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            target = ids[0, 1:]
            total += float(logprobs[torch.arange(len(target)), target][-len(p.chosen_ids):].sum())
    assert total / len(data) == pytest.approx(uninterrupted[2]["val/dpo_chosen_logprob_mean"], abs=1e-4)
