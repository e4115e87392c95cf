"""trainer.on_nonfinite on a real run: a forced NaN under skip and under stop (rlcore/nonfinite.py).

The NaN is forced by the test-only hook ``RLX_TEST_POISON_STEP=2``: the controller sets the actor's
advantages to NaN in step 2's batch, so the NaN travels the real path (the head's loss, megatron's
backward, the engines' check before the optimizer step). A reward function cannot do it: the reward
path refuses non-finite scores (rlcore/reward.py), and a huge finite one does not reliably overflow.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from rlcore.job import ConfigError, load_job
from rlcore.nonfinite import POISON_ENV, NonFiniteError, NonFiniteGuard, first_nonfinite
from rlcore.validate import validate
from tests.runs import ONE_RANK, REPO

SPEC = os.path.join(REPO, "yaml_configs", "quickstart_cpu.yaml")


def test_first_nonfinite_names_the_loss_term_first():
    m = {"actor/loss": float("nan"), "actor/pg_loss": float("nan"), "actor/kl_ref": 0.1, "actor/grad_norm": float("inf")}
    assert first_nonfinite(m, "actor") == "actor/pg_loss"
    assert first_nonfinite({"actor/loss": 0.1, "actor/pg_loss": 0.1, "actor/grad_norm": float("inf")}, "actor") == \
        "actor/grad_norm"
    assert first_nonfinite({"actor/loss": 0.1, "actor/grad_norm": 1.0}, "actor") is None


def test_the_policy_is_checked_before_start():
    cfg = load_job(SPEC, ["trainer.on_nonfinite=retry"])
    with pytest.raises(ConfigError, match=r"trainer.on_nonfinite='retry' is not one of: stop, skip"):
        validate(cfg)


def test_the_guard_on_a_critic_update(tmp_path):
    """The controller's side alone, for the critic (the e2e tests below poison the actor): a skipped
    update is dumped, then counted (skip) or named in one sentence (stop); a finite one passes."""
    actor, critic = object(), object()
    batch = {"returns": torch.full((2, 3), float("inf")), "input_ids": torch.ones(2, 3, dtype=torch.long)}
    bad = {"critic/loss": float("inf"), "critic/vf_loss": float("inf"), "critic/grad_norm": float("nan"),
           "critic/update_skipped": 1.0}
    skip = NonFiniteGuard("skip", str(tmp_path / "skip"), {"actor": actor, "critic": critic})
    skip.start(4)
    skip.check(critic, batch, {"critic/loss": 0.1, "critic/grad_norm": 1.0, "critic/update_skipped": 0.0})
    skip.check(critic, batch, bad)
    skip.check(critic, batch, bad)  # a second mini-batch of the same step: its own file
    assert skip.metrics() == {"actor/skipped_steps": 0.0, "critic/skipped_steps": 2.0}
    assert sorted(p.name for p in (tmp_path / "skip" / "debug").iterdir()) == ["step_4_critic.pt",
                                                                                 "step_4_critic_2.pt"]
    stop = NonFiniteGuard("stop", str(tmp_path / "stop"), {"actor": actor, "critic": critic})
    stop.start(7)
    with pytest.raises(NonFiniteError, match=r"^step 7: critic update: critic/vf_loss is inf \(the update was not "
                                             r"applied; its batch is in .*step_7_critic\.pt; trainer\.on_nonfinite=stop"):
        stop.check(critic, batch, bad)
    dump = torch.load(tmp_path / "stop" / "debug" / "step_7_critic.pt", weights_only=True)
    assert dump["first_bad"] == "critic/vf_loss" and torch.isinf(dump["batch"]["returns"]).all()


def poisoned_run(run_dir, tiny_assets, policy: str) -> subprocess.CompletedProcess:
    """3 steps, a checkpoint after every step, step 2's actor batch poisoned."""
    model, data = tiny_assets
    cmd = [sys.executable, "-m", "launch.cli", "train", SPEC, f"model.path={model}", f"data.train_files=[{data}]",
           f"data.val_files=[{data}]", f"trainer.run_dir={run_dir}", "trainer.val_every=0", "trainer.total_steps=3",
           "data.batch_size=4", "trainer.save_every=1", "trainer.keep_last=0", f"trainer.on_nonfinite={policy}", *ONE_RANK]
    env = dict(os.environ, **{POISON_ENV: "2"})
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def metrics_lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]  # NaN reads back


