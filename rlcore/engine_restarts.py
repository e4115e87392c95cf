"""A dead engine is not a dead run: the one place that decides what happens when a rollout engine dies.

The trainer generates and syncs through ``EngineRestarts``. When the pool reports a dead (or hung,
then killed) engine (``rlcore.faults.EngineDied``, within ``rollout.engine_timeout_s`` of its death
for a generation, at once for a sync), the engine is restarted on its own bundles, the weight-sync
groups are rebuilt on both sides (they include every engine's workers), the current weights are
synced into every engine under the version they already had, and the call is redone: a generation
with the same prompts and seeds (so its samples are the ones the dead engine would have made), a sync
as it was. ``restarts`` counts them for the run (``rollout/engine_restarts``); the death after
``rollout.max_engine_restarts`` of them stops the run with one sentence.

Restarts happen on the thread that built this object (the trainer's). A generation that runs ahead
on the rollout queue's producer thread (``trainer.off_policy_steps`` > 0) is not restarted there: the
actor trains meanwhile, so the weights of the version it was scheduled for are gone. It fails with
``EngineDiedAhead``; the trainer's next sync (or generation) meets the dead engine and restarts it, and
the rollout queue samples that batch again at its step, on the trainer's thread, with the current
weights (its lag is then 0; the run is no longer reproducible to the bit, as with any restart ahead).
With ``rollout.partial_rollouts`` the sync does not wait for the batch generating ahead, so it may
meet the dead engine while that generation is still in flight: it waits for the generation to end
(its requests died with the engine: it fails within ``rollout.engine_timeout_s``) before restarting,
and a generation ahead that would start during the restart fails at once, to be sampled again too.
"""
from __future__ import annotations

import threading
from typing import Protocol

from rlcore.config import RolloutConfig
from rlcore.faults import EngineDied, EngineDiedAhead
from rlcore.roles import Generator
from rlcore.weight_sync import WeightReceiver, WeightSender, connect_weight_sync, sync_weights


class RestartableEngines(Generator, WeightReceiver, Protocol):
    """The rollout pool as the policy sees it: it generates, receives weights and restarts an engine."""

    def restart_engine(self, engine: int) -> None:
        """A new engine ``engine`` on the dead one's bundles, from the model folder (version 0)."""


class EngineRestarts:
    """The trainer's way to the engines: ``generate`` and ``sync_weights``, redone after a restart."""

    def __init__(self, actor: WeightSender, rollout: RestartableEngines, cfg: RolloutConfig):
        self.actor, self.rollout, self.cfg = actor, rollout, cfg
        self.restarts = 0  # in this run (this process): rollout/engine_restarts
        self.version = 0  # the weight version every engine holds: the last completed sync's
        self._thread = threading.get_ident()
        self._ahead = 0  # generations in flight on other threads (the rollout queue's producer)
        self._restarting: list[int] = []  # the engines restarted, until the sync after it: nothing generates ahead
        self._ahead_changed = threading.Condition()

    def generate(self, prompt_ids: list[list[int]], **sampling):
        """``rollout.generate``; after a dead engine was replaced and given version ``self.version``,
        the same call again."""
        ahead = threading.get_ident() != self._thread
        if ahead:
            with self._ahead_changed:
                if self._restarting:  # a restarted engine holds the checkpoint's weights until the sync
                    raise EngineDiedAhead(self._restarting, "generation ahead of its step", "it was being restarted")
                self._ahead += 1
        try:
            while True:
                try:
                    return self.rollout.generate(prompt_ids, **sampling)
                except EngineDied as died:
                    self._replace(died)
                    self.sync_weights(self.version)
        finally:
            if ahead:
                with self._ahead_changed:
                    self._ahead -= 1
                    self._ahead_changed.notify_all()

    def sync_weights(self, version: int) -> list:
        """The actor's current weights into every engine as ``version``; redone after a dead engine was
        replaced (the survivors may hold part of it: they get all of it again)."""
        while True:
            try:
                reports = sync_weights(self.actor, self.rollout, version, check=self.cfg.check_weights,
                                       timeout_s=self.cfg.sync_timeout_s)
                break
            except EngineDied as died:
                self._replace(died)
        self.version = version
        with self._ahead_changed:
            self._restarting = []
        return reports

    def _replace(self, died: EngineDied) -> None:
        """Restarts the dead engines and rebuilds the weight-sync groups (again if one dies meanwhile),
        or raises the sentence that stops the run; on another thread, ``EngineDiedAhead``."""
        if threading.get_ident() != self._thread:
            raise EngineDiedAhead(died.engines, died.during + " ahead of its step", died.cause,
                                  " while the actor trained (trainer.off_policy_steps > 0); the trainer restarts it "
                                  "and samples that batch again at its step") from died
        with self._ahead_changed:
            # Only with rollout.partial_rollouts: a sync while a batch generates ahead. That generation
            # ends within rollout.engine_timeout_s (its requests died with the engine); then nothing
            # generates ahead until the sync after the restart.
            self._ahead_changed.wait_for(lambda: self._ahead == 0)
            self._restarting = sorted(set(self._restarting) | set(died.engines))
        while True:
            if self.restarts + len(died.engines) > self.cfg.max_engine_restarts:
                raise EngineDied(died.engines, died.during, died.cause,
                                 f" after {self.restarts} engine restart(s) in this run, the limit of "
                                 f"rollout.max_engine_restarts={self.cfg.max_engine_restarts}: stopping, the "
                                 "last checkpoint is intact") from died
            for e in died.engines:
                self.rollout.restart_engine(e)
                self.restarts += 1
            try:
                connect_weight_sync(self.actor, self.rollout, self.rollout.num_engines, self.cfg.bucket_mb * 1024 ** 2,
                                    self.rollout.dtype, self.cfg.weight_transport, timeout_s=self.cfg.sync_timeout_s)
                return
            except EngineDied as again:
                died = again
