"""Checkpoints: atomic folders, `latest`, keep_last, validation and fallback (fast, no Ray); then on the
real stack: SIGKILL mid-step + resume=auto reproduces the uninterrupted run (the session's
reference_run, tests/conftest.py) and leaves no process behind, a TP2PP1 checkpoint resumes under
TP1PP2, and `rlx export` gives a HuggingFace folder that transformers loads with the trainer's
log-probs. The TP1PP2 resume runs in this process (Trainer.fit, what `rlx train` runs) so that the
export test reuses its actor group instead of starting Ray and another group."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from rlcore.checkpoint import (LATEST, MANIFEST, QUEUED, QUEUED_KEY, TMP_PREFIX, CheckpointError,
                               find_resume_checkpoint, list_checkpoints, load_queued_samples, save_checkpoint,
                               trim_metrics, verify_checkpoint, write_manifest)
from tests.runs import QUICKSTART as SPEC, SMALL_STEPS, small_quickstart, step_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------ folder logic (no Ray)
def _controller_only(ckpt_dir, steps, keep_last=0):
    """Checkpoints holding only the controller's state (no roles): the folder logic is the same."""
    for step in steps:
        save_checkpoint(str(ckpt_dir), step, {}, {"step": step, "weight_version": step,
                                                  "loader": {"epoch": 0, "position": 8 * step}},
                        "trainer:\n  seed: 1\n", keep_last, log=lambda m: None)


def test_latest_is_written_last_and_keep_last_prunes(tmp_path):
    _controller_only(tmp_path, [1, 2, 3, 4], keep_last=2)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [4, 3]
    assert (tmp_path / LATEST).read_text().strip() == "step_00000004"
    manifest = json.loads((tmp_path / "step_00000004" / MANIFEST).read_text())
    assert set(manifest["files"]) == {"controller.json", "rng.pt", "job.yaml"}
    folder, state = find_resume_checkpoint("auto", str(tmp_path), log=lambda m: None)
    assert folder.endswith("step_00000004") and state["loader"]["position"] == 32


def test_a_partial_tmp_folder_is_never_a_checkpoint(tmp_path):
    _controller_only(tmp_path, [1])
    # A save that died half-way: a .tmp- folder with files but no manifest, and no pointer to it.
    partial = tmp_path / f"{TMP_PREFIX}step_00000002"
    shutil.copytree(tmp_path / "step_00000001", partial)
    (partial / MANIFEST).unlink()
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [1]
    folder, _ = find_resume_checkpoint("auto", str(tmp_path), log=lambda m: None)
    assert folder.endswith("step_00000001")
    _controller_only(tmp_path, [2])  # the next save clears it
    assert not partial.exists()


def test_truncated_file_is_named_and_auto_falls_back(tmp_path):
    _controller_only(tmp_path, [1, 2])
    bad = tmp_path / "step_00000002" / "rng.pt"
    bad.write_bytes(bad.read_bytes()[:10])  # truncated
    with pytest.raises(CheckpointError, match=f"{bad}: truncated"):
        verify_checkpoint(str(tmp_path / "step_00000002"))
    with pytest.raises(CheckpointError, match="rng.pt: truncated"):  # an explicit path: no fallback
        find_resume_checkpoint(str(tmp_path / "step_00000002"), str(tmp_path))
    said = []
    folder, state = find_resume_checkpoint("auto", str(tmp_path), log=said.append)
    assert folder.endswith("step_00000001") and state["step"] == 1
    assert any(str(bad) in m for m in said)
    assert any("falling back to the previous complete checkpoint" in m and "step_00000001" in m for m in said)


def test_corrupted_file_same_size_is_named(tmp_path):
    _controller_only(tmp_path, [1])
    bad = tmp_path / "step_00000001" / "controller.json"
    data = bytearray(bad.read_bytes())
    data[5] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{bad}: corrupted"):
        verify_checkpoint(str(tmp_path / "step_00000001"))
    with pytest.raises(CheckpointError, match="no usable checkpoint"):  # auto with nothing usable
        find_resume_checkpoint("auto", str(tmp_path), log=lambda m: None)


