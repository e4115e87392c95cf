"""What the cluster did to a run, as errors the CLI prints as one line (``rlx train`` exits 1): a dead
rollout engine that could not be (or may not be) restarted, a dead Megatron rank, a weight sync that a
member never finished. Raised by the roles (``rollout``, ``megatron_workers``) and the weight sync;
the restart policy for engines is ``rlcore.engine_restarts``."""
from __future__ import annotations


class RunStopped(RuntimeError):
    """The run cannot go on: a process of it died or stopped answering, or an update was non-finite
    under trainer.on_nonfinite=stop (rlcore/nonfinite.py). Nothing is written after it (the last
    checkpoint is intact); the message is one sentence."""


class EngineDied(RunStopped):
    """Rollout engines ``engines`` died (or hung and were killed) during ``during``; ``cause`` says
    which of the two. The engine restart policy catches it; uncaught, it stops the run."""

    def __init__(self, engines: list[int], during: str, cause: str = "its process exited", then: str = ""):
        self.engines, self.during, self.cause = sorted(engines), during, cause
        names = ", ".join(map(str, self.engines))
        super().__init__(f"rollout engine{'s' if len(self.engines) > 1 else ''} {names} died during {during} "
                         f"({cause}){then}")


class EngineDiedAhead(EngineDied):
    """An engine died under a generation ahead of its step (``trainer.off_policy_steps`` > 0), on the
    rollout queue's producer thread. That thread restarts nothing: the trainer's thread does (in its
    next sync or generation) and the queue samples the batch again at its step."""


class RankDied(RunStopped):
    """Rank ``rank`` of the Megatron role ``role`` died during ``during``."""

    def __init__(self, role: str, rank: int, during: str):
        self.role, self.rank, self.during = role, rank, during
        super().__init__(f"the {role}'s Megatron rank {rank} died during {during}; the run stops here and the last "
                         "checkpoint is intact (nothing was written after the death)")


class WeightSyncError(RunStopped):
    """A weight sync (or its group setup) failed on a member, or a member did not finish within
    ``rollout.sync_timeout_s``."""
