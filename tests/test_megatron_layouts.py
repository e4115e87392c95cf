"""Layout equivalence: one actor update gives the same loss, metrics and updated weights under
TP1PP1, TP2, PP2, DP2 (DP2 with the distributed optimizer), PP2 with uneven stages (1 and 3 layers:
megatron's first/last-stage counts) and PP2 with two virtual stages per PP rank (megatron's
interleaved 1F1B, one layer per model chunk), from the same HF checkpoint and batch. Distributed
checkpoints cross between TP1PP1 and TP1PP2VPP2 both ways, optimizer state included, and TP1PP1's
loads into the uneven split.

The model is a Qwen2 with qkv bias and tied embeddings, so TP splits the fused qkv bias and PP keeps
a second copy of the embedding on the last stage, whose gradient megatron must add to the first's.
Each DP rank gets >= 2 micro-batches, which exercises the loss normalisation across micro-batches
and DP ranks.
"""
from __future__ import annotations

import pytest
import torch

from launch.assets import make_tiny_model
from megatron_workers.group import MegatronGroup
from rlcore.roles import RoleSpec
from rlcore.algos import LossConfig, actor_loss, loss_weights
from rlcore.batch import Batch
from rlcore.config import OptimConfig
from tests.batches import right_padded_rows

BATCH, SEQ, MICRO_BATCH = 8, 20, 2  # 4 micro-batches in one process, 2 per rank under DP2
LOSS = LossConfig(entropy_coeff=0.01, kl_coeff=0.0)
# clip_grad=1.0 clips (the first gradient's norm is ~2.7): the global norm must agree across layouts.
# Adam's first step is lr * g / (|g| + eps): for |g| << eps it amplifies float noise in g by lr / eps,
# and layouts sum gradients in different orders (~1e-9 apart). eps=1e-6 keeps that below 1e-6 while
# lr=1e-3 moves the weights by up to 1e-3, far above the tolerance.
OPTIM = OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0)
TOL = 1e-5


@pytest.fixture(scope="module")
def placement(ray_pools):
    return ray_pools({"actor": 4}, {"actor": "actor"}).placement("actor")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2-tied")), arch="qwen2", tie_word_embeddings=True)


def right_padded_batch(vocab: int = 16, seed: int = 0) -> Batch:
    """Prompts of 3-6 tokens, responses up to the end of a random length, right padding after it."""
    g = torch.Generator().manual_seed(seed)
    input_ids, response_mask = right_padded_rows(g, BATCH, SEQ, vocab, min_response=2)
    attention_mask = (input_ids != 0).long()
    return Batch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                 advantages=torch.randn(BATCH, SEQ, generator=g) * response_mask,
                 loss_weights=loss_weights(response_mask, "token-mean", SEQ))


def make_group(model_path, placement, tp, pp, dp, vpp=1, pp_layers=None):
    return MegatronGroup(RoleSpec("actor", model_path, tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO_BATCH,
                                  profile="cpu", dtype="float32", seed=0, vpp=vpp, pp_layers=pp_layers,
                                  optim=OptimConfig(**{**OPTIM.__dict__, "use_distributed_optimizer": dp > 1})),
                         placement)


def update_and_measure(group, batch):
    """(log-probs before, update metrics, updated HF weights, log-probs after) of one update."""
    before = group.forward(batch)["logprobs"]
    if "old_logprobs" not in batch:  # the one-process run: on-policy, old = the model's own
        batch["old_logprobs"] = before * batch["response_mask"]
    metrics = group.update(batch, LOSS)
    weights = group.hf_state_dict()
    after = group.forward(batch)["logprobs"]
    return before, metrics, weights, after


def update_then_logprobs(group, batch):
    """The log-probs after one more update: they depend on the optimizer's state, not only the weights."""
    group.update(Batch(batch), LOSS)
    return group.forward(batch)["logprobs"]


def load_one_process_checkpoint(group, batch, checkpoints) -> dict:
    """Loads TP1PP1's checkpoint (model and optimizer) into ``group``: the ``loaded`` log-probs and
    weights, and the log-probs after a ``second_update`` from there."""
    group.load_checkpoint(str(checkpoints / "tp1pp1"), with_optimizer=True)
    loaded = group.forward(batch)["logprobs"], group.hf_state_dict()
    return {"loaded": loaded, "second_update": update_then_logprobs(group, batch)}


def run_layout(model_path, placement, tp, pp, dp, batch):
    group = make_group(model_path, placement, tp, pp, dp)
    try:
        return update_and_measure(group, batch)
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def second_update():
    """The log-probs after a second update on the same batch (``logprobs``), filled in by
    ``one_process``."""
    return {}


