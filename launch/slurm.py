"""``rlx submit``: renders ``launch/rlx.sbatch`` for a job spec and submits it with ``sbatch``; and the
small steps that script runs (``python -m launch.slurm node-ip | wait | check-stopped``).

The operator never edits bash: ``rlx submit JOB.yaml --nodes N [--partition P --time T ...]
[key.sub=value ...]`` writes ``<log dir>/<job name>.sbatch`` (the #SBATCH lines, the RLX_* settings,
the job spec and overrides, then the body of ``rlx.sbatch``), submits it, and prints where the logs go.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the steps the sbatch script runs should not pay for importing torch
    from rlcore.validate import JobLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(ROOT, "launch", "rlx.sbatch")
CPU_OBJECT_STORE_BYTES = 512 * 1024 ** 2  # as rlcore.placement.start_ray on the cpu profile


def add_submit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, required=True, help="nodes to allocate (one Ray node each)")
    p.add_argument("--gpus-per-node", type=int,
                   help="GPUs per node (default: resources.gpus_per_node, else 8; on the cpu profile the "
                        "pools' logical GPUs spread over the nodes)")
    p.add_argument("--partition", help="sbatch --partition")
    p.add_argument("--account", help="sbatch --account")
    p.add_argument("--time", help="sbatch --time, e.g. 24:00:00")
    p.add_argument("--job-name", help="sbatch --job-name (default: rlx-<spec name>)")
    p.add_argument("--port", type=int, default=6379, help="the Ray head's port (+1, +2 are used too)")
    p.add_argument("--bringup-timeout", type=int, default=300,
                   help="seconds to wait for every node's GPUs to register with Ray")
    p.add_argument("--log-dir", help="where the driver log and per-node Ray logs go (default: <run_dir>/slurm)")
    p.add_argument("--signal", metavar="SIG@SECONDS",
                   help="Slurm sends SIG (USR1 or TERM) to the batch script SECONDS before the time limit, e.g. "
                        "USR1@120 (#SBATCH --signal=B:USR1@120): rlx train finishes its step, saves a "
                        "checkpoint and exits with 75; give it the time of a step and a save")
    p.add_argument("--requeue", action="store_true",
                   help="requeue the job when rlx train stopped on a signal (exit status 75); the requeued job "
                        "resumes from its checkpoint (trainer.resume=auto)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="OPTION",
                   help="an extra sbatch option, e.g. --sbatch-arg=--qos=high (repeatable)")
    p.add_argument("--wait", action="store_true", help="block until the job ends; exit with its status")
    p.add_argument("--dry-run", action="store_true", help="write and print the script; submit nothing")


def gpus_per_node(args, cfg, layout: JobLayout) -> int:
    if args.gpus_per_node:
        return args.gpus_per_node
    if layout.device == "cpu":  # logical GPUs: exactly what the pools need, spread over the nodes
        return math.ceil(layout.total_gpus / args.nodes)
    return cfg.resources.gpus_per_node or 8


def batch_signal(spec: str) -> str:
    """``USR1@120`` (or ``B:USR1@120``, ``SIGTERM@60``) as sbatch's ``B:USR1@120``: the batch shell only.
    Slurm's form without ``B:`` signals every process of every step, the Ray nodes' too, whose workers
    would die before the checkpoint is saved; rlx.sbatch passes the signal on to rlx train instead."""
    from rlcore.job import ConfigError

    m = re.fullmatch(r"(?:B:)?(?:SIG)?(USR1|TERM)@(\d+)", spec.strip())
    if not m:
        raise ConfigError(f"--signal={spec!r}: expected SIG@SECONDS with SIG USR1 or TERM (what rlx train "
                          "checkpoints on), e.g. --signal=USR1@120")
    return f"B:{m.group(1)}@{m.group(2)}"


def render(args, cfg, layout: JobLayout) -> tuple[str, str]:
    """The sbatch script for ``args.job`` with its overrides, and the folder its logs go to."""
    from rlcore.job import ConfigError

    if args.nodes < 1:
        raise ConfigError(f"--nodes={args.nodes} must be at least 1")
    per_node = gpus_per_node(args, cfg, layout)
    if layout.total_gpus > args.nodes * per_node:
        raise ConfigError(f"resources.pools need {layout.total_gpus} GPUs but --nodes {args.nodes} x "
                          f"--gpus-per-node {per_node} = {args.nodes * per_node}")
    log_dir = os.path.abspath(args.log_dir or os.path.join(cfg.trainer.run_dir, "slurm"))
    name = args.job_name or "rlx-" + os.path.splitext(os.path.basename(args.job))[0]
    sbatch = [f"--job-name={name}", f"--nodes={args.nodes}", "--ntasks-per-node=1", "--exclusive",
              f"--output={log_dir}/{name}-%j.out"]
    if layout.device == "gpu":
        sbatch.append(f"--gpus-per-node={per_node}")
    for key in ("partition", "account", "time"):
        if getattr(args, key):
            sbatch.append(f"--{key}={getattr(args, key)}")
    if args.signal:
        sbatch.append(f"--signal={batch_signal(args.signal)}")
    if args.requeue:  # a requeued job keeps its id, so its output file too: append, not truncate
        sbatch += ["--requeue", "--open-mode=append"]
    sbatch += args.sbatch_arg
    settings = {
        "RLX_ROOT": ROOT,
        "RLX_PYTHON": sys.executable,
        "RLX_RAY_PORT": args.port,
        "RLX_GPUS_PER_NODE": per_node,
        "RLX_BRINGUP_TIMEOUT_S": args.bringup_timeout,
        "RLX_LOG_DIR": log_dir,
        "RLX_OBJECT_STORE_BYTES": CPU_OBJECT_STORE_BYTES if layout.device == "cpu" else "",
        "RLX_REQUEUE": int(args.requeue),
    }
    with open(TEMPLATE) as f:
        body = f.read().split("\n", 1)[1]  # without its shebang
    job_args = " ".join(shlex.quote(a) for a in [os.path.abspath(args.job), *args.overrides])
    header = ["#!/bin/bash", *(f"#SBATCH {shlex.quote(o)}" for o in sbatch),
              f"# Rendered by: rlx submit {' '.join(shlex.quote(a) for a in sys.argv[2:])}",
              *(f"export {k}={shlex.quote(str(v))}" for k, v in settings.items()),
              f"[ $# -eq 0 ] && set -- {job_args}  # the job spec and its overrides", ""]
    return "\n".join(header) + body, log_dir


def submit(args, cfg, layout: JobLayout) -> int:
    script, log_dir = render(args, cfg, layout)
    os.makedirs(log_dir, exist_ok=True)
    name = args.job_name or "rlx-" + os.path.splitext(os.path.basename(args.job))[0]
    path = os.path.join(log_dir, f"{name}.sbatch")
    with open(path, "w") as f:
        f.write(script)
    if args.dry_run:
        print(script, end="")
        print(f"# written to {path}; submit with: sbatch {path}")
        return 0
    from rlcore.job import ConfigError

    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch not found on PATH: run rlx submit on a Slurm login node "
                          "(launch/install_slurm.sh sets up a one-machine cluster)")
    cmd = ["sbatch", "--parsable", *(["--wait"] if args.wait else []), path]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    job_id = (proc.stdout.readline().strip().split(";") or [""])[0]
    if job_id:
        print(f"submitted Slurm job {job_id} ({args.nodes} node(s)): {path}")
        print(f"driver log: {log_dir}/{name}-{job_id}.out; Ray logs per node: {log_dir}/{job_id}/")
    rest = proc.stdout.read()
    rc = proc.wait()
    if rest.strip():
        print(rest, end="")
    if args.wait and job_id:
        print(f"Slurm job {job_id} ended with exit status {rc}")
    return rc


# ------------------------------------------------------------------- steps the sbatch script runs
def node_ip() -> str:
    """This node's address as Ray picks it (the interface that routes outwards)."""
    from ray.util import get_node_ip_address

    return get_node_ip_address()


