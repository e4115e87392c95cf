"""Weight sync, receiving side: senders in the test process (rank 0 of one WeightSyncGroup per
actor PP stage running ``rlcore.weight_sync.send_buckets``, what the actor's stage senders run; no
Megatron) broadcast a SECOND random model's HF state dict in small buckets; afterwards the engines
must compute exactly that model (transformers forward, fp32), for an untied Qwen2 (two engines: a
group of 3), a tied-embedding one over two stage groups (the stale lm_head trap) and one engine with
vLLM TP 2 over two stage groups, without serving stale prefix-cache KV; the checksum check passes,
and catches a bucket corrupted on the wire. Last, end to end with the sending side real too: a
Megatron PP2 actor with tied embeddings, updated, synced into the tied engine (on this module's
cluster, so that it starts no Ray and no engine of its own).

The untied and TP2 cases sync into the session's shared rollout layouts (tests/rollout_layouts.py,
also tests/test_layout_matrix.py's), their first model sent in by the same path; the tied case has
an engine of its own, started on its first model (the shared engines run an untied model, and a tied
model's weights hold no lm_head to send them)."""
from __future__ import annotations

import re
import socket
import threading

import pytest
import ray
import torch

from launch.assets import make_tiny_model
from rlcore.config import RolloutConfig
from rlcore.weight_sync import (StageLink, TensorSpec, WeightMismatchError, WeightSyncGroup, check_engines,
                                checksum, plan_buckets)
from rlcore.weight_sync.broadcast import send_buckets
from tests.rollout_layouts import MAX_POSITIONS, ROLLOUT_LAYOUTS

BUCKET_BYTES = 100_000  # several buckets; q/k land in one bucket and v in the next
MAX_LEN = 256  # room for a prompt longer than one CPU KV block (128 tokens), so prefix caching bites
# untied: two engines in one stage group (world 3), prepacked CPU GEMM weights (the reload); tied: one
# engine, two actor PP stages (two groups). tp2: one engine whose two vLLM workers each join both stage
# groups (world 3) and load their shards, with plain (unpacked) CPU GEMM weights: the in-place load
# (model.load_weights), not the reload. ``layout``: the shared rollout layout the case syncs into.
def _in_layout(layout: str, **case) -> dict:
    engines, tp, cpu_prepack = ROLLOUT_LAYOUTS[layout]
    return dict(case, layout=layout, engines=engines, tp=tp, cpu_prepack=cpu_prepack)


CASES = {"untied": _in_layout("2xtp1", tied=False, stages=1, seeds=(21, 22)),
         "tied": dict(tied=True, engines=1, tp=1, cpu_prepack=True, stages=2, seeds=(23, 24)),
         "tp2": _in_layout("1xtp2", tied=False, stages=2, seeds=(25, 26))}
assert MAX_LEN <= MAX_POSITIONS  # the shared engines' context holds the long prompt


@pytest.fixture(scope="module")
def cluster(ray_pools):
    return ray_pools({"rollout_tied": 1, "actor": 2}, {"tied": "rollout_tied", "actor": "actor"})


@pytest.fixture(scope="module")
def setups(cluster, rollout_layouts, tmp_path_factory):
    """Per case: the pool, holding model A (the tied engine started on it; the shared layouts sent it,
    as version 4), and the HF models A and B (the one the tests send)."""
    from transformers import AutoModelForCausalLM

    from rollout import RolloutPool

    root = tmp_path_factory.mktemp("rollout-sync")
    models = {}
    for case, c in CASES.items():
        dirs = [make_tiny_model(str(root / f"{case}-{s}"), seed=s, tie_word_embeddings=c["tied"],
                                max_position_embeddings=MAX_LEN) for s in c["seeds"]]
        models[case] = dirs, [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in dirs]
    dirs, _ = models["tied"]
    tied = RolloutPool(dirs[0], RolloutConfig(engines=1, tp=1, kv_cache_gb=0.25), cluster.placement("tied"), "cpu",
                       "float32", seed=0)
    try:
        pools = {case: rollout_layouts[c["layout"]] if "layout" in c else tied for case, c in CASES.items()}
        for case, c in CASES.items():
            if "layout" in c:
                sd_a = _state_dict(models[case][1][0])
                plans = _stage_plans(sd_a, c["stages"])
                _, groups = _connect(pools[case], plans, 1 + c["engines"] * c["tp"])
                _with_senders(_senders(groups, plans, sd_a), pools[case].receive_weights(4))
        yield {case: dict(pool=pools[case], hf_a=hf[0], hf_b=hf[1], dir_a=dirs[0])
               for case, (dirs, hf) in models.items()}
    finally:
        tied.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_senders(works, refs):
    """Runs each sender's work (one per stage) in its own thread while the engines' ``refs``
    complete: both sides of a group op block until the other side is there."""
    results, errors = [None] * len(works), []

    def run(i, work):
        try:
            results[i] = work()
        except BaseException as e:  # re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, w), daemon=True) for i, w in enumerate(works)]
    for th in threads:
        th.start()
    got = ray.get(refs, timeout=300)
    for th in threads:
        th.join(timeout=300)
    if errors:
        raise errors[0]
    return got, results


