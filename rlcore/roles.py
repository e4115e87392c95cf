"""What the loop needs of each role, as small typed interfaces.

``rlcore`` never imports ``megatron_workers`` or ``rollout``: the composition root (``launch/``)
builds the roles and hands them to the ``Trainer``, which talks to them only through these
protocols. A Megatron group with the LM head is a ``TrainableRole`` (the actor) or a
``ForwardRole`` (the reference); with the value head it is the critic; the rollout pool is a
``Generator`` and the receiving side of weight sync. A ``RoleSpec`` is the plain description a
Megatron role is built from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch

from rlcore.batch import Batch, Trajectory
from rlcore.config import OptimConfig
from rlcore.lr_schedule import LRSchedule
from rlcore.weight_sync import WeightReceiver, WeightSender

__all__ = ["ForwardRole", "Generator", "RoleSpec", "Roles", "TrainableRole", "WeightReceiver", "WeightSender"]


@dataclass(frozen=True)
class RoleSpec:
    """One Megatron role: which model, which layout, which head, and whether it trains.

    ``name`` names the role's metrics (``actor/grad_norm``) and messages; it never selects
    behaviour: the ``head`` decides what the last stage computes and ``optim`` whether it trains."""
    name: str  # "actor" | "reference" | "critic" | any later scoring role
    model_path: str  # HF folder: config.json + *.safetensors
    tp: int
    pp: int
    dp: int
    micro_batch_size: int  # sequences per forward/backward micro-batch, per DP rank
    profile: str  # "cpu" | "gpu"
    dtype: str  # "float32" | "bfloat16" (resolved, not "auto")
    seed: int
    head: str = "lm"  # "lm": vocabulary logits -> log-probs; "value": a scalar per token
    optim: Optional[OptimConfig] = None  # None: forward-only (no optimizer is built)
    vpp: int = 1  # virtual pipeline stages (model chunks) per PP rank
    pp_layers: Optional[tuple[int, ...]] = None  # transformer layers per PP stage; None: the even split
    # Math threads of each rank (torch.set_num_threads): its share of the node's cores among every
    # process the job places there (launch/compose.py's math_threads).
    threads: int = 1
    # The C allocator's mode in each rank's process (resources.host_malloc: "glibc" | "keep").
    host_malloc: str = "glibc"
    # Each rank's process started with torch's huge-page advice (resources.host_hugepages).
    host_hugepages: bool = False
    # Run the rows that share a prompt as one row, the prompt once (megatron_workers/packing.py).
    shared_prompt: bool = False
    # Micro-batches by a token budget instead of micro_batch_size rows (None: by rows).
    max_tokens_per_micro_batch: Optional[int] = None
    # The optimizer's learning-rate schedule over the run (trainable roles); None: optim.lr throughout.
    lr_schedule: Optional[LRSchedule] = None
    # Forward-only roles whose models this role's processes hold too, under the same TP/PP/DP/VPP
    # (the reference in the actor's ranks): no processes of their own to start, and one CUDA
    # context, allocator and copy of the framework per GPU instead of two.
    colocated: tuple["RoleSpec", ...] = ()

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def trainable(self) -> bool:
        return self.optim is not None


class UpdateResult(dict):
    """An update's metrics (``dict[str, float]``), and in ``outputs`` the token-aligned [B, S]
    tensors the head kept from the update's own forward (empty unless asked for)."""

    def __init__(self, metrics: dict[str, float], outputs: Optional[dict[str, torch.Tensor]] = None):
        super().__init__(metrics)
        self.outputs = outputs or {}


@runtime_checkable
class ForwardRole(Protocol):
    """A model that scores batches without training: the reference, a reward model."""

    def forward(self, batch: Batch, **head_args) -> dict[str, torch.Tensor]:
        """The head's token-aligned [B, S] outputs for ``batch`` (LM head: ``logprobs``,
        ``entropy``; value head: ``values``)."""
        ...

    def shutdown(self) -> None: ...


@runtime_checkable
class TrainableRole(ForwardRole, Protocol):
    """A model the loop updates: the actor, the critic."""

    def update(self, batch: Batch, loss_cfg, **head_args) -> "UpdateResult":
        """One optimizer step on the whole of ``batch`` (``loss_weights`` already set) with the
        head's loss; returns the metrics summed over micro-batches and DP ranks, and in
        ``.outputs`` what the head kept of its own forward (the LM head's ``logprobs`` when called
        with ``on_policy=True``: the batch needs no ``old_logprobs`` then)."""
        ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str, with_optimizer: bool = True) -> None: ...


@runtime_checkable
class Generator(Protocol):
    """The rollout engines: samples with the engine's log-prob of every token and the weight
    version that sampled it (``Trajectory.token_versions``; more than one per trajectory only when a
    weight sync lands mid-generation, ``rollout.partial_rollouts``)."""

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, max_tokens: int = 256, seed: Optional[int] = None) -> list[Trajectory]: ...

    def shutdown(self) -> None: ...


@dataclass
class Roles:
    """Every role of one job, built by the composition root. ``on_shutdown`` releases what was
    acquired for them (resource pools); ``shutdown`` stops the roles first, the rollout first."""
    actor: TrainableRole  # also the weight sync's WeightSender
    rollout: Generator  # also the weight sync's WeightReceiver
    reference: Optional[ForwardRole] = None
    critic: Optional[TrainableRole] = None
    # The roles reward sources score with, by source name (rlcore/reward_sources.py): "rm", "prm" (a
    # ForwardRole with the score head), a judge's engines.
    reward: dict[str, Any] = field(default_factory=dict)
    on_shutdown: list[Callable[[], Any]] = field(default_factory=list)

    def trainable(self) -> dict[str, TrainableRole]:
        """The roles whose weights and optimizer state a checkpoint holds, by name."""
        return {name: role for name, role in (("actor", self.actor), ("critic", self.critic)) if role is not None}

    def shutdown(self) -> None:
        for role in (self.rollout, *self.reward.values(), self.critic, self.reference, self.actor):
            if role is not None:
                role.shutdown()
        for release in self.on_shutdown:
            release()