def test_queued_batches_go_to_their_tensor_file_inside_the_manifest(tmp_path):
    """The samples of batches queued ahead (trainer.off_policy_steps > 0): controller.json lists the
    batches and their loader positions, queued_batches.pt holds the samples, checked like every file."""
    samples = {"scores": torch.tensor([0.5, 1.0]), "trajectories": {"finish_reason": {"list": ["stop", "length"]}}}
    controller = {"step": 1, "weight_version": 1, "loader": {"epoch": 0, "position": 16},
                  QUEUED_KEY: [{"batch": 2, "loader_before": {"epoch": 0, "position": 8}, "samples": samples}]}
    folder = save_checkpoint(str(tmp_path), 1, {}, controller, "trainer:\n  seed: 1\n", log=lambda m: None)
    manifest = json.loads((tmp_path / "step_00000001" / MANIFEST).read_text())
    assert set(manifest["files"]) == {"controller.json", "rng.pt", "job.yaml", QUEUED}
    state = verify_checkpoint(folder)
    assert state[QUEUED_KEY] == [{"batch": 2, "loader_before": {"epoch": 0, "position": 8}}]
    back = load_queued_samples(folder, state)[QUEUED_KEY][0]["samples"]
    assert torch.equal(back["scores"], samples["scores"]) and back["trajectories"] == samples["trajectories"]
    os.remove(os.path.join(folder, QUEUED))
    write_manifest(folder, 1)  # as if it had never been written
    with pytest.raises(CheckpointError, match=r"queued_batches.pt: missing from the checkpoint, whose "
                                              r"controller.json lists queued batches \[2\]"):
        verify_checkpoint(folder)


def test_never_and_empty_dir_start_fresh(tmp_path):
    _controller_only(tmp_path, [1])
    assert find_resume_checkpoint("never", str(tmp_path)) is None
    assert find_resume_checkpoint("auto", str(tmp_path / "nothing-here")) is None


