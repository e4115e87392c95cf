"""The loggers behind trainer.logger, run directly (no Ray): metrics.jsonl, TensorBoard, an offline W&B
run and an MLflow file store, each read back through its own library; a resumed run continues the
same tracker run without repeating a step; names and missing packages refused before start."""
import json
import os
import subprocess
import sys

import pytest
import torch

from rlcore import loggers as loggers_mod
from rlcore.config import JobConfig
from rlcore.job import ConfigError, load_job
from rlcore.loggers import LoggerContext, check_loggers
from rlcore.metrics import MetricsLogger, is_measurement, timer


def _ctx(run_dir, start_step=0, **kw) -> LoggerContext:
    return LoggerContext(run_dir=str(run_dir), total_steps=3, start_step=start_step, project="rlx-test",
                         experiment="unit", config={"actor.tp": 1, "data.train_files": ["a.parquet"]},
                         spec_yaml="actor:\n  tp: 1\n", **kw)


def test_metrics_jsonl_tensorboard_and_timer(tmp_path):
    m = {}
    with timer("rollout", m):
        pass
    assert m["timing/rollout_s"] >= 0.0
    # What resumed runs leave out when they compare their metrics with an uninterrupted run's.
    assert is_measurement("timing/rollout_s") and is_measurement("weight_sync/recv_page_faults")
    assert not any(map(is_measurement, ("reward/mean", "actor/pg_loss", "rollout/weight_version")))
    with MetricsLogger(_ctx(tmp_path), ["console", "jsonl", "tensorboard"]) as log:
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


def test_jsonl_is_written_even_when_not_listed(tmp_path):
    with MetricsLogger(_ctx(tmp_path), ["console"]) as log:
        log.log(1, {"reward/mean": 0.5})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 0.5}
    assert not (tmp_path / "tensorboard").exists()


