import json

import pytest
import torch

from rlcore.metrics import MetricsLogger, timer


def test_metrics_jsonl_tensorboard_and_timer(tmp_path):
    m = {}
    with timer("rollout", m):
        pass
    assert m["timing/rollout_s"] >= 0.0
    with MetricsLogger(str(tmp_path), total_steps=2) as log:
        log.log(1, {"reward/mean": 0.25, "actor/pg_loss": torch.tensor(-0.5), **m})
        log.log(2, {"reward/mean": 0.75})
        with pytest.raises(TypeError, match="actor/entropy"):
            log.log(3, {"actor/entropy": "high"})
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and lines[0]["actor/pg_loss"] == -0.5
    assert lines[1] == {"step": 2, "reward/mean": 0.75}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == [0.25, 0.75]
