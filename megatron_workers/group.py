"""The driver's handle on one Megatron role: TP x PP x DP ranks, each a ``MegatronEngine`` in a Ray
actor (each PP rank holding ``vpp`` model chunks with virtual pipeline stages).

The group shards a batch over DP, runs the same call on every rank and collects the results from
the last PP stage's TP rank 0 of each DP replica. It implements ``rlcore.roles.ForwardRole`` and,
when its spec has an optimizer, ``TrainableRole``. Rank order is megatron's default (tp-cp-ep-dp-pp:
TP fastest, then DP, then PP); the group does not rely on it, it asks each rank for its coordinates
after ``init``.

A rank whose process dies ends the call with ``rlcore.faults.RankDied`` naming the role and the rank
(one sentence for the CLI), not Ray's traceback, and without waiting for its peers (they would wait
in a collective for it until Megatron's timeout).
"""
from __future__ import annotations

import torch

from rlcore.batch import Batch
from rlcore.faults import RankDied
from rlcore.layout import check_micro_batches, check_model_split
from rlcore.placement import RolePlacement
from rlcore.roles import RoleSpec, UpdateResult

from .engine import MegatronEngine
from .heads import HEADS
from .host_malloc import hugepages_env
from .model import read_hf_config

DEATH_GRACE_S = 10.0  # after one rank's error, how long the others may take to show a death instead


