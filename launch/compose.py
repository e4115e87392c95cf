"""The composition root: the one place that knows which class plays which role.

``build_trainer`` loads the task (tokenizer, datasets, reward function) while Ray starts, so that bad
inputs fail before any role starts, then starts the resource pools, builds each role from its spec
(Megatron groups with the LM or value head, the vLLM rollout pool), connects the weight sync between
the actor and the engines, and hands it all to ``rlcore.trainer.Trainer``, which knows the roles only
as protocols.
"""
from __future__ import annotations

import os
import threading
from dataclasses import replace
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from launch.report import write_after_run
from rlcore import checkpoint
from rlcore.config import JobConfig
from rlcore.data import load_task
from rlcore.judge import judge_rollout_config
from rlcore.layout import RoleLayout
from rlcore.lr_schedule import role_schedule
from rlcore.validate import REWARD_MODEL_SECTIONS, JobLayout
from rlcore.placement import ResourcePools, math_threads, start_ray
from rlcore.roles import Roles, RoleSpec
from rlcore.trainer import Trainer
from rlcore.weight_sync import connect_weight_sync


def role_spec(name: str, lay: RoleLayout, layout: JobLayout, model_path: str, micro_batch_size: int, seed: int,
              head: str = "lm", optim=None, threads: int = 1, shared_prompt: bool = False,
              max_tokens_per_micro_batch: int | None = None, lr_schedule=None) -> RoleSpec:
    return RoleSpec(name, model_path, tp=lay.tp, pp=lay.pp, dp=lay.dp, vpp=lay.vpp, pp_layers=lay.pp_layers,
                    micro_batch_size=micro_batch_size, profile=layout.device, dtype=layout.dtype, seed=seed,
                    head=head, optim=optim, threads=threads, host_malloc=layout.host_malloc,
                    host_hugepages=layout.host_hugepages,
                    shared_prompt=shared_prompt, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                    lr_schedule=lr_schedule)


def reference_shape(cfg: JobConfig) -> dict:
    """The reference's micro-batch shape: the actor's unless set."""
    r, a = cfg.reference, cfg.actor
    return dict(shared_prompt=a.shared_prompt if r.shared_prompt is None else r.shared_prompt,
                max_tokens_per_micro_batch=(a.max_tokens_per_micro_batch if r.max_tokens_per_micro_batch is None
                                            else r.max_tokens_per_micro_batch))


def reference_spec(cfg: JobConfig, layout: JobLayout, threads: dict[str, int]) -> RoleSpec:
    return role_spec("reference", layout.reference, layout, cfg.model.path,
                     cfg.reference.micro_batch_size or cfg.actor.micro_batch_size, cfg.trainer.seed,
                     threads=threads["reference"], **reference_shape(cfg))


def actor_and_reference(cfg: JobConfig, layout: JobLayout, actor: RoleSpec, pools: ResourcePools,
                   threads: dict[str, int]) -> dict[str, Callable[[], Any]]:
    """The makers of the actor and, when the job has one, the reference: in the actor's processes
    (``RoleLayout.host``, reference.colocate) or in its own."""
    if layout.reference is None:
        return {"actor": _megatron(actor, pools)}
    ref = reference_spec(cfg, layout, threads)
    if layout.reference.host == "actor":
        return {"actor": _megatron(replace(actor, colocated=(ref,)), pools)}
    return {"actor": _megatron(actor, pools), "reference": _megatron(ref, pools)}


def started_reference(layout: JobLayout, started: dict[str, Any]):
    """The reference role once started: a view of the actor's processes, or a group of its own."""
    if layout.reference is None:
        return None
    if layout.reference.host is not None:
        return started[layout.reference.host].hosted("reference")
    return started["reference"]