def test_trim_metrics_drops_steps_after_the_checkpoint(tmp_path):
    lines = [json.dumps({"step": s, "x": s}) for s in (0, 1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "x"')  # cut by a kill
    trim_metrics(str(tmp_path), 2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_bad_resume_and_save_keys_are_config_errors():
    from rlcore.job import ConfigError, load_job
    from rlcore.validate import validate

    with pytest.raises(ConfigError, match="trainer.resume='/no/such/ckpt' is neither auto, never nor"):
        validate(load_job("yaml_configs/quickstart_cpu.yaml", ["trainer.resume=/no/such/ckpt"]))
    with pytest.raises(ConfigError, match="trainer.keep_last=-1 must not be negative"):
        validate(load_job("yaml_configs/quickstart_cpu.yaml", ["trainer.keep_last=-1"]))


# --------------------------------------------------------------------------- real stack (e2e)
STEPS = SMALL_STEPS


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(abs(a[k] - b[k]) for k in a)


@pytest.mark.e2e
def test_sigkill_mid_step_then_resume_auto_reproduces_the_run(interrupted_run, reference_run, monkeypatch):
    """SIGKILL of the driver alone in the step after its first checkpoint (tests/conftest.py
    interrupted_run, leg 2: a run resumed after a SIGTERM, saving every step, so megatron's checkpoint
    writer ran in every rank), then `rlx train` again with the default resume=auto: every step equals
    the uninterrupted run's (tests/conftest.py reference_run) EXACTLY (every metric but the timings
    and other measurements of the machine, max |diff| == 0). Why exact: the restored state is bitwise
    the saved one (model, Adam moments and step, lr scheduler, dataloader position, RNG states, weight
    version), the engine gets the restored weights by the same weight sync, vLLM's sampling is seeded
    per step (seed * 100003 + step), and Megatron on CPU fp32 with gloo is deterministic for a fixed
    layout.

    And no process outlives the killed driver: no exit handler of it runs, Ray's processes lose their
    parent, the reaper (rlcore/reaper.py) ends what is left (tests/test_processes.py has the rest)."""
    run = interrupted_run
    saved = run.stopped_after + 1  # the killed leg's first checkpoint
    assert run.killed_code == -signal.SIGKILL
    assert run.killed_markers, "the run's Ray processes carry no marker:\n" + run.killed_log[-3000:]
    assert run.killed_saw_raylet, "the watch never saw the killed run's Ray"
    assert run.killed_left == [], f"{len(run.killed_left)} process(es) of the killed run still alive: {run.killed_left}"
    assert run.logged_before_kill <= saved + 1, "killed after the step after its checkpoint ended"

    resumed = run.resumed
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert f"checkpoint: resumed from {run.run_dir / 'checkpoints' / f'step_{saved:08d}'}" in resumed.stdout
    # A resume keeps the console quiet too: the ranks' checkpoint loading warns about nothing of ours.
    assert "Warning" not in resumed.stdout + resumed.stderr, (resumed.stdout + resumed.stderr)[-3000:]
    got, want = step_metrics(run.run_dir), step_metrics(reference_run.run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert _max_diff(got[step], want[step]) == 0.0, (step, got[step], want[step])
    # actor/lr among them: the warm-up + cosine schedule (tests/runs.py) continues exactly after each resume.
    assert len({got[step]["actor/lr"] for step in got}) == STEPS
    # The MLflow run continues across the SIGTERM and the kill: one run, each step once, metrics.jsonl's values.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's reader (the runs set their own)
    client = MlflowClient(tracking_uri=f"file:{run.run_dir}/mlruns")
    tracked = client.get_run(json.loads((run.run_dir / "mlflow_run.json").read_text())["id"])
    assert len(client.search_runs([tracked.info.experiment_id])) == 1 and tracked.info.status == "FINISHED"
    history = client.get_metric_history(tracked.info.run_id, "actor/pg_loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert {m.step: m.value for m in history} == {step: got[step]["actor/pg_loss"] for step in got}


@pytest.fixture(scope="module")
def tp1pp2_resumed(tiny_assets, reference_run, tmp_path_factory):
    """The step-3 checkpoint of the TP2 PP1 run resumed with actor TP1 PP2 and trained to step 4, in
    this process (what `rlx train` runs: Trainer.fit), so that the export test can use its actor
    group too: (the trainer, its run_dir, what it printed)."""
    import contextlib
    import io

    import ray

    from launch.compose import build_trainer
    from rlcore.job import load_job
    from rlcore.validate import validate

    model, data = tiny_assets
    ckpt = reference_run.run_dir / "checkpoints" / "step_00000003"
    run_dir = tmp_path_factory.mktemp("tp1pp2") / "run"
    cfg = load_job(SPEC, small_quickstart(model, data, run_dir, "actor.tp=1", "actor.pp=2", f"trainer.resume={ckpt}"))
    printed = io.StringIO()
    trainer = None
    try:
        trainer = build_trainer(cfg, validate(cfg, require_files=True))
        with contextlib.redirect_stdout(printed):
            trainer.fit()
        yield trainer, run_dir, printed.getvalue()
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()


@pytest.mark.e2e
def test_tp2_checkpoint_resumes_under_tp1_pp2(reference_run, tp1pp2_resumed):
    """The step-3 checkpoint of the TP2 PP1 run resumed with actor TP1 PP2: step 4's losses and
    metrics equal the uninterrupted TP2 run's within 1e-5 (float rounding of a different reduction
    order; the samples are identical because the engine receives bitwise-identical weights)."""
    _, run_dir, printed = tp1pp2_resumed
    assert "actor.tp: 2 -> 1" in printed and "actor.pp: 1 -> 2" in printed, printed[-3000:]
    assert "checkpoint: resumed from" in printed and "step_00000003" in printed
    assert sorted(step_metrics(run_dir)) == [STEPS]
    got, want = step_metrics(run_dir)[STEPS], step_metrics(reference_run.run_dir)[STEPS]
    assert got["reward/mean"] == want["reward/mean"]
    assert got["actor/lr"] == want["actor/lr"]  # the lr schedule continues across the layout change
    for key in ("actor/pg_loss", "actor/loss", "actor/ppo_kl", "actor/kl_ref", "actor/entropy",
                "actor/grad_norm"):
        if key in want:
            assert abs(got[key] - want[key]) <= 1e-5, (key, got[key], want[key])
    # keep_last=2 kept steps 3 and 4 of the reference run.
    assert [s for s, _ in list_checkpoints(str(reference_run.run_dir / "checkpoints"))] == [4, 3]


@pytest.mark.e2e
def test_export_to_hf_matches_the_trainer_logprobs(reference_run, tp1pp2_resumed, tmp_path, capsys):
    """`rlx export` of the last checkpoint, sharded small on purpose: transformers loads it, and its
    log-probs of fixed sequences equal the trainer's (the TP1 PP2 actor group above, loading the same
    checkpoint) within 1e-4; the tokenizer and chat template come along. A truncated checkpoint
    file is refused with its name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launch.cli import main as rlx
    from rlcore.batch import Batch

    ckpt = reference_run.run_dir / "checkpoints"  # a checkpoint_dir: its latest
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "export", str(ckpt), "--to", "hf", str(out),
                           "--max-shard-size", "1MB"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 1
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template and tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}],
                                                                     tokenize=False) == "<s>1+2="
    hf = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 16, (64, 10), generator=g)  # 64 rows: two of the actor's micro-batches (PP2 needs whole ones)
    with torch.no_grad():
        logits = hf(ids).logits.float()
    hf_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]

    actor = tp1pp2_resumed[0].actor
    actor.load_checkpoint(str(ckpt / "step_00000004" / "actor"))
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(ids.shape))
    trainer_lp = actor.forward(batch)["logprobs"][:, 1:]
    gap = (hf_lp - trainer_lp).abs().max().item()
    print(f"exported model vs trainer: max |log-prob diff| = {gap:.3g}")
    assert gap <= 1e-4

    # The export refuses a damaged checkpoint and names the file (before loading anything: in-process).
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt / "step_00000004", damaged)
    bad = sorted((damaged / "actor").glob("*.distcp"))[0]
    bad.write_bytes(bad.read_bytes()[:-100])
    capsys.readouterr()
    assert rlx(["export", str(damaged), "--to", "hf", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: truncated" in err, err[-2000:]