def hf_seq_logprobs(model, seq: list[int], start: int = 1, temperature: float = 1.0) -> torch.Tensor:
    """log p(seq[t] | seq[:t]) for t >= start."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, start - 1:-1].double() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(seq[start:])[:, None])[:, 0]


def _max_prompt_diff(pool, model, seqs) -> float:
    got = pool.prompt_logprobs(seqs)
    worst = 0.0
    for seq, lps in zip(seqs, got):
        assert lps[0] == 0.0
        ref = hf_seq_logprobs(model, seq)
        worst = max(worst, (torch.tensor(lps[1:], dtype=torch.float64) - ref).abs().max().item())
    return worst


def _state_dict(model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        # What an HF checkpoint (and the trainer) holds for a tied model: no lm_head.weight. Sent
        # anyway, vLLM 0.32's Qwen2 would load it into the shared Parameter and thereby rebuild the
        # lm_head's GEMM, hiding the stale-handle trap this test is about.
        del sd["lm_head.weight"]
    return sd


def _stage_plans(sd: dict[str, torch.Tensor], stages: int) -> list:
    """Each stage's bucket plan, cut like actor PP stages would own the weights: with two stages,
    the embedding and layers 0-1 on the first, layers 2-3, the final norm and lm_head on the last."""
    def stage(name: str) -> int:
        if stages == 1:
            return 0
        if name.startswith("model.layers."):
            return int(int(name.split(".")[2]) >= 2)
        return 0 if "embed_tokens" in name else 1

    return [plan_buckets([TensorSpec(k, tuple(v.shape), "float32") for k, v in sd.items() if stage(k) == s],
                         BUCKET_BYTES) for s in range(stages)]


def test_plan_must_cover_the_model(setups):
    """A plan that misses a weight would leave it stale; the engines refuse it before joining."""
    pool = setups["tied"]["pool"]
    sd = _state_dict(setups["tied"]["hf_b"])
    del sd["model.layers.1.mlp.up_proj.weight"]
    plan = _stage_plans(sd, 1)
    with pytest.raises(ray.exceptions.RayTaskError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        ray.get(pool.init_weight_sync([_link(0, 1)], plan))
    with pytest.raises(ValueError, match="expect \\[2\\] receivers"):
        pool.init_weight_sync([_link(0, 2)], plan)


FREED_HEAP = """
import os, sys, torch
from rollout.worker_extension import return_freed_heap

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20

# 4,000 blocks of 64 KiB, below glibc's mmap threshold: ~250 MiB inside the heap, and one block after
# them, so that freeing them leaves the heap's top in use and glibc itself returns nothing.
blocks = [torch.ones(16 << 10) for _ in range(4000)]
last = torch.ones(16 << 10)
del blocks
before = rss_mib()
assert return_freed_heap()
after = rss_mib()
assert before - after > 150, (before, after)
assert float(last.sum()) == 16 << 10

# Without malloc_trim (a C library other than glibc) it says so once and does nothing.
import ctypes, logging
from rollout import worker_extension
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("rollout.worker_extension").addHandler(Keep())
class NoTrim:
    pass
real_cdll = ctypes.CDLL
ctypes.CDLL = lambda name: NoTrim()
assert not return_freed_heap() and not return_freed_heap()
ctypes.CDLL = real_cdll
assert len(records) == 1 and "no malloc_trim" in records[0], records
print("ok")
"""


def test_a_reload_hands_the_freed_heap_back():
    """``return_freed_heap``, which the worker calls after each reload (the cpu profile's prepacked
    engines; every engine case of this file but tp2 runs that path), returns the free pages of the heap to
    the kernel: the freed temporaries of one sync no longer stay resident into the next. Without
    malloc_trim it warns once."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", FREED_HEAP], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_only_the_expected_reload_warnings_are_dropped():
    """vLLM's reload warns "<layer>: Failed to load weights" for each layer that got no tensor: the
    rotary layer always (its cache is its own), a tied lm_head once the plan check has seen the tie
    (its weight is embed_tokens', sent under that name), any other layer never dropped."""
    import logging

    from rollout.worker_extension import _DropExpectedReloadWarnings

    dropped = _DropExpectedReloadWarnings()

    def shown(layer: str, message: str = "%s: Failed to load weights") -> bool:
        return dropped.filter(logging.LogRecord("vllm", logging.WARNING, __file__, 1, message, (layer,), None))

    assert not shown("RotaryEmbedding") and shown("ParallelLMHead") and shown("QKVParallelLinear")
    dropped.layers.add("ParallelLMHead")  # what the plan check does for a tied model
    assert not shown("ParallelLMHead") and shown("QKVParallelLinear") and shown("VocabParallelEmbedding")
    assert shown("RotaryEmbedding", "%s: Delayed processing")


