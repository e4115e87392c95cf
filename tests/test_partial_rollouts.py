"""Partial rollouts (rollout.partial_rollouts): a weight sync lands in the middle of a generation,
between two engine steps, and the generation goes on with its running requests and their KV cache.

On the real tiny vLLM engine (a Ray actor, as in a run; the senders are this test process, as in
tests/test_rollout_weight_sync.py): a test hook holds the generation after N engine steps, the sync
runs, and every token records the version that sampled it; the tokens before the pause carry the
old weights' log-probs and the tokens after it the new weights'. The new weights differ from the old
ones in the final norm only, which no KV entry depends on, so "the new weights' log-probs" are
exactly a full forward of the new model (with any other change the later tokens would attend to KV
the old weights computed: that is what a partial rollout is, and what rollout correction is for).
A second sync mid-generation to an unrelated model then shows that the prefix cache serves no KV
of older weights afterwards. Last, the quickstart with the option on, its syncs landing mid-generation."""
from __future__ import annotations

import copy
import threading

import pytest
import ray
import torch

from launch.assets import make_tiny_model
from rlcore.config import RolloutConfig
from rlcore.validate import validate
from tests.runs import ONE_RANK
from tests.test_config import assert_in, files, job, validate_error  # noqa: F401 (files: a fixture)
from tests.test_rollout_weight_sync import (MAX_LEN, _connect, _senders, _stage_plans, _state_dict, _with_senders,
                                            hf_seq_logprobs)

HOLD_AFTER = 3  # engine steps before the sync: the prefill's token and two more
# The module's pools (logical GPUs of the tests' Ray cluster): the unit tests' engine on a pool of its
# own; the e2e run's job reserves its own (its actor 2, its rollout 1) from the GPUs left free.
MODULE_POOLS = {"partial": 1, "actor": 2, "rollout": 1}


@pytest.fixture(scope="module")
def cluster(ray_pools):
    return ray_pools(MODULE_POOLS, {"rollout": "partial"})


@pytest.fixture(scope="module")
def setup(cluster, tmp_path_factory):
    """A one-engine pool with partial rollouts on, started on model A; A, B (A with its final norm
    scaled) and C (unrelated) as HF models."""
    from transformers import AutoModelForCausalLM

    from rollout import RolloutPool

    root = tmp_path_factory.mktemp("partial")
    dir_a, dir_c = (make_tiny_model(str(root / name), seed=seed, max_position_embeddings=MAX_LEN)
                    for name, seed in (("a", 31), ("c", 32)))
    hf_a, hf_c = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (dir_a, dir_c))
    hf_b = copy.deepcopy(hf_a)
    with torch.no_grad():
        hf_b.model.norm.weight.mul_(torch.linspace(1.5, 3.0, hf_b.model.norm.weight.numel()))
    pool = RolloutPool(dir_a, RolloutConfig(engines=1, kv_cache_gb=0.25, partial_rollouts=True),
                       cluster.placement("rollout"), "cpu", "float32", seed=0)
    try:
        plans = _stage_plans(_state_dict(hf_b), 1)
        _, groups = _connect(pool, plans, 2)
        yield dict(pool=pool, groups=groups, plans=plans, hf_a=hf_a, hf_b=hf_b, hf_c=hf_c)
    finally:
        pool.shutdown()


def _generate_with_sync_after(s, steps: int, model, version: int, prompts, **sampling):
    """A generation held after ``steps`` engine steps, ``model`` synced in as ``version`` right there,
    then let go; returns its trajectories and the engine's sync report."""
    pool, out = s["pool"], {}
    pool.hold_after_steps(steps)
    worker = threading.Thread(target=lambda: out.update(trajs=pool.generate(prompts, **sampling)), daemon=True)
    worker.start()
    assert pool.wait_held(300) == [True]
    (report,), _ = _with_senders(_senders(s["groups"], s["plans"], _state_dict(model)), pool.receive_weights(version))
    worker.join(300)
    assert "trajs" in out, "the generation did not finish after the sync"
    return out["trajs"], report


