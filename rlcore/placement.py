"""Resource pools: named Ray placement groups of one-GPU bundles, and the roles placed on them.

On the cpu profile Ray is started with logical GPUs (``num_gpus=N``), so exactly this code places
the roles on a laptop and on a cluster. Roles that name the same pool time-share its GPUs: each of
their actors asks for ``1 / roles_on_pool`` of a bundle's GPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from rlcore import reaper, worker_logs

# A worker process starts with one math thread; the Megatron engines and the vLLM engines then take
# their share of the cores (``math_threads``). More threads than cores were 5-100x slower on a shared
# 2-core box whenever another process held a core (docs/cpu-profile.md).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def math_threads(cores: int, processes: int) -> int:
    """Each compute process's math threads: its share of ``cores`` among the ``processes`` placed on
    them (every Megatron rank of every role and every vLLM worker), at least one. Never more threads
    than cores in all: oversubscribed threads wait on each other in every parallel region."""
    if cores < 1 or processes < 1:
        raise ValueError(f"math_threads: cores={cores} and processes={processes} must be >= 1")
    return max(1, cores // processes)
# vLLM logs dozens of INFO lines per engine start and per weight reload; the console is for the
# training progress. Set VLLM_LOGGING_LEVEL=INFO in the environment to see them again. A run
# (rlcore/worker_logs.py) keeps them at INFO in run_dir/logs/, off the console.
LOG_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}


def keep_stop_handlers_through_shutdown() -> None:
    """This process's Ray (the driver's, not the workers') without abseil's failure-signal handler.
    Ray 2.60 installs it over SIGTERM at ``ray.init`` and, early in ``ray.shutdown()``, sets SIGTERM
    back to the default in C, behind Python's handler: a preempted run's second SIGTERM during the
    ~1.5 s shutdown (Slurm may signal again) then killed ``rlx train`` with -15 after its checkpoint
    instead of letting it exit 75, and launch/rlx.sbatch did not requeue the job. The handler only
    prints a native stack when the driver itself crashes; Python's own tracebacks are unaffected.
    Ray reads the switch (its ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``) when it builds this process's
    core worker; the workers read their own environment and keep theirs."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"):
        raise RuntimeError("ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER is gone: this code "
                           "targets Ray 2.60, which setup.py pins")
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def start_ray(device: str, total_gpus: int, address: str | None = None, num_cpus: int | None = None) -> None:
    """Connects to ``address`` (a Slurm-started cluster) or starts a local Ray; on the cpu profile
    the local cluster gets ``total_gpus`` logical GPUs."""
    import ray

    if ray.is_initialized():
        return
    keep_stop_handlers_through_shutdown()
    # Ray actors must import this repository's packages wherever they run.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: os.environ.get(k, v) for k, v in worker_logs.log_env(LOG_ENV).items()}
    env.update(WORKER_ENV, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    kwargs = dict(runtime_env={"env_vars": env}, include_dashboard=False, log_to_driver=True)
    if address:
        ray.init(address=address, **kwargs)
        return
    # address="local": always a fresh cluster, never one that `ray start` left on this machine (Ray's
    # default would join the latest cluster in /tmp/ray and then refuse num_gpus).
    kwargs["address"] = "local"
    # Every process of the local cluster carries the marker and dies with this one (rlcore/reaper.py).
    os.environ[reaper.MARKER_ENV] = reaper.this_process_marker()
    try:
        if device == "cpu":
            # Logical GPUs, and a small object store: batches are small and RAM is shared with every
            # worker on a laptop-sized box. No idle workers started ahead: the two Ray started (one per
            # CPU) were never used (each role's actor came up in a new process of its own) and took
            # ~1.2 CPU-s of a 2-core box's start-up, and their memory for the whole run.
            ray.init(num_gpus=total_gpus, num_cpus=num_cpus or os.cpu_count(),
                     object_store_memory=512 * 1024 ** 2, _system_config={"prestart_worker_first_driver": False},
                     **kwargs)
        else:
            ray.init(num_cpus=num_cpus, **kwargs)
    finally:  # only Ray's processes inherit it, not what this process starts later
        del os.environ[reaper.MARKER_ENV]
    worker_logs.link_ray_session()  # run_dir/logs/ray: the session's own logs, next to the workers'


@dataclass
class RolePlacement:
    """Where one role's actors go: bundle ``bundle_indices[i]`` of ``placement_group`` hosts actor i."""

    pool: str
    placement_group: object  # ray.util.placement_group.PlacementGroup
    bundle_indices: list[int]
    gpu_fraction: float  # num_gpus each actor asks for

    def actor_options(self, i: int) -> dict:
        """``.options(**...)`` for the role's i-th actor."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(num_cpus=0, num_gpus=self.gpu_fraction,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_group,
                        placement_group_bundle_index=self.bundle_indices[i]))


class ResourcePools:
    """Creates one placement group per named pool and hands out role placements."""

    def __init__(self, pools: dict[str, int], role_pools: dict[str, str], timeout_s: float = 120.0):
        import ray
        from ray.util.placement_group import placement_group

        self._groups = {}
        wanted = {name: gpus for name, gpus in pools.items() if name in role_pools.values()}
        have = ray.cluster_resources().get("GPU", 0)
        if sum(wanted.values()) > have:
            raise RuntimeError(f"resources.pools {wanted} need {sum(wanted.values())} GPUs, but the Ray cluster "
                               f"has {have:g}")
        for name, gpus in pools.items():
            if name not in role_pools.values():
                continue  # a declared pool no role uses holds no GPUs
            pg = placement_group([{"GPU": 1}] * gpus, strategy="PACK", name=f"rlx-pool-{name}")
            ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
            if not ready:
                raise RuntimeError(f"resources.pools.{name}: Ray could not reserve {gpus} GPUs within "
                                   f"{timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}")
            self._groups[name] = (pg, gpus)
        self._sharing = {p: sum(1 for q in role_pools.values() if q == p) for p in role_pools.values()}
        self._role_pools = role_pools

    def placement(self, role: str) -> RolePlacement:
        pool = self._role_pools[role]
        pg, gpus = self._groups[pool]
        return RolePlacement(pool, pg, list(range(gpus)), 1.0 / self._sharing[pool])

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg, _ in self._groups.values():
            remove_placement_group(pg)
        self._groups.clear()
