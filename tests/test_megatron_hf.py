"""Megatron workers against HuggingFace: log-probs equal transformers' forward of the same checkpoint,
gathered weights round-trip the checkpoint exactly, and a weight-sync receiver gets the checkpoint.

Each test builds one group (Ray actors on logical GPUs) and runs every check on it, so the suite
starts few processes.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_workers.group import MegatronGroup
from rlcore.roles import RoleSpec
from rlcore.batch import Batch
from rlcore.weight_sync import DTYPES, WeightSyncGroup
from rlcore.weight_sync.broadcast import receive_buckets
from rlcore.weight_sync.shm import SharedSlots, receive_shared


@pytest.fixture(scope="module")
def placement(ray_pools):
    return ray_pools({"actor": 4}, {"reference": "actor"}).placement("reference")


def fixed_sequences(batch_size: int = 4, seq_len: int = 24, vocab: int = 16, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(input_ids=torch.randint(0, vocab, (batch_size, seq_len), generator=g))


def hf_model_and_weights(path: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    from safetensors.torch import load_file

    return model, load_file(f"{path}/model.safetensors")


def hf_logprobs(model, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def make_group(path, placement, tp=1, pp=1, dp=1, micro_batch_size=2):
    return MegatronGroup(RoleSpec("reference", path, tp=tp, pp=pp, dp=dp, micro_batch_size=micro_batch_size,
                                  profile="cpu", dtype="float32", seed=0), placement)


def check_logprobs_match_hf(group, path, temperature=0.8):
    model, _ = hf_model_and_weights(path)
    batch = fixed_sequences()
    ours = group.forward(batch, temperature=temperature)["logprobs"]
    ref = hf_logprobs(model, batch["input_ids"], temperature)
    assert ours.shape == ref.shape
    assert torch.all(ours[:, 0] == 0)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def check_round_trip(group, path):
    _, weights = hf_model_and_weights(path)
    gathered = group.hf_state_dict()
    assert sorted(gathered) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(gathered[name], tensor), name


def receive_weights(group, bucket_bytes: int, wire_dtype: str, transport: str) -> dict[str, torch.Tensor]:
    """The rollout side of a weight sync, done by this test process: join each stage's group as its
    one receiver and take every bucket by the stage's plan, from a broadcast or from the stage's
    shared slots (where every TP rank of the stage wrote its own shards)."""
    import ray

    plans = group.weight_sync_plans(bucket_bytes, wire_dtype)
    links = group.weight_sync_links(transport, receivers=1)
    assert [link.writers for link in links] == [group.tp if transport == "shm" else 1] * group.pp
    writer_inits = group.init_weight_sync(links)
    slots = [SharedSlots(link) if transport == "shm" else None for link in links]
    receivers = [WeightSyncGroup(link.host, link.port, rank=link.writers, world_size=link.world_size)
                 for link in links]
    ray.get(writer_inits)
    assert not any(os.path.exists(p) for s in slots if s for p in s.paths), "slot files outlive the set-up"
    sends = group.send_weights()
    received, stats = {}, {}
    if transport == "shm":
        stream = receive_shared(receivers, slots, plans, stats)
    else:
        stream = receive_buckets(receivers, plans, "cpu", stats, reuse_buffers=True)
    for name, t in stream:
        assert name not in received, f"{name} arrived twice"
        received[name] = t.clone()
    sent = [s for s in ray.get(sends) if s is not None]
    assert len(sent) == group.pp and {s["transport"] for s in sent} == {transport}
    return received, plans


def check_weight_sync(group, path):
    _, weights = hf_model_and_weights(path)
    for transport in ("broadcast", "shm"):
        # Small buckets, so that every stage sends several of them and the tensors larger than a
        # bucket (q_proj, the MLP weights) travel in row pieces.
        # 48 KiB: 96-row pieces of the 128-wide layers, so pieces straddle the TP shards' boundaries.
        received, plans = receive_weights(group, bucket_bytes=48 * 1024, wire_dtype="float32", transport=transport)
        assert all(len(plan) > 1 for plan in plans)
        assert any(t.rows is not None for plan in plans for b in plan for t in b.tensors)
        assert all(b.numel * 4 <= 48 * 1024 for plan in plans for b in plan)
        assert sorted(received) == sorted(weights)
        for name, tensor in weights.items():
            assert torch.equal(received[name], tensor), (transport, name)
    # A sync with the bf16 wire dtype of a bf16 rollout engine: a new plan, cast on the sender.
    for transport in ("broadcast", "shm"):
        received, _ = receive_weights(group, bucket_bytes=1 << 20, wire_dtype="bfloat16", transport=transport)
        for name, tensor in weights.items():
            assert received[name].dtype == DTYPES["bfloat16"]
            assert torch.equal(received[name], tensor.to(torch.bfloat16)), (transport, name)


def test_qwen2_untied_tp1pp1_logprobs_match_transformers(qwen2_untied, placement):
    group = make_group(qwen2_untied, placement)
    try:
        check_logprobs_match_hf(group, qwen2_untied)
    finally:
        group.shutdown()


def test_qwen2_untied_tp2_logprobs_round_trip_and_weight_sync(qwen2_untied, placement):
    group = make_group(qwen2_untied, placement, tp=2)
    try:
        check_logprobs_match_hf(group, qwen2_untied)
        check_round_trip(group, qwen2_untied)
        check_weight_sync(group, qwen2_untied)
    finally:
        group.shutdown()


def test_llama_tied_pp2_logprobs_round_trip_and_weight_sync(llama_tied, placement):
    group = make_group(llama_tied, placement, pp=2)
    try:
        check_logprobs_match_hf(group, llama_tied)
        check_round_trip(group, llama_tied)  # no lm_head: the tied embedding is exported once
        check_weight_sync(group, llama_tied)
    finally:
        group.shutdown()


def test_a_reference_in_the_actor_processes_stays_the_checkpoint_while_the_actor_trains(llama_tied, placement):
    """RoleSpec.colocated: the reference's model in the actor's PP2 ranks (a tied embedding, shared
    across the two stages, built twice in one process): its log-probs are transformers' before and
    after the actor's update moved the actor's own."""
    from rlcore.algos import loss_weights
    from rlcore.config import LossConfig, OptimConfig
    from tests.batches import right_padded_rows

    reference = RoleSpec("reference", llama_tied, tp=1, pp=2, dp=1, micro_batch_size=2, profile="cpu",
                         dtype="float32", seed=0)
    actor = RoleSpec("actor", llama_tied, tp=1, pp=2, dp=1, micro_batch_size=2, profile="cpu", dtype="float32",
                     seed=0, optim=OptimConfig(lr=1e-2), colocated=(reference,))
    group = MegatronGroup(actor, placement)
    try:
        hosted = group.hosted("reference")
        check_logprobs_match_hf(hosted, llama_tied)
        g = torch.Generator().manual_seed(0)
        input_ids, mask = right_padded_rows(g, 4, 24)
        batch = Batch(input_ids=input_ids, attention_mask=(input_ids != 0).long(), response_mask=mask,
                      advantages=torch.randn(4, 1, generator=g) * mask, loss_weights=loss_weights(mask, "token-mean", 24))
        before = group.forward(batch)["logprobs"]
        torch.testing.assert_close(hosted.forward(batch)["logprobs"], before, atol=0, rtol=0)
        group.update(batch, LossConfig(kl_coeff=0.0), on_policy=True)
        assert (group.forward(batch)["logprobs"] - before).abs().max() > 1e-3  # the actor moved
        check_logprobs_match_hf(hosted, llama_tied)  # the reference did not
        assert hosted.peak_memory_mb() == []  # no processes of its own
    finally:
        group.shutdown()
    with pytest.raises(ValueError, match=r"reference: a role in actor's processes must be forward-only with actor's TP=1 PP=2"):
        MegatronGroup(RoleSpec("actor", llama_tied, tp=1, pp=2, dp=1, micro_batch_size=2, profile="cpu",
                               dtype="float32", seed=0, colocated=(RoleSpec("reference", llama_tied, tp=2, pp=1, dp=1,
                                                                            micro_batch_size=2, profile="cpu",
                                                                            dtype="float32", seed=0),)), placement)
