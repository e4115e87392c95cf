"""One rank of a Megatron role: the same engine for the actor, the reference, the critic and any
later scoring model, hosted in a Ray actor by ``group.MegatronGroup``.

The rank joins a gloo (cpu profile) or NCCL (gpu profile) world of TP x PP x DP ranks and builds its
PP stage of the model from the HF checkpoint, ending in the role's head (``heads.py``: the
vocabulary logits, or a scalar value head). A trainable role (``RoleSpec.optim`` set) is wrapped in
megatron's DistributedDataParallel with megatron's optimizer. Two entry points, both through
megatron's ``get_forward_backward_func`` schedules (PP micro-batching is megatron's own):
``forward`` (forward only; the head's outputs) and ``update`` (forward-backward with the head's loss
as megatron's loss hook, then one optimizer step).

With virtual pipeline stages (VPP > 1) the stage is ``vpp`` model chunks (megatron's interleaved
1F1B schedule): one DDP per chunk, one optimizer over all of them, a data iterator per chunk, as
Megatron-LM's training.py does. Checkpoints are ``checkpointing.py``; the weight sync's sending side
is ``weight_sender.py``.
"""
from __future__ import annotations

import datetime
import gc
import math
import os
import socket
import warnings
from functools import partial

import torch

from rlcore import worker_logs
from rlcore.batch import Batch
from rlcore.lr_schedule import LRSchedule, resolve as resolve_lr_schedule
from rlcore.roles import RoleSpec
from rlcore.startup import collector_paused

from .heads import HEADS
from .host_malloc import check_host_hugepages, use_host_malloc
from .packing import ActiveInputs, ModelInputs, attach_input_hooks, model_inputs, token_budget_micro_batches, trimmed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def role_lr_schedule(spec: RoleSpec) -> LRSchedule:
    """The role's schedule; a RoleSpec built without one (outside a job) trains at optim.lr throughout,
    which only a constant spec without warm-up means."""
    if spec.lr_schedule is not None:
        return spec.lr_schedule
    o = spec.optim
    if o.lr_decay_style != "constant" or o.lr_warmup_steps or o.lr_warmup_ratio:
        raise ValueError(f"{spec.name}: optim asks for a learning-rate schedule, but the RoleSpec has no "
                         "lr_schedule (rlcore.lr_schedule.role_schedule resolves it from the job)")
    return resolve_lr_schedule(o, total=1)


def build_lr_scheduler(optimizer, schedule: LRSchedule, weight_decay: float):
    """megatron-core's OptimizerParamScheduler for ``schedule``; it also applies megatron's per-group
    wd_mult (no weight decay on biases and norms), with a constant weight decay. Which schedule wins on
    resume: the spec's (override_opt_param_scheduler; the step count always comes from the checkpoint),
    or with ``from_checkpoint`` the checkpoint's (use_checkpoint_opt_param_scheduler)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=schedule.warmup_init if schedule.warmup_steps > 0 else schedule.lr, max_lr=schedule.lr,
        min_lr=schedule.min_lr, lr_warmup_steps=schedule.warmup_steps, lr_decay_steps=schedule.decay_steps,
        lr_decay_style=schedule.decay_style, start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=0,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=schedule.from_checkpoint,
        override_opt_param_scheduler=not schedule.from_checkpoint)


def current_lr(optimizer) -> float:
    """The lr of the optimizer's default parameter groups (megatron's own pick for logging)."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    return float(get_canonical_lr_for_logging(optimizer.param_groups))


def follow_lr_scheduler(lr_scheduler) -> None:
    """After a checkpoint load: megatron's get_lr prefers a parameter group's own max_lr/min_lr (set
    from the spec at construction, or restored with the optimizer's state) to the scheduler's, so the
    groups get the scheduler's values (the spec's or the checkpoint's, as build_lr_scheduler decided)
    and the lr is recomputed at the loaded step."""
    for group in lr_scheduler.optimizer.param_groups:
        group["max_lr"], group["min_lr"] = lr_scheduler.max_lr, lr_scheduler.min_lr
    lr_scheduler.step(increment=0)


