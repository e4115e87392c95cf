"""The Megatron critic: GPTModel with a scalar value head (megatron_workers/value_head.py).

From one actor checkpoint (a Qwen2 with tied embeddings: the critic drops the vocabulary projection,
its head starts from the seed) the critic's values match transformers' Qwen2ForTokenClassification
with the same weights, token-aligned; one update with rlcore.algos.critic_loss has transformers'
gradient norm and gives the same new values under TP1 and TP2 x DP2; the exported weights (with
``score.weight``) load back, under PP2, into the same values; and regressing on fixed returns lowers
the value loss step after step.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from launch.assets import make_tiny_model
from megatron_workers.group import MegatronGroup
from rlcore.roles import RoleSpec
from megatron_workers.value_head import critic_hf_config
from rlcore.algos import CriticLossConfig, critic_loss, loss_weights
from rlcore.batch import Batch
from rlcore.config import OptimConfig
from tests.batches import right_padded_rows

pytestmark = pytest.mark.slow

BATCH, SEQ, MICRO_BATCH = 8, 20, 2  # 4 micro-batches in one process, 2 per rank under DP2
LOSS = CriticLossConfig(cliprange_value=0.5)
# As in test_megatron_layouts: clipping active, and an Adam eps that keeps the layouts' float noise
# in the gradients (different summation orders) far below the tolerance.
OPTIM = OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0)
TOL = 1e-5
REGRESSION_STEPS = 5
METRICS = {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/loss", "critic/grad_norm",
           "critic/update_skipped", "critic/lr"}


@pytest.fixture(scope="module")
def placement(ray_pools):
    return ray_pools({"critic": 4}, {"critic": "critic"}).placement("critic")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2-tied")), arch="qwen2", tie_word_embeddings=True)


def critic_batch(vocab: int = 16, seed: int = 0) -> Batch:
    """Right-padded prompt+response rows; each row's return is +-1 by the parity of its first token
    (which every later position sees), on response tokens only."""
    g = torch.Generator().manual_seed(seed)
    input_ids, response_mask = right_padded_rows(g, BATCH, SEQ, vocab, min_response=2)
    sign = (input_ids[:, :1] % 2) * 2.0 - 1.0
    return Batch(input_ids=input_ids, response_mask=response_mask, returns=sign * response_mask,
                 loss_weights=loss_weights(response_mask, "token-mean", SEQ))


def make_group(path, placement, tp, pp, dp):
    return MegatronGroup(RoleSpec("critic", path, tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO_BATCH, profile="cpu",
                                  dtype="float32", seed=0, head="value", optim=OPTIM), placement)


def one_update(group, batch):
    """(values before, update metrics, values after) for one step whose old values are the critic's own."""
    before = group.forward(batch)["values"]
    batch["old_values"] = before * batch["response_mask"]
    metrics = group.update(batch, LOSS)
    return before, metrics, group.forward(batch)["values"]