@pytest.fixture
def mlflow_env(monkeypatch):
    """No tracking URI and no MLFLOW_ALLOW_FILE_STORE: the logger's own defaults (the file store, and
    MLflow 3's opt-in to it); the opt-in it sets is undone after the test."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded, so teardown restores the original
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


def _wandb_history(run_dir) -> list[dict]:
    """The history records of every offline run under run_dir/wandb, through wandb's own reader of
    its .wandb transaction log (`wandb leet inspect --json`)."""
    records = []
    for run in sorted((run_dir / "wandb").glob("offline-run-*")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        records += [json.loads(line) for line in out.splitlines() if line.strip()]
    return records


def _wandb_steps(records) -> list[tuple[int, float]]:
    return [(r["history"]["step"]["num"], r["history"]["item"]["reward/mean"])
            for r in records if r["type"] == "history" and "reward/mean" in r["history"]["item"]]


def test_wandb_offline_run_holds_config_and_metrics_and_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(_ctx(tmp_path), ["jsonl", "wandb"]) as log:
        for step in (1, 2, 3):
            log.log(step, {"reward/mean": step / 10, "actor/kl_ref": float(step)})
    run_id = json.loads((tmp_path / "wandb_run.json").read_text())["id"]
    (wandb_file,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = _wandb_history(tmp_path)
    assert _wandb_steps(records) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "rlx-test" and run["display_name"] == "unit" and run["run_id"] == run_id
    assert run["config"]["update"]["actor.tp"] == 1

    # Resumed from a checkpoint at step 2: the same W&B run; step 3 (already there) is not repeated.
    with MetricsLogger(_ctx(tmp_path, start_step=2), ["wandb"]) as log:
        log.log(3, {"reward/mean": 0.33})
        log.log(4, {"reward/mean": 0.4})
    assert json.loads((tmp_path / "wandb_run.json").read_text()) == {"id": run_id, "last_step": 4}
    assert _wandb_steps(_wandb_history(tmp_path)) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert wandb_file.exists()


def test_mlflow_file_store_holds_params_and_metrics_and_resumes_the_same_run(tmp_path, mlflow_env):
    from mlflow.tracking import MlflowClient

    with MetricsLogger(_ctx(tmp_path), ["mlflow"]) as log:
        for step in (1, 2, 3):
            log.log(step, {"reward/mean": step / 10, "actor/kl_ref": float("nan") if step == 2 else 0.0})
    uri = f"file:{tmp_path}/mlruns"
    run_id = json.loads((tmp_path / "mlflow_run.json").read_text())["id"]
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "unit" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "rlx-test"
    assert run.data.params == {"actor.tp": "1", "data.train_files": "['a.parquet']"}
    history = lambda key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]  # noqa: E731
    assert history("reward/mean") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    kl = history("actor/kl_ref")
    assert kl[0] == (1, 0.0) and kl[1][0] == 2 and kl[1][1] != kl[1][1]  # NaN stays visible
    assert "job.yaml" in [a.path for a in client.list_artifacts(run_id)]

    with MetricsLogger(_ctx(tmp_path, start_step=2), ["mlflow"]) as log:
        log.log(3, {"reward/mean": 0.33})
        log.log(4, {"reward/mean": 0.4})
    assert history("reward/mean") == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # A run that raised is marked failed.
    with pytest.raises(RuntimeError):
        with MetricsLogger(_ctx(tmp_path / "crashed"), ["mlflow"]) as log:
            log.log(1, {"reward/mean": 0.1})
            raise RuntimeError("step 2 crashed")
    crashed_id = json.loads((tmp_path / "crashed" / "mlflow_run.json").read_text())["id"]
    crashed = MlflowClient(tracking_uri=f"file:{tmp_path}/crashed/mlruns").get_run(crashed_id)
    assert crashed.info.status == "FAILED"


def test_a_fresh_start_begins_a_new_tracker_run(tmp_path, mlflow_env):
    ids = []
    for _ in range(2):
        with MetricsLogger(_ctx(tmp_path), ["mlflow"]) as log:
            log.log(1, {"reward/mean": 0.1})
        ids.append(json.loads((tmp_path / "mlflow_run.json").read_text())["id"])
    assert ids[0] != ids[1]


def test_unknown_repeated_and_missing_loggers_are_one_sentence(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"trainer.logger='neptune' is not one of: console, jsonl, "
                                         r"tensorboard, wandb, mlflow"):
        check_loggers(["console", "neptune"])
    with pytest.raises(ValueError, match="trainer.logger lists 'console' twice"):
        check_loggers(["console", "console"])
    with pytest.raises(ValueError, match="trainer.wandb_mode='offlne' is not one of: online, offline, disabled"):
        check_loggers(["wandb"], wandb_mode="offlne")
    # wandb as if it were not installed: refused before anything starts, naming the extra.
    real = loggers_mod.package_installed
    monkeypatch.setattr(loggers_mod, "package_installed", lambda package: package != "wandb" and real(package))
    with pytest.raises(ValueError, match=r"trainer.logger lists 'wandb', but the wandb package is not installed: "
                                         r"pip install 'rlx\[wandb\]', or drop 'wandb' from trainer.logger"):
        MetricsLogger(_ctx(tmp_path), ["console", "wandb"])
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing opened

    from rlcore.validate import validate  # what `rlx validate` and `rlx train` run first

    cfg = load_job(None, ["model.path=/nonexistent", "trainer.logger=[console,wandb]"])
    with pytest.raises(ConfigError, match="trainer.logger lists 'wandb', but the wandb package is not installed"):
        validate(cfg)


def test_the_old_tensorboard_key_names_trainer_logger():
    with pytest.raises(ConfigError, match="trainer.tensorboard moved to trainer.logger"):
        load_job(None, ["trainer.tensorboard=false"])
    assert JobConfig().trainer.logger == ["console", "jsonl", "tensorboard"]


def test_for_job_passes_the_spec_names_and_modes(tmp_path, mlflow_env):
    cfg = load_job(None, ["model.path=/nonexistent", f"trainer.run_dir={tmp_path}/my-run", "trainer.logger=[mlflow]",
                          "trainer.project_name=proj", "trainer.total_steps=7"])
    log = MetricsLogger.for_job(cfg)
    try:
        assert log.ctx.experiment == "my-run" and log.ctx.project == "proj"
        assert log.ctx.config["trainer.total_steps"] == 7 and log.ctx.config["actor.loss.clip_ratio_low"] == 0.2
        assert "trainer:" in log.ctx.spec_yaml
        assert log.names == ["jsonl", "mlflow"]
    finally:
        log.close()
    assert os.path.isdir(f"{tmp_path}/my-run/mlruns")


@pytest.mark.e2e
def test_quickstart_run_writes_wandb_mlflow_and_the_report(tracked_short_run, monkeypatch):
    """One tiny `rlx train` with every tracker (tests/conftest.py: its console is test_console.py's):
    the offline W&B run and the MLflow file store hold each step's metrics as metrics.jsonl does, the
    spec is their config, and report.png is written."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's reader; the run sets its own
    run_dir, _ = tracked_short_run
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert not (run_dir / "tensorboard").exists()  # not listed

    records = _wandb_history(run_dir)
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "rlx-e2e" and run["display_name"] == "run"
    assert run["config"]["update"]["rollout.n"] == 4
    mlflow_id = json.loads((run_dir / "mlflow_run.json").read_text())["id"]
    client = MlflowClient(tracking_uri=f"file:{run_dir}/mlruns")
    assert client.get_run(mlflow_id).info.status == "FINISHED"
    assert client.get_run(mlflow_id).data.params["data.batch_size"] == "4"
    for key in ("reward/mean", "actor/kl_ref", "rollout/logprob_diff_max", "timing/step_s"):
        expected = {x["step"]: x[key] for x in lines}
        assert {s: history[s][key] for s in history if key in history[s]} == pytest.approx(expected), key
        mlflow_history = client.get_metric_history(mlflow_id, key)
        assert len(mlflow_history) == 2 and {m.step: m.value for m in mlflow_history} == pytest.approx(expected), key

    data = (run_dir / "report.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
