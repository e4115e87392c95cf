#!/usr/bin/env bash
# The CPU quickstart end to end on a fresh machine: install, build the tiny model and data, train.
# Extra arguments are dotted overrides, e.g.  bash launch/quickstart_cpu.sh trainer.total_steps=5
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install_cpu.sh
.venv/bin/python -m launch.assets
.venv/bin/rlx train yaml_configs/quickstart_cpu.yaml "$@"