def wait_for_cluster(address: str, nodes: int, gpus_per_node: int, timeout_s: float, log_dir: str) -> int:
    """Waits until ``nodes`` Ray nodes with ``gpus_per_node`` GPUs each have registered at ``address``;
    0 when they have, else 1 with one line saying what is missing."""
    import ray

    deadline = time.monotonic() + timeout_s
    host, port = address.rsplit(":", 1)
    while True:  # first the head's port, so ray.init does not fail on a head still starting
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                print(f"rlx: the Ray head at {address} did not open its port within {timeout_s:.0f} s; "
                      f"see {log_dir}/ray-head-*.log", file=sys.stderr)
                return 1
            time.sleep(1)
    while True:  # the head may still be starting (or starting again: run_ray_node)
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            break
        except (ConnectionError, RuntimeError) as e:
            if time.monotonic() > deadline:
                print(f"rlx: could not connect to the Ray head at {address} within {timeout_s:.0f} s ({e}); "
                      f"see {log_dir}/ray-head-*.log", file=sys.stderr)
                return 1
            time.sleep(3)
    try:
        want = nodes * gpus_per_node
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            gpus = sum(n["Resources"].get("GPU", 0) for n in alive)
            if len(alive) >= nodes and gpus >= want:
                print(f"[rlx] Ray cluster up: {len(alive)} node(s), {gpus:g} GPUs "
                      f"({', '.join(sorted(n['NodeManagerAddress'] for n in alive))})", flush=True)
                return 0
            if time.monotonic() > deadline:
                print(f"rlx: the Ray cluster at {address} did not come up within {timeout_s:.0f} s: "
                      f"{len(alive)} of {nodes} node(s) registered with {gpus:g} of {want} GPUs "
                      f"({', '.join(n['NodeManagerAddress'] for n in alive) or 'none'}); see the Ray logs "
                      f"in {log_dir}", file=sys.stderr)
                return 1
            time.sleep(2)
    finally:
        ray.shutdown()