def test_tokens_after_a_mid_generation_sync_are_sampled_by_the_new_weights(setup):
    rng = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(4, 16, (n,), generator=rng).tolist() for n in (5, 9)]
    trajs, report = _generate_with_sync_after(setup, HOLD_AFTER, setup["hf_b"], 1, prompts, n=3, temperature=1.0,
                                              max_tokens=10, seed=7)
    assert report["mid_generation"] and report["version"] == 1
    spanning = 0
    for t in trajs:
        before = min(HOLD_AFTER, len(t.response_ids))  # one token per request per step (all fit in one batch)
        assert t.token_versions == [0] * before + [1] * (len(t.response_ids) - before)
        assert t.weight_version == 0 and t.spans_versions == (len(t.response_ids) > before)
        seq = t.prompt_ids + t.response_ids
        got = torch.tensor(t.response_logprobs, dtype=torch.float64)
        old, new = (hf_seq_logprobs(setup[m], seq, start=len(t.prompt_ids)) for m in ("hf_a", "hf_b"))
        assert (got[:before] - old[:before]).abs().max().item() <= 1e-3
        if t.spans_versions:
            spanning += 1
            assert (got[before:] - new[before:]).abs().max().item() <= 1e-3
            assert (old[before:] - new[before:]).abs().max().item() > 0.05  # the two models tell apart
    assert spanning >= 4  # of 6 samples of up to 10 tokens: most do not stop within 3


def test_no_stale_prefix_cache_after_a_partial_rollout(setup):
    """The long prompt's KV is cached by the engine's current weights, then a sync to model C lands
    while a generation on it runs: afterwards the same prompt must be computed by C (the cache was
    reset once the generation was done), not served from KV of the weights before."""
    pool = setup["pool"]
    (v,) = pool.versions()
    rng = torch.Generator().manual_seed(1)
    long_prompt = [1] + torch.randint(4, 16, (150,), generator=rng).tolist()  # longer than a CPU KV block (128)
    pool.generate([long_prompt], n=1, temperature=0.0, max_tokens=2)
    trajs, report = _generate_with_sync_after(setup, 2, setup["hf_c"], v + 1, [long_prompt], n=2, temperature=1.0,
                                              max_tokens=6, seed=3)
    assert report["mid_generation"] and {t.weight_version for t in trajs} == {v}
    after = pool.generate([long_prompt], n=2, temperature=1.0, max_tokens=4, seed=4)
    for t in after:
        assert t.token_versions == [v + 1] * len(t.response_ids)
        ref = hf_seq_logprobs(setup["hf_c"], t.prompt_ids + t.response_ids, start=len(t.prompt_ids))
        assert (torch.tensor(t.response_logprobs, dtype=torch.float64) - ref).abs().max().item() <= 1e-3
    # An idle engine's sync resets the prefix cache at once, as without partial rollouts.
    _with_senders(_senders(setup["groups"], setup["plans"], _state_dict(setup["hf_a"])), pool.receive_weights(v + 2))
    assert pool.versions() == [v + 2]