def checkpoint_state(step_dir) -> dict:
    """Everything the actor's checkpoint holds, flattened: weights and Adam's moments (the
    torch_dist shards, read with torch's own converter) and the optimizer's step count and the lr
    scheduler (common.pt)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    actor = step_dir / "actor"
    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(actor), str(out))
    state = {"shards": torch.load(out, weights_only=False), "common": torch.load(actor / "common.pt", weights_only=False)}

    def flat(d, prefix=""):
        items = {}
        for k, v in d.items():
            items.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return items
    return flat(state)


def same(a, b) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def load_debug(path) -> dict:
    # How to read a dump: plain torch.load (tensors, floats and strings only: weights_only holds).
    return torch.load(path, weights_only=True)


@pytest.mark.e2e
def test_skip_drops_the_update_and_the_run_goes_on(tmp_path, tiny_assets):
    run_dir = tmp_path / "skip"
    proc = poisoned_run(run_dir, tiny_assets, "skip")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = metrics_lines(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert [m["actor/skipped_steps"] for m in lines] == [0.0, 1.0, 1.0]  # cumulative over the run
    assert [m["actor/update_skipped"] for m in lines] == [0.0, 1.0, 0.0]
    bad = lines[1]
    assert bad["actor/pg_loss"] != bad["actor/pg_loss"] and bad["actor/loss"] != bad["actor/loss"]  # NaN, logged
    assert not torch.isfinite(torch.tensor(bad["actor/grad_norm"]))
    # The version still names "the weights after step k": the sync after the skip sent the same weights.
    assert [m["weights/version"] for m in lines] == [1.0, 2.0, 3.0]

    # Weights, Adam's moments and step count and the lr scheduler after step 2 equal those after step 1.
    ckpts = run_dir / "checkpoints"
    s1, s2, s3 = (checkpoint_state(ckpts / f"step_{k:08d}") for k in (1, 2, 3))
    assert any("exp_avg_sq" in k for k in s1) and "common.lr_scheduler.num_steps" in s1
    assert s1.keys() == s2.keys() and all(same(s1[k], s2[k]) for k in s1)
    assert s3["common.lr_scheduler.num_steps"] == s2["common.lr_scheduler.num_steps"] + 1  # step 3 trained
    assert any(torch.is_tensor(s2[k]) and not torch.equal(s2[k], s3[k]) for k in s2 if "weight" in k)

    dump = load_debug(run_dir / "debug" / "step_2_actor.pt")
    assert (dump["step"], dump["role"], dump["first_bad"]) == (2, "actor", "actor/pg_loss")
    assert torch.isnan(dump["batch"]["advantages"]).all() and dump["batch"]["input_ids"].shape[0] == 4 * 16
    assert dump["metrics"]["actor/update_skipped"] == 1.0


@pytest.mark.e2e
def test_stop_ends_the_run_naming_step_role_and_metric(tmp_path, tiny_assets):
    run_dir = tmp_path / "stop"
    proc = poisoned_run(run_dir, tiny_assets, "stop")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    sentence = [line for line in proc.stderr.splitlines() if line.startswith("rlx train: ")]
    assert len(sentence) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sentence[0].startswith("rlx train: step 2: actor update: actor/pg_loss is nan")
    assert "trainer.on_nonfinite=stop" in sentence[0] and str(run_dir / "debug" / "step_2_actor.pt") in sentence[0]
    assert [m["step"] for m in metrics_lines(run_dir)] == [1]  # the steps before are kept
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_00000001"]  # the last checkpoint, intact (it loads: every shard is there)
    assert checkpoint_state(run_dir / "checkpoints" / "step_00000001")["common.lr_scheduler.num_steps"] == 1
    dump = load_debug(run_dir / "debug" / "step_2_actor.pt")
    assert dump["first_bad"] == "actor/pg_loss" and torch.isnan(dump["batch"]["advantages"]).all()
