"""One rank of a Megatron role (actor, critic, reference): a plain class that ``group.MegatronGroup`` hosts
in a Ray actor.

The rank joins a gloo (cpu profile) or NCCL (gpu profile) world of TP x PP x DP ranks, builds its PP
stage of the GPTModel from the HF checkpoint and, for a trainable role, wraps it in megatron's
DistributedDataParallel with megatron's optimizer. Forward and backward always go through
megatron's ``get_forward_backward_func`` schedules, so PP micro-batching is megatron's own.

With virtual pipeline stages (VPP > 1) the stage is ``vpp`` model chunks (megatron's interleaved
1F1B schedule): one DDP per chunk, one optimizer over all of them, a data iterator per chunk, and
chunk state dicts named ``model0``, ``model1``, ... in checkpoints, as Megatron-LM's training.py
and checkpointing.py do. With VPP = 1 everything is the single model of before.
"""
from __future__ import annotations

import datetime
import math
import os
import socket
import warnings
from functools import partial

import torch

from rlcore.batch import Batch
from rlcore.config import OptimConfig

TRAINABLE_ROLES = ("actor", "critic")  # critic: the value model of value_head.py
FORWARD_ONLY_ROLES = ("reference",)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class MegatronWorker:
    """Construction is cheap (Ray creates the actor); ``init`` joins the world and builds the model and
    must run on every rank of the group at once."""

    def __init__(self, role: str, model_path: str, tp: int, pp: int, dp: int, rank: int,
                 micro_batch_size: int, profile: str, dtype: str, optim: OptimConfig | None, seed: int,
                 vpp: int = 1):
        if role not in TRAINABLE_ROLES + FORWARD_ONLY_ROLES:
            raise ValueError(f"role {role!r}: expected one of {TRAINABLE_ROLES + FORWARD_ONLY_ROLES}")
        if role in TRAINABLE_ROLES and optim is None:
            raise ValueError(f"role {role!r} trains and needs an OptimConfig")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if vpp < 1 or (vpp > 1 and pp == 1):
            raise ValueError(f"{role}: vpp={vpp} must be >= 1, and vpp > 1 needs pp > 1 (got pp={pp})")
        # One math thread per worker process: on a shared CPU box more threads per process made
        # every process slower (shared/notes/offline-models-and-data.md).
        torch.set_num_threads(1)
        self.role, self.model_path, self.profile, self.dtype = role, model_path, profile, dtype
        self.tp, self.pp, self.dp, self.vpp, self.rank = tp, pp, dp, vpp, rank
        self.world_size = tp * pp * dp
        self.micro_batch_size, self.optim_cfg, self.seed = micro_batch_size, optim, seed
        self.trainable = role in TRAINABLE_ROLES

    # ------------------------------------------------------------------------------------ set-up
    @staticmethod
    def node_ip_and_free_port() -> tuple[str, int]:
        return node_ip(), free_port()

    def init(self, master_addr: str, master_port: int) -> dict:
        """Joins the world, initialises Megatron's parallel state, builds and loads the model (and the
        optimizer). Returns this rank's coordinates."""
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
            backend, self.device = "gloo", torch.device("cpu")
        elif self.profile == "gpu":
            if not torch.cuda.is_available():
                raise RuntimeError("the gpu profile needs CUDA, but torch.cuda.is_available() is False")
            torch.cuda.set_device(0)  # Ray exposes this actor's GPU as device 0 (CUDA_VISIBLE_DEVICES)
            backend, self.device = "nccl", torch.device("cuda", 0)
        else:
            raise ValueError(f"profile {self.profile!r}: expected cpu or gpu")

        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel

        from .hf_weights import load_hf_weights
        from .model import build_gpt_model, read_hf_config, transformer_config
        from .weight_sender import StageWeightSender

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size))
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(minutes=10))
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None)
        torch.manual_seed(self.seed)
        if self.profile == "gpu":
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)

        self.hf = read_hf_config(self.model_path)
        self.config = transformer_config(self.hf, self.profile, self.dtype, self.tp, self.pp, self.vpp)
        # unwrapped: names map to HF. The critic is the same GPTModel ending in a scalar value head.
        # One chunk per virtual stage, in layer order (vp_stage None: no virtual stages). Built in the
        # same order on every rank: a chunk holding a tied embedding all-reduces it at construction.
        vp_stages = list(range(self.vpp)) if self.vpp > 1 else [None]
        self.model_chunks = [build_gpt_model(self.hf, self.config, self.profile, vp_stage=v,
                                             value_head_seed=self.seed if self.role == "critic" else None)
                             for v in vp_stages]
        for chunk in self.model_chunks:
            load_hf_weights(chunk, self.hf, self.model_path)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.weight_sender = StageWeightSender(self.model_chunks, self.hf, self.coords(), self.tp, self.profile,
                                               self.device, self.node_ip_and_free_port)

        if self.trainable:
            self._build_trainer()
            self.forward_chunks = self.ddp_chunks
        else:
            for chunk in self.model_chunks:
                chunk.eval()
            self.forward_chunks = self.model_chunks
        return self.coords()

    def _build_trainer(self) -> None:
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.optim_cfg
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=o.use_distributed_optimizer)
        # One DDP per chunk; as Megatron-LM's training.py, only the first chunk buckets its gradients
        # (the others reduce theirs as one bucket when the schedule finishes them).
        self.ddp_chunks = [DistributedDataParallel(self.config, ddp_config, chunk, disable_bucketing=i > 0)
                           for i, chunk in enumerate(self.model_chunks)]
        opt_config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            bf16=self.config.bf16, params_dtype=self.config.params_dtype,
            use_distributed_optimizer=o.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, self.ddp_chunks)
        # Constant lr and weight decay; the scheduler is what applies megatron's per-group wd_mult
        # (no weight decay on biases and norms).
        self.lr_scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=o.lr, max_lr=o.lr, min_lr=o.lr, lr_warmup_steps=0, lr_decay_steps=1,
            lr_decay_style="constant", start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=0,
            wd_incr_style="constant")
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
    def _micro_batches(self, batch: Batch) -> list[Batch]:
        if batch.size == 0 or batch.size % self.micro_batch_size:
            raise ValueError(f"{self.role}: the DP shard of {batch.size} rows does not split into "
                             f"micro-batches of {self.micro_batch_size} (pipeline stages exchange "
                             f"fixed-shape activations)")
        if self.vpp > 1 and (batch.size // self.micro_batch_size) % self.pp:
            # megatron 0.16.1's interleaved schedule groups micro-batches pp at a time
            # (microbatch_group_size_per_vp_stage defaults to pp) and refuses a partial group.
            raise ValueError(f"{self.role}: the DP shard of {batch.size} rows makes "
                             f"{batch.size // self.micro_batch_size} micro-batches of {self.micro_batch_size}, "
                             f"not a multiple of PP={self.pp} as the interleaved schedule (VPP={self.vpp}) needs")
        seq_len = batch["input_ids"].shape[1]
        if self.config.sequence_parallel and seq_len % self.tp:
            raise ValueError(f"{self.role}: sequence length {seq_len} is not divisible by TP={self.tp} "
                             f"(sequence parallel)")
        on_device = Batch({k: v.to(self.device) for k, v in batch.items()})
        return on_device.split(self.micro_batch_size)

    def _forward(self, model, micro_batch: Batch) -> torch.Tensor:
        """This stage's output: vocab-parallel logits [b, s, V/TP] on the last stage, activations
        elsewhere (the input of a later stage arrives through megatron's set_input_tensor)."""
        input_ids = micro_batch["input_ids"]
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        # No attention mask: right padding under the causal mask never changes real positions.
        return model(input_ids, position_ids, None)

    def _set_training(self, mode: bool) -> None:
        for chunk in self.forward_chunks:
            chunk.train(mode)

    def _run_schedule(self, micro_batches: list[Batch], loss_func, forward_only: bool) -> list:
        """Megatron's forward(-backward) schedule over ``micro_batches``; ``loss_func(micro_batch,
        output)`` is the hook megatron applies to the last stage's output of each micro-batch.
        Returns what the hooks returned (their second element when training), on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            micro_batch = next(data_iterator)
            return self._forward(model, micro_batch), partial(loss_func, micro_batch)

        # Interleaved: every chunk runs every micro-batch in order, each reading its own iterator.
        data_iterator = ([iter(micro_batches) for _ in self.forward_chunks] if self.vpp > 1
                         else iter(micro_batches))
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data_iterator, model=self.forward_chunks,
            num_microbatches=len(micro_batches), seq_length=micro_batches[0]["input_ids"].shape[1],
            micro_batch_size=self.micro_batch_size, forward_only=forward_only,
            collect_non_loss_data=forward_only)

    def compute_logprobs(self, batch: Batch, temperature: float = 1.0) -> dict[str, torch.Tensor] | None:
        """Token-aligned [b, S] ``logprobs`` and ``entropy`` of this rank's DP shard (forward only).

        Returned by the last PP stage's TP rank 0 (on the CPU); None on every other rank."""
        from .logprobs import token_logprobs_and_entropy

        def collect(micro_batch, output, non_loss_data=True):
            lp, ent = token_logprobs_and_entropy(output, micro_batch["input_ids"], temperature, self.tp_group)
            return {"logprobs": lp, "entropy": ent}

        self._set_training(False)
        with torch.no_grad():
            outputs = self._run_schedule(self._micro_batches(batch), collect, forward_only=True)
        if self.trainable:
            self._set_training(True)
        if not (self.is_last_stage and self.tp_rank == 0):
            return None
        return {k: torch.cat([o[k] for o in outputs]).cpu() for k in ("logprobs", "entropy")}

    def update(self, batch: Batch, loss_cfg, temperature: float = 1.0) -> dict | None:
        """One optimizer step on this rank's DP shard with ``rlcore.algos.actor_loss`` as the loss.

        Returns, on the last PP stage's TP rank 0, ``{"sums": metrics summed over this shard's
        micro-batches (additive over DP by the rlcore.algos contract), "grad_norm": float}``; None on
        the other ranks."""
        from rlcore.algos import actor_loss

        from .logprobs import token_logprobs_and_entropy

        if not self.trainable:
            raise RuntimeError(f"role {self.role!r} is forward-only: it has no optimizer")
        micro_batches = self._micro_batches(batch)
        # actor_loss returns this micro-batch's share of the global aggregate (sum(x * loss_weights), the
        # weights computed over the whole batch by the controller), and the update must follow the gradient of the SUM of those shares over all micro-batches
        # and DP ranks. Verified in megatron-core 0.16.1: for a 2-tuple (loss, metrics) the schedule
        # divides the loss by num_microbatches before backward (pipeline_parallel/schedules.py:263-269,
        # forward_step_calc_loss; cp size is 1), and DDP pre-scales gradients by 1/DP before summing
        # them over DP (distributed/distributed_data_parallel.py:285-288 with average_in_collective=
        # False; param_and_grad_buffer.py:391 then a SUM all-reduce/reduce-scatter). Multiplying by
        # num_microbatches * DP cancels both.
        grad_scale = len(micro_batches) * self.dp

        def loss_func(micro_batch, output):
            logprobs, entropy = token_logprobs_and_entropy(output, micro_batch["input_ids"], temperature,
                                                           self.tp_group)
            loss, metrics = actor_loss(logprobs, entropy, micro_batch, loss_cfg)
            return loss * grad_scale, {"actor/loss": loss.detach(), **metrics}

        return self._optimizer_step(micro_batches, loss_func)

    def _optimizer_step(self, micro_batches: list[Batch], loss_func) -> dict | None:
        """Forward-backward over ``micro_batches`` with the loss hook ``loss_func(micro_batch, output)
        -> (scaled loss, metrics)``, then one optimizer step. Returns ``{"sums": each metric summed
        over the micro-batches, "grad_norm"}`` on the last PP stage's TP rank 0, None elsewhere."""
        for ddp in self.ddp_chunks:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(micro_batches, loss_func, forward_only=False)
        success, grad_norm, _ = self.optimizer.step()
        if not success:
            raise RuntimeError(f"{self.role} update: the optimizer skipped the step (inf/nan in gradients)")
        grad_norm = float(grad_norm)
        if not math.isfinite(grad_norm):
            raise RuntimeError(f"{self.role} update: the gradient norm is {grad_norm}")
        self.lr_scheduler.step(increment=1)
        if not (self.is_last_stage and self.tp_rank == 0):
            return None
        sums = {k: float(sum(o[k] for o in outputs)) for k in outputs[0]}
        return {"sums": sums, "grad_norm": grad_norm}

    # ---------------------------------------------------------------------------------- critic
    def _require_critic(self, what: str) -> None:
        if self.role != "critic":
            raise RuntimeError(f"{what} needs the critic's value model; role {self.role!r} has none")

    def compute_values(self, batch: Batch) -> torch.Tensor | None:
        """Token-aligned [b, S] values of this rank's DP shard (forward only; value_head.token_values).

        Returned by the last PP stage's TP rank 0 (on the CPU); None on every other rank."""
        from .value_head import token_values

        self._require_critic("compute_values")

        def collect(micro_batch, output, non_loss_data=True):
            return token_values(output)

        self._set_training(False)
        with torch.no_grad():
            outputs = self._run_schedule(self._micro_batches(batch), collect, forward_only=True)
        self._set_training(True)
        if not (self.is_last_stage and self.tp_rank == 0):
            return None
        return torch.cat(outputs).cpu()

    def update_values(self, batch: Batch, loss_cfg) -> dict | None:
        """One critic optimizer step on this rank's DP shard with ``rlcore.algos.critic_loss`` (a
        ``CriticLossConfig``) as the loss hook; returns as ``update``."""
        from rlcore.algos import critic_loss

        from .value_head import token_values

        self._require_critic("update_values")
        micro_batches = self._micro_batches(batch)
        # critic_loss returns this micro-batch's share of the global aggregate (its loss_weights sum
        # to 1 over the whole batch); the schedule's 1/num_microbatches and DDP's 1/DP are cancelled
        # as in update().
        grad_scale = len(micro_batches) * self.dp

        def loss_func(micro_batch, output):
            loss, metrics = critic_loss(token_values(output), micro_batch, loss_cfg)
            return loss * grad_scale, {"critic/loss": loss.detach(), **metrics}

        return self._optimizer_step(micro_batches, loss_func)

    # ------------------------------------------------------------------------------ checkpoints
    # megatron-core's distributed checkpoint of this role's model (+ optimizer + lr scheduler when the
    # role trains). Every tensor is saved with its global shape and offsets, so a checkpoint loads
    # under another TP/PP/DP layout. The optimizer state follows the model's sharding: the plain
    # optimizer keys its exp_avg/exp_avg_sq by the parameter's sharded key, and the distributed
    # optimizer is saved in the "fully_reshardable" format (gathered per parameter like the plain one;
    # 0.16.1's torch_dist refuses the flattened "fully_sharded_model_space" format).
    # "mem_efficient" gathers the distributed optimizer's state over the gloo DP group (megatron's
    # other path moves it to CUDA, which the cpu profile lacks) onto DP rank 0, which writes it.
    _OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                       "distrib_optim_fully_reshardable_mem_efficient": True,
                       "chained_optim_avoid_prefix": True}

    # Chunks are saved as Megatron-LM does: "model" for one, "model0", "model1", ... for virtual
    # stages. The tensors inside carry global keys and offsets (layer numbers include the chunk's
    # offset), so the nesting does not matter to a load under another TP/PP/VPP layout.
    def _model_state_keys(self) -> list[str]:
        return ["model"] if len(self.model_chunks) == 1 else [f"model{i}" for i in range(len(self.model_chunks))]

    def _checkpoint_state(self, is_loading: bool, with_optimizer: bool) -> dict:
        state = {key: chunk.sharded_state_dict() for key, chunk in zip(self._model_state_keys(), self.model_chunks)}
        # The optimizer finds its parameters' sharded keys in the chunks' state dicts.
        model_state = state["model"] if len(self.model_chunks) == 1 else dict(state)
        if with_optimizer and getattr(self, "optimizer", None) is not None:
            if is_loading:
                # A distributed optimizer that has not stepped has no state to load into (its
                # state_dict() asserts on the Adam step): megatron's own remedy, a zero-gradient step
                # whose state the load then overwrites (the weights are loaded after it).
                from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

                for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                    if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
                        opt._init_optimizer_states_with_dummy_values()
            state["optimizer"] = self.optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                                   metadata=dict(self._OPTIM_METADATA))
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return state

    def save_checkpoint(self, path: str) -> None:
        """Writes this role's distributed checkpoint into the folder ``path`` (every rank at once)."""
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        os.makedirs(path, exist_ok=True)
        strategy = get_default_save_sharded_strategy()  # torch_dist
        if self.dp > 1:  # DP replicas share the writing instead of replica 0 writing everything
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
        dist_checkpointing.save(self._checkpoint_state(False, True), path, sharded_strategy=strategy)

    def load_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        """Loads this role's distributed checkpoint from ``path`` into this rank's shards (any layout
        the checkpoint was saved under); the optimizer and lr scheduler too when ``with_optimizer``."""
        from megatron.core import dist_checkpointing

        with_optimizer = with_optimizer and getattr(self, "optimizer", None) is not None
        loaded = dist_checkpointing.load(self._checkpoint_state(True, with_optimizer), path)
        for key, chunk in zip(self._model_state_keys(), self.model_chunks):
            chunk.load_state_dict(loaded[key], strict=True)
        if with_optimizer:
            self.optimizer.load_state_dict(loaded["optimizer"])
            self.lr_scheduler.load_state_dict(loaded["lr_scheduler"])
        elif getattr(self, "optimizer", None) is not None:
            self.optimizer.reload_model_params()  # the optimizer's main params follow the new weights

    # ----------------------------------------------------------------------------- full weights
    @property
    def is_stage_sender(self) -> bool:
        """The rank that speaks for its PP stage's full weights: DP rank 0, TP rank 0."""
        return self.dp_rank == 0 and self.tp_rank == 0

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