def test_an_engine_dying_under_a_partial_rollout_is_restarted_after_the_generation_ahead_ends(setup):
    """The restart policy with a generation in flight on another thread (the producer's, held on the
    engine): the sync that meets the dead engine waits for that generation to end before it restarts
    anything; the engine then really dies (SIGKILL), the held generation fails as a death ahead of its
    step (the queue samples that batch again at its step), and only then does the policy decide (here
    max_engine_restarts=0: the sentence that stops the run, so no actor is needed), after which no
    generation ahead may start. The last test on the module's engine: it kills it."""
    import os
    import signal
    import time

    from rlcore.engine_restarts import EngineRestarts
    from rlcore.faults import EngineDied, EngineDiedAhead

    pool = setup["pool"]
    restarts = EngineRestarts(None, pool, RolloutConfig(engines=1, partial_rollouts=True, engine_timeout_s=120,
                                                        max_engine_restarts=0))
    pool.hold_after_steps(2)
    raised, order = {}, []

    def produce():
        try:
            restarts.generate([[1, 5, 6, 7]], n=2, max_tokens=8)
        except EngineDiedAhead as e:
            raised["generation"] = e
            order.append("generation failed")

    def kill_later():  # the engine really dies while the trainer's thread waits below
        time.sleep(3)
        order.append("killed")
        os.kill(pool.pids()[0], signal.SIGKILL)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    assert pool.wait_held(300) == [True]
    threading.Thread(target=kill_later, daemon=True).start()
    with pytest.raises(EngineDied) as err:  # what the trainer's sync calls when it meets a dead engine
        restarts._replace(EngineDied([0], "the weight sync to version 9"))
    order.append("policy decided")
    producer.join(300)
    # It waited for the held generation: that ended only once the engine was killed.
    assert order == ["killed", "generation failed", "policy decided"]
    raised["sync"] = err.value
    assert str(raised["generation"]).startswith("rollout engine 0 died during generation ahead of its step")
    assert "the trainer restarts it and samples that batch again at its step" in str(raised["generation"])
    assert str(raised["sync"]) == (
        "rollout engine 0 died during the weight sync to version 9 (its process exited) after 0 engine restart(s) "
        "in this run, the limit of rollout.max_engine_restarts=0: stopping, the last checkpoint is intact")
    late = []  # a generation ahead after the restart began (on the producer's thread, as in a run)
    ahead = threading.Thread(target=lambda: late.append(_raises(restarts.generate, [[1, 5]], n=1)))
    ahead.start()
    ahead.join(60)
    assert isinstance(late[0], EngineDiedAhead), late
    assert str(late[0]).startswith("rollout engine 0 died during generation ahead of its step (it was being restarted)")
    assert restarts.restarts == 0


def _raises(fn, *args, **kwargs) -> BaseException | None:
    try:
        fn(*args, **kwargs)
    except BaseException as e:  # handed to the test's thread
        return e
    return None


def test_partial_rollouts_need_a_batch_generating_ahead(files):
    message = validate_error(files, "rollout.partial_rollouts=true")
    assert_in(message, "rollout.partial_rollouts=true needs trainer.off_policy_steps >= 1 (it is 0")
    validate(job(files, "rollout.partial_rollouts=true", "trainer.off_policy_steps=1"))


@pytest.mark.e2e
def test_quickstart_with_partial_rollouts(tmp_path, tiny_assets, cluster):
    """3 quickstart steps (answers of up to 8 tokens), one step ahead, with partial rollouts: batches
    2 and 3 are held after 2 engine steps until the sync of the step before lands, so on the whole
    stack (the trainer's threads, the shm transport, vLLM-CPU's reload) that sync pauses a generation
    and the batch trained next mixes two versions, with the lag still <= 1."""
    import json

    from launch.compose import build_trainer
    from rlcore.job import load_job

    model, data = tiny_assets
    run_dir = tmp_path / "run"
    cfg = load_job("yaml_configs/quickstart_cpu.yaml", [
        f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]", f"trainer.run_dir={run_dir}",
        "trainer.val_every=0", "trainer.total_steps=3", "trainer.off_policy_steps=1", "rollout.partial_rollouts=true",
        "rollout.max_response_length=8", "rollout.sync_timeout_s=120", "trainer.logger=[console,jsonl]", *ONE_RANK])
    layout = validate(cfg)
    trainer = None
    try:
        trainer = build_trainer(cfg, layout)
        pool, real_generate, calls = trainer.rollout, trainer.rollout.generate, []

        def generate_held(*args, **kwargs):
            calls.append(1)
            if len(calls) > 1:  # batch 1 trains first: no sync comes while it generates
                pool.hold_after_steps(2)
            return real_generate(*args, **kwargs)

        pool.generate = generate_held
        trainer.fit()
    finally:
        if trainer is not None:
            trainer.shutdown()  # its pools too; the tests' Ray cluster stays up for the next module
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and len(calls) == 3
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]  # the first token's version
    assert [r["rollout/sync_mid_generation"] for r in rows] == [1.0, 1.0, 0.0]  # step 3's finds nothing running
    assert rows[0]["rollout/multi_version_frac"] == 0.0
    assert all(r["rollout/multi_version_frac"] > 0.5 for r in rows[1:]), [r["rollout/multi_version_frac"] for r in rows]
    assert rows[-1]["weights/version"] == 3.0
