"""Shared fixtures: a local Ray cluster with logical GPUs and named pools for the modules that place
roles in-process (one cluster for all of them, run one after the other); the tiny model and data; and
the `rlx train` runs whose results several modules assert on (each run once per session: every e2e
start-up saved is half a minute of the suite)."""
import faulthandler
import os
import subprocess
import sys

import pytest

from rlcore.placement import ResourcePools, start_ray

_SESSION = pytest.StashKey()


def pytest_sessionfinish(session):
    session.config.stash[_SESSION] = session
    _stop_shared_ray()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process as ``rlx`` ends its own (launch/cli.py: ``exit_without_teardown``): once
    the results are written, the threads are joined and the exit handlers run (Ray's shutdown among
    them), then the process exits with pytest's status, skipping the interpreter's teardown of every
    module. That teardown comes after dozens of Ray sessions were started and shut down in this one
    process; on 2026-12-05 a fresh-clone run ended in SIGSEGV there, after "689 passed" was printed
    (exit status 139 for a green suite; the next run of the same tree exited 0). A fault in the exit
    handlers themselves still prints its traceback: faulthandler, which pytest's own plugin has just
    turned off, is on again for them."""
    session = config.stash.get(_SESSION, None)
    if session is None:  # no session ran (--version, a usage error): the normal exit
        return
    from launch.cli import exit_without_teardown

    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    exit_without_teardown(int(session.exitstatus))


# The logical GPUs of the in-process cluster: at least the shared rollout layouts' 5
# (tests/rollout_layouts.py) and the most that one module's pools hold at once besides
# (tests/test_layout_matrix.py: 4).
SHARED_RAY_GPUS = 12


class _SharedRay:
    """Whether this process's Ray cluster was started here (and so is ours to stop), how many times it
    was (what was placed on an earlier one is gone), the modules that use ``ray_pools`` and those that
    use ``rollout_layouts``, and those layouts' pools once started: (the cluster's start count, pools,
    their ResourcePools)."""
    started = False
    starts = 0
    modules: set = set()
    layout_modules: set = set()
    rollout_layouts: tuple | None = None


def _shared_cluster() -> None:
    """Starts this process's Ray cluster (SHARED_RAY_GPUS logical GPUs, 2 CPUs) if it is not up."""
    import ray

    if not ray.is_initialized():
        start_ray("cpu", total_gpus=SHARED_RAY_GPUS, num_cpus=2)
        _SharedRay.started = True
        _SharedRay.starts += 1


def _stop_shared_ray() -> None:
    if not _SharedRay.started:  # called before every test of the other modules: no Ray import there
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()  # the shared rollout layouts' engines with it
    _SharedRay.started = False
    _SharedRay.rollout_layouts = None


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(session, config, items):
    """The modules that use ``ray_pools`` run one after the other, where the first of them was
    (each module's tests in their own order, every other module in its place; those that use
    ``rollout_layouts`` last): they share one Ray cluster, started once instead of once per module
    (~4 s to start and ~1.5 s to stop each time, on top of the CPU its helper processes take on a
    2-core machine)."""
    ray_modules = {_module(item) for item in items if "ray_pools" in getattr(item, "fixturenames", ())}
    _SharedRay.modules = ray_modules
    _SharedRay.layout_modules = {_module(item) for item in items
                                 if "rollout_layouts" in getattr(item, "fixturenames", ())}
    if not ray_modules:
        return
    first = next(i for i, item in enumerate(items) if _module(item) in ray_modules)
    # Those that use the shared rollout layouts last, next to each other: their engines stay up from the
    # first of them to the end of the group, and are idle in between only while those modules run.
    grouped = sorted((item for item in items if _module(item) in ray_modules),
                     key=lambda item: _module(item) in _SharedRay.layout_modules)
    rest = [item for item in items if _module(item) not in ray_modules]
    items[:] = rest[:first] + grouped + rest[first:]


def pytest_runtest_setup(item):
    """The tests of every other module run with no Ray cluster in this process, as they would alone
    (``rlx train`` in-process starts its own, sized for its job)."""
    if _module(item) not in _SharedRay.modules:
        _stop_shared_ray()


