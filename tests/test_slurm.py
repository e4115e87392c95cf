"""`rlx submit` on a real Slurm: Debian's slurmctld, slurmd and munge as a one-node cluster, the CPU
quickstart trained through the sbatch script's Ray bring-up, and its teardown.

The cluster comes from `launch/install_slurm.sh` (apt-get when Slurm is missing: root and network, as in
CI) and lives in a temporary folder; its daemons are stopped by pid file after the module. Other Ray
clusters on this machine are never touched: "no Ray process left" is checked for this job's own Ray
temp dir only.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from launch.slurm import processes_naming

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = os.path.join(REPO, "launch", "install_slurm.sh")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def assets(tiny_assets):
    """The session's tiny model and data (tests/conftest.py): the requeued job is compared with the
    session's reference run of them."""
    return tiny_assets


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node Slurm cluster; yields the environment its clients need."""
    have_slurm = all(shutil.which(c) for c in ("sbatch", "slurmctld", "slurmd", "munged"))
    if not have_slurm and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip("Slurm is not installed, and installing it from Debian's packages needs root and apt-get")
    folder = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"),
           "RLX_SLURMCTLD_PORT": str(_free_port()), "RLX_SLURMD_PORT": str(_free_port())}
    try:
        # The script's slurm.conf with one change for the tests: MinJobAge=5 (s). `sbatch --wait` polls
        # the job after 2 s, then 8 s, then every 32 s, but stops growing the interval at MinJobAge/2 (a
        # finished job's record must not be purged unseen): with the script's 600 a job that ends after
        # 45 s is seen at 74 s; with 5, within 2 s.
        subprocess.run(["bash", INSTALL, "configure", str(folder)], env=env, check=True, timeout=900)
        conf = folder / "slurm.conf"
        text = conf.read_text()
        assert "MinJobAge=600" in text, text
        conf.write_text(text.replace("MinJobAge=600", "MinJobAge=5"))
        subprocess.run(["bash", INSTALL, "start", str(folder)], env=env, check=True, timeout=900)
        yield env
    finally:
        subprocess.run(["bash", INSTALL, "stop", str(folder)], env=env, timeout=120)


def _submit(env, assets, tmp_path, *extra, port=None):
    model, data = assets
    cmd = [sys.executable, "-m", "launch.cli", "submit", "yaml_configs/quickstart_cpu.yaml", "--nodes", "1", "--wait",
           "--port", str(port or _free_port()), "--log-dir", str(tmp_path / "slurm"), *extra,
           f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]", "trainer.val_every=0",
           f"trainer.run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    job = re.search(r"submitted Slurm job (\d+)", proc.stdout)
    assert job, proc.stdout + proc.stderr
    log = (tmp_path / "slurm" / f"rlx-quickstart_cpu-{job.group(1)}.out").read_text()
    return proc, job.group(1), log


@pytest.mark.slurm
@pytest.mark.e2e
def test_a_cluster_that_does_not_come_up_in_time_fails_with_a_sentence(slurm, assets, tmp_path):
    # The head's port is taken (bound, never listening), so the Ray head cannot come up however fast
    # the machine is: within the 1 s bring-up timeout the job must end with the bring-up status and say why.
    # The head's `ray start` then waits for a GCS that never answers (Ray's default: 5 s to connect,
    # then 30 s for the cluster id) and handles the teardown's SIGTERM only after that; shorter Ray
    # timeouts in the job's environment (sbatch passes it on) keep the teardown short.
    env = {**slurm, "RAY_gcs_rpc_server_connect_timeout_s": "1", "RAY_py_gcs_connect_timeout_s": "2"}
    with socket.socket() as squatter:
        squatter.bind(("", _free_port()))
        proc, job, log = _submit(env, assets, tmp_path, "--bringup-timeout", "1", "trainer.total_steps=1",
                                 port=squatter.getsockname()[1])
    assert proc.returncode == 3
    assert re.search(r"rlx: (the Ray head at \S+ did not open its port|could not connect to the Ray head at \S+"
                     r"|the Ray cluster at \S+ did not come up) within 1 s", log), log[-2000:]
    assert "] rlx train " not in log  # training never started
    assert f"teardown: no Ray processes of /tmp/rlx-ray-{job} left" in log
    assert processes_naming(f"/tmp/rlx-ray-{job}") == []
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slurm
@pytest.mark.e2e
def test_a_signalled_job_saves_is_requeued_and_equals_an_uninterrupted_run(slurm, assets, reference_run, tmp_path):
    """`rlx submit --requeue --signal=USR1@60`, then `scancel --signal=USR1 --batch` once step 1 is
    logged (what Slurm does 60 s before the time limit, at a moment the test picks): the batch shell
    passes the signal on, rlx train saves its step and exits with 75, the script stops Ray and requeues
    the job, the second start resumes from the checkpoint and finishes; every step's metrics equal an
    uninterrupted local run's: the session's reference run (tests/conftest.py: the same small
    quickstart, for 4 steps; nothing in steps 1-3 depends on total_steps, tests/runs.py fixing the lr
    schedule's decay_steps). Slurm makes a requeued job eligible a while after the requeue
    (launch/install_slurm.sh's cred_expire): most of this test's wall time."""
    from tests.runs import small_quickstart, step_metrics

    model, data = assets
    want = step_metrics(reference_run.run_dir)
    log_dir, run_dir = tmp_path / "slurm", tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.cli", "submit", "yaml_configs/quickstart_cpu.yaml", "--nodes", "1", "--wait",
           "--port", str(_free_port()), "--log-dir", str(log_dir), "--requeue", "--signal=USR1@60", "--time=30",
           *small_quickstart(model, data, run_dir, steps=3)]
    submit = subprocess.Popen(cmd, cwd=REPO, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = submit.stdout.readline()
    job = re.search(r"submitted Slurm job (\d+)", first)
    assert job, first + submit.stdout.read()
    job = job.group(1)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # step 1 done
        assert submit.poll() is None, submit.stdout.read()
        assert time.monotonic() < deadline, "step 1 not logged within 10 minutes"
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    out = submit.communicate(timeout=900)[0]
    log_path = log_dir / f"rlx-quickstart_cpu-{job}.out"
    log = log_path.read_text()
    # `sbatch --wait` may return at the requeue: the job's second start ends the test.
    deadline = time.monotonic() + 900
    while "rlx train exited with status 0" not in log:
        assert time.monotonic() < deadline, log[-4000:]
        time.sleep(2)
        log = log_path.read_text()
    assert "#SBATCH --signal=B:USR1@60" in (log_dir / "rlx-quickstart_cpu.sbatch").read_text()
    assert "got SIGUSR1: passing it on to rlx train" in log, log[-4000:]
    stopped = re.search(r"stopped by SIGUSR1 after step (\d) of 3 with checkpoint", log)
    assert stopped, log[-4000:]
    assert "rlx train exited with status 75" in log and f"requeueing job {job}" in log
    assert f"checkpoint: resumed from {run_dir / 'checkpoints' / f'step_0000000{stopped.group(1)}'}" in log
    assert (log_dir / job / "restart-1").is_dir()  # the second start's own logs
    # Each start's bring-up: the head on the allocated node, its logical GPUs (the pools' 3) registered;
    # each start's teardown: Ray stopped by its own `ray start`, nothing of this job's Ray left on the node.
    assert log.count(f"job {job}: 1 node(s)") == 2 and log.count("Ray cluster up: 1 node(s), 3 GPUs") == 2
    assert log.count("teardown: stopping the Ray cluster (1 srun steps)") == 2
    assert log.count(f"teardown: no Ray processes of /tmp/rlx-ray-{job} left") == 2
    host = socket.gethostname()
    assert "[rlx] Ray on" in (log_dir / job / f"ray-head-{host}.log").read_text()
    assert (log_dir / job / f"ray-logs-{host}" / "raylet.out").exists()
    got = step_metrics(run_dir)
    assert sorted(got) == [1, 2, 3]
    for step in (1, 2, 3):
        assert got[step] == want[step], (step, got[step], want[step])
    assert processes_naming(f"/tmp/rlx-ray-{job}") == []
    print(out)


def test_submit_renders_a_script_the_operator_never_edits(assets, tmp_path, capsys):
    """--dry-run: the #SBATCH lines, the settings and the job's arguments; valid bash; nothing submitted."""
    from launch.cli import main as rlx

    model, data = assets
    assert rlx(["submit", "yaml_configs/quickstart_cpu.yaml", "--nodes", "2", "--partition", "debug",
                "--time", "01:00:00", "--log-dir", str(tmp_path), "--dry-run", f"model.path={model}",
                f"data.train_files=[{data}]", "data.val_files=[]", "trainer.total_steps=5"]) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "#SBATCH --partition=debug",
                 "#SBATCH --time=01:00:00", f"#SBATCH --output={tmp_path}/rlx-quickstart_cpu-%j.out",
                 "export RLX_GPUS_PER_NODE=2",  # the cpu profile's 3 logical GPUs over 2 nodes
                 "export RLX_BRINGUP_TIMEOUT_S=300", f"export RLX_ROOT={REPO}"):
        assert line in script, line
    assert "--gpus-per-node" not in script.split("export")[0]  # no GPUs to ask Slurm for on the cpu profile
    assert "export RLX_REQUEUE=0" in script and "--signal" not in script.split("export")[0]
    assert "trainer.total_steps=5" in script and os.path.abspath("yaml_configs/quickstart_cpu.yaml") in script
    path = tmp_path / "rlx-quickstart_cpu.sbatch"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    # More GPUs than the nodes hold: one sentence.
    assert rlx(["submit", "yaml_configs/quickstart_cpu.yaml", "--nodes", "1", "--gpus-per-node", "2", "--dry-run",
                f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]"]) == 2
    assert "resources.pools need 3 GPUs but --nodes 1 x --gpus-per-node 2 = 2" in capsys.readouterr().err
    # Preemption: the signal goes to the batch shell only (B:), the job is requeueable and appends to its log.
    assert rlx(["submit", "yaml_configs/quickstart_cpu.yaml", "--nodes", "1", "--signal", "USR1@120", "--requeue",
                "--log-dir", str(tmp_path), "--dry-run", f"model.path={model}", f"data.train_files=[{data}]",
                "data.val_files=[]"]) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "export RLX_REQUEUE=1"):
        assert line in script, line
    assert rlx(["submit", "yaml_configs/quickstart_cpu.yaml", "--nodes", "1", "--signal", "INT@5", "--dry-run",
                f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]"]) == 2
    assert "--signal='INT@5': expected SIG@SECONDS with SIG USR1 or TERM" in capsys.readouterr().err
