"""`rlx train` as a user runs it, for the e2e tests: a subprocess on a job spec with the tiny model
and data, its metrics.jsonl read back."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_cli(spec: str, run_dir, model: str, data: str, *overrides: str) -> list[dict]:
    """Runs ``rlx train spec`` with ``model`` and ``data`` into ``run_dir`` (validation off) and returns
    its metrics lines; a failed run fails the test with the end of its output."""
    cmd = [sys.executable, "-m", "launch.cli", "train", spec, f"model.path={model}",
           f"data.train_files=[{data}]", f"data.val_files=[{data}]", f"trainer.run_dir={run_dir}",
           "trainer.val_every=0", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
