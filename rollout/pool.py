"""The rollout pool: ``cfg.engines`` vLLM engines as Ray actors on the rollout role's placement."""
from __future__ import annotations

import ray

from rlcore.batch import Trajectory
from rlcore.config import RolloutConfig
from rlcore.hf_config import read_hf_config
from rlcore.layout import check_rollout_split
from rlcore.placement import RolePlacement
from rlcore.weight_sync import Bucket, StageLink

from .engine import VLLMEngine


class RolloutPool:
    def __init__(self, model_path: str, cfg: RolloutConfig, placement: RolePlacement, profile: str, dtype: str,
                 seed: int, max_model_len: int | None = None, startup_timeout_s: float = 900.0, threads: int = 1):
        """``threads``: each vLLM worker's math threads (its share of the cores, launch/compose.py)."""
        need = cfg.engines * cfg.tp
        if cfg.engines < 1 or cfg.tp < 1:
            raise ValueError(f"rollout.engines={cfg.engines} and rollout.tp={cfg.tp} must be >= 1")
        # The same check as `rlx validate`, before any engine starts.
        check_rollout_split(read_hf_config(model_path, key=None), cfg.tp, profile)
        if len(placement.bundle_indices) < need:
            raise ValueError(f"rollout: {cfg.engines} engines x tp {cfg.tp} need {need} GPUs, pool "
                             f"{placement.pool!r} has {len(placement.bundle_indices)}")
        self.cfg, self.profile = cfg, profile
        remote_cls = ray.remote(VLLMEngine)
        self.engines = []
        for e in range(cfg.engines):
            first = e * cfg.tp
            options = placement.actor_options(first)  # engine e starts on bundle e * tp
            bundles = None
            if cfg.tp > 1 and profile == "gpu":
                # vLLM's Ray executor places the engine's tp workers on these bundles; the engine
                # actor itself holds no GPU. (On the cpu profile the tp workers are child processes
                # of the engine actor, which sits on its first bundle; the others stay reserved.)
                bundles = [placement.bundle_indices[first + k] for k in range(cfg.tp)]
                options["num_gpus"] = 0
            self.engines.append(remote_cls.options(**options).remote(
                model_path, cfg, profile, dtype, seed, engine_index=e, max_model_len=max_model_len,
                ray_bundle_indices=bundles, threads=threads))
        # Surfaces a failed engine start here, with its traceback, rather than at the first call.
        ready, pending = ray.wait([h.version.remote() for h in self.engines], num_returns=len(self.engines),
                                  timeout=startup_timeout_s)
        if pending:
            raise RuntimeError(f"rollout: {len(pending)} of {cfg.engines} engines not up within "
                               f"{startup_timeout_s:.0f} s")
        ray.get(ready)

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
        refs = []
        for engine, (start, end) in zip(self.engines, chunks):
            if start == end:
                continue
            refs.append((start, engine.generate.remote(
                prompt_ids[start:end], n, temperature, top_p, top_k, max_tokens,
                None if seed is None else seed + start * n)))
        out: list[Trajectory] = []
        for (start, ref) in refs:
            for t in ray.get(ref):
                t.prompt_index += start
                out.append(t)
        return out

    def prompt_logprobs(self, sequences: list[list[int]], engine: int = 0) -> list[list[float]]:
        """``VLLMEngine.prompt_logprobs`` on engine ``engine``."""
        if not 0 <= engine < len(self.engines):
            raise ValueError(f"prompt_logprobs: engine {engine} of a pool of {len(self.engines)}")
        return ray.get(self.engines[engine].prompt_logprobs.remote(sequences))

    # ------------------------------------------------------------------ weight sync
    def node_ips(self) -> list[str]:
        """The node IP of every engine (the weight-sync transport depends on where they are)."""
        return ray.get([engine.node_ip.remote() for engine in self.engines])

    def init_weight_sync(self, links: list[StageLink], plans: list[list[Bucket]],
                         timeout_s: float = 600.0) -> list[ray.ObjectRef]:
        """Every engine joins every stage group (``links[s]``, ``plans[s]``); engine e's vLLM worker w is
        rank ``writers + e * tp + w``. Returns the engines' refs without waiting: group creation blocks
        until every member (the writers too) has joined, so the caller gets these together with the
        writers' init."""
        expect = len(self.engines) * self.cfg.tp
        bad = [link.stage for link in links if link.receivers != expect]
        if bad:
            raise ValueError(f"weight sync: stage groups {bad} expect {[links[s].receivers for s in bad]} receivers; "
                             f"{len(self.engines)} engines x tp {self.cfg.tp} = {expect}")
        return [engine.init_weight_sync.remote(links, [link.writers + e * self.cfg.tp for link in links],
                                               plans, timeout_s)
                for e, engine in enumerate(self.engines)]

    def receive_weights(self, version: int) -> list[ray.ObjectRef]:
        """Every engine receives and loads sync ``version``; refs of their stats dicts, not awaited
        (the senders must send at the same time)."""
        return [engine.receive_weights.remote(version) for engine in self.engines]

    def weight_checksums(self) -> list[dict[str, float]]:
        """One HF-named checksum dict per engine."""
        return ray.get([engine.weight_checksums.remote() for engine in self.engines])

    def versions(self) -> list[int]:
        return ray.get([engine.version.remote() for engine in self.engines])

    def peak_memory_mb(self) -> list[float]:
        """Each engine process's peak resident memory (MiB), in engine order."""
        return ray.get([engine.peak_memory_mb.remote() for engine in self.engines])

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
