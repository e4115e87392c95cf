"""The rollout pool: ``cfg.engines`` vLLM engines as Ray actors on the rollout role's placement.

Every wait on an engine is bounded (``rollout.engine_timeout_s``): an engine whose process died, or
that did not answer in time (then killed), is ``rlcore.faults.EngineDied`` naming it, and
``restart_engine`` starts a new one on the same bundles (the restart policy is
``rlcore.engine_restarts``)."""
from __future__ import annotations

import ray

from rlcore.batch import Trajectory
from rlcore.config import RolloutConfig
from rlcore.faults import EngineDied
from rlcore.hf_config import read_hf_config
from rlcore.layout import check_rollout_split
from rlcore.placement import RolePlacement
from rlcore.weight_sync import Bucket, StageLink

from .engine import VLLMEngine


class RolloutPool:
    def __init__(self, model_path: str, cfg: RolloutConfig, placement: RolePlacement, profile: str, dtype: str,
                 seed: int, max_model_len: int | None = None, startup_timeout_s: float = 900.0, threads: int = 1,
                 name: str = "rollout"):
        """``threads``: each vLLM worker's math threads (its share of the cores, launch/compose.py);
        ``name``: the role, naming its engines' logs (``<name>_engine<e>.log``)."""
        need = cfg.engines * cfg.tp
        if cfg.engines < 1 or cfg.tp < 1:
            raise ValueError(f"rollout.engines={cfg.engines} and rollout.tp={cfg.tp} must be >= 1")
        # The same check as `rlx validate`, before any engine starts.
        check_rollout_split(read_hf_config(model_path, key=None), cfg.tp, profile)
        if len(placement.bundle_indices) < need:
            raise ValueError(f"rollout: {cfg.engines} engines x tp {cfg.tp} need {need} GPUs, pool "
                             f"{placement.pool!r} has {len(placement.bundle_indices)}")
        self.cfg, self.profile, self.dtype = cfg, profile, dtype
        self.startup_timeout_s = startup_timeout_s
        remote_cls = ray.remote(VLLMEngine)
        self._starts = []  # how to start engine e again (restart_engine): its actor options and arguments
        for e in range(cfg.engines):
            first = e * cfg.tp
            options = placement.actor_options(first)  # engine e starts on bundle e * tp
            if cfg.partial_rollouts:
                # A second thread takes the weight sync while a generation runs (the engine's lock
                # puts the sync between two of its steps); otherwise one call at a time.
                options["max_concurrency"] = 2
            bundles = None
            if cfg.tp > 1 and profile == "gpu":
                # vLLM's Ray executor places the engine's tp workers on these bundles; the engine
                # actor itself holds no GPU. (On the cpu profile the tp workers are child processes
                # of the engine actor, which sits on its first bundle; the others stay reserved.)
                bundles = [placement.bundle_indices[first + k] for k in range(cfg.tp)]
                options["num_gpus"] = 0
            self._starts.append(lambda options=options, e=e, bundles=bundles: remote_cls.options(**options).remote(
                model_path, cfg, profile, dtype, seed, engine_index=e, max_model_len=max_model_len,
                ray_bundle_indices=bundles, threads=threads, name=name))
        self.engines = [start() for start in self._starts]
        self._wait_up(range(cfg.engines))

    def _wait_up(self, engines) -> None:
        """Surfaces a failed engine start here, with its traceback, rather than at the first call."""
        engines = list(engines)
        ready, pending = ray.wait([self.engines[e].version.remote() for e in engines], num_returns=len(engines),
                                  timeout=self.startup_timeout_s)
        if pending:
            raise RuntimeError(f"rollout: {len(pending)} of {len(engines)} engines not up within "
                               f"{self.startup_timeout_s:.0f} s")
        ray.get(ready)

    def restart_engine(self, engine: int) -> None:
        """Kills engine ``engine`` (if anything is left of it) and starts a new one on its bundles, from
        the model folder (weight version 0): the caller must connect the weight sync again and sync."""
        ray.kill(self.engines[engine], no_restart=True)
        self.engines[engine] = self._starts[engine]()
        self._wait_up([engine])

    def pids(self) -> list[int]:
        """Each engine actor's process id, in engine order."""
        return self._await([(e, h.pid.remote()) for e, h in enumerate(self.engines)], "a pid query")

    def _await(self, calls: list[tuple[int, ray.ObjectRef]], during: str) -> list:
        """The results of ``calls`` ((engine, ref) pairs), in order, once all are done. Engines whose
        process died, or that had not answered within rollout.engine_timeout_s (killed then, so they
        cannot answer later), raise ``EngineDied`` naming all of them."""
        refs = [ref for _, ref in calls]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.engine_timeout_s)
        hung = [e for e, ref in calls if ref in pending]
        dead, results = [], []
        for e, ref in calls:
            if e in hung:
                continue
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                dead.append(e)
        for e in hung:
            ray.kill(self.engines[e], no_restart=True)
        if hung:
            raise EngineDied(dead + hung, during, f"no answer within rollout.engine_timeout_s="
                                                  f"{self.cfg.engine_timeout_s:g} s; killed")
        if dead:
            raise EngineDied(dead, during)
        return results

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def num_receiving_ranks(self) -> int:
        """Members of each weight-sync group on the rollout side: every vLLM worker of every engine."""
        return len(self.engines) * self.cfg.tp

    # ------------------------------------------------------------------ sampling
    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, max_tokens: int = 256, seed: int | None = None) -> list[Trajectory]:
        """``n`` samples per prompt, prompts split into contiguous chunks (one per engine, sizes
        differing by at most one) that run concurrently. Returned in request order; ``prompt_index``
        counts over the whole request. With ``seed``, prompt i's samples use seeds
        ``seed + i * n + j`` whichever engine serves them."""
        if not prompt_ids:
            raise ValueError("generate: no prompts")
        chunks = _chunks(len(prompt_ids), len(self.engines))
        calls, starts = [], []
        for e, (engine, (start, end)) in enumerate(zip(self.engines, chunks)):
            if start == end:
                continue
            starts.append(start)
            calls.append((e, engine.generate.remote(
                prompt_ids[start:end], n, temperature, top_p, top_k, max_tokens,
                None if seed is None else seed + start * n)))
        out: list[Trajectory] = []
        for start, trajs in zip(starts, self._await(calls, "generation")):
            for t in trajs:
                t.prompt_index += start
                out.append(t)
        return out

    def prompt_logprobs(self, sequences: list[list[int]], engine: int = 0) -> list[list[float]]:
        """``VLLMEngine.prompt_logprobs`` on engine ``engine``."""
        if not 0 <= engine < len(self.engines):
            raise ValueError(f"prompt_logprobs: engine {engine} of a pool of {len(self.engines)}")
        return self._await([(engine, self.engines[engine].prompt_logprobs.remote(sequences))], "prompt scoring")[0]

    # ------------------------------------------------------------------ weight sync
    def node_ips(self) -> list[str]:
        """The node IP of every engine (the weight-sync transport depends on where they are)."""
        return self._await([(e, h.node_ip.remote()) for e, h in enumerate(self.engines)], "a node query")

    def init_weight_sync(self, links: list[StageLink], plans: list[list[Bucket]]) -> list[ray.ObjectRef]:
        """Every engine joins every stage group (``links[s]``, ``plans[s]``); engine e's vLLM worker w is
        rank ``writers + e * tp + w``. Returns the engines' refs without waiting: group creation blocks
        (at most each link's ``timeout_s``) until every member (the writers too) has joined, so the
        caller gets these together with the writers' init."""
        expect = len(self.engines) * self.cfg.tp
        bad = [link.stage for link in links if link.receivers != expect]
        if bad:
            raise ValueError(f"weight sync: stage groups {bad} expect {[links[s].receivers for s in bad]} receivers; "
                             f"{len(self.engines)} engines x tp {self.cfg.tp} = {expect}")
        return [engine.init_weight_sync.remote(links, [link.writers + e * self.cfg.tp for link in links], plans)
                for e, engine in enumerate(self.engines)]

    def receive_weights(self, version: int) -> list[ray.ObjectRef]:
        """Every engine receives and loads sync ``version``; refs of their stats dicts, not awaited
        (the senders must send at the same time)."""
        return [engine.receive_weights.remote(version) for engine in self.engines]

    def weight_checksums(self) -> list[dict[str, float]]:
        """One HF-named checksum dict per engine."""
        return self._await([(e, h.weight_checksums.remote()) for e, h in enumerate(self.engines)], "a weight check")

    def hold_after_steps(self, after_steps: int) -> None:
        """Test hook (``VLLMEngine.hold_after_steps``) on every engine."""
        self._await([(e, h.hold_after_steps.remote(after_steps)) for e, h in enumerate(self.engines)], "a test hook")

    def wait_held(self, timeout_s: float) -> list[bool]:
        """Test hook (``VLLMEngine.wait_held``): per engine, whether its generation is held."""
        return self._await([(e, h.wait_held.remote(timeout_s)) for e, h in enumerate(self.engines)], "a test hook")

    def versions(self) -> list[int]:
        return self._await([(e, h.version.remote()) for e, h in enumerate(self.engines)], "a version query")

    def peak_memory_mb(self) -> list[float]:
        """Each engine process's peak resident memory (MiB), in engine order."""
        return self._await([(e, h.peak_memory_mb.remote()) for e, h in enumerate(self.engines)], "a memory query")

    def shutdown(self) -> None:
        for engine in self.engines:
            ray.kill(engine)
        self.engines = []


def _chunks(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) ranges over ``count`` items, sizes differing by at most one."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        out.append((start, end))
        start = end
    return out
