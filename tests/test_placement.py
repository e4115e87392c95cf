import pytest

from rlcore.placement import ResourcePools


def test_resource_pools_refuse_more_gpus_than_the_cluster_has(ray_pools):
    from tests.conftest import SHARED_RAY_GPUS

    ray_pools({"actor": 1}, {"actor": "actor"})  # the tests' cluster: SHARED_RAY_GPUS logical GPUs
    with pytest.raises(RuntimeError, match=rf"need {SHARED_RAY_GPUS + 1} GPUs, but the Ray cluster has "
                                           rf"{SHARED_RAY_GPUS}"):
        ResourcePools({"actor": SHARED_RAY_GPUS, "rollout": 1}, {"actor": "actor", "rollout": "rollout"})


def test_math_threads_are_a_processes_share_of_the_cores():
    from rlcore.placement import math_threads

    assert math_threads(2, 3) == 1  # the SmolLM2 job on 2 cores: actor PP2 + one engine
    assert math_threads(16, 5) == 3  # never more threads than cores in all
    assert math_threads(16, 1) == 16
    with pytest.raises(ValueError, match="cores=0"):
        math_threads(0, 3)


def test_job_threads_count_every_pool_and_node(tmp_path):
    from launch.compose import job_threads
    from rlcore.layout import RoleLayout, RolloutLayout
    from rlcore.config import JobConfig
    from rlcore.validate import JobLayout

    actor = RoleLayout(pool="actor", gpus=2, tp=1, pp=2, dp=1)
    layout = JobLayout(actor=actor, reference=actor, rollout=RolloutLayout("rollout", 2, engines=1, tp=2),
                       device="cpu", total_gpus=4, dtype="float32")
    cfg = JobConfig()
    cfg.resources.num_cpus = 12
    # The synchronous loop runs one phase at a time: each role's ranks share the 12 cores alone.
    assert job_threads(cfg, layout) == {"actor": 6, "reference": 6, "rollout": 6}
    cfg.trainer.off_policy_steps = 1  # sampling ahead: 2 actor + 2 reference ranks + 2 vLLM workers at once
    assert job_threads(cfg, layout) == {"actor": 2, "reference": 2, "rollout": 2}
    cfg.resources.nodes = 2
    assert job_threads(cfg, layout) == {"actor": 4, "reference": 4, "rollout": 4}  # 3 processes per node
    cfg.trainer.off_policy_steps, cfg.resources.nodes = 0, 1
    cfg.resources.num_cpus = 2  # 2 cores: the PP2 ranks and the engine's 2 TP workers 1 thread each
    assert job_threads(cfg, layout) == {"actor": 1, "reference": 1, "rollout": 1}
    one_worker = JobLayout(actor=actor, reference=None, rollout=RolloutLayout("rollout", 1, engines=1, tp=1),
                           device="cpu", total_gpus=3, dtype="float32")
    assert job_threads(cfg, one_worker) == {"actor": 1, "rollout": 2}  # the SmolLM2 job: the engine gets both
    # A reference in the actor's processes has no ranks of its own: it computes with the actor's threads.
    hosted = JobLayout(actor=actor, reference=RoleLayout(pool="actor", gpus=2, tp=1, pp=2, dp=1, host="actor"),
                       rollout=RolloutLayout("rollout", 2, engines=1, tp=2), device="cpu", total_gpus=4,
                       dtype="float32")
    cfg.resources.num_cpus, cfg.trainer.off_policy_steps = 12, 1  # 2 actor ranks + 2 vLLM workers at once
    assert job_threads(cfg, hosted) == {"actor": 3, "reference": 3, "rollout": 3}


def test_vllm_cpu_threads_bind_gives_each_worker_its_own_cores():
    from rollout.engine import cpu_threads_bind

    cpus = list(range(8))
    assert cpu_threads_bind(0, 2, 2, cpus) == "0,1|2,3"
    assert cpu_threads_bind(1, 2, 2, cpus) == "4,5|6,7"  # the next engine's block
    assert cpu_threads_bind(2, 2, 2, cpus) == "nobind"  # past the cores: the OS places them
    assert cpu_threads_bind(0, 2, 1, [0]) == "nobind"  # 2 workers, 1 core: pinning would serialise them