def save_hf_critic(state: dict[str, torch.Tensor], base_model: str, out_dir: str) -> str:
    """An HF *ForTokenClassification folder from the critic's ``hf_state_dict``."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(base_model, "config.json")) as f:
        config = critic_hf_config(json.load(f))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def transformers_critic(folder: str):
    import transformers

    model = transformers.AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForTokenClassification" and model.score.out_features == 1
    return model.eval()


def transformers_values(model, batch):
    """transformers' token-aligned values where they are scored (response tokens), 0 elsewhere: the
    value head runs only at the positions that score a response token."""
    return F.pad(model(batch["input_ids"]).logits[:, :-1, 0], (1, 0)) * batch["response_mask"]


@pytest.fixture(scope="module")
def one_process(model_path, placement, tmp_path_factory):
    """TP1 PP1 DP1: initial weights, one update, exported weights, then the regression steps."""
    batch = critic_batch()
    group = make_group(model_path, placement, 1, 1, 1)
    try:
        initial = group.hf_state_dict()
        before, metrics, after = one_update(group, Batch(batch))
        updated = group.hf_state_dict()
        vf_losses = [metrics["critic/vf_loss"]]
        for _ in range(REGRESSION_STEPS):
            vf_losses.append(one_update(group, Batch(batch))[1]["critic/vf_loss"])
    finally:
        group.shutdown()
    tmp = tmp_path_factory.mktemp("critic")
    return dict(batch=batch, before=before, metrics=metrics, after=after, vf_losses=vf_losses,
                initial_dir=save_hf_critic(initial, model_path, str(tmp / "initial")),
                updated_dir=save_hf_critic(updated, model_path, str(tmp / "updated")))


def test_values_and_gradient_match_transformers(one_process):
    """The exported initial critic is a valid HF Qwen2ForTokenClassification: its shifted token
    logits are our values, and the gradient of critic_loss on the whole batch has the norm megatron
    reported for the sum over micro-batches."""
    batch, before, metrics = one_process["batch"], one_process["before"], one_process["metrics"]
    assert before.shape == (BATCH, SEQ) and torch.all(before[:, 0] == 0)
    model = transformers_critic(one_process["initial_dir"])
    values = transformers_values(model, batch)
    torch.testing.assert_close(before, values.detach(), atol=TOL, rtol=0)

    hf_batch = Batch(batch, old_values=before * batch["response_mask"])
    loss, hand = critic_loss(values, hf_batch, LOSS)
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    assert set(metrics) == METRICS
    assert metrics["critic/grad_norm"] == pytest.approx(float(grad_norm), rel=TOL)
    assert metrics["critic/grad_norm"] > OPTIM.clip_grad  # clipping is active
    assert metrics["critic/lr"] == OPTIM.lr  # no schedule: the constant lr
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"):
        assert metrics[key] == pytest.approx(float(hand[key]), abs=TOL), key
    assert metrics["critic/loss"] == pytest.approx(metrics["critic/vf_loss"], abs=1e-7)
    # On-policy first step: nothing is clipped, and the loss is the token-mean of 0.5 (v - R)^2.
    mask = batch["response_mask"]
    assert metrics["critic/vf_clipfrac"] == 0
    expected = float((0.5 * (before - batch["returns"]) ** 2 * mask).sum() / mask.sum())
    assert metrics["critic/vf_loss"] == pytest.approx(expected, abs=TOL)
    assert not torch.allclose(one_process["after"], before)  # the update changed the values


def test_regressing_to_fixed_returns_lowers_the_value_loss(one_process):
    losses = one_process["vf_losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.25 * losses[0], losses


def test_tp2_dp2_update_matches_one_process(model_path, placement, one_process):
    """Same initial values (the head's init depends on the seed only), same metrics and new values."""
    group = make_group(model_path, placement, 2, 1, 2)
    try:
        before, metrics, after = one_update(group, Batch(one_process["batch"]))
    finally:
        group.shutdown()
    torch.testing.assert_close(before, one_process["before"], atol=TOL, rtol=0)
    assert set(metrics) == METRICS
    for key, value in one_process["metrics"].items():
        assert metrics[key] == pytest.approx(value, abs=TOL, rel=TOL), key
    torch.testing.assert_close(after, one_process["after"], atol=TOL, rtol=0)


def test_exported_critic_loads_back_under_pp2(placement, one_process):
    """A critic checkpoint (score.weight and score.bias present, no lm_head) loads under PP2 and
    reproduces the updated critic's values; its HF export equals the checkpoint."""
    from safetensors.torch import load_file

    folder = one_process["updated_dir"]
    saved = load_file(os.path.join(folder, "model.safetensors"))
    assert saved["score.weight"].shape == (1, 128) and saved["score.bias"].shape == (1,)
    assert "lm_head.weight" not in saved
    group = make_group(folder, placement, 1, 2, 1)
    try:
        values = group.forward(Batch(one_process["batch"]))["values"]
        exported = group.hf_state_dict()
    finally:
        group.shutdown()
    torch.testing.assert_close(values, one_process["after"], atol=TOL, rtol=0)
    assert sorted(exported) == sorted(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0, msg=name)
    hf_values = transformers_values(transformers_critic(folder), one_process["batch"])
    torch.testing.assert_close(values, hf_values.detach(), atol=TOL, rtol=0)


def test_critic_from_an_untied_actor_ignores_lm_head(qwen2_untied, placement, tmp_path):
    """An actor checkpoint with lm_head.weight: the critic (PP2 here) exports every body tensor as it
    was, no lm_head, and a seeded head; transformers with those weights gives the same values."""
    from safetensors.torch import load_file

    batch = critic_batch()
    group = make_group(qwen2_untied, placement, 1, 2, 1)
    try:
        values = group.forward(batch)["values"]
        exported = group.hf_state_dict()
    finally:
        group.shutdown()
    actor = load_file(os.path.join(qwen2_untied, "model.safetensors"))
    assert sorted(exported) == sorted([k for k in actor if k != "lm_head.weight"] + ["score.bias", "score.weight"])
    for name, tensor in actor.items():
        if name != "lm_head.weight":
            torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0, msg=name)
    assert torch.all(exported["score.bias"] == 0) and exported["score.weight"].abs().sum() > 0
    model = transformers_critic(save_hf_critic(exported, qwen2_untied, str(tmp_path / "critic")))
    torch.testing.assert_close(values, transformers_values(model, batch).detach(), atol=TOL, rtol=0)


def test_critic_hf_config_is_read_as_the_same_model(model_path):
    from megatron_workers.model import read_hf_config

    with open(os.path.join(model_path, "config.json")) as f:
        actor_config = json.load(f)
    config = critic_hf_config(actor_config)
    assert config["architectures"] == ["Qwen2ForTokenClassification"] and config["num_labels"] == 1
    assert critic_hf_config(config) == config  # idempotent
    with pytest.raises(ValueError, match="ForCausalLM or"):
        critic_hf_config({**actor_config, "architectures": ["Qwen2ForSequenceClassification"]})
    folder = os.path.join(os.path.dirname(model_path), "critic-config")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    assert read_hf_config(folder) == read_hf_config(model_path)