class MegatronGroup:
    def __init__(self, spec: RoleSpec, placement: RolePlacement):
        import ray

        if min(spec.tp, spec.pp, spec.dp) < 1:
            raise ValueError(f"{spec.name}: TP, PP and DP must be >= 1, got TP={spec.tp} PP={spec.pp} DP={spec.dp}")
        # The same check as `rlx validate`, before any engine starts.
        for s in (spec, *spec.colocated):
            check_model_split(read_hf_config(s.model_path), s.tp, s.pp, s.vpp, s.name, pp_layers=s.pp_layers)
        for s in spec.colocated:  # one parallel state per process: theirs must be this role's
            if (s.tp, s.pp, s.dp, s.vpp) != (spec.tp, spec.pp, spec.dp, spec.vpp) or s.trainable:
                raise ValueError(f"{s.name}: a role in {spec.name}'s processes must be forward-only with "
                                 f"{spec.name}'s TP={spec.tp} PP={spec.pp} DP={spec.dp} VPP={spec.vpp}, got "
                                 f"TP={s.tp} PP={s.pp} DP={s.dp} VPP={s.vpp}{' and an optimizer' * s.trainable}")
        if len(placement.bundle_indices) < spec.world_size:
            raise ValueError(f"{spec.name}: TP x PP x DP = {spec.world_size} ranks, but pool {placement.pool!r} has "
                             f"{len(placement.bundle_indices)} GPUs")
        self.spec, self.head = spec, HEADS[spec.head]
        self.role, self.tp, self.pp, self.dp, self.vpp = spec.name, spec.tp, spec.pp, spec.dp, spec.vpp
        self.profile = spec.profile
        engine_cls = ray.remote(MegatronEngine)
        # Ray merges these variables into the job's (rlcore/placement.py); torch reads them at import.
        env = {"runtime_env": {"env_vars": hugepages_env(spec.host_hugepages)}} if spec.host_hugepages else {}
        self.workers = [engine_cls.options(**placement.actor_options(i), **env).remote(spec, i)
                        for i in range(spec.world_size)]
        try:
            # Plain ray.get: an actor that failed to start is an ActorDiedError carrying its traceback.
            master_addr, master_port = ray.get(self.workers[0].node_ip_and_free_port.remote())
            # initialize_model_parallel is collective: every rank must be inside init at once.
            coords = ray.get([w.init.remote(master_addr, master_port) for w in self.workers])
            # Each rank computes with its share of the cores (launch/compose.py job_threads), not the
            # one thread a Ray worker starts with (rlcore/placement.py WORKER_ENV).
            for rank, c in enumerate(coords):
                if c["math_threads"] != spec.threads:
                    raise RuntimeError(f"{spec.name} rank {rank} computes with {c['math_threads']} math threads, "
                                       f"but its share of the cores is {spec.threads} (RoleSpec.threads)")
        except BaseException:
            self.shutdown()
            raise
        # Where results come from: the last PP stage's TP rank 0 of each DP replica; and each PP
        # stage's weight sender (DP rank 0, TP rank 0).
        self._reporter = {c["dp_rank"]: i for i, c in enumerate(coords)
                          if c["pp_rank"] == spec.pp - 1 and c["tp_rank"] == 0}
        self._senders = [next(i for i, c in enumerate(coords)
                              if c["pp_rank"] == s and c["dp_rank"] == 0 and c["tp_rank"] == 0)
                         for s in range(spec.pp)]
        self._dp_rank = [c["dp_rank"] for c in coords]
        self._coords = coords
        self._weight_sync_ready = False
        self._hosted = {s.name: HostedRole(self, s) for s in spec.colocated}

    def hosted(self, name: str) -> "HostedRole":
        """The colocated role ``name`` (``RoleSpec.colocated``), whose model lives in these ranks."""
        return self._hosted[name]

    def _get(self, refs: list, what: str, ranks: list[int] | None = None) -> list:
        """``ray.get(refs)``, the refs of ranks ``ranks`` (default: one per rank, in rank order), except
        that a rank whose process died is ``RankDied``, raised as soon as Ray reports it. A rank's
        other error is raised once every rank is done or, since its peers may then wait in a
        collective for it, ``DEATH_GRACE_S`` later (a peer's death often shows up first as such an error)."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        index = {ref: i for i, ref in enumerate(refs)}
        results, pending, error = [None] * len(refs), list(refs), None
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=None if error is None else DEATH_GRACE_S)
            if not ready:
                raise error
            for ref in ready:
                try:
                    results[index[ref]] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    raise RankDied(self.role, ranks[index[ref]], what) from None
                except Exception as e:
                    error = error or e
        if error is not None:
            raise error
        return results

    # ------------------------------------------------------------------------------------- compute
    def _run_sharded(self, method: str, batch: Batch, *args, spec: RoleSpec | None = None) -> list:
        """Calls ``method(shard, *args)`` on every rank with its DP shard (one ray.put per shard);
        returns the results of the DP replicas' reporting ranks, in DP order. ``spec``: the role
        whose micro-batches these are (a colocated one's; default this group's)."""
        import ray

        s = spec or self.spec  # the check `rlx validate` ran on the configured batch sizes, on this batch
        if not s.max_tokens_per_micro_batch:  # by tokens: each rank plans its own micro-batches
            check_micro_batches(s.name, s, "the batch", batch.size, f"{s.name}.micro_batch_size",
                                s.micro_batch_size, f"{s.name}.vpp")
        shards = [ray.put(batch.shard(d, self.dp)) for d in range(self.dp)]
        what = method if s is self.spec else f"the {s.name}'s {method}"
        results = self._get([getattr(w, method).remote(shards[d], *args)
                             for w, d in zip(self.workers, self._dp_rank)], what)
        return [results[self._reporter[d]] for d in range(self.dp)]

    def forward(self, batch: Batch, **head_args) -> dict[str, torch.Tensor]:
        """The head's token-aligned [B, S] outputs for ``batch`` (forward only; position 0 holds 0):
        ``logprobs`` and ``entropy`` of ``input_ids`` for the LM head (``temperature=``), ``values``
        for the value head (``values[:, t]``: the value of the state before token t)."""
        return self._forward(self.spec, batch, head_args)

    def _forward(self, spec: RoleSpec, batch: Batch, head_args: dict) -> dict[str, torch.Tensor]:
        """``forward`` of this group's model or, for a colocated ``spec``, of that role's."""
        keys = HEADS[spec.head].forward_keys
        role = None if spec is self.spec else spec.name
        parts = self._run_sharded("forward", self._head_keys(batch, keys), head_args, role, spec=spec)
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def update(self, batch: Batch, loss_cfg, **head_args) -> UpdateResult:
        """One optimizer step on ``batch`` (all of it: the group shards it over DP) with the head's
        loss. Returns the metrics summed over micro-batches and DP ranks (the global aggregates),
        ``<role>/loss`` and ``<role>/grad_norm``; in ``.outputs`` the [B, S] tensors the head kept
        (the LM head's ``logprobs`` with ``on_policy=True``)."""
        self.head.check_update(batch, self.role, **head_args)
        if self.head.train_keys is not None:  # only what the loss reads travels to the workers
            batch = self._head_keys(batch, self.head.train_keys)
        parts = self._run_sharded("update", batch, loss_cfg, head_args)
        metrics = {k: sum(p["sums"][k] for p in parts) for k in parts[0]["sums"]}
        metrics[f"{self.role}/grad_norm"] = parts[0]["grad_norm"]  # the global norm: the same on every rank
        # A non-finite loss or gradient norm: the engines did not apply the step (the same on every rank).
        metrics[f"{self.role}/update_skipped"] = float(parts[0]["skipped"])
        metrics[f"{self.role}/lr"] = parts[0]["lr"]  # the lr this optimizer step ran at
        outputs = {k: torch.cat([p["outputs"][k] for p in parts]) for k in parts[0]["outputs"]}
        return UpdateResult(metrics, outputs)

    @staticmethod
    def _head_keys(batch: Batch, keys: tuple[str, ...]) -> Batch:
        """What travels to the workers: ``keys`` of ``batch``; the masks only where the batch has
        them (without a response mask every position's output is computed)."""
        optional = ("attention_mask", "response_mask")
        return batch.select(*[k for k in keys if k in batch or k not in optional])

    # ------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Writes this role's megatron-core distributed checkpoint (model, and optimizer + lr scheduler
        when it trains) into the folder ``path``; every rank writes its shards."""
        self._get([w.save_checkpoint.remote(path) for w in self.workers], "a checkpoint save")

    def load_checkpoint(self, path: str, with_optimizer: bool = True) -> None:
        """Loads a checkpoint written by ``save_checkpoint`` under any TP/PP layout into this group."""
        self._get([w.load_checkpoint.remote(path, with_optimizer) for w in self.workers], "a checkpoint load")

    # ------------------------------------------------------------------------------ full weights
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """All weights as full HF-named tensors (CPU, the model's dtype), gathered over TP and PP."""
        results = self._get([w.hf_state_dict.remote() for w in self.workers], "a weight gather")
        out = {}
        for s in self._senders:
            out.update(results[s])
        return out

    # ------------------------------------------------------------------------------- weight sync
    def weight_sync_plans(self, bucket_bytes: int, wire_dtype: str) -> list[list]:
        """One bucket plan (list of rlcore.weight_sync.Bucket) per PP stage, in stage order; every rank
        of DP replica 0 keeps its stage's plan for ``send_weights``."""
        plans = self._get([w.weight_sync_plan.remote(bucket_bytes, wire_dtype) for w in self.workers],
                          "the weight-sync planning")
        self._weight_sync_ready = False  # a new plan needs receivers that know it: init again
        return [plans[s] for s in self._senders]

    def node_ips(self) -> list[str]:
        """The node IP of every rank (the weight-sync transport depends on where they are)."""
        return [ip for ip, _ in self._get([w.node_ip_and_free_port.remote() for w in self.workers], "a node query")]

    def weight_sync_links(self, transport: str, receivers: int) -> list:
        """Each stage sender's rlcore.weight_sync.StageLink for the registered ``transport`` (made now,
        with whatever the members must find when they join), in stage order; ``receivers`` ranks will
        join each group."""
        return self._get([self.workers[s].weight_sync_link.remote(transport, receivers) for s in self._senders],
                         "the weight-sync group setup", ranks=self._senders)

    def init_weight_sync(self, links: list) -> list:
        """Every rank joins its stage's group (those that are not writers return at once). The calls
        block until the receivers join too: ray.get the returned refs together with theirs."""
        if len(links) != self.pp:
            raise ValueError(f"{self.role}: {len(links)} weight-sync links for {self.pp} PP stages")
        refs = [w.init_weight_sync.remote(links[c["pp_rank"]]) for w, c in zip(self.workers, self._coords)]
        self._weight_sync_ready = True
        return refs

    def send_weights(self, with_checksums: bool = False) -> list:
        """Sends every stage's buckets over its weight-sync group (stages in parallel; each rank as the
        transport needs). Returns the refs to ray.get together with the receivers: the
        stage senders' stats (with ``checksums`` of what they sent when asked), None for other ranks."""
        # Checked here, not on the senders: a sender that refused would leave its TP peers waiting
        # in their all-gathers.
        if not self._weight_sync_ready:
            raise RuntimeError(f"{self.role}: weight sync is not set up; call weight_sync_plans(), "
                               f"weight_sync_links() and init_weight_sync() first")
        return [w.send_weights.remote(with_checksums) for w in self.workers]

    def math_threads(self) -> list[int]:
        """Each rank's torch math threads now, in rank order."""
        return self._get([w.math_threads.remote() for w in self.workers], "a thread query")

    def peak_memory_mb(self) -> list[float]:
        """Each rank's peak resident memory (MiB), in rank order."""
        return self._get([w.peak_memory_mb.remote() for w in self.workers], "a memory query")

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []


class HostedRole:
    """A forward-only role whose model lives in another role's ranks (``RoleSpec.colocated``; the
    reference in the actor's): a ``rlcore.roles.ForwardRole`` that runs on its host's processes,
    one call at a time with the host's own (a Ray actor runs its calls in order)."""

    def __init__(self, host: MegatronGroup, spec: RoleSpec):
        self.host, self.spec, self.role = host, spec, spec.name

    def forward(self, batch: Batch, **head_args) -> dict[str, torch.Tensor]:
        return self.host._forward(self.spec, batch, head_args)

    def peak_memory_mb(self) -> list[float]:
        """No processes of its own: its memory is in its host's figures."""
        return []

    def shutdown(self) -> None:
        """Nothing of its own to stop: it goes with its host's processes."""