def concurrent_processes(cfg: JobConfig, layout: JobLayout) -> dict[str, int]:
    """Per role (each with processes of its own), how many compute processes share a node's cores
    while that role computes. The synchronous loop (trainer.off_policy_steps 0) runs one phase at a
    time, so a role's ranks share the cores among themselves only (the engines generate while the
    Megatron ranks wait, and the reverse); with sampling ahead, the engines and the Megatron ranks
    compute at once and share them all."""
    nodes = max(1, cfg.resources.nodes)
    ranks = {name: r.tp * r.pp * r.dp for name, r in (("actor", layout.actor), ("reference", layout.reference),
                                                       ("critic", layout.critic)) if r is not None and r.host is None}
    if layout.rollout is not None:
        ranks["rollout"] = layout.rollout.engines * layout.rollout.tp
    ranks.update({name: r.tp * r.pp * r.dp for name, r in layout.reward.items()})
    if layout.judge is not None:
        ranks["judge"] = layout.judge.engines * layout.judge.tp
    if cfg.trainer.off_policy_steps > 0:
        return {name: -(-sum(ranks.values()) // nodes) for name in ranks}
    return {name: -(-n // nodes) for name, n in ranks.items()}


def job_threads(cfg: JobConfig, layout: JobLayout) -> dict[str, int]:
    """Each role's math threads per process: a node's cores (resources.num_cpus, else this machine's)
    shared by the processes that compute at the same time on that node (``concurrent_processes``)."""
    cores = cfg.resources.num_cpus or os.cpu_count() or 1
    threads = {name: math_threads(cores, n) for name, n in concurrent_processes(cfg, layout).items()}
    if layout.reference is not None and layout.reference.host is not None:  # computes in its host's ranks
        threads["reference"] = threads[layout.reference.host]
    return threads


def start_roles(makers: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Starts every role at once, each constructor in a thread of this process (Ray's API is
    thread-safe), and returns them by name. Each role's processes import torch, Megatron or vLLM
    and load their checkpoint on their own, so they come up side by side instead of one after the
    other (the quickstart's roles: 17 s instead of 23 s on 2 cores, where the imports compete for
    the cores; more where they do not). If a role fails to start, the others are shut down once
    they are up and the first failure, in ``makers``' order, is raised; an interrupt shuts down
    what is up and leaves the rest to the Ray shutdown after it."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(makers)), thread_name_prefix="rlx-start")
    futures = {name: pool.submit(make) for name, make in makers.items()}
    try:
        wait(futures.values())
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        _shutdown_started(futures)
        raise
    pool.shutdown()
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    if failed:
        _shutdown_started(futures)
        raise failed[0]
    return {name: f.result() for name, f in futures.items()}


def _shutdown_started(futures: dict[str, Future]) -> None:
    for f in futures.values():
        if f.done() and not f.cancelled() and f.exception() is None:
            f.result().shutdown()


def _megatron(spec: RoleSpec, pools: ResourcePools) -> Callable[[], Any]:
    from megatron_workers import MegatronGroup

    return lambda: MegatronGroup(spec, pools.placement(spec.name))


def _rollout(cfg: JobConfig, layout: JobLayout, pools: ResourcePools, threads: int) -> Callable[[], Any]:
    from rollout import RolloutPool

    # The longest sequence a job can make (the loader refuses longer prompts): vLLM sizes its
    # batches and the KV cache it must hold for one sequence by it, not by the model's context.
    max_model_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    return lambda: RolloutPool(cfg.model.path, cfg.rollout, pools.placement("rollout"), layout.device, layout.dtype,
                               cfg.trainer.seed, max_model_len=max_model_len, threads=threads)


def _start_job_roles(cfg: JobConfig, layout: JobLayout, role_pools: dict[str, str],
                     makers: Callable[[ResourcePools], dict[str, Callable[[], Any]]]) -> tuple[dict, ResourcePools]:
    """Ray, the pools of ``role_pools``, and the roles ``makers(pools)`` starts."""
    start_ray(layout.device, layout.total_gpus, cfg.resources.ray_address, cfg.resources.num_cpus)
    pools = ResourcePools(cfg.resources.pools, role_pools)
    try:
        return start_roles(makers(pools)), pools
    except BaseException:
        pools.shutdown()
        raise


def _connect(cfg: JobConfig, layout: JobLayout, roles: Roles) -> None:
    try:
        connect_weight_sync(roles.actor, roles.rollout, cfg.rollout.engines, cfg.rollout.bucket_mb * 1024 ** 2,
                            layout.dtype, cfg.rollout.weight_transport, timeout_s=cfg.rollout.sync_timeout_s)
    except BaseException:
        roles.shutdown()
        raise


def build_roles(cfg: JobConfig, layout: JobLayout) -> Roles:
    """Starts Ray and every role of the validated job; the weight sync is connected."""
    role_pools = {"actor": layout.actor.pool, "rollout": layout.rollout.pool}
    if layout.reference and layout.reference.host is None:
        role_pools["reference"] = layout.reference.pool
    if layout.critic:
        role_pools["critic"] = layout.critic.pool
    role_pools.update({name: r.pool for name, r in layout.reward.items()})
    if layout.judge:
        role_pools["judge"] = layout.judge.pool
    seed, a, c = cfg.trainer.seed, cfg.actor, cfg.critic
    threads = job_threads(cfg, layout)

    def makers(pools: ResourcePools) -> dict[str, Callable[[], Any]]:
        actor = role_spec("actor", layout.actor, layout, cfg.model.path, a.micro_batch_size, seed, optim=a.optim,
                          threads=threads["actor"], shared_prompt=a.shared_prompt,
                          max_tokens_per_micro_batch=a.max_tokens_per_micro_batch,
                          lr_schedule=role_schedule(cfg, "actor"))
        made = actor_and_reference(cfg, layout, actor, pools, threads)  # the reference only when a KL term needs it
        if layout.critic:  # PPO's value model: only when the advantage estimator needs values
            made["critic"] = _megatron(role_spec("critic", layout.critic, layout, c.model_path or cfg.model.path,
                                                 c.micro_batch_size, seed, head="value", optim=c.optim,
                                                 threads=threads["critic"], shared_prompt=c.shared_prompt,
                                                 max_tokens_per_micro_batch=c.max_tokens_per_micro_batch,
                                                 lr_schedule=role_schedule(cfg, "critic")), pools)
        for name, lay in layout.reward.items():  # reward models: forward-only, the score head
            section = getattr(cfg.reward, REWARD_MODEL_SECTIONS[name])
            made[name] = _megatron(role_spec(name, lay, layout, section.path, section.micro_batch_size, seed,
                                             head="score", threads=threads[name]), pools)
        made["rollout"] = _rollout(cfg, layout, pools, threads["rollout"])
        if layout.judge:  # the LLM judge's engines: the judge model, never weight-synced
            from rollout import RolloutPool

            made["judge"] = lambda: RolloutPool(cfg.reward.judge.model_path, judge_rollout_config(cfg),
                                                pools.placement("judge"), layout.device, layout.dtype, seed,
                                                max_model_len=cfg.reward.judge.max_model_len,
                                                threads=threads["judge"], name="judge")
        return made

    started, pools = _start_job_roles(cfg, layout, role_pools, makers)
    reward = {name: started[name] for name in (*layout.reward, "judge") if name in started}
    roles = Roles(actor=started["actor"], rollout=started["rollout"], reference=started_reference(layout, started),
                  critic=started.get("critic"), reward=reward, on_shutdown=[pools.shutdown])
    _connect(cfg, layout, roles)
    return roles


def build_preference_roles(cfg: JobConfig, layout: JobLayout) -> Roles:
    """The roles of a preference job (algorithm.type dpo | rm): the trained actor with the objective's head,
    the forward-only reference when the objective needs it, and a rollout pool with the weight sync
    only for DPO's greedy validation (algorithm.dpo.greedy_val_files)."""
    from rlcore.preference_losses import PREFERENCE_OBJECTIVES

    objective = PREFERENCE_OBJECTIVES.meta(cfg.algorithm.type)
    role_pools = {"actor": layout.actor.pool}
    if layout.reference is not None and layout.reference.host is None:
        role_pools["reference"] = layout.reference.pool
    if layout.rollout is not None:
        role_pools["rollout"] = layout.rollout.pool
    seed, a = cfg.trainer.seed, cfg.actor
    threads = job_threads(cfg, layout)

    def makers(pools: ResourcePools) -> dict[str, Callable[[], Any]]:
        actor = role_spec("actor", layout.actor, layout, cfg.model.path, a.micro_batch_size, seed,
                          head=objective.head, optim=a.optim, threads=threads["actor"],
                          lr_schedule=role_schedule(cfg, "actor"))
        made = actor_and_reference(cfg, layout, actor, pools, threads)
        if layout.rollout:
            made["rollout"] = _rollout(cfg, layout, pools, threads["rollout"])
        return made

    started, pools = _start_job_roles(cfg, layout, role_pools, makers)
    roles = Roles(actor=started["actor"], rollout=started.get("rollout"),
                  reference=started_reference(layout, started), on_shutdown=[pools.shutdown])
    if roles.rollout is not None:
        _connect(cfg, layout, roles)
    return roles


def load_while_ray_starts(load: Callable[[], Any], cfg: JobConfig, layout: JobLayout) -> Any:
    """``load()`` (the task: mostly transformers' imports behind AutoTokenizer, 3-4 s of one core on a
    2-core box) in a thread while this thread starts Ray, whose start-up (4-5 s there) is mostly its own
    processes coming up and this one waiting: the two overlap instead of adding up. Its error (a bad
    row, a reward function that cannot be imported) is raised once Ray is up, before any role starts;
    the caller's Ray shutdown follows."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlx-task") as pool:
        task = pool.submit(load)
        start_ray(layout.device, layout.total_gpus, cfg.resources.ray_address, cfg.resources.num_cpus)
        return task.result()


def build_trainer(cfg: JobConfig, layout: JobLayout):
    checkpoint.seed_everything(cfg.trainer.seed)  # python, numpy, torch of the controller
    if cfg.algorithm.type != "rl":  # DPO / reward-model training on preference pairs
        from rlcore.preference import PreferenceTrainer
        from rlcore.preference_data import load_preference_task

        task = load_while_ray_starts(lambda: load_preference_task(cfg), cfg, layout)
        return PreferenceTrainer(cfg, task, build_preference_roles(cfg, layout))
    task = load_while_ray_starts(lambda: load_task(cfg), cfg, layout)
    return Trainer(cfg, task, build_roles(cfg, layout))


def run(cfg: JobConfig, layout: JobLayout) -> list[dict]:
    """Trains the validated job to the end; every role and Ray are stopped whatever happens."""
    import ray

    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    report = None
    try:
        trainer = build_trainer(cfg, layout)
        try:
            return trainer.fit()
        finally:
            # <run_dir>/report.png, also after a failure. metrics.jsonl is complete once fit is done (a
            # flushed line per step), so it is drawn (1-2 s of one core) while the roles and Ray stop,
            # which is mostly waiting on their processes.
            report = threading.Thread(target=write_after_run, args=(cfg.trainer.run_dir,), name="rlx-report")
            report.start()
            trainer.shutdown()
    finally:
        ray.shutdown()
        if report is None:  # the roles did not start: nothing to overlap with
            write_after_run(cfg.trainer.run_dir)
        else:
            report.join()
