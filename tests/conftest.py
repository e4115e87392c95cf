"""Shared fixtures: a local Ray cluster with logical GPUs and named pools, one per test module."""
import pytest

from rlcore.placement import ResourcePools, start_ray


@pytest.fixture(scope="module")
def ray_pools():
    """``ray_pools(pools, role_pools)`` starts Ray with as many logical GPUs as the pools hold (once
    per module) and returns the ``ResourcePools``; everything is torn down after the module."""
    import ray

    made = []

    def start(pools: dict[str, int], role_pools: dict[str, str]) -> ResourcePools:
        start_ray("cpu", total_gpus=sum(pools.values()), num_cpus=2)
        made.append(ResourcePools(pools, role_pools))
        return made[-1]

    yield start
    for pools in made:
        pools.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def qwen2_untied(tmp_path_factory):
    """The quickstart's architecture: Qwen2 (random qkv biases), untied embeddings."""
    from launch.assets import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2-untied")), arch="qwen2")


@pytest.fixture(scope="session")
def llama_tied(tmp_path_factory):
    """A Llama with tied input/output embeddings."""
    from launch.assets import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("llama-tied")), arch="llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    """(model, data): the quickstart's tiny Qwen2 and its addition parquet, built for one module."""
    from launch.assets import make_addition_data, make_tiny_model

    root = tmp_path_factory.mktemp("tiny-assets")
    return make_tiny_model(str(root / "model")), make_addition_data(str(root / "data"))