def run_ray_node(cmd: list[str], stop_file: str, attempts: int = 3) -> int:
    """Runs ``ray start ... --block`` (one srun step per node) and starts it again when it fails while
    starting: Ray 2.60's raylet gives its agents a fixed 15 s to report their ports and exits when a
    busy node is slower. The teardown creates ``stop_file`` (the job's log folder is shared by the
    nodes), or sends SIGTERM: either way ``ray start`` gets SIGTERM and stops its Ray processes."""
    import signal

    child: Optional[subprocess.Popen] = None
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the driver's preemption notice, should srun pass it on
    rc = 1
    for attempt in range(1, attempts + 1):
        started = time.monotonic()
        child = subprocess.Popen(cmd)
        while True:
            try:
                rc = child.wait(timeout=1)
                break
            except subprocess.TimeoutExpired:
                if not stopping and os.path.exists(stop_file):
                    on_signal(signal.SIGTERM, None)
        if stopping:
            print(f"[rlx] Ray on {socket.gethostname()} stopped", flush=True)
            return 0
        print(f"[rlx] `ray start` on {socket.gethostname()} exited with status {rc} after "
              f"{time.monotonic() - started:.0f} s (attempt {attempt} of {attempts})", flush=True)
        if attempt < attempts:
            time.sleep(5)  # let its ports close
    return rc


def processes_naming(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process on this node whose command line contains ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # The path itself, not a longer one it prefixes (/tmp/rlx-ray-1 is not /tmp/rlx-ray-12).
        if re.search(re.escape(text) + r"(/|\s|$)", cmd):
            found.append((int(pid), cmd))
    return found


def check_stopped(temp_dir: str, grace_s: float = 15.0) -> int:
    """After teardown: every process of this job's Ray (it names the job's ``temp_dir``) has exited;
    stragglers are killed and named. Other Ray clusters on the node are not touched."""
    import signal

    deadline = time.monotonic() + grace_s
    left = processes_naming(temp_dir)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = processes_naming(temp_dir)
    for pid, cmd in left:
        print(f"[rlx] teardown: killing Ray process {pid} left behind: {cmd[:120]}", flush=True)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"[rlx] teardown: no Ray processes of {temp_dir} left on {socket.gethostname()}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.slurm", description="steps of launch/rlx.sbatch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("node-ip", help="print this node's IP address as Ray picks it")
    w = sub.add_parser("wait", help="wait until every node's GPUs registered with the Ray head")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--gpus-per-node", type=int, required=True)
    w.add_argument("--timeout", type=float, default=300)
    w.add_argument("--log-dir", default=".")
    c = sub.add_parser("check-stopped", help="make sure no process of this job's Ray is left")
    c.add_argument("--temp-dir", required=True)
    r = sub.add_parser("ray-node", help="run `ray start ... --block`, again if it fails while starting")
    r.add_argument("--attempts", type=int, default=3)
    r.add_argument("--stop-file", required=True, help="stop Ray when this file appears")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- ray start ...")
    args = parser.parse_args(argv)
    if args.command == "ray-node":
        return run_ray_node(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd, args.stop_file, args.attempts)
    if args.command == "node-ip":
        print(node_ip())
        return 0
    if args.command == "wait":
        return wait_for_cluster(args.address, args.nodes, args.gpus_per_node, args.timeout, args.log_dir)
    return check_stopped(args.temp_dir)


if __name__ == "__main__":
    sys.exit(main())
