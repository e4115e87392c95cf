"""The driver's handle on one Megatron role: TP x PP x DP ranks, each a ``MegatronWorker`` in a Ray actor
(each PP rank holding ``vpp`` model chunks with virtual pipeline stages).

Rank order is megatron's default (tp-cp-ep-dp-pp: TP fastest, then DP, then PP); the group does not
rely on it, it asks each rank for its coordinates after ``init``.
"""
from __future__ import annotations

import torch

from rlcore.batch import Batch
from rlcore.config import OptimConfig
from rlcore.layout import check_model_split
from rlcore.placement import RolePlacement

from .model import read_hf_config
from .worker import MegatronWorker


class MegatronGroup:
    def __init__(self, role: str, model_path: str, tp: int, pp: int, dp: int, placement: RolePlacement,
                 micro_batch_size: int, profile: str, dtype: str, optim: OptimConfig | None, seed: int,
                 vpp: int = 1):
        import ray

        if min(tp, pp, dp) < 1:
            raise ValueError(f"{role}: TP, PP and DP must be >= 1, got TP={tp} PP={pp} DP={dp}")
        check_model_split(read_hf_config(model_path), tp, pp, vpp, role)  # as `rlx validate`, before any worker
        world = tp * pp * dp
        if len(placement.bundle_indices) < world:
            raise ValueError(f"{role}: TP x PP x DP = {world} ranks, but pool {placement.pool!r} has "
                             f"{len(placement.bundle_indices)} GPUs")
        self.role, self.tp, self.pp, self.dp, self.vpp = role, tp, pp, dp, vpp
        self.profile = profile
        worker_cls = ray.remote(MegatronWorker)
        self.workers = [
            worker_cls.options(**placement.actor_options(i)).remote(
                role, model_path, tp, pp, dp, i, micro_batch_size, profile, dtype, optim, seed, vpp)
            for i in range(world)
        ]
        try:
            master_addr, master_port = ray.get(self.workers[0].node_ip_and_free_port.remote())
            # initialize_model_parallel is collective: every rank must be inside init at once.
            coords = ray.get([w.init.remote(master_addr, master_port) for w in self.workers])
        except BaseException:
            self.shutdown()
            raise
        # Where results come from: the last PP stage's TP rank 0 of each DP replica; and each PP
        # stage's weight sender (DP rank 0, TP rank 0).
        self._reporter = {c["dp_rank"]: i for i, c in enumerate(coords)
                          if c["pp_rank"] == pp - 1 and c["tp_rank"] == 0}
        self._senders = [next(i for i, c in enumerate(coords)
                              if c["pp_rank"] == s and c["dp_rank"] == 0 and c["tp_rank"] == 0)
                         for s in range(pp)]
        self._dp_rank = [c["dp_rank"] for c in coords]
        self._coords = coords
        self._weight_sync_ready = False

    # ------------------------------------------------------------------------------------- compute
    def _run_sharded(self, method: str, batch: Batch, *args) -> list:
        """Calls ``method(shard, *args)`` on every rank with its DP shard (one ray.put per shard);
        returns the results of the DP replicas' reporting ranks, in DP order."""
        import ray

        shards = [ray.put(batch.shard(d, self.dp)) for d in range(self.dp)]
        results = ray.get([getattr(w, method).remote(shards[d], *args)
                           for w, d in zip(self.workers, self._dp_rank)])
        return [results[self._reporter[d]] for d in range(self.dp)]

    def compute_logprobs_and_entropy(self, batch: Batch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-aligned [B, S] log-probs and entropies of ``batch["input_ids"]`` (forward only)."""
        if self.role == "critic":
            raise RuntimeError("the critic has a value head, not a vocabulary: use compute_values")
        parts = self._run_sharded("compute_logprobs", batch.select("input_ids"), temperature)
        return torch.cat([p["logprobs"] for p in parts]), torch.cat([p["entropy"] for p in parts])

    def compute_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Token-aligned [B, S] log-probs of ``batch["input_ids"]`` (position 0 holds 0)."""
        return self.compute_logprobs_and_entropy(batch, temperature)[0]

    def update(self, batch: Batch, loss_cfg, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on ``batch`` (all of it: the group shards it over DP) with
        ``rlcore.algos.actor_loss``. Returns the metrics summed over micro-batches and DP ranks (the
        global token-means), ``actor/loss`` and ``actor/grad_norm``.

        For the critic ``loss_cfg`` is a ``rlcore.algos.CriticLossConfig`` and the loss is
        ``rlcore.algos.critic_loss``: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
        ``critic/loss`` and ``critic/grad_norm``."""
        if self.role == "critic":
            return self._update_critic(batch, loss_cfg)
        if float(batch["response_mask"].sum()) <= 0:
            raise ValueError(f"{self.role} update: the batch has no response tokens (response_mask is all 0)")
        if "loss_weights" not in batch:
            raise ValueError(f"{self.role} update: the batch has no 'loss_weights' (set batch['loss_weights'] = "
                             "rlcore.algos.loss_weights(response_mask, loss_agg_mode, max_response_length) on the "
                             "whole mini-batch before the update)")
        parts = self._run_sharded("update", batch, loss_cfg, temperature)
        metrics = {k: sum(p["sums"][k] for p in parts) for k in parts[0]["sums"]}
        metrics["actor/grad_norm"] = parts[0]["grad_norm"]  # the global norm: the same on every rank
        return metrics

    # ------------------------------------------------------------------------------------- critic
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """The critic's token-aligned [B, S] values of ``batch["input_ids"]`` (forward only):
        ``values[:, t]`` is the value of the state before token t; position 0 holds 0."""
        if self.role != "critic":
            raise RuntimeError(f"compute_values needs the critic; this group is the {self.role}")
        return torch.cat(self._run_sharded("compute_values", batch.select("input_ids")))

    def _update_critic(self, batch: Batch, loss_cfg) -> dict[str, float]:
        # Only what critic_loss reads travels to the workers.
        needed = batch.select("input_ids", "response_mask", "returns", "old_values", "loss_weights")
        parts = self._run_sharded("update_values", needed, loss_cfg)
        metrics = {k: sum(p["sums"][k] for p in parts) for k in parts[0]["sums"]}
        metrics["critic/grad_norm"] = parts[0]["grad_norm"]  # the global norm: the same on every rank
        return metrics

    # ------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Writes this role's megatron-core distributed checkpoint (model, and optimizer + lr scheduler
        when it trains) into the folder ``path``; every rank writes its shards."""
        import ray

        ray.get([w.save_checkpoint.remote(path) for w in self.workers])

    def load_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        """Loads a checkpoint written by ``save_checkpoint`` under any TP/PP layout into this group."""
        import ray

        ray.get([w.load_checkpoint.remote(path, with_optimizer) for w in self.workers])

    # ------------------------------------------------------------------------------ full weights
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """All weights as full HF-named tensors (CPU, the model's dtype), gathered over TP and PP."""
        import ray

        results = ray.get([w.hf_state_dict.remote() for w in self.workers])
        out = {}
        for s in self._senders:
            out.update(results[s])
        return out

    # ------------------------------------------------------------------------------- weight sync
    def weight_sync_plans(self, bucket_bytes: int, wire_dtype: str) -> list[list]:
        """One bucket plan (list of rlcore.weight_sync.Bucket) per PP stage, in stage order; every rank
        of DP replica 0 keeps its stage's plan for ``send_weights``."""
        import ray

        plans = ray.get([w.weight_sync_plan.remote(bucket_bytes, wire_dtype) for w in self.workers])
        self._weight_sync_ready = False  # a new plan needs receivers that know it: init again
        return [plans[s] for s in self._senders]

    def node_ips(self) -> list[str]:
        """The node IP of every rank (the weight-sync transport depends on where they are)."""
        import ray

        return [ip for ip, _ in ray.get([w.node_ip_and_free_port.remote() for w in self.workers])]

    def weight_sync_links(self, transport: str, receivers: int) -> list:
        """Each stage sender's rlcore.weight_sync.StageLink for ``transport`` (``shm``: it creates the
        stage's shared bucket slots now), in stage order; ``receivers`` ranks will join each group."""
        import ray

        return ray.get([self.workers[s].weight_sync_link.remote(transport, receivers) for s in self._senders])

    def init_weight_sync(self, links: list) -> list:
        """Every rank joins its stage's group (those that are not writers return at once). The calls
        block until the receivers join too: ray.get the returned refs together with theirs."""
        if len(links) != self.pp:
            raise ValueError(f"{self.role}: {len(links)} weight-sync links for {self.pp} PP stages")
        refs = [w.init_weight_sync.remote(links[c["pp_rank"]]) for w, c in zip(self.workers, self._coords)]
        self._weight_sync_ready = True
        return refs

    def send_weights(self, with_checksums: bool = False) -> list:
        """Broadcasts every stage's buckets over its weight-sync group (stages in parallel; every rank
        takes part in its TP gathers). Returns the refs to ray.get together with the receivers: the
        stage senders' stats (with ``checksums`` of what they sent when asked), None for other ranks."""
        # Checked here, not on the senders: a sender that refused would leave its TP peers waiting
        # in their all-gathers.
        if not self._weight_sync_ready:
            raise RuntimeError(f"{self.role}: weight sync is not set up; call weight_sync_plans(), "
                               f"weight_sync_links() and init_weight_sync() first")
        return [w.send_weights.remote(with_checksums) for w in self.workers]

    def peak_memory_mb(self) -> list[float]:
        """Each rank's peak resident memory (MiB), in rank order."""
        import ray

        return ray.get([w.peak_memory_mb.remote() for w in self.workers])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