@pytest.fixture(scope="module")
def ray_pools():
    """``ray_pools(pools, role_pools)`` returns the ``ResourcePools`` of those pools on this process's
    Ray cluster (SHARED_RAY_GPUS logical GPUs, 2 CPUs), started if it is not up; the module's pools
    are removed after the module (their placement groups, and so every actor placed in them). The
    cluster stays up for the next module that uses this fixture (pytest_collection_modifyitems runs
    them one after the other) and is stopped before a test of any other module (pytest_runtest_setup).
    A test that stops Ray itself (``rlx train`` in-process) takes the module's pools with it; the next
    call starts the cluster again."""
    import ray

    made = []

    def start(pools: dict[str, int], role_pools: dict[str, str]) -> ResourcePools:
        if sum(pools.values()) > SHARED_RAY_GPUS:
            raise ValueError(f"pools {pools} hold more than the {SHARED_RAY_GPUS} logical GPUs of the tests' "
                             f"Ray cluster: raise SHARED_RAY_GPUS in tests/conftest.py")
        if not ray.is_initialized():
            made.clear()  # pools of a cluster a test stopped: gone with it
            _shared_cluster()
        made.append(ResourcePools(pools, role_pools))
        return made[-1]

    yield start
    if ray.is_initialized():  # a test may have stopped Ray itself: its pools went with it
        for pools in made:
            pools.shutdown()


@pytest.fixture(scope="module")
def rollout_layouts(ray_pools, tmp_path_factory):
    """{name: RolloutPool} of tests/rollout_layouts.py's ROLLOUT_LAYOUTS on this process's Ray cluster,
    started by the first module that asks and kept for the next (pytest_collection_modifyitems runs
    them one after the other, last of the ``ray_pools`` modules) until the cluster stops. Started again
    if a test stopped the cluster in between. The pools' placement groups are their own, not a
    module's. Each test syncs the weights it checks into the engines first. (``ray_pools`` is asked for
    so that the module is one of the shared-cluster group: pytest_collection_modifyitems.)"""
    from tests.rollout_layouts import ROLLOUT_LAYOUTS, start_rollout_layouts

    _shared_cluster()
    if _SharedRay.rollout_layouts is None or _SharedRay.rollout_layouts[0] != _SharedRay.starts:
        placements = ResourcePools({name: engines * tp for name, (engines, tp, _) in ROLLOUT_LAYOUTS.items()},
                                   {name: name for name in ROLLOUT_LAYOUTS})
        root = str(tmp_path_factory.mktemp("rollout-layouts") / "start")
        _SharedRay.rollout_layouts = (_SharedRay.starts, start_rollout_layouts(root, placements.placement),
                                      placements)
    return _SharedRay.rollout_layouts[1]


@pytest.fixture(scope="session")
def qwen2_untied(tmp_path_factory):
    """The quickstart's architecture: Qwen2 (random qkv biases), untied embeddings."""
    from launch.assets import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2-untied")), arch="qwen2")