@pytest.fixture(scope="module")
def one_process(model_path, placement, checkpoints, second_update):
    """The TP1PP1 run, which also saves its updated model and optimizer to ``checkpoints/tp1pp1``
    and then takes a ``second_update``."""
    batch = right_padded_batch()
    group = make_group(model_path, placement, 1, 1, 1)
    try:
        result = update_and_measure(group, batch)
        group.save_checkpoint(str(checkpoints / "tp1pp1"))
        second_update["logprobs"] = update_then_logprobs(group, batch)
    finally:
        group.shutdown()
    return batch, result


def test_one_process_matches_transformers_and_first_step_is_on_policy(model_path, one_process):
    import transformers

    batch, (before, metrics, weights, after) = one_process
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    log_softmax = torch.log_softmax(model(batch["input_ids"]).logits[:, :-1], -1)
    pad = torch.nn.functional.pad
    logprobs = pad(log_softmax.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1), (1, 0))
    entropy = pad(-(log_softmax.exp() * log_softmax).sum(-1), (1, 0))
    # Outputs are computed where they score a response token only; the other positions hold 0.
    scored = batch["response_mask"].bool()
    torch.testing.assert_close(before[scored], logprobs.detach()[scored], atol=TOL, rtol=0)
    assert torch.all(before[~scored] == 0)

    # Megatron's gradient is the gradient of the global token-mean loss (of the sum of actor_loss over
    # micro-batches): its norm equals that of transformers' gradient of the same loss on the whole batch.
    loss, _ = actor_loss(logprobs, entropy, batch, LOSS)
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    assert metrics["actor/loss"] == pytest.approx(float(loss.detach()), abs=TOL)
    assert metrics["actor/grad_norm"] == pytest.approx(float(grad_norm), rel=TOL)

    assert abs(metrics["actor/ppo_kl"]) < 1e-6
    assert metrics["actor/clip_frac"] == 0
    assert metrics["actor/grad_norm"] > OPTIM.clip_grad  # clipping is active
    assert metrics["actor/loss"] == pytest.approx(metrics["actor/pg_loss"] - LOSS.entropy_coeff *
                                                  metrics["actor/entropy"], abs=1e-7)
    # The loss is the global token-mean: recompute it from the batch (ratio 1 on the first step).
    mask = batch["response_mask"]
    assert metrics["actor/pg_loss"] == pytest.approx(float(-(batch["advantages"] * mask).sum() / mask.sum()),
                                                     abs=1e-6)
    # The update changed the model ...
    assert not torch.allclose(after, before)
    # ... by one step of torch's AdamW on the clipped gradient (megatron's optimizer; on the cpu profile
    # torch's fused kernel, megatron_workers/engine.py use_fused_cpu_adam), weight decay 0.
    clip = min(1.0, OPTIM.clip_grad / (float(grad_norm) + 1e-6))
    for p in model.parameters():
        p.grad.mul_(clip)
    torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=(OPTIM.adam_beta1, OPTIM.adam_beta2),
                      eps=OPTIM.adam_eps, weight_decay=0.0).step()
    stepped = model.state_dict()
    assert weights and set(weights) <= set(stepped)
    for name, value in weights.items():
        torch.testing.assert_close(value, stepped[name].detach(), atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("tp,pp,dp,vpp,pp_layers", [(2, 1, 1, 1, None), (1, 2, 1, 1, None), (1, 1, 2, 1, None),
                                                    (1, 2, 1, 1, (1, 3)), (1, 2, 1, 2, None)],
                         ids=["TP2", "PP2", "DP2", "PP2-1|3", "PP2VPP2"])
def test_layout_matches_one_process(request, model_path, placement, one_process, tp, pp, dp, vpp, pp_layers):
    batch, (ref_before, ref_metrics, ref_weights, ref_after) = one_process
    if vpp > 1:  # the run that also exchanges checkpoints with TP1PP1 (test_checkpoints_cross_vpp_layouts)
        before, metrics, weights, after = request.getfixturevalue("pp2vpp2_run")["update"]
    elif pp_layers is not None:  # the run that also loads TP1PP1's checkpoint (test_checkpoint_loads_into_...)
        before, metrics, weights, after = request.getfixturevalue("uneven_run")["update"]
    else:
        before, metrics, weights, after = run_layout(model_path, placement, tp, pp, dp, Batch(batch))

    torch.testing.assert_close(before, ref_before, atol=TOL, rtol=0)
    assert sorted(metrics) == sorted(ref_metrics)
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=TOL, rel=TOL), key
    assert abs(metrics["actor/ppo_kl"]) < 1e-6 and metrics["actor/clip_frac"] == 0
    assert sorted(weights) == sorted(ref_weights)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, atol=TOL, rtol=0, msg=name)
    # Under PP the last stage's copy of the tied embedding must have received the same update.
    torch.testing.assert_close(after, ref_after, atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def uneven_run(model_path, placement, one_process, checkpoints):
    """TP1PP2 with 1 layer on the first stage (and the embedding) and 3 on the last (and the tied
    head): ``update`` as ``update_and_measure``; it then loads TP1PP1's checkpoint (model and
    optimizer, saved under the even one-stage layout) and gives the ``loaded`` log-probs and weights
    and the log-probs after a ``second_update`` from there."""
    batch, _ = one_process
    group = make_group(model_path, placement, 1, 2, 1, pp_layers=(1, 3))
    out = {}
    try:
        # Each stage's weight-sync plan lists the HF tensors it holds: the layers megatron built there.
        out["stage_layers"] = [sorted({int(t.name.split(".")[2]) for b in stage_plan for t in b.tensors
                                       if t.name.startswith("model.layers.")})
                               for stage_plan in group.weight_sync_plans(1 << 20, "float32")]
        out["update"] = update_and_measure(group, Batch(batch))
        out.update(load_one_process_checkpoint(group, batch, checkpoints))
    finally:
        group.shutdown()
    return out


def test_checkpoint_loads_into_an_uneven_pipeline_split(one_process, uneven_run, second_update):
    """megatron's distributed checkpoints name every layer by its global index: TP1PP1's loads into
    stages of 1 and 3 layers exactly, and the Adam state comes along (the next update is TP1PP1's)."""
    _, (_, _, ref_weights, ref_after) = one_process
    assert uneven_run["stage_layers"] == [[0], [1, 2, 3]]  # the split is megatron's, not the even one
    loaded, weights = uneven_run["loaded"]
    torch.testing.assert_close(loaded, ref_after, atol=TOL, rtol=0)
    assert sorted(weights) == sorted(ref_weights)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(uneven_run["second_update"], second_update["logprobs"], atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def pp2vpp2_run(model_path, placement, one_process, checkpoints):
    """TP1PP2VPP2 (two model chunks of one layer per PP rank): ``update`` as ``update_and_measure``;
    it then saves its checkpoint to ``checkpoints/pp2vpp2``, loads TP1PP1's (model and optimizer) and
    gives the ``loaded`` log-probs and weights and the metrics of a ``second_update`` from there."""
    batch, _ = one_process
    group = make_group(model_path, placement, 1, 2, 1, vpp=2)
    try:
        out = {"update": update_and_measure(group, Batch(batch))}
        group.save_checkpoint(str(checkpoints / "pp2vpp2"))
        out.update(load_one_process_checkpoint(group, batch, checkpoints))
    finally:
        group.shutdown()
    return out


def test_checkpoints_cross_vpp_layouts(model_path, placement, one_process, checkpoints, pp2vpp2_run,
                                      second_update):
    """TP1PP2VPP2 <-> TP1PP1: a checkpoint saved by model chunks (model0, model1 per PP rank, the
    optimizer over both) loads into one unchunked model and back, model and optimizer state: the
    same function, the same weights, and the same next update from either side."""
    batch, (_, _, ref_weights, ref_after) = one_process
    _, _, vpp_weights, vpp_after = pp2vpp2_run["update"]
    group = make_group(model_path, placement, 1, 1, 1)
    try:
        group.load_checkpoint(str(checkpoints / "pp2vpp2"), with_optimizer=True)
        loaded, weights = group.forward(batch)["logprobs"], group.hf_state_dict()
        loaded_second_update = update_then_logprobs(group, batch)
    finally:
        group.shutdown()
    # PP2VPP2 -> TP1PP1, and TP1PP1 -> PP2VPP2: exact weights, the saver's log-probs.
    for got, got_weights, want, want_weights in ((loaded, weights, vpp_after, vpp_weights),
                                                 (*pp2vpp2_run["loaded"], ref_after, ref_weights)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        assert sorted(got_weights) == sorted(want_weights)
        for name, ref in want_weights.items():
            torch.testing.assert_close(got_weights[name], ref, atol=0, rtol=0, msg=name)
    # The Adam moments and step count came along: after a load either way the next update moves the
    # model as TP1PP1's own next update did (a fresh Adam's first step would move it elsewhere).
    for got in (loaded_second_update, pp2vpp2_run["second_update"]):
        torch.testing.assert_close(got, second_update["logprobs"], atol=TOL, rtol=0)