def _link(stage: int, receivers: int) -> StageLink:
    """A broadcast link whose writer (the stage's sender) is this test process."""
    return StageLink(stage, "127.0.0.1", _free_port(), writers=1, receivers=receivers, transport="broadcast")


def _connect(pool, plans, world):
    """One stage group per plan: the test process is each group's rank 0 (the stage's sender)."""
    links = [_link(s, world - 1) for s in range(len(plans))]
    ranks, groups = _with_senders(
        [lambda link=link: WeightSyncGroup(link.host, link.port, 0, world) for link in links],
        pool.init_weight_sync(links, plans))
    return ranks, groups


def _senders(groups, plans, sd):
    """The stages send in parallel, each its own buckets, as the actor's stage senders do."""
    def send(group, plan):
        names = [t.name for b in plan for t in b.tensors if t.rows is None or t.rows[0] == 0]
        return send_buckets(group, plan, iter([(n, sd[n]) for n in names]), with_checksums=True)
    return [lambda g=g, p=p: send(g, p) for g, p in zip(groups, plans)]


@pytest.mark.parametrize("case", list(CASES))
def test_synced_engines_compute_the_sent_model(setups, case):
    s = setups[case]
    pool, hf_a, hf_b = s["pool"], s["hf_a"], s["hf_b"]
    engines, tp, stages = CASES[case]["engines"], CASES[case]["tp"], CASES[case]["stages"]
    world = 1 + engines * tp
    sd_a, sd_b = _state_dict(hf_a), _state_dict(hf_b)
    plans = _stage_plans(sd_b, stages)
    where = {t.name: i for i, b in enumerate(plans[0]) for t in b.tensors}
    q, v = (where[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qv")
    assert len(plans[0]) > 3 and q != v  # a fused qkv_proj arrives over two buckets

    rng = torch.Generator().manual_seed(0)
    seqs = [[1] + torch.randint(4, 16, (n,), generator=rng).tolist() for n in (9, 24, 40)]
    long_prompt = [1] + torch.randint(4, 16, (150,), generator=rng).tolist()
    assert _max_prompt_diff(pool, hf_a, seqs) <= 1e-3  # engines hold model A
    # Fill every engine's prefix cache with model A's KV of the long prompt.
    pool.generate([long_prompt] * engines, n=1, temperature=0.0, max_tokens=2)

    ranks, groups = _connect(pool, plans, world)
    assert ranks == [[1 + e * tp] * stages for e in range(engines)]

    stats, sent = _with_senders(_senders(groups, plans, sd_b), pool.receive_weights(5))
    total = sum(b.numel for plan in plans for b in plan) * 4
    assert sum(st["bytes"] for st in sent) == total
    for st in stats:
        assert st["version"] == 5 and st["buckets"] == sum(map(len, plans)) and st["bytes"] == total
        assert st["load"] == ("reload" if CASES[case]["cpu_prepack"] else "in_place")

    assert _max_prompt_diff(pool, hf_b, seqs) <= 1e-3
    # The long prompt again: served from a stale prefix cache its log-probs would be model A's.
    trajs = pool.generate([long_prompt] * engines, n=2, temperature=1.0, max_tokens=4, seed=3)
    assert {t.weight_version for t in trajs} == {5}
    for t in trajs:
        ref = hf_seq_logprobs(hf_b, t.prompt_ids + t.response_ids, start=len(t.prompt_ids))
        assert (torch.tensor(t.response_logprobs, dtype=torch.float64) - ref).abs().max().item() <= 1e-3

    # The checksum check (rollout.check_weights): what the senders packed == what every engine holds.
    expected = {k: v for st in sent for k, v in st["checksums"].items()}
    assert expected == checksum(sorted(sd_b.items()))
    engine_sums = pool.weight_checksums()
    check_engines(expected, engine_sums)
    for got in engine_sums:
        # The output projection the engine multiplies by (read through its GEMM): for a tied model
        # it must be the NEW embedding, not the one the lm_head's prepacked handle was built from.
        assert got["lm_head.weight"] == pytest.approx(
            expected["model.embed_tokens.weight" if CASES[case]["tied"] else "lm_head.weight"], rel=1e-9)

    # The groups stay up: a second sync (back to model A) over the same groups.
    _with_senders(_senders(groups, plans, sd_a), pool.receive_weights(6))
    assert _max_prompt_diff(pool, hf_a, seqs) <= 1e-3
    assert pool.versions() == [6] * engines


def test_a_corrupted_bucket_is_caught_by_the_checksum_check(setups):
    """One value flipped in a packed bucket on its way out (after the sender's checksums were
    taken): the engine loads it, and the check names exactly that tensor."""
    s = setups["untied"]
    pool, engines = s["pool"], CASES["untied"]["engines"]
    sd = _state_dict(s["hf_b"])
    plans = _stage_plans(sd, 1)
    target = "model.layers.2.mlp.down_proj.weight"
    index = next(i for i, b in enumerate(plans[0]) if any(t.name == target for t in b.tensors))
    offset = 0
    for t in plans[0][index].tensors:
        if t.name == target:
            break
        offset += t.numel
    _, (group,) = _connect(pool, plans, 1 + engines)
    real_broadcast, calls = group.broadcast_async, []

    def corrupting_broadcast(flat, src=0):  # the sender posts its buckets in plan order
        if len(calls) == index:
            flat[offset + 7] += 1.0
        calls.append(flat.numel())
        return real_broadcast(flat, src)

    group.broadcast_async = corrupting_broadcast
    _, (sent,) = _with_senders(_senders([group], plans, sd), pool.receive_weights(7))
    with pytest.raises(WeightMismatchError, match=r"rollout engine 0 holds a different "
                                                  rf"{re.escape(target)} "):
        check_engines(sent["checksums"], pool.weight_checksums(), list(sent["checksums"]))


@pytest.mark.e2e
def test_weight_sync_makes_vllm_match_the_trained_tied_pp2_actor(cluster, setups):
    """A Megatron actor (PP2, tied embeddings: the last stage's lm_head copy must follow the first
    stage's embedding) from the tied engine's model A, which the engine holds again after the test
    above; a large real update; after the sync the engine scores as the trained actor does and every
    HF tensor it holds equals the trainer's."""
    from megatron_workers import MegatronGroup
    from rlcore.algos import LossConfig, loss_weights
    from rlcore.batch import Batch
    from rlcore.config import OptimConfig
    from rlcore.roles import RoleSpec
    from rlcore.weight_sync import connect_weight_sync, sync_weights

    s = setups["tied"]
    rollout = s["pool"]
    actor = MegatronGroup(RoleSpec("actor", s["dir_a"], tp=1, pp=2, dp=1, micro_batch_size=4, profile="cpu",
                                   dtype="float32", seed=0, optim=OptimConfig(lr=0.05, clip_grad=0.0)),
                          cluster.placement("actor"))
    try:
        connect_weight_sync(actor, rollout, 1, bucket_bytes=256 * 1024, wire_dtype="float32")
        g = torch.Generator().manual_seed(0)
        input_ids = torch.randint(4, 16, (8, 12), generator=g)
        response_mask = torch.zeros(8, 12)
        response_mask[:, 5:] = 1.0
        batch = Batch(input_ids=input_ids, attention_mask=torch.ones(8, 12, dtype=torch.long),
                      response_mask=response_mask)
        seqs = input_ids.tolist()
        mask = torch.zeros_like(response_mask).bool()
        mask[:, 1:] = True  # every position that has a prefix
        every_position = Batch(input_ids=input_ids)  # no response mask: every output is computed

        before = torch.tensor(rollout.prompt_logprobs(seqs))
        assert (before - actor.forward(every_position)["logprobs"])[mask].abs().max() < 1e-3, "same model must agree"

        # A large step so the new weights are far from the engine's.
        batch["old_logprobs"] = actor.forward(batch)["logprobs"]
        batch["advantages"] = torch.randn(input_ids.shape, generator=torch.Generator().manual_seed(1))
        batch["loss_weights"] = loss_weights(response_mask, "token-mean", norm_length=7)
        actor.update(batch, LossConfig(kl_coeff=0.0))
        trained = actor.forward(every_position)["logprobs"]
        stale = torch.tensor(rollout.prompt_logprobs(seqs))
        assert (stale - trained)[mask].abs().max() > 1e-2, "the update should move the log-probs"

        sync_weights(actor, rollout, version=7)
        synced = torch.tensor(rollout.prompt_logprobs(seqs))
        assert (synced - trained)[mask].abs().max() <= 1e-3
        # And the weights themselves: every HF tensor the engine holds equals the trainer's.
        expected = checksum(list(actor.hf_state_dict().items()))
        (engine_sums,) = rollout.weight_checksums()
        for name, value in expected.items():
            assert engine_sums[name] == pytest.approx(value, rel=1e-9, abs=1e-9), name
        trajs = rollout.generate([seqs[0][:5]], n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=2)
        assert {t.weight_version for t in trajs} == {7}
    finally:
        actor.shutdown()