def use_fused_cpu_adam(optimizer) -> None:
    """torch's fused CPU AdamW kernel for megatron's optimizer (the cpu profile). Without
    TransformerEngine or apex megatron-core falls back to torch's AdamW with its defaults
    (optimizer/__init__.py:32), whose CPU step is a python loop of ~10 tensor ops per parameter, with
    two temporaries the size of each (the square root, the division): 0.5-1.8 s per step on a
    SmolLM2 stage against 0.16-0.19 s fused (docs/cpu-profile.md). The same AdamW, rounded differently
    in the last bits. Set on the parameter groups, which a checkpoint's optimizer state replaces: the
    engine sets it again after every load."""
    for group in optimizer.param_groups:
        group["fused"] = True


def allocate_adam_state(optimizer) -> None:
    """AdamW's step count and moments for every parameter of megatron's optimizer, made now (the cpu
    profile, after ``use_fused_cpu_adam``) as torch's fused AdamW makes them at its first step: the
    same zeros, so every step is equal to the bit. Made lazily, the 2 x 4 bytes per weight fill the
    holes the first update's freed activations leave in the rank's C heap (``host_malloc: keep``
    keeps them), so the second update grows the heap again by about its activations: on the SmolLM2
    job ~160k fresh pages and 2-3.5 s of system time in step 2's update. Made first, they sit below the
    activations, which reuse their own memory from the first update on (docs/cpu-profile.md).
    Not megatron's ``init_state_fn``: it makes the moments without the step count, which torch's
    AdamW then never adds (it makes a parameter's state only when the state is empty)."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = chained.optimizer
        if not isinstance(adam, torch.optim.Adam):  # torch's AdamW is an Adam
            raise TypeError(f"the cpu profile's optimizer is torch's AdamW; megatron built {type(adam).__name__}")
        for group in adam.param_groups:
            if not group["fused"]:
                raise RuntimeError("allocate_adam_state runs after use_fused_cpu_adam (the fused kernel's "
                                   "step count is a float32 tensor beside each parameter)")
            for p in group["params"]:
                state = adam.state[p]
                if state:  # a checkpoint's, or a step already taken
                    continue
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


class MegatronEngine:
    """Construction is cheap (Ray creates the actor); ``init`` joins the world and builds the model and
    must run on every rank of the group at once."""

    def __init__(self, spec: RoleSpec, rank: int, hosted: bool = False):
        """``hosted``: a colocated role's engine inside another role's rank (``RoleSpec.colocated``),
        which owns the process: its logs, its threads, its place in the world."""
        if not hosted:
            # First: this rank's output (megatron's, torch's, gloo's) into run_dir/logs/; errors and
            # unexpected warnings still reach the console (rlcore/worker_logs.py).
            worker_logs.to_console(worker_logs.capture_worker_output(f"{spec.name}_rank{rank}"), "ray")
        if spec.micro_batch_size < 1:
            raise ValueError(f"{spec.name}: micro_batch_size must be >= 1, got {spec.micro_batch_size}")
        # The layout itself (TP/PP/VPP against the model) is rlcore.layout's check, which the group
        # runs before any engine starts.
        if not hosted:
            # The rank's share of the cores (RoleSpec.threads): more threads than cores in all were 5-100x
            # slower on a shared 2-core box whenever another process held a core (docs/cpu-profile.md).
            torch.set_num_threads(spec.threads)
            use_host_malloc(spec.host_malloc)  # before the model, its gradients and Adam's state exist
            hugepages = check_host_hugepages(spec.host_hugepages)
            if hugepages:
                warnings.warn(hugepages)
        self.spec, self.head, self.rank = spec, HEADS[spec.head], rank
        self.role, self.model_path, self.profile, self.dtype = spec.name, spec.model_path, spec.profile, spec.dtype
        self.tp, self.pp, self.dp, self.vpp = spec.tp, spec.pp, spec.dp, spec.vpp
        self.micro_batch_size, self.seed = spec.micro_batch_size, spec.seed
        self.trainable = spec.trainable
        self.optimizer = self.lr_scheduler = None
        self.colocated: dict[str, MegatronEngine] = {}

    # ------------------------------------------------------------------------------------ set-up
    @staticmethod
    def node_ip_and_free_port() -> tuple[str, int]:
        return node_ip(), free_port()

    def _select_device(self) -> str:
        """Applies the device profile to this process; returns the torch.distributed backend."""
        # megatron-core 0.16.1 calls the torch.distributed collectives torch 2.13 deprecates (the
        # distributed optimizer's reduce-scatter and all-gather): a FutureWarning in the worker's
        # output at the first call, about a call that is not ours.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` "
                                                  r"is deprecated", category=FutureWarning)
        # Loading a torch_dist checkpoint (every resume), megatron-core's strategy calls torch's
        # deprecated `load_state_dict` on ShardedTensors: two FutureWarnings per rank on the console of
        # every resumed run, about calls that are not ours either.
        warnings.filterwarnings("ignore", message=r"(`load_state_dict` is deprecated and will be removed|Please use "
                                                  r"DTensor instead and we are deprecating ShardedTensor)",
                                category=FutureWarning)
        if self.profile == "cpu":
            if torch.cuda.is_available():
                raise RuntimeError("the cpu profile needs a CPU-only torch process, but CUDA is available "
                                   "here; use the gpu profile on GPU machines")
            # megatron-core warns at import that TransformerEngine and apex are missing: on the cpu
            # profile that is the intended set-up, and the warnings would drown the worker logs.
            warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex|Apex) (are|is) not installed")
            # Advice for CUDA (CUDA_DEVICE_MAX_CONNECTIONS) and CUDA graphs: meaningless on the CPU.
            warnings.filterwarnings("ignore", message=r".*(async grad allreduce|full scope is deprecated)")
            from .cpu_compat import apply_cpu_compat

            apply_cpu_compat()
            self.device = torch.device("cpu")
            return "gloo"
        if self.profile == "gpu":
            if not torch.cuda.is_available():
                raise RuntimeError("the gpu profile needs CUDA, but torch.cuda.is_available() is False")
            torch.cuda.set_device(0)  # Ray exposes this actor's GPU as device 0 (CUDA_VISIBLE_DEVICES)
            self.device = torch.device("cuda", 0)
            return "nccl"
        raise ValueError(f"profile {self.profile!r}: expected cpu or gpu")

    def init(self, master_addr: str, master_port: int) -> dict:
        """Joins the world, initialises Megatron's parallel state, builds and loads the model (and the
        optimizer), then the colocated roles' models under the same parallel state. Returns this
        rank's coordinates."""
        # What is imported so far (torch, Ray: ~400k objects) lives as long as the process: frozen,
        # the one collection after the set-up below walks only the objects created since.
        gc.freeze()
        # megatron-core's imports and the model's build with automatic collections off: each would walk
        # everything imported since the freeze and find nothing to free (rlcore/startup.py).
        with collector_paused():
            self._set_up(master_addr, master_port)
        threads = self.math_threads()
        hosting = "".join(f" (and the {name}'s model)" for name in self.colocated)
        print(f"{self.role} rank {self.rank}{hosting}: {threads} math threads (RoleSpec.threads={self.spec.threads})",
              flush=True)
        return {**self.coords(), "math_threads": threads}

    def _set_up(self, master_addr: str, master_port: int) -> None:
        backend = self._select_device()

        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.spec.world_size))
        dist.init_process_group(backend, rank=self.rank, world_size=self.spec.world_size,
                                timeout=datetime.timedelta(minutes=10))
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None)
        torch.manual_seed(self.seed)
        if self.profile == "gpu":
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
        self._build()
        # Built after this role's model, in the same order on every rank (a tied embedding all-reduces
        # at construction). Their random init is overwritten by the checkpoint, and no later draw
        # depends on the generator's state (dropout is 0, model.py).
        for spec in self.spec.colocated:
            hosted = MegatronEngine(spec, self.rank, hosted=True)
            hosted.device = self.device
            hosted._build()
            self.colocated[spec.name] = hosted

    def _build(self) -> None:
        """This role's model stage from its HF checkpoint under the parallel state already set up, and
        the optimizer when it trains."""
        from megatron.core import parallel_state

        from .hf_weights import load_hf_weights
        from .model import read_hf_config, transformer_config
        from .weight_sender import StageWeightSender

        self.hf = read_hf_config(self.model_path)
        # Shared-prompt rows bring their own attention mask and rotary positions (packing.py): the
        # model takes the mask from each forward (model.py explicit_mask).
        self.explicit_mask = self.spec.shared_prompt
        self.config = transformer_config(self.hf, self.profile, self.dtype, self.tp, self.pp, self.vpp,
                                         self.spec.pp_layers, explicit_mask=self.explicit_mask)
        # Unwrapped chunks: their names map to HF. One chunk per virtual stage, in layer order
        # (vp_stage None: no virtual stages). Built in the same order on every rank: a chunk holding a
        # tied embedding all-reduces it at construction.
        vp_stages = list(range(self.vpp)) if self.vpp > 1 else [None]
        self.model_chunks = [self.head.build(self.hf, self.config, self.profile, v, self.seed,
                                             explicit_mask=self.explicit_mask) for v in vp_stages]
        for chunk in self.model_chunks:
            load_hf_weights(chunk, self.hf, self.model_path)
        # Each micro-batch's rows, positions and scored outputs (packing.py) reach the model chunks
        # through these hooks.
        self.active_inputs = ActiveInputs()
        for chunk in self.model_chunks:
            attach_input_hooks(chunk, self.active_inputs)
        # Micro-batches are cut to their own longest row (and packed rows differ in length), so
        # pipeline stages exchange each activation's shape before it (megatron's variable-length
        # p2p). The interleaved schedule too: its p2p runs one direction per call (overlap_p2p_comm,
        # model.py), so each shape exchange pairs sends and receives of one kind even at PP=2.
        if self.pp > 1:
            self.config.variable_seq_lengths = True
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.weight_sender = StageWeightSender(self.model_chunks, self.hf, self.coords(), self.tp, self.profile,
                                               self.device, self.node_ip_and_free_port)

        if self.trainable:
            self._build_optimizer()
        else:
            for chunk in self.model_chunks:
                chunk.eval()
            self.forward_chunks = self.model_chunks

    @staticmethod
    def math_threads() -> int:
        """The intra-op threads torch runs this rank's math with, as seen by the actor's calls (a Ray
        actor runs every call on one thread, the one that set them in ``__init__``)."""
        return torch.get_num_threads()

    def _build_optimizer(self) -> None:
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.spec.optim
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=o.use_distributed_optimizer)
        # One DDP per chunk; as Megatron-LM's training.py, only the first chunk buckets its gradients
        # (the others reduce theirs as one bucket when the schedule finishes them).
        self.ddp_chunks = [DistributedDataParallel(self.config, ddp_config, chunk, disable_bucketing=i > 0)
                           for i, chunk in enumerate(self.model_chunks)]
        self.forward_chunks = self.ddp_chunks
        schedule = role_lr_schedule(self.spec)
        opt_config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=schedule.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            bf16=self.config.bf16, params_dtype=self.config.params_dtype,
            use_distributed_optimizer=o.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, self.ddp_chunks)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, schedule, o.weight_decay)
        if self.profile == "cpu":
            use_fused_cpu_adam(self.optimizer)
            allocate_adam_state(self.optimizer)
        # The hooks megatron's schedules call: skip the DP all-reduce on all but the last micro-batch,
        # then reduce gradients over DP (and the tied embedding over the first/last PP stages).
        no_sync = [ddp.no_sync for ddp in self.ddp_chunks]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss

    def coords(self) -> dict:
        return dict(rank=self.rank, tp_rank=self.tp_rank, pp_rank=self.pp_rank, dp_rank=self.dp_rank)

    @staticmethod
    def peak_memory_mb() -> float:
        """This process's peak resident memory so far (MiB; ru_maxrss is KiB on Linux), for the bench."""
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    # ------------------------------------------------------------------------ forward / backward
    @property
    def _reports(self) -> bool:
        """The rank whose results the group collects: the last PP stage's TP rank 0."""
        return self.is_last_stage and self.tp_rank == 0

    def _micro_batch_rows(self, batch: Batch) -> list[list[int]]:
        """Which rows of this DP shard each micro-batch holds: ``micro_batch_size`` consecutive rows
        (the group has checked that they split evenly), or under ``max_tokens_per_micro_batch`` the
        token-budget plan (packing.py)."""
        if self.spec.max_tokens_per_micro_batch:
            return token_budget_micro_batches(batch, self.spec.max_tokens_per_micro_batch, self.spec.shared_prompt)
        size = self.micro_batch_size
        return [list(range(i, min(i + size, batch.size))) for i in range(0, batch.size, size)]

    def _micro_batches(self, batch: Batch) -> list[tuple[Batch, ModelInputs, list[int]]]:
        """This DP shard's micro-batches on the device, each with the rows the model runs for it
        (packing.py) and the shard rows it holds."""
        on_device = Batch({k: v.to(self.device) for k, v in batch.items()})
        out = []
        for rows in self._micro_batch_rows(on_device):
            index = torch.tensor(rows, device=self.device)
            micro_batch = Batch({k: v.index_select(0, index) for k, v in on_device.items()})
            multiple = self.tp if self.config.sequence_parallel else 1
            micro_batch = trimmed(micro_batch, multiple)
            inputs = model_inputs(micro_batch, self.spec.shared_prompt, multiple)
            seq_len = inputs.tokens.shape[1]
            if self.config.sequence_parallel and seq_len % self.tp:
                raise ValueError(f"{self.role}: sequence length {seq_len} is not divisible by TP={self.tp} "
                                 f"(sequence parallel)")
            out.append((micro_batch, inputs, rows))
        return out

    @staticmethod
    def _reassemble(parts: list[torch.Tensor], micro_batches: list, rows: int, seq_len: int) -> torch.Tensor:
        """The micro-batches' token-aligned [b_i, s_i] outputs back into the shard's [rows, seq_len]."""
        out = parts[0].new_zeros((rows, seq_len))
        for part, (_, _, index) in zip(parts, micro_batches):
            out[torch.tensor(index), :part.shape[1]] = part
        return out

    def _forward_step(self, model, inputs: ModelInputs) -> torch.Tensor:
        """This stage's output: on the last stage the head's output at the scored positions
        (vocab-parallel logits [1, N, V/TP] or values [1, N, 1]; every position [b, s, .] when the
        micro-batch has no response mask), activations elsewhere (the input of a later stage arrives
        through megatron's set_input_tensor)."""
        self.active_inputs.current = inputs
        # Unpacked rows need no attention mask: right padding under the causal mask never changes
        # real positions. Packed rows bring theirs, and an explicit-mask model always needs one.
        if self.explicit_mask and inputs.attention_mask is None:
            raise RuntimeError(f"{self.role}: a micro-batch without an attention mask reached a model that takes "
                               "its mask from every forward (shared_prompt)")
        return model(inputs.tokens, inputs.position_ids, inputs.attention_mask)

    def _run_schedule(self, micro_batches: list[tuple[Batch, ModelInputs, list[int]]], loss_func,
                      forward_only: bool) -> list:
        """Megatron's forward(-backward) schedule over ``micro_batches``; ``loss_func(micro_batch,
        inputs, output)`` is the hook megatron applies to the last stage's output of each
        micro-batch. Returns what the hooks returned (their second element when training), on the
        last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            micro_batch, inputs, _ = next(data_iterator)
            return self._forward_step(model, inputs), partial(loss_func, micro_batch, inputs)

        # Interleaved: every chunk runs every micro-batch in order, each reading its own iterator.
        data_iterator = ([iter(micro_batches) for _ in self.forward_chunks] if self.vpp > 1
                         else iter(micro_batches))
        rows, seq_len = micro_batches[0][1].tokens.shape  # the p2p shape (variable_seq_lengths: sent along)
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data_iterator, model=self.forward_chunks,
                num_microbatches=len(micro_batches), seq_length=seq_len, micro_batch_size=rows,
                forward_only=forward_only, collect_non_loss_data=forward_only)
        finally:
            self.active_inputs.current = None

    def forward(self, batch: Batch, head_args: dict | None = None, role: str | None = None
                ) -> dict[str, torch.Tensor] | None:
        """The head's token-aligned [b, S] outputs for this rank's DP shard (forward only): the LM
        head's ``logprobs`` and ``entropy`` (``head_args``: ``temperature``), the value head's
        ``values``; of the colocated role ``role``'s model when given. Returned by the last PP
        stage's TP rank 0 (on the CPU); None elsewhere."""
        if role is not None and role != self.role:
            if role not in self.colocated:
                raise ValueError(f"{self.role} rank {self.rank} holds no model of role {role!r} "
                                 f"(colocated: {', '.join(self.colocated) or 'none'})")
            return self.colocated[role].forward(batch, head_args)
        head_args = head_args or {}

        def collect(micro_batch, inputs, output, non_loss_data=True):
            return self.head.outputs(output, micro_batch, inputs, self.tp_group, **head_args)

        for chunk in self.forward_chunks:
            chunk.train(False)
        micro_batches = self._micro_batches(batch)
        with torch.no_grad():
            outputs = self._run_schedule(micro_batches, collect, forward_only=True)
        if self.trainable:
            for chunk in self.forward_chunks:
                chunk.train(True)
        if not self._reports:
            return None
        b, s = batch["input_ids"].shape
        return {k: self._reassemble([o[k] for o in outputs], micro_batches, b, s).cpu() for k in outputs[0]}

    def update(self, batch: Batch, loss_cfg, head_args: dict | None = None) -> dict | None:
        """One optimizer step on this rank's DP shard with the head's loss (``rlcore.algos``'s
        ``actor_loss`` for the LM head, ``critic_loss`` for the value head).

        Returns, on the last PP stage's TP rank 0, ``{"sums": metrics summed over this shard's
        micro-batches (additive over DP by the rlcore.algos contract), "grad_norm": float,
        "outputs": the token-aligned [b, S] outputs the head kept from the update's own forward
        (the LM head's ``logprobs`` under ``on_policy=True``; else empty)}``; None on the other ranks."""
        if not self.trainable:
            raise RuntimeError(f"role {self.role!r} is forward-only: it has no optimizer")
        head_args = head_args or {}
        micro_batches = self._micro_batches(batch)
        # The head's loss returns this micro-batch's share of the global aggregate (sum(x *
        # loss_weights), the weights computed over the whole batch by the controller), and the update
        # must follow the gradient of the SUM of those shares over all micro-batches and DP ranks.
        # Verified in megatron-core 0.16.1: for a 2-tuple (loss, metrics) the schedule divides the loss
        # by num_microbatches before backward (pipeline_parallel/schedules.py:263-269,
        # forward_step_calc_loss; cp size is 1), and DDP pre-scales gradients by 1/DP before summing
        # them over DP (distributed/distributed_data_parallel.py:285-288 with average_in_collective=
        # False; param_and_grad_buffer.py:391 then a SUM all-reduce/reduce-scatter). Multiplying by
        # num_microbatches * DP cancels both.
        grad_scale = len(micro_batches) * self.dp

        def loss_func(micro_batch, inputs, output):
            loss, metrics, kept = self.head.loss(output, micro_batch, inputs, loss_cfg, self.tp_group, **head_args)
            return loss * grad_scale, {"metrics": {f"{self.role}/loss": loss.detach(), **metrics}, "kept": kept}

        for ddp in self.ddp_chunks:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(micro_batches, loss_func, forward_only=False)
        grad_norm, finite = self._check_finite(outputs)
        lr = current_lr(self.optimizer)  # the lr this step ran (or would have run) at
        if finite:
            self.optimizer.step()  # recomputes the same norm to clip with it
            self.lr_scheduler.step(increment=1)
        else:
            # Not applied: weights, Adam's moments and step count, and the lr schedule stay as they
            # were (the controller's trainer.on_nonfinite decides whether the run goes on).
            for ddp in self.ddp_chunks:
                ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        if not self._reports:
            return None
        sums = {k: float(sum(o["metrics"][k] for o in outputs)) for k in outputs[0]["metrics"]}
        b, s = batch["input_ids"].shape
        kept = {k: self._reassemble([o["kept"][k] for o in outputs], micro_batches, b, s).cpu()
                for k in outputs[0]["kept"]}
        return {"sums": sums, "grad_norm": grad_norm, "lr": lr, "outputs": kept, "skipped": not finite}

    def _check_finite(self, outputs: list) -> tuple[float, bool]:
        """The global gradient norm of the backward just run, and whether it and every reporting
        rank's loss are finite (the same answer on every rank of the role).

        Checked BEFORE megatron's optimizer step, because megatron-core 0.16.1 does not skip a
        non-finite step in fp32 or bf16: only fp16's loss scaler looks for inf/nan
        (optimizer/optimizer.py:524-557; FP32Optimizer.prepare_grads returns False). With a NaN norm
        the clip coefficient is NaN, ``clip_coeff < 1.0`` is False (clip_grads.py:172-173) and Adam
        writes NaN into every weight; with an inf norm the clip zeroes the gradients and Adam still
        moves the weights by its moments and counts the step. ``prepare_grads`` only copies the
        gradients into the optimizer's params (fp32/bf16 have no loss scaler to update), so the
        step's own call repeats it harmlessly."""
        import torch.distributed as dist

        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())  # all-reduced over the model-parallel ranks
        loss_key = f"{self.role}/loss"
        bad_loss = any(not math.isfinite(float(o["metrics"][loss_key])) for o in outputs) if self._reports else False
        flag = torch.tensor([float(bad_loss or not math.isfinite(grad_norm))], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the role's world: every rank skips or none does
        return grad_norm, flag.item() == 0.0

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Writes this role's distributed checkpoint into the folder ``path`` (every rank at once)."""
        from .checkpointing import save_role

        save_role(path, self.model_chunks, self.optimizer, self.lr_scheduler, self.dp)

    def load_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        """Loads this role's distributed checkpoint (saved under any layout) into this rank's shards."""
        from .checkpointing import load_role

        load_role(path, self.model_chunks, self.optimizer, self.lr_scheduler, with_optimizer)
        if with_optimizer and self.optimizer is not None:
            follow_lr_scheduler(self.lr_scheduler)
        if self.optimizer is not None and self.profile == "cpu":
            use_fused_cpu_adam(self.optimizer)

    # ----------------------------------------------------------------------------- full weights
    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """This PP stage's weights as full HF-named tensors (on the CPU) on the stage sender; None on
        other ranks. Every rank must call it (the TP group of DP replica 0 gathers together)."""
        from .hf_weights import iter_hf_tensors

        if self.dp_rank != 0:
            return None
        out = {}
        for name, tensor in iter_hf_tensors(self.model_chunks, self.hf):
            if self.tp_rank == 0:
                out[name] = tensor.detach().to("cpu", copy=True)
        return out if self.tp_rank == 0 else None

    # ------------------------------------------------------------------------------ weight sync
    # The group calls these by name; the sending side is megatron_workers.weight_sender.
    def weight_sync_plan(self, bucket_bytes: int, wire_dtype: str):
        return self.weight_sender.weight_sync_plan(bucket_bytes, wire_dtype)

    def weight_sync_link(self, transport: str, receivers: int):
        return self.weight_sender.weight_sync_link(transport, receivers)

    def init_weight_sync(self, link) -> None:
        self.weight_sender.init_weight_sync(link)

    def close_weight_sync(self) -> None:
        self.weight_sender.close_weight_sync()

    def send_weights(self, with_checksums: bool = False) -> dict | None:
        return self.weight_sender.send_weights(with_checksums)