@pytest.fixture(scope="session")
def llama_tied(tmp_path_factory):
    """A Llama with tied input/output embeddings."""
    from launch.assets import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("llama-tied")), arch="llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """(model, data): the quickstart's tiny Qwen2 and its addition parquet, built once (tests only read
    them; a test that needs a damaged or changed model copies it first)."""
    from launch.assets import make_addition_data, make_tiny_model

    root = tmp_path_factory.mktemp("tiny-assets")
    return make_tiny_model(str(root / "model")), make_addition_data(str(root / "data"))


@pytest.fixture(scope="session")
def reference_run(tiny_assets, tmp_path_factory):
    """The small quickstart (tests/runs.py: 8 prompts x 8 samples, 4 steps of 2 optimizer steps under a
    warm-up + cosine lr, actor TP2 PP1), uninterrupted, saving every step and keeping the last 2
    checkpoints: what the SIGKILLed and resumed run (test_checkpoint.py), the SIGTERMed and rerun one
    (test_preemption.py) and the requeued Slurm job (test_slurm.py, steps 1-3) must equal, whose lrs
    test_lr_schedule.py checks, and the checkpoints test_checkpoint.py resumes under TP1 PP2 and
    exports. Its processes are watched while it runs: a run that finished must leave none
    (test_preemption.py asserts ``left``). A ``tests.runs.WatchedRun``."""
    from tests.procs import ProcessWatch
    from tests.runs import REPO, WatchedRun, small_quickstart_cmd

    model, data = tiny_assets
    root = tmp_path_factory.mktemp("reference")
    run_dir, log = root / "run", root / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(small_quickstart_cmd(model, data, run_dir, "trainer.save_every=1",
                                                     "trainer.keep_last=2"),
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    watch = ProcessWatch(proc.pid)
    try:
        code = proc.wait(timeout=900)
    finally:
        watch.stop()
    assert code == 0, log.read_text()[-6000:]
    return WatchedRun(run_dir, log, any("raylet" in cmd for _, cmd in watch.seen.values()),
                      watch.wait_until_none_left(30))


@pytest.fixture(scope="session")
def interrupted_run(tiny_assets, tmp_path_factory):
    """The small quickstart (tests/runs.py) interrupted twice in one run_dir, as a preempted and then
    OOM-killed job is: SIGTERMed twice after step 1 with trainer.save_every=0 (tests/test_preemption.py),
    rerun with a checkpoint every step and SIGKILLed (the driver alone, in its own session) once the
    first checkpoint after the resume is complete (tests/test_checkpoint.py), rerun to the end. Every
    leg logs to MLflow too: one tracker run must span all three. One interrupted run for both modules:
    three start-ups instead of four. A ``tests.runs.InterruptedRun``."""
    import signal
    import time

    from tests.procs import GRACE_S, ProcessWatch
    from tests.runs import REPO, InterruptedRun, small_quickstart_cmd, step_metrics

    model, data = tiny_assets
    root = tmp_path_factory.mktemp("interrupted")
    run_dir, metrics, latest = root / "run", root / "run" / "metrics.jsonl", root / "run" / "checkpoints" / "latest"
    mlflow = "trainer.logger=[console,jsonl,mlflow]"

    def wait_for(done, proc, log, what):
        deadline = time.monotonic() + 600
        while not done():
            assert proc.poll() is None, f"the run ended before {what}:\n" + log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"no {what} within 10 minutes"
            time.sleep(0.05)

    # Leg 1: SIGTERM twice (the second while it finishes the step or saves) once step 1 is logged.
    log1 = root / "stopped.log"
    with open(log1, "w") as out:
        proc = subprocess.Popen(small_quickstart_cmd(model, data, run_dir, mlflow), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    watch = ProcessWatch(proc.pid)
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, proc, log1, "step 1")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        stopped_code = proc.wait(timeout=600)
    finally:
        watch.stop()
    stopped_left = watch.wait_until_none_left(GRACE_S)
    assert stopped_code == 75, f"the SIGTERMed run exited {stopped_code}, not 75:\n" + log1.read_text()[-4000:]
    stopped_after = max(step_metrics(run_dir))
    assert stopped_after in (1, 2), f"SIGTERMed after step 1, it stopped after step {stopped_after}, not the " \
                                    "step in flight"
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    latest_after_stop = latest.read_text().strip()

    # Leg 2: resume=auto with a checkpoint every step; SIGKILL once the next one is complete.
    log2, first_save = root / "killed.log", f"step_{stopped_after + 1:08d}"
    with open(log2, "w") as out:
        proc = subprocess.Popen(small_quickstart_cmd(model, data, run_dir, "trainer.save_every=1", mlflow), cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    watch = ProcessWatch(proc.pid)
    try:
        wait_for(lambda: latest.exists() and latest.read_text().strip() == first_save, proc, log2,
                 f"checkpoint {first_save}")
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone, mid-step: as when it is OOM-killed
        killed_code = proc.wait()
        watch.stop()
        killed_left = watch.wait_until_none_left(GRACE_S)
    finally:
        try:  # only if the reaper failed: whatever of its session is left, before the resume
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    logged_before_kill = max(step_metrics(run_dir))

    # Leg 3: resume=auto again, to the end.
    resumed = subprocess.run(small_quickstart_cmd(model, data, run_dir, mlflow), cwd=REPO, capture_output=True,
                             text=True, timeout=900)
    return InterruptedRun(run_dir, stopped_code, log1.read_text(), stopped_after, checkpoints, latest_after_stop,
                          stopped_left,
                          killed_code, log2.read_text(), set(watch.markers),
                          any("raylet" in cmd for _, cmd in watch.seen.values()), killed_left, logged_before_kill,
                          resumed)


@pytest.fixture(scope="session")
def tracked_short_run(tiny_assets, tmp_path_factory):
    """One short `rlx train` of the quickstart (2 steps, 4 prompts x 4 samples) with every tracker on:
    an offline W&B run and an MLflow file store (the logger opts in to it itself), and the reference
    in processes of its own (reference.colocate=false; every other e2e run has it in the actor's). Its
    console and run_dir/logs/ are tests/test_console.py's, what the trackers hold tests/test_metrics.py's:
    (run_dir, the finished ``subprocess.CompletedProcess``)."""
    from tests.runs import QUICKSTART, REPO

    model, data = tiny_assets
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE")}
    env["WANDB_MODE"] = "offline"
    cmd = [sys.executable, "-m", "launch.cli", "train", QUICKSTART, f"model.path={model}",
           f"data.train_files=[{data}]", f"data.val_files=[{data}]", f"trainer.run_dir={run_dir}",
           "trainer.val_every=0", "trainer.total_steps=2", "data.batch_size=4", "rollout.n=4",
           "actor.micro_batch_size=8", "trainer.logger=[console,jsonl,wandb,mlflow]", "trainer.project_name=rlx-e2e",
           "reference.colocate=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return run_dir, proc
