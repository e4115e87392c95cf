"""megatron-core distributed checkpoints of one role: its model chunks, and the optimizer and lr
scheduler when it trains.

Every tensor is saved with its global shape and offsets, so a checkpoint loads under another
TP/PP/DP/VPP layout. The optimizer state follows the model's sharding: the plain optimizer keys its
exp_avg/exp_avg_sq by the parameter's sharded key, and the distributed optimizer is saved in the
"fully_reshardable" format (gathered per parameter like the plain one; 0.16.1's torch_dist refuses
the flattened "fully_sharded_model_space" format). "mem_efficient" gathers the distributed
optimizer's state over the gloo DP group (megatron's other path moves it to CUDA, which the cpu
profile lacks) onto DP rank 0, which writes it.

Chunks are saved as Megatron-LM does: "model" for one, "model0", "model1", ... for virtual stages.
The tensors inside carry global keys and offsets (layer numbers include the chunk's offset), so the
nesting does not matter to a load under another layout.
"""
from __future__ import annotations

import os

_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                   "distrib_optim_fully_reshardable_mem_efficient": True,
                   "chained_optim_avoid_prefix": True}


def _model_state_keys(chunks: list) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _sharded_state(chunks: list, optimizer, lr_scheduler, is_loading: bool) -> dict:
    """The sharded state dict of the chunks, plus the optimizer's and the scheduler's when
    ``optimizer`` is given."""
    state = {key: chunk.sharded_state_dict() for key, chunk in zip(_model_state_keys(chunks), chunks)}
    # The optimizer finds its parameters' sharded keys in the chunks' state dicts.
    model_state = state["model"] if len(chunks) == 1 else dict(state)
    if optimizer is not None:
        if is_loading:
            # A distributed optimizer that has not stepped has no state to load into (its
            # state_dict() asserts on the Adam step): megatron's own remedy, a zero-gradient step
            # whose state the load then overwrites (the weights are loaded after it).
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata=dict(_OPTIM_METADATA))
        state["lr_scheduler"] = lr_scheduler.state_dict()
    return state


def _results_queue_in_process() -> None:
    """megatron's torch_dist writer hands each rank's write results to a queue served by a spawned
    multiprocessing Manager process, made for async saves (the writing then runs in another process).
    Saves here are synchronous, and that Manager, with the resource tracker it keeps open, is never
    stopped when the worker dies without running its exit handlers (SIGKILL, a lost raylet): two
    ~300 MB orphans per rank, alive indefinitely. A queue in this process carries the results as well."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_role(path: str, chunks: list, optimizer=None, lr_scheduler=None, dp: int = 1) -> None:
    """Writes the role's distributed checkpoint into the folder ``path`` (every rank at once)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    os.makedirs(path, exist_ok=True)
    _results_queue_in_process()
    strategy = get_default_save_sharded_strategy()  # torch_dist
    if dp > 1:  # DP replicas share the writing instead of replica 0 writing everything
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    dist_checkpointing.save(_sharded_state(chunks, optimizer, lr_scheduler, False), path, sharded_strategy=strategy)


def load_role(path: str, chunks: list, optimizer=None, lr_scheduler=None, with_optimizer: bool = True) -> None:
    """Loads a role's distributed checkpoint from ``path`` into this rank's shards (any layout the
    checkpoint was saved under); the optimizer and lr scheduler too when ``with_optimizer``."""
    from megatron.core import dist_checkpointing

    with_optimizer = with_optimizer and optimizer is not None
    loaded = dist_checkpointing.load(_sharded_state(chunks, optimizer if with_optimizer else None, lr_scheduler,
                                                    True), path)
    for key, chunk in zip(_model_state_keys(chunks), chunks):
        chunk.load_state_dict(loaded[key], strict=True)
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        lr_scheduler.load_state_dict(loaded["lr_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # the optimizer's main params follow the new weights
