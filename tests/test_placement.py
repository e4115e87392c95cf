import pytest

from rlcore.placement import ResourcePools


def test_resource_pools_refuse_more_gpus_than_the_cluster_has(ray_pools):
    ray_pools({"actor": 1}, {"actor": "actor"})  # starts Ray with 1 logical GPU
    with pytest.raises(RuntimeError, match=r"need 3 GPUs, but the Ray cluster has 1"):
        ResourcePools({"actor": 2, "rollout": 1}, {"actor": "actor", "rollout": "rollout"})
