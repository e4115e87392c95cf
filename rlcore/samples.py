"""One step's sampled batch (``Samples``), and how a checkpoint keeps the batches queued ahead
(``trainer.off_policy_steps`` > 0): exact, compact tensors (the prompts as dataset indices, each
trajectory field as one column), and the rule for restoring them into a resumed job."""
from __future__ import annotations

import dataclasses

import torch

from rlcore import checkpoint
from rlcore.batch import Trajectory
from rlcore.data import PromptItem
from rlcore.rollout_queue import SavedBatch


@dataclasses.dataclass
class Samples:
    """One step's sampled batch: the prompts, their rollout.n trajectories each (grouped by prompt,
    in order), each trajectory's score (on its last token), its token rewards (a process reward
    model's, per response token) and, for estimators that need one, the score of the greedy response
    to its prompt."""
    prompts: list[PromptItem]
    trajs: list[Trajectory]
    scores: torch.Tensor
    baseline_scores: torch.Tensor | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # what sampling it reported
    token_rewards: list[torch.Tensor] | None = None

    def to_saved(self) -> dict:
        """Tensors (and lists of plain values) for a checkpoint, every value exact: the prompts as
        their dataset indices, each trajectory field as one column."""
        return {"prompt_indices": torch.tensor([p.index for p in self.prompts]),
                "trajectories": {f.name: _column([getattr(t, f.name) for t in self.trajs])
                                 for f in dataclasses.fields(Trajectory)},
                "scores": self.scores, "baseline_scores": self.baseline_scores,
                "token_rewards": self.token_rewards,
                # plain numbers (a numpy scalar would not load with weights_only), the same values
                "metrics": {k: v if type(v) in (int, float) else float(v) for k, v in self.metrics.items()}}

    @classmethod
    def from_saved(cls, saved: dict, dataset) -> "Samples":
        """The inverse of ``to_saved``, the prompts looked up in ``dataset`` (the training prompts).
        Raises ``ValueError`` when they are not the ones the trajectories answer (the data changed)."""
        columns = {name: _uncolumn(col) for name, col in saved["trajectories"].items()}
        n = len(next(iter(columns.values())))
        trajs = [Trajectory(**{name: col[i] for name, col in columns.items()}) for i in range(n)]
        indices = saved["prompt_indices"].tolist()
        if any(not 0 <= i < len(dataset) for i in indices):
            raise ValueError(f"prompt indices up to {max(indices)}, the training data has {len(dataset)} prompts")
        prompts = [dataset[i] for i in indices]
        if any(t.prompt_ids != prompts[t.prompt_index].prompt_ids for t in trajs):
            raise ValueError("the training data's prompts at the saved indices are not the ones sampled")
        return cls(prompts, trajs, saved["scores"], saved["baseline_scores"], dict(saved["metrics"]),
                   saved["token_rewards"])


def _column(values: list) -> dict:
    """One trajectory field over a batch, compact and exact: numbers as one tensor, lists of numbers as
    one flat tensor and their lengths; int32 / float32 where every value fits exactly."""
    def tensor(flat: list):
        if all(type(v) is int for v in flat):
            t = torch.tensor(flat, dtype=torch.int64)
            return t.to(torch.int32) if t.numel() == 0 or (t.abs().max() < 2 ** 31) else t
        if all(type(v) in (int, float) for v in flat):
            t = torch.tensor(flat, dtype=torch.float64)
            narrow = t.to(torch.float32)
            return narrow if torch.equal(narrow.to(torch.float64), t) else t
        return None

    if all(type(v) is list for v in values):
        flat = tensor([x for v in values for x in v])
        if flat is not None:
            return {"flat": flat, "lengths": torch.tensor([len(v) for v in values], dtype=torch.int64)}
    elif (col := tensor(values)) is not None:
        return {"values": col}
    return {"list": list(values)}  # strings (finish reasons) and anything else, as they are


def _uncolumn(col: dict) -> list:
    if "flat" in col:
        return [part.tolist() for part in torch.split(col["flat"], col["lengths"].tolist())]
    if "values" in col:
        return col["values"].tolist()
    return list(col["list"])


def queued_batches_to_restore(state: dict, cfg, dataset) -> tuple[list[SavedBatch], dict, str | None]:
    """What a resumed run does with the batches a checkpoint queued after its step (``state``: its
    controller state; ``cfg``: the resumed job): (the batches to queue again, the loader position to
    continue from, why none are restored or None). They are restored when they fit the job (the same
    ``trainer.off_policy_steps``, batch shape and training prompts); otherwise the loader goes back to
    before the first of them, and the batches are sampled again."""
    k = cfg.trainer.off_policy_steps
    queued = state.get(checkpoint.QUEUED_KEY) or []
    saved_k = state.get("off_policy_steps")  # None: a checkpoint from before queued batches were kept
    why, restored = None, []
    if saved_k is None:
        why = "it was written before checkpoints kept them"
    elif queued and saved_k != k:
        why = f"they were queued under trainer.off_policy_steps={saved_k}, this job has {k}"
    elif queued:
        try:
            restored = [SavedBatch(q["batch"], q["loader_before"], Samples.from_saved(q["samples"], dataset))
                        for q in queued]
        except ValueError as e:
            why = f"they do not fit this job's data ({e})"
        except (KeyError, TypeError) as e:  # written by a version whose Trajectory has other fields
            raise checkpoint.CheckpointError(f"{checkpoint.QUEUED}: the queued batches' samples do not "
                                             f"match this version's trajectories ({e!r})") from e
        rows = (cfg.data.batch_size, cfg.data.batch_size * cfg.rollout.n)
        if restored and any((len(q.samples.prompts), len(q.samples.trajs)) != rows for q in restored):
            why, restored = f"they do not fit data.batch_size={rows[0]} x rollout.n={cfg.rollout.n}", []
    elif k > 0:
        why = ("it was saved with trainer.off_policy_steps=0" if saved_k == 0 else
               f"batch {state['failed_batch']}'s sampling had failed" if "failed_batch" in state else
               "none was queued after the run's last step")
    if restored:
        return restored, state["loader"], None
    # Sampled again: from before the first saved batch (an old checkpoint's "loader" is that already).
    loader = queued[0]["loader_before"] if queued else state["loader"]
    return [], loader, why if (k > 0 or queued) else None
