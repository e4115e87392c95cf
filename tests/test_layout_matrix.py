"""Weight sync from every actor layout to every rollout layout, on the real stack.

Actor layouts {TP1PP1, TP2PP1, TP1PP2, TP2PP2, DP2} x rollout layouts {1 engine TP1, 2 engines TP1,
1 engine TP2}: after a sync, every engine's log-probs of fixed sequences equal the actor's (fp32,
max abs diff <= 1e-3) and the checksum check (``rollout.check_weights``) passes.

Cost: the three rollout pools start once per module and stay up; each actor layout starts once
(a module-scoped parametrized fixture, so pytest runs its three rollout layouts back to back) and
re-connects the weight-sync groups to each pool in turn. Each actor layout loads a differently
seeded checkpoint, so every sync really changes the engines' weights.
"""
from __future__ import annotations

import pytest
import torch

from launch.assets import make_tiny_model
from rlcore.batch import Batch
from rlcore.config import OptimConfig, RolloutConfig
from rlcore.weight_sync import connect_weight_sync, sync_weights

pytestmark = pytest.mark.e2e

ACTOR_LAYOUTS = {"tp1pp1": (1, 1, 1), "tp2pp1": (2, 1, 1), "tp1pp2": (1, 2, 1), "tp2pp2": (2, 2, 1),
                 "dp2": (1, 1, 2)}  # (TP, PP, DP)
ROLLOUT_LAYOUTS = {"1xtp1": (1, 1), "2xtp1": (2, 1), "1xtp2": (1, 2)}  # (engines, TP per engine)
BUCKET_BYTES = 64 * 1024  # several buckets per stage for the 0.4M-param model


@pytest.fixture(scope="module")
def cluster(ray_pools):
    pools = {"actor": 4, **{name: e * tp for name, (e, tp) in ROLLOUT_LAYOUTS.items()}}
    return ray_pools(pools, {name: name for name in pools})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layout-matrix")


@pytest.fixture(scope="module")
def rollouts(cluster, model_dir):
    from rollout import RolloutPool

    start = make_tiny_model(str(model_dir / "rollout-start"), seed=100)
    pools = {}
    try:
        for name, (engines, tp) in ROLLOUT_LAYOUTS.items():
            pools[name] = RolloutPool(start, RolloutConfig(engines=engines, tp=tp, kv_cache_gb=0.25),
                                      cluster.placement(name), "cpu", "float32", seed=0)
        yield pools
    finally:
        for pool in pools.values():
            pool.shutdown()


@pytest.fixture(scope="module", params=list(ACTOR_LAYOUTS))
def actor(request, cluster, model_dir):
    from megatron_workers import MegatronGroup

    tp, pp, dp = ACTOR_LAYOUTS[request.param]
    seed = list(ACTOR_LAYOUTS).index(request.param)
    model = make_tiny_model(str(model_dir / f"actor-{request.param}"), seed=seed)
    group = MegatronGroup("actor", model, tp, pp, dp, cluster.placement("actor"), 4, "cpu", "float32",
                          OptimConfig(), seed=0)
    yield group
    group.shutdown()


def _fixed_sequences(vocab: int = 16, n: int = 8, seq: int = 12) -> Batch:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, vocab, (n, seq), generator=g)
    return Batch(input_ids=input_ids, attention_mask=torch.ones(n, seq, dtype=torch.long))


@pytest.mark.parametrize("rollout_layout", list(ROLLOUT_LAYOUTS))
def test_synced_engines_match_the_actor(actor, rollouts, rollout_layout):
    pool = rollouts[rollout_layout]
    batch = _fixed_sequences()
    seqs = batch["input_ids"].tolist()
    expected = actor.compute_logprobs(batch)[:, 1:]  # position 0 has no prefix

    connect_weight_sync(actor, pool, pool.num_engines, bucket_bytes=BUCKET_BYTES, wire_dtype="float32")
    before = torch.tensor(pool.prompt_logprobs(seqs))[:, 1:]
    assert (before - expected).abs().max() > 1e-2, "the engines should start on other weights"

    reports = sync_weights(actor, pool, version=1, check=True)  # raises if any tensor differs
    assert len(reports) == pool.num_engines and all(r["version"] == 1 for r in reports)
    for r in reports:
        assert r["bytes"] == sum(s["bytes"] for s in r["send"])
    for e in range(pool.num_engines):
        got = torch.tensor(pool.prompt_logprobs(seqs, engine=e))[:, 1:]
        diff = (got - expected).abs().max().item()
        assert diff <= 1e-3, f"engine {e}: max |vLLM - actor| log-prob = {diff}"
