"""Megatron workers against HuggingFace: log-probs equal transformers' forward of the same checkpoint,
gathered weights round-trip the checkpoint exactly, and a weight-sync receiver gets the checkpoint.

Each test builds one group (Ray actors on logical GPUs) and runs every check on it, so the suite
starts few processes.
"""
from __future__ import annotations

import pytest
import torch

from megatron_workers.group import MegatronGroup
from rlcore.batch import Batch
from rlcore.weight_sync import DTYPES, WeightSyncGroup, empty_buffer, unpack


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
    return MegatronGroup("reference", path, tp=tp, pp=pp, dp=dp, placement=placement,
                         micro_batch_size=micro_batch_size, profile="cpu", dtype="float32", optim=None, seed=0)


def check_logprobs_match_hf(group, path, temperature=0.8):
    model, _ = hf_model_and_weights(path)
    batch = fixed_sequences()
    ours = group.compute_logprobs(batch, temperature=temperature)
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


def receive_weights(group, bucket_bytes: int, wire_dtype: str) -> dict[str, torch.Tensor]:
    """The rollout side of a weight sync, done by this test process: join each stage's group as rank
    1 of 2 and unpack every bucket by the stage's plan."""
    import ray

    plans = group.weight_sync_plans(bucket_bytes, wire_dtype)
    endpoints = group.weight_sync_endpoints()
    sender_inits = group.init_weight_sync([2] * len(plans))
    receivers = [WeightSyncGroup(host, port, rank=1, world_size=2) for host, port in endpoints]
    ray.get(sender_inits)
    sends = group.send_weights()
    received = {}
    for plan, receiver in zip(plans, receivers):  # stage by stage: the other stages' senders wait
        for bucket in plan:
            buffer = empty_buffer(bucket)
            receiver.broadcast(buffer, src=0)
            received.update((name, t.clone()) for name, t in unpack(bucket, buffer))
    ray.get(sends)
    return received, plans


def check_weight_sync(group, path):
    _, weights = hf_model_and_weights(path)
    # Small buckets, so that every stage sends several of them.
    received, plans = receive_weights(group, bucket_bytes=64 * 1024, wire_dtype="float32")
    assert all(len(plan) > 1 for plan in plans)
    assert sorted(received) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(received[name], tensor), name
    # A second sync with the bf16 wire dtype of a bf16 rollout engine: a new plan, cast on the sender.
    received, _ = receive_weights(group, bucket_bytes=1 << 20, wire_dtype="bfloat16")
    for name, tensor in weights.items():
        assert received[name].dtype == DTYPES["bfloat16"]
        assert torch.equal(received[name], tensor.to(torch.bfloat16)), name


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
