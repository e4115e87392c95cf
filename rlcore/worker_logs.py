"""A quiet console and full logs: every process's output under ``run_dir/logs/``, and on the console
only the training progress, errors and warnings that are not known to be harmless.

- The driver (``open_run_logs``, from ``rlx train``): ``logs/driver.log`` gets every library log
  record of the controller process (Ray's included, INFO and up); the console keeps their warnings
  and errors, minus Ray's known-harmless start-up warning (it stays in driver.log). ``logs/ray`` links Ray's session logs (raylet, GCS, every
  worker's own files).
- Each Ray worker (``capture_worker_output``, first thing in a Megatron rank's and a vLLM engine's
  constructor): the process's stdout and stderr, at the file-descriptor level so C++ warnings,
  progress bars and child processes are caught too, go to ``logs/<name>.log``. What Ray forwards to
  the driver's console (the process's original stderr, shown with Ray's ``(Actor pid=...)`` prefix) is
  then only what a console handler passes: log records and Python warnings (``logging.captureWarnings``)
  at WARNING or above, minus the exact known-harmless message patterns each package lists where it
  knows why they are harmless (rollout/engine.py, megatron_workers/engine.py). Exceptions still reach
  the driver through Ray, with their tracebacks.

Without a log folder (``RLX_LOG_DIR`` unset: engines started by tests, not by a run) nothing changes.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from typing import Iterable

LOG_DIR_ENV = "RLX_LOG_DIR"  # set by the driver, passed to every worker through Ray's runtime_env
CONSOLE_FORMAT = "%(levelname)s %(name)s: %(message)s"
# Ray's driver-side start-up warning: the default token auth of a local cluster (it is only reachable
# from this machine; a cluster joined by address has its own settings).
RAY_HARMLESS = (r"^Token authentication is enabled for this Ray cluster\. Set RAY_AUTH_MODE=disabled to opt out",)


class DropHarmless(logging.Filter):
    """Passes records at ``level`` or above whose message matches none of ``patterns`` (re.search)."""

    def __init__(self, patterns: Iterable[str], level: int = logging.WARNING):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level:
            return False
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def log_dir_of(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), "logs")


def open_run_logs(run_dir: str) -> str:
    """In the driver, before Ray starts: ``run_dir/logs/`` with driver.log, the folder the workers will
    write into (``LOG_DIR_ENV``), and Ray's harmless start-up lines kept off the console. Returns the
    folder."""
    import ray  # noqa: F401  (configures the "ray" logger and its console handler at import)

    folder = log_dir_of(run_dir)
    os.makedirs(folder, exist_ok=True)
    os.environ[LOG_DIR_ENV] = folder
    path = os.path.join(folder, "driver.log")
    driver_log = logging.FileHandler(path)
    driver_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ray_logger = logging.getLogger("ray")  # propagate=False: it needs the file handler of its own
    for handler in ray_logger.handlers:  # Ray's console handler: its INFO lines go to driver.log only
        handler.addFilter(DropHarmless(RAY_HARMLESS))
    root = logging.getLogger()
    if not root.handlers:  # the console still gets the driver's warnings (Python's last resort would not
        root.addHandler(logging.StreamHandler(sys.stderr))  # fire once the file handler is there)
        root.handlers[0].setLevel(logging.WARNING)
    for logger in (root, ray_logger):  # a second run in this process: its own file, not both
        for old in [h for h in logger.handlers if getattr(h, "rlx_driver_log", False)]:
            logger.removeHandler(old)
            old.close()
        logger.addHandler(driver_log)
    driver_log.rlx_driver_log = True
    root.setLevel(min(root.level, logging.INFO))
    return folder


def log_env(defaults: dict[str, str]) -> dict[str, str]:
    """The logging env vars for the workers: ``defaults``, and in a run with a log folder that folder
    and vLLM's INFO lines (they go to the file; the console filters)."""
    folder = os.environ.get(LOG_DIR_ENV)
    return {**defaults, LOG_DIR_ENV: folder, "VLLM_LOGGING_LEVEL": "INFO"} if folder else dict(defaults)


def link_ray_session(folder: str | None = None) -> None:
    """``logs/ray`` -> this Ray session's log folder (after ``ray.init``)."""
    import ray

    folder = folder or os.environ.get(LOG_DIR_ENV)
    node = getattr(ray._private.worker, "_global_node", None)
    if not folder or node is None:  # joined a cluster started elsewhere: its session lives on its head
        return
    link = os.path.join(folder, "ray")
    if os.path.islink(link):
        os.unlink(link)
    if not os.path.exists(link):
        os.symlink(node.get_logs_dir_path(), link)


def capture_worker_output(name: str, harmless: Iterable[str] = ()) -> logging.Handler | None:
    """In a Ray worker: this process's stdout/stderr into ``<RLX_LOG_DIR>/<name>.log``; returns the
    console handler (add it to loggers that do not propagate, e.g. vLLM's, with ``to_console``), or
    None when there is no log folder (nothing is redirected then)."""
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder or not _in_ray_worker():  # never the driver's (or a test process's) own console
        return None
    path = os.path.join(folder, f"{name}.log")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:  # e.g. a run_dir not shared with this node: say so, keep the console
        print(f"rlx: cannot write this worker's log {path} ({e}); its output stays on the console",
              file=sys.stderr, flush=True)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.fdopen(os.dup(2), "w", buffering=1)  # what Ray forwards to the driver's console
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    handler = logging.StreamHandler(console)
    handler.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    handler.addFilter(DropHarmless(harmless))
    root = logging.getLogger()
    if not root.handlers:  # the full record in the file (stderr is the file now)
        root.addHandler(logging.StreamHandler(sys.stderr))
    root.addHandler(handler)
    root.setLevel(min(root.level, logging.INFO))
    logging.captureWarnings(True)  # Python warnings become "py.warnings" records: file, and console if not harmless
    return handler


def _in_ray_worker() -> bool:
    import ray

    worker = ray._private.worker.global_worker
    return ray.is_initialized() and worker.mode == ray._private.worker.WORKER_MODE


def to_console(handler: logging.Handler | None, *logger_names: str) -> None:
    """Also send these (non-propagating) loggers' records through the worker's console handler."""
    if handler is None:
        return
    for name in logger_names:
        logger = logging.getLogger(name)
        if handler not in logger.handlers:
            logger.addHandler(handler)
