"""``rlx plan``: memory per GPU of every role of a job spec, and ``--suggest``: valid layouts, ranked.

Everything here is arithmetic on the HF config.json (the model's shape) and the job spec; nothing is
loaded or started, so a cluster spec is planned on a laptop. The parameter counts are exactly what
megatron-core's GPTModel holds per rank (tests/test_plan.py builds the model and compares); the
memory model follows how the workers run it:

- weights: parameters in the model dtype (bf16 on the gpu profile, fp32 on cpu);
- gradients: megatron DDP's main_grad buffer, fp32 (``grad_reduce_in_fp32=True`` in the worker);
- optimizer: Adam's two moments in fp32, plus an fp32 master copy of bf16 weights; divided by DP
  with ``optim.use_distributed_optimizer`` (megatron's 6 + 12/DP bytes per parameter in bf16);
- activations: what one micro-batch of ``micro_batch_size`` x (max_prompt_length +
  max_response_length) tokens keeps for the backward, per layer, times the micro-batches a 1F1B
  pipeline stage holds in flight, plus the vocab-parallel logits of the last stage at its scored
  positions (fp32: the one buffer the log-softmax works in; bf16: and their fp32 copy); no
  activation recomputation (the workers do not enable it);
- rollout (vLLM): ``gpu_memory_utilization`` of the GPU minus the weights / TP and a profile-run
  reserve is the KV cache; it must hold at least one sequence of the maximal length.
Roles on one pool (actor and reference) are resident together: their estimates add up.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field, replace
from typing import Optional

from rlcore.config import on_policy_update, resolved_critic
from rlcore.hf_config import HFModelSpec, parse_hf_config, read_hf_config
from rlcore.job import ConfigError
from rlcore.layout import RoleLayout, stage_layers
from rlcore.validate import REWARD_MODEL_SECTIONS, JobLayout, validate

GB = 1e9
BYTES = {"bfloat16": 2, "float32": 4}

# vLLM's start-up profile run: a forward over this many batched tokens decides its activation peak
# (its max_num_batched_tokens default), plus memory outside torch's allocator (NCCL, CUDA context).
VLLM_PROFILE_TOKENS = 8192
VLLM_NON_TORCH_GB = 1.0
VLLM_MAX_NUM_SEQS = 256  # vLLM's default cap on sequences decoded together per engine

# The cost model of --suggest: an H100-class node (one step's seconds only rank layouts; they are not
# a forecast of the wall time).
PEAK_FLOPS = 989e12  # dense bf16
MFU = 0.4  # share of the peak a Megatron update reaches
HBM_BYTES_S = 3.35e12  # decode reads every weight and the KV cache once per generated token
NVLINK_BYTES_S = 200e9  # per GPU, effective for all-reduce inside a node
NETWORK_BYTES_S = 40e9  # per GPU, effective between nodes (400 Gb/s InfiniBand)
ALLREDUCE_LATENCY_S = 15e-6  # one small all-reduce (vLLM does two per layer per decode step under TP)
# A training pool's estimate must stay below this share of the GPU: the rest is the CUDA context, NCCL
# buffers and the caching allocator's fragmentation, which the estimate does not count.
TRAIN_MEMORY_SHARE = 0.9


class PlanError(ConfigError):
    """A layout that cannot fit or cannot be placed; one sentence naming the key to change."""


# ------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class ModelDims:
    """The architecture facts the memory model needs (Qwen2 / Llama: GQA, SwiGLU, RMSNorm), under the
    short names its arithmetic uses; read by rlcore's one HF config reader (``from_spec``)."""

    architecture: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qkv_bias: bool
    tied: bool

    @classmethod
    def from_spec(cls, hf: HFModelSpec) -> "ModelDims":
        return cls(architecture=hf.architecture, hidden=hf.hidden_size, ffn=hf.ffn_hidden_size,
                   layers=hf.num_layers, heads=hf.num_attention_heads, kv_heads=hf.num_kv_heads,
                   head_dim=hf.head_dim, vocab=hf.vocab_size, qkv_bias=hf.qkv_bias, tied=hf.tie_word_embeddings)

    @classmethod
    def from_hf(cls, hf: dict, source: str) -> "ModelDims":
        """From a config.json's contents (``source`` names it in messages)."""
        return cls.from_spec(parse_hf_config(hf, source))

    @property
    def qkv_width(self) -> int:  # rows of the fused QKV projection
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def layer_params(self, tp: int) -> int:
        """One transformer layer on one TP rank: QKV (+bias), output projection and the SwiGLU MLP
        are split by TP; the two RMSNorm weights are replicated."""
        h = self.hidden
        qkv = h * self.qkv_width + (self.qkv_width if self.qkv_bias else 0)
        proj = self.heads * self.head_dim * h
        mlp = h * 2 * self.ffn + self.ffn * h
        return (qkv + proj + mlp) // tp + 2 * h

    def stage_params(self, tp: int, pp: int, stage: int, value_head: bool = False, pp_layers=None) -> int:
        """Parameters of one rank of pipeline stage ``stage`` (megatron GPTModel): its layers (``pp_layers``
        per stage, or the even split), the word embeddings on the first stage, the final norm and the
        output layer on the last. Tied embeddings still hold a copy on the last stage when PP > 1
        (megatron syncs it). The critic's value head (``value_head``) replaces the output layer with a
        replicated Linear(hidden, 1)."""
        n = stage_layers(self.layers, pp, pp_layers)[stage] * self.layer_params(tp)
        embedding = self.vocab // tp * self.hidden
        if stage == 0:
            n += embedding
        if stage == pp - 1:
            n += self.hidden  # final norm
            if value_head:
                n += self.hidden + 1
            elif not self.tied or pp > 1:
                n += embedding
        return n

    def total_params(self) -> int:
        return self.stage_params(1, 1, 0)

    def kv_heads_per_rank(self, tp: int) -> int:
        """vLLM splits KV heads over TP ranks, or replicates them when there are fewer heads than ranks."""
        return max(1, self.kv_heads // tp)


# ----------------------------------------------------------------------------------- estimates
@dataclass
class RoleEstimate:
    role: str
    pool: str
    gpus: int
    tp: int
    pp: int
    dp: int  # rollout: engines
    params: int  # per GPU (the worst pipeline stage)
    weights: float  # bytes per GPU
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0  # rollout
    kv_sequences: int = 0  # rollout: maximal-length sequences the KV cache holds at once
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.kv_cache


@dataclass
class Plan:
    model: ModelDims
    source: str
    device: str
    dtype: str
    gpu_memory: float  # bytes
    roles: list[RoleEstimate]
    seq_len: int
    sequences: int  # per step

    def pool_totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for r in self.roles:
            totals[r.pool] = totals.get(r.pool, 0.0) + r.total
        return totals


def _activation_bytes_per_token_layer(m: ModelDims, tp: int, device: str, seq_len: int, act_bytes: int,
                                     masked: bool = False) -> float:
    """What one layer keeps for the backward per token on one TP rank: the two norm inputs and the
    QKV/MLP inputs (hidden-sized; split by TP only under sequence parallelism, which the gpu profile
    turns on for TP > 1), Q/K/V and the attention output, the SwiGLU input (2 x ffn) and output.
    The cpu profile's unfused attention also keeps the [heads, s, s] scores and probabilities (fp32).
    On the gpu profile, rows with an explicit mask (``masked``: shared-prompt rows) run TE's unfused
    attention, which keeps the [heads, s, s] probabilities for the backward: in the activations' dtype,
    and in fp32 from the softmax when TE's fused softmax kernel does not apply (counted: the bound)."""
    sp = tp if device == "gpu" else 1
    per_token = (4 * m.hidden / sp + m.qkv_width / tp + m.heads * m.head_dim / tp + 3 * m.ffn / tp) * act_bytes
    if device == "cpu":
        per_token += 2 * (m.heads / tp) * seq_len * 4
    elif masked:
        per_token += (m.heads / tp) * seq_len * (act_bytes + 4)
    return per_token


def _train_role(m: ModelDims, role: str, lay: RoleLayout, dtype: str, device: str, seq_len: int,
                micro_batch: int, microbatches: int, trainable: bool, distributed_optimizer: bool,
                value_head: bool = False, shape: Optional["MicroBatchShape"] = None) -> RoleEstimate:
    """``shape``: the rows one micro-batch runs (shared-prompt rows, scored positions); default
    ``micro_batch`` rows of ``seq_len`` tokens, every position scored."""
    wbytes = BYTES[dtype]
    shape = shape or MicroBatchShape(micro_batch, seq_len, micro_batch * seq_len)
    per_layer = _activation_bytes_per_token_layer(m, lay.tp, device, shape.row_len, wbytes,
                                                  shape.masked) * shape.tokens
    # The logits at the positions that score a response token only: fp32 ones become the log-softmax's
    # buffer (megatron_workers/logprobs.py, divided in place); bf16 ones beside their fp32 copy.
    logits = 0.0 if value_head else shape.scored * (m.vocab / lay.tp) * (4 if wbytes == 4 else wbytes + 4)
    worst: Optional[RoleEstimate] = None
    layers = lay.stage_layers(m.layers)
    for stage in range(lay.pp):
        params = m.stage_params(lay.tp, lay.pp, stage, value_head, lay.pp_layers)
        last = stage == lay.pp - 1
        if trainable:
            # 1F1B: stage s holds the activations of up to pp - s micro-batches before its first backward.
            in_flight = min(lay.pp - stage, microbatches) * layers[stage]  # micro-batch x layers
            if lay.vpp > 1:
                # Interleaved 1F1B (megatron's get_pp_rank_microbatches): 2(pp - s - 1) + (vpp - 1) pp
                # warm-up forwards of one chunk (layers / (pp vpp) layers) each, plus the one in flight;
                # on stage 0 that is layers * (1 + (pp - 1) / (pp vpp)), the Megatron paper's figure.
                chunks = min(2 * (lay.pp - stage - 1) + (lay.vpp - 1) * lay.pp + 1, microbatches * lay.vpp)
                in_flight = chunks * (layers[stage] // lay.vpp)
            acts = in_flight * per_layer + (logits if last else 0.0)
            master = 4 if dtype == "bfloat16" else 0  # fp32 copy of bf16 weights
            optim = params * (8 + master) / (lay.dp if distributed_optimizer else 1)
            grads = params * 4.0
        else:  # forward only: one layer's working set, and the logits
            acts, optim, grads = per_layer + (logits if last else 0.0), 0.0, 0.0
        est = RoleEstimate(role=role, pool=lay.pool, gpus=lay.gpus, tp=lay.tp, pp=lay.pp, dp=lay.dp,
                           params=params, weights=params * wbytes, grads=grads, optimizer=optim,
                           activations=acts)
        if worst is None or est.total > worst.total:
            worst = est
    if lay.pp > 1:
        worst.notes.append(f"worst pipeline stage of {lay.pp}"
                           + (f", {lay.vpp} virtual stages each" if lay.vpp > 1 else "")
                           + (f" (layers per stage {'|'.join(map(str, layers))})" if lay.pp_layers else ""))
    return worst


def _rollout_role(m: ModelDims, cfg, layout: JobLayout, gpu_memory: float, seq_len: int) -> RoleEstimate:
    ro, r = layout.rollout, cfg.rollout
    wbytes = BYTES[layout.dtype]
    params = m.total_params()
    weights = params / ro.tp * wbytes  # vLLM shards every matrix, the vocabulary included, by its TP
    kv_per_token = 2 * m.layers * m.kv_heads_per_rank(ro.tp) * m.head_dim * wbytes  # K and V
    if layout.device == "cpu":
        kv = r.kv_cache_gb * 2 ** 30
        reserve = 0.0
        note = "cpu profile: rollout.kv_cache_gb of host memory"
    else:
        profile_acts = VLLM_PROFILE_TOKENS * (2 * m.hidden + m.qkv_width / ro.tp + 3 * m.ffn / ro.tp) * wbytes
        reserve = profile_acts + VLLM_NON_TORCH_GB * GB
        kv = r.gpu_memory_utilization * gpu_memory - weights - reserve
        note = f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} of {gpu_memory / GB:g} GB"
    est = RoleEstimate(role="rollout", pool=ro.pool, gpus=ro.gpus, tp=ro.tp, pp=1, dp=ro.engines,
                       params=math.ceil(params / ro.tp), weights=weights, activations=reserve,
                       kv_cache=max(kv, 0.0), notes=[note])
    est.kv_sequences = int(max(kv, 0.0) // (kv_per_token * seq_len))
    return est


def read_model(cfg) -> tuple[ModelDims, str]:
    """The model's dimensions from model.path's config.json, or model.hf_config when the folder is not here."""
    hf = read_hf_config(cfg.model.path, cfg.model.hf_config)
    return ModelDims.from_spec(hf), hf.source


def _updates(cfg, role) -> tuple[int, int]:
    """(sequences per optimizer step, optimizer steps per rollout batch) of a role that trains
    (``cfg.actor``, or ``resolved_critic(cfg)``)."""
    mini = role.ppo_mini_batch_size or cfg.data.batch_size
    return mini * cfg.rollout.n, max(1, cfg.data.batch_size // mini) * role.ppo_epochs


def estimate(cfg, layout: JobLayout, model: Optional[tuple[ModelDims, str]] = None) -> Plan:
    """Every role's memory per GPU for the validated ``layout`` of ``cfg``."""
    m, source = model or read_model(cfg)
    seq_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    a = cfg.actor
    prompt, response, n = cfg.data.max_prompt_length, cfg.rollout.max_response_length, cfg.rollout.n
    score_head = False
    if cfg.algorithm.type != "rl":  # preference pairs: a chosen and a rejected sequence per prompt
        from rlcore.preference_losses import PREFERENCE_OBJECTIVES

        n = 2
        step_sequences = 2 * (a.ppo_mini_batch_size or cfg.data.batch_size)
        score_head = PREFERENCE_OBJECTIVES.meta(cfg.algorithm.type).head == "score"  # rm: no vocabulary logits
    else:
        step_sequences, _ = _updates(cfg, a)
    sequences = cfg.data.batch_size * n
    gpu_memory = cfg.resources.gpu_memory_gb * GB
    roles = [_train_role(m, "actor", layout.actor, layout.dtype, layout.device, seq_len, a.micro_batch_size,
                         max(1, step_sequences // (layout.actor.dp * a.micro_batch_size)), True,
                         a.optim.use_distributed_optimizer, value_head=score_head,
                         shape=MicroBatchShape.of(a.micro_batch_size, prompt, response, n, a.shared_prompt))]
    if layout.reference is not None:
        mb = cfg.reference.micro_batch_size or a.micro_batch_size
        shared = a.shared_prompt if cfg.reference.shared_prompt is None else cfg.reference.shared_prompt
        roles.append(_train_role(m, "reference", layout.reference, layout.dtype, layout.device, seq_len, mb, 1,
                                 False, False, shape=MicroBatchShape.of(mb, prompt, response, n, shared)))
    critic_layout = getattr(layout, "critic", None)
    if critic_layout is not None:
        c = resolved_critic(cfg)
        critic_sequences, _ = _updates(cfg, c)
        roles.append(_train_role(m, "critic", critic_layout, layout.dtype, layout.device, seq_len,
                                 c.micro_batch_size,
                                 max(1, critic_sequences // (critic_layout.dp * c.micro_batch_size)), True,
                                 c.optim.use_distributed_optimizer, value_head=True))
    for name, lay in layout.reward.items():  # reward models: forward only, a scalar head, their own shape
        key = f"reward.{REWARD_MODEL_SECTIONS[name]}"
        section = getattr(cfg.reward, REWARD_MODEL_SECTIONS[name])
        dims = ModelDims.from_spec(read_hf_config(section.path, key=f"{key}.path")) if os.path.isdir(section.path) else m
        roles.append(_train_role(dims, key, lay, layout.dtype, layout.device, seq_len, section.micro_batch_size, 1,
                                 False, False, value_head=True))
    if layout.rollout is not None:  # a preference job has engines only for DPO's greedy validation
        roles.append(_rollout_role(m, cfg, layout, gpu_memory, seq_len))
    return Plan(model=m, source=source, device=layout.device, dtype=layout.dtype, gpu_memory=gpu_memory,
                roles=roles, seq_len=seq_len, sequences=sequences)


def check(plan: Plan, cfg) -> None:
    """Raise ``PlanError`` naming the key to change when a pool or the rollout cannot fit."""
    res = cfg.resources
    if res.gpus_per_node is not None:
        total = sum(res.pools.values())
        if total > res.nodes * res.gpus_per_node:
            raise PlanError(f"resources.pools need {total} GPUs but resources.nodes*resources.gpus_per_node="
                            f"{res.nodes}*{res.gpus_per_node}={res.nodes * res.gpus_per_node}")
        for r in plan.roles:
            if res.gpus_per_node % r.tp:
                raise PlanError(f"{r.role}.tp={r.tp} does not divide resources.gpus_per_node={res.gpus_per_node}: "
                                "a tensor-parallel group must sit inside one node")
    ro = next((r for r in plan.roles if r.role == "rollout"), None)
    if ro is not None and ro.kv_sequences < 1:
        if plan.device == "cpu":
            raise PlanError(f"rollout.kv_cache_gb={cfg.rollout.kv_cache_gb} cannot hold one sequence of "
                            f"{plan.seq_len} tokens (data.max_prompt_length + rollout.max_response_length)")
        raise PlanError(
            f"rollout.tp={ro.tp}: the model's weights ({ro.weights / GB:.1f} GB per GPU) and vLLM's reserve "
            f"({ro.activations / GB:.1f} GB) leave no KV cache for one sequence of {plan.seq_len} tokens within "
            f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} of "
            f"resources.gpu_memory_gb={cfg.resources.gpu_memory_gb:g}; raise rollout.tp")
    if plan.device == "cpu":
        return  # logical GPUs share host memory; resources.gpu_memory_gb does not apply
    for pool, total in plan.pool_totals().items():
        if ro is not None and pool == ro.pool:
            continue
        if total > TRAIN_MEMORY_SHARE * plan.gpu_memory:
            on_pool = [r for r in plan.roles if r.pool == pool]
            parts = " + ".join(f"{r.role} {r.total / GB:.1f}" for r in on_pool)
            worst = max(on_pool, key=lambda r: r.total)
            hint = (f"{worst.role}.tp/{worst.role}.pp" if worst.role == "reference" else
                    f"{worst.role}.tp or {worst.role}.pp, set {worst.role}.optim.use_distributed_optimizer=true, "
                    f"or lower {worst.role}.micro_batch_size")
            raise PlanError(f"pool {pool!r} needs {total / GB:.1f} GB per GPU ({parts}), more than "
                            f"{TRAIN_MEMORY_SHARE:.0%} of resources.gpu_memory_gb={cfg.resources.gpu_memory_gb:g} "
                            f"(the rest is CUDA context, NCCL buffers, fragmentation); raise {hint}")


# ---------------------------------------------------------------------------------------- output
def _gb(x: float) -> str:
    if not x:
        return "-"
    return f"{x / GB:.1f}" if x >= 0.1 * GB else f"{x / GB:.4f}"  # a tiny (CPU) model still shows its figures


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def format_plan(plan: Plan, cfg) -> str:
    m = plan.model
    lines = [f"model: {m.architecture}, {_params(m.total_params())} parameters ({plan.source}); "
             f"{plan.device} profile, {plan.dtype}"]
    if cfg.algorithm.type != "rl":
        lines.append(f"batch: {cfg.data.batch_size} pairs x (chosen, rejected) = {plan.sequences} sequences of up to "
                     f"{cfg.data.max_prompt_length}+{cfg.rollout.max_response_length}={plan.seq_len} tokens "
                     f"(algorithm.type={cfg.algorithm.type})")
    else:
        lines.append(f"batch: {cfg.data.batch_size} prompts x {cfg.rollout.n} samples = {plan.sequences} sequences "
                     f"of up to {cfg.data.max_prompt_length}+{cfg.rollout.max_response_length}={plan.seq_len} tokens")
    if plan.device == "gpu":
        lines.append(f"GPU memory: {plan.gpu_memory / GB:g} GB (resources.gpu_memory_gb)")
    lines.append("")
    head = ("role", "pool", "gpus", "tp", "pp", "dp", "params/GPU", "weights", "grads", "optimizer",
            "activations", "kv cache", "total GB")
    rows = [head]
    for r in plan.roles:
        rows.append((r.role, r.pool, r.gpus, r.tp, "-" if r.role == "rollout" else r.pp,
                     f"{r.dp} engines" if r.role == "rollout" else r.dp, _params(r.params), _gb(r.weights),
                     _gb(r.grads), _gb(r.optimizer), _gb(r.activations), _gb(r.kv_cache), _gb(r.total)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    for pool, total in plan.pool_totals().items():
        on = [r.role for r in plan.roles if r.pool == pool]
        share = f" of {plan.gpu_memory / GB:g} ({total / plan.gpu_memory:.0%})" if plan.device == "gpu" else ""
        lines.append(f"pool {pool!r}: {' + '.join(on)} = {_gb(total)} GB per GPU{share}")
    ro = next((r for r in plan.roles if r.role == "rollout"), None)
    if ro is not None:
        demand = math.ceil(plan.sequences / ro.dp)
        lines.append(f"rollout KV cache: {ro.kv_sequences} sequences of {plan.seq_len} tokens at once per engine "
                     f"({demand} per engine per step; {ro.notes[0]})")
    for r in plan.roles:
        for note in r.notes[(1 if r.role == "rollout" else 0):]:
            lines.append(f"{r.role}: {note}")
    if plan.device == "cpu":
        lines.append(cpu_process_note(engines=ro is not None))
    return "\n".join(lines)


# What the cpu profile's figures leave out: each process's own memory before its tensors. Measured on the
# SmolLM2 job (AMD 2-vCPU box, 2026-12-06): a Megatron rank's RSS after init less its weights and gradient
# buffer, 445 MiB as a local process and ~500 MiB as a Ray actor; a vLLM engine's process with torch and
# vLLM imported, 603 MiB. docs/cpu-profile.md ("What `rlx plan` counts on the cpu profile").
CPU_RANK_PROCESS = "~0.5 GB per Megatron rank (python, torch, megatron-core, gloo, Ray's worker)"
CPU_ENGINE_PROCESS = ("~0.6 GB per vLLM engine (torch and vLLM imported), which also holds a prepacked copy of its "
                      "linear weights with rollout.cpu_prepack")


def cpu_process_note(engines: bool) -> str:
    """The cpu profile's line under `rlx plan`'s table: what its GB leave out (the engines' part only where
    the job has engines)."""
    return (f"cpu profile: the GB above are tensors only; each process adds its own: {CPU_RANK_PROCESS}"
            + (f" and {CPU_ENGINE_PROCESS}" if engines else ""))


# --------------------------------------------------------------------------------------- suggest
@dataclass
class Candidate:
    actor: RoleLayout
    critic: Optional[RoleLayout]
    rollout_tp: int
    rollout_engines: int
    plan: Plan
    rollout_s: float
    train_s: float
    sync_s: float

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.train_s + self.sync_s


def _valid_tps(m: ModelDims, gpus_per_node: int) -> list[int]:
    return [t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node and gpus_per_node % t == 0 and not m.heads % t
            and not m.kv_heads % t and not m.ffn % t and not m.vocab % t]


def _pool_sizes(total: int, gpus_per_node: int, nodes: int) -> list[int]:
    """Pool sizes worth trying: whole nodes on a multi-node allocation (a pool never shares a node's
    NVLink domain with another pool's traffic), powers of two inside a single node."""
    if nodes > 1:
        return [k * gpus_per_node for k in range(1, nodes)]
    return [g for g in (1, 2, 4, 8, 16) if g < total]


def _train_seconds(m: ModelDims, lay: RoleLayout, tokens: float, forward_passes: int, gpus_per_node: int,
                   microbatches: int, optimizer_steps: int, with_update: bool) -> float:
    """Compute at MFU of the pool's peak, stretched by the pipeline bubble, plus TP all-reduces on
    NVLink and the DP gradient all-reduce (over the network once the DP group spans nodes)."""
    params = m.total_params()
    flops = (6 if with_update else 0) * params * tokens + 2 * forward_passes * params * tokens
    bubble = (lay.pp - 1) / (lay.vpp * microbatches + lay.pp - 1)  # interleaving shrinks it vpp-fold
    # A pipeline runs at its slowest stage's pace: the last one also computes the output layer.
    layer = m.layer_params(1)
    output = m.vocab * m.hidden
    per_stage = [n * layer for n in lay.stage_layers(m.layers)]
    per_stage[-1] += output
    imbalance = max(per_stage) / (sum(per_stage) / lay.pp)
    compute = flops / (lay.gpus * PEAK_FLOPS * MFU) / (1 - bubble) * imbalance
    # Per layer: 2 all-reduces of [tokens, hidden] forward, 2 more backward (ring: 2(tp-1)/tp of it).
    allreduces = (4 if with_update else 0) + 2 * forward_passes
    tp_bytes = allreduces * max(lay.stage_layers(m.layers)) * (tokens / lay.dp) * m.hidden * 2 * 2 * (lay.tp - 1) / lay.tp
    tp_comm = tp_bytes / NVLINK_BYTES_S
    dp_comm = 0.0
    if with_update and lay.dp > 1:
        bw = NETWORK_BYTES_S if lay.gpus > gpus_per_node else NVLINK_BYTES_S
        grad_bytes = m.stage_params(lay.tp, lay.pp, 0) * 4 * 2 * (lay.dp - 1) / lay.dp
        dp_comm = optimizer_steps * grad_bytes / bw
    # PP: every micro-batch's [tokens, hidden] bf16 activations cross each stage boundary forward and
    # back, over NVLink inside a node and the network when a replica's TP x PP spans nodes.
    passes = (2 if with_update else 0) + forward_passes
    pp_bw = NETWORK_BYTES_S if lay.tp * lay.pp > gpus_per_node else NVLINK_BYTES_S
    pp_comm = passes * (lay.pp - 1) * (tokens / lay.dp) * m.hidden * 2 / pp_bw if lay.pp > 1 else 0.0
    return compute + tp_comm + dp_comm + pp_comm


def _rollout_seconds(m: ModelDims, ro: RoleEstimate, sequences: int, prompt_len: int, response_len: int) -> float:
    """Decode is memory-bound: each step reads the engine's weights shard and the KV cache of the
    sequences decoded together, plus two all-reduces per layer under TP; prefill is compute at MFU."""
    per_engine = math.ceil(sequences / ro.dp)
    together = max(1, min(per_engine, ro.kv_sequences, VLLM_MAX_NUM_SEQS))
    waves = math.ceil(per_engine / together)
    kv_token = 2 * m.layers * m.kv_heads_per_rank(ro.tp) * m.head_dim * 2
    kv_read = together * (prompt_len + response_len / 2) * kv_token
    # Roofline: a decode step is bound by reading the weights and KV, or by its FLOPs at a large batch.
    memory = (ro.weights + kv_read) / HBM_BYTES_S
    compute = 2 * m.total_params() * together / (ro.tp * PEAK_FLOPS * MFU)
    step = max(memory, compute) + (2 * m.layers * ALLREDUCE_LATENCY_S if ro.tp > 1 else 0.0)
    prefill = 2 * m.total_params() * per_engine * prompt_len / (ro.tp * PEAK_FLOPS * MFU)
    return waves * response_len * step + prefill


@dataclass
class Suggestions:
    best: list[Candidate]  # the top ones, fastest first
    tried: int  # layouts enumerated
    valid: int  # of which divide and fit
    spec_rank: Optional[int]  # where the spec's own layout ranks (1-based), None when it is not among them
    spec: Optional[Candidate]


def _is_spec_layout(c: Candidate, layout: JobLayout) -> bool:
    spec_critic = getattr(layout, "critic", None)
    same_critic = (c.critic is None and spec_critic is None) or (
        c.critic is not None and spec_critic is not None
        and (c.critic.gpus, c.critic.tp, c.critic.pp) == (spec_critic.gpus, spec_critic.tp, spec_critic.pp))
    return (same_critic and (c.actor.gpus, c.actor.tp, c.actor.pp) == (layout.actor.gpus, layout.actor.tp, layout.actor.pp)
            and (c.rollout_engines, c.rollout_tp) == (layout.rollout.engines, layout.rollout.tp))


def suggest(cfg, layout: JobLayout, gpus_per_node: int, nodes: int, top: int = 10) -> Suggestions:
    """Every layout of the spec's model and batch on ``nodes`` x ``gpus_per_node`` GPUs that divides
    and fits, ranked by the estimated seconds per step (fastest first)."""
    m, source = model = read_model(cfg)
    total = gpus_per_node * nodes
    prompt_len, response_len = cfg.data.max_prompt_length, cfg.rollout.max_response_length
    sequences = cfg.data.batch_size * cfg.rollout.n
    tokens = sequences * (prompt_len + response_len)
    _, optimizer_steps = _updates(cfg, cfg.actor)
    has_critic = getattr(layout, "critic", None) is not None
    tps = _valid_tps(m, gpus_per_node)
    sizes = _pool_sizes(total, gpus_per_node, nodes)
    tried, found = 0, []
    for actor_gpus in sizes:
        for critic_gpus in (sizes if has_critic else [0]):
            rollout_gpus = total - actor_gpus - critic_gpus
            if rollout_gpus < 1:
                continue
            for tp, pp, rtp, ctp, cpp in itertools.product(
                    tps, _divisors(m.layers), [t for t in tps], tps if has_critic else [1],
                    _divisors(m.layers) if has_critic else [1]):
                tried += 1
                cand = _candidate(cfg, layout, model, actor_gpus, critic_gpus, rollout_gpus, tp, pp, rtp, ctp, cpp,
                                  gpus_per_node, nodes, tokens, sequences, prompt_len, response_len, optimizer_steps)
                if cand is not None:
                    found.append(cand)
    found.sort(key=lambda c: c.step_s)
    rank = next((i for i, c in enumerate(found, 1) if _is_spec_layout(c, layout)), None)
    return Suggestions(found[:top], tried, len(found), rank, found[rank - 1] if rank else None)


def _divisors(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16) if not n % d]


def _candidate(cfg, layout, model, actor_gpus, critic_gpus, rollout_gpus, tp, pp, rtp, ctp, cpp, gpus_per_node,
               nodes, tokens, sequences, prompt_len, response_len, optimizer_steps) -> Optional[Candidate]:
    m = model[0]
    if actor_gpus % (tp * pp) or rollout_gpus % rtp or (critic_gpus and critic_gpus % (ctp * cpp)):
        return None
    step_sequences, _ = _updates(cfg, cfg.actor)
    critic_sequences, critic_steps = _updates(cfg, resolved_critic(cfg))
    actor = RoleLayout(pool="actor", gpus=actor_gpus, tp=tp, pp=pp, dp=actor_gpus // (tp * pp))
    if step_sequences % (actor.dp * cfg.actor.micro_batch_size):
        return None
    critic = None
    if critic_gpus:
        critic = RoleLayout(pool="critic", gpus=critic_gpus, tp=ctp, pp=cpp, dp=critic_gpus // (ctp * cpp))
        if critic_sequences % (critic.dp * cfg.critic.micro_batch_size):
            return None
    pools = {"actor": actor_gpus, "rollout": rollout_gpus, **({"critic": critic_gpus} if critic else {})}
    trial_cfg = replace(cfg, resources=replace(cfg.resources, pools=pools, nodes=nodes, gpus_per_node=gpus_per_node))
    trial = replace(layout, actor=actor,
                    reference=replace(actor, pool="actor") if layout.reference is not None else None,
                    rollout=replace(layout.rollout, pool="rollout", gpus=rollout_gpus, engines=rollout_gpus // rtp,
                                    tp=rtp))
    if critic is not None:
        trial = replace(trial, critic=critic)
    plan = estimate(trial_cfg, trial, model)
    try:
        check(plan, trial_cfg)
    except PlanError:
        return None
    ro = next(r for r in plan.roles if r.role == "rollout")
    forward = 1 + (layout.reference is not None)  # old log-probs, reference log-probs
    microbatches = max(1, step_sequences // (actor.dp * cfg.actor.micro_batch_size))
    train = _train_seconds(m, actor, tokens, forward, gpus_per_node, microbatches, optimizer_steps, True)
    if critic is not None:
        train += _train_seconds(m, critic, tokens, 1, gpus_per_node, microbatches, critic_steps, True)
    # Weight sync: the full bf16 model crosses from the actor's nodes to the rollout's.
    sync = m.total_params() * 2 / (NETWORK_BYTES_S if nodes > 1 else NVLINK_BYTES_S)
    return Candidate(actor=actor, critic=critic, rollout_tp=rtp, rollout_engines=rollout_gpus // rtp, plan=plan,
                     rollout_s=_rollout_seconds(m, ro, sequences, prompt_len, response_len), train_s=train,
                     sync_s=sync)


COST_MODEL = f"""cost model (seconds per step, to rank layouts; not a forecast):
  rollout = waves x response tokens x decode step + prefill at {MFU:.0%} MFU; a decode step is the larger of
            (weights/TP + KV read) / HBM {HBM_BYTES_S / 1e12:g} TB/s and its FLOPs at {MFU:.0%} MFU, plus 2 all-reduces
            per layer when rollout.tp > 1; waves = sequences per engine / what its KV cache decodes together
            (at most {VLLM_MAX_NUM_SEQS})
  train   = (6 update + 2 per forward pass) x params x tokens / (GPUs x {PEAK_FLOPS / 1e12:g} TFLOP/s x {MFU:.0%})
            / (1 - PP bubble (pp-1)/(microbatches+pp-1)) x slowest stage / mean stage (the last stage also
            computes the output layer) + TP all-reduces at {NVLINK_BYTES_S / 1e9:g} GB/s + PP activation sends
            + DP gradient all-reduce ({NETWORK_BYTES_S / 1e9:g} GB/s once the pool spans nodes)
  sync    = the bf16 model once over the network ({NETWORK_BYTES_S / 1e9:g} GB/s per GPU)
  pools are whole nodes on more than one node; every layout shown divides the model and the batch and
  fits {TRAIN_MEMORY_SHARE:.0%} of resources.gpu_memory_gb with the spec's micro-batch, sequence length and
  optimizer settings."""


def format_suggestions(s: Suggestions, gpus_per_node: int, nodes: int) -> str:
    cands, tried = s.best, s.tried
    if not cands:
        return (f"no layout on {nodes} x {gpus_per_node} GPUs divides and fits ({tried} tried); raise "
                "resources.gpu_memory_gb, lower the micro-batch size or the sequence length, or add nodes")
    head = ("#", "actor pool", "tp", "pp", "dp", "critic pool", "rollout pool", "engines x tp", "train GB/GPU",
            "kv seqs", "rollout s", "train s", "sync s", "step s")
    rows = [head]
    for i, c in enumerate(cands, 1):
        totals = c.plan.pool_totals()
        ro = next(r for r in c.plan.roles if r.role == "rollout")
        rows.append((i, c.actor.gpus, c.actor.tp, c.actor.pp, c.actor.dp,
                     f"{c.critic.gpus} (tp{c.critic.tp} pp{c.critic.pp})" if c.critic else "-",
                     ro.gpus, f"{c.rollout_engines} x {c.rollout_tp}", f"{totals['actor'] / GB:.1f}",
                     ro.kv_sequences, f"{c.rollout_s:.0f}", f"{c.train_s:.0f}", f"{c.sync_s:.1f}", f"{c.step_s:.0f}"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = [f"the {len(cands)} best of {s.valid} layouts on {nodes} x {gpus_per_node} GPUs that divide and fit "
             f"({tried} tried):"]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if s.spec_rank is not None:
        lines.append(f"the spec's own layout ranks #{s.spec_rank} of {s.valid} ({s.spec.step_s:.0f} s per step)")
    else:
        lines.append("the spec's own layout is not among them (other pools or nodes, or it does not fit)")
    return "\n".join(lines + ["", COST_MODEL])


# ----------------------------------------------------------------------- suggest: the cpu profile
# The cpu profile's constants, measured on the 2-core x86-64 development machine (torch 2.13.0+cpu,
# megatron-core 0.16.1) by `rlx plan yaml_configs/smollm2_math_cpu.yaml --suggest --calibrate`, which
# measures them again on any machine (launch/calibrate.py says how).
CPU_CALIBRATION = {
    "matmul_flops": 7.9e10,  # fp32 torch matmul on one thread, FLOP/s
    "microbatch_s": 1.5e-3,  # one more micro-batch of megatron's 1F1B schedule, per stage (forward + backward)
    "microbatch_forward_s": 4.1e-4,  # ... forward only
    "layer_s": 3.6e-3,  # ... and per layer of a stage (forward + backward)
    "layer_forward_s": 1.9e-3,  # ... forward only
    "allreduce_s": 1.6e-4,  # gloo all-reduce latency
    "allreduce_bytes_s": 2.8e9,  # gloo all-reduce bandwidth
    # torch's fused AdamW step per fp32 parameter, one thread. That run measured the python-loop Adam the
    # workers ran then (1.7e-9); this is it scaled by fused / loop measured side by side on a 2-core Intel
    # Xeon (1.0-1.2 against 6.3-6.6 ns per parameter, 2026-12-04).
    "adam_s_per_param": 3.0e-10,
    "softmax_s_per_element": 3.3e-9,  # log-softmax + entropy over fp32 rows, per element, one thread
    # What each math thread past the first adds, as a fraction of one thread's rate (1 = linear). Not
    # from --calibrate's micro-benchmarks, which read 0.66-0.91 (a layer's matmuls) and 0.76-1.0 (the
    # softmax pass) in three runs on a 2-core AMD EPYC: inside a whole update they gain less.
    # torch.profiler's op table of one rank's SmolLM2 update at one and at two threads, the same kept
    # batches (that box, 2026-12-06): aten::mm 5.41 -> 3.10 s (1.75x); aten::_softmax, its backward
    # and exp_ 1.5-1.9x.
    "matmul_thread_gain": 0.75,
    "softmax_thread_gain": 0.6,
}


@dataclass
class CpuCandidate:
    actor: RoleLayout  # its ``gpus``: the size of the actor's pool (resources.pools.<actor.pool>)
    threads: int  # each actor rank's math threads (launch/compose.py job_threads)
    micro_batch_size: int
    microbatches: int  # per DP rank per optimizer step
    logprob_s: float  # the forward passes (old log-probs, the reference's when it takes the actor's layout)
    update_s: float
    memory: float  # bytes of host memory the actor's ranks hold together (the worst stage's estimate x ranks)

    @property
    def train_s(self) -> float:
        return self.logprob_s + self.update_s

    def overrides(self, pool_name: str) -> list[str]:
        """The dotted overrides that give a job this layout."""
        a = self.actor
        split = "null" if a.pp_layers is None else f"[{','.join(map(str, a.pp_layers))}]"
        return [f"resources.pools.{pool_name}={a.gpus}", f"actor.tp={a.tp}", f"actor.pp={a.pp}",
                f"actor.pp_layers={split}", f"actor.micro_batch_size={self.micro_batch_size}"]


@dataclass
class CpuSuggestions:
    best: list[CpuCandidate]
    valid: int
    spec_rank: Optional[int]
    spec: Optional[CpuCandidate]
    pool_sizes: list[int]  # the actor pool sizes tried
    cores: int
    constants: dict
    measured: bool  # constants measured in this run (--calibrate), else the stored CPU_CALIBRATION
    seq_len: int
    layers: int
    memory_gb: Optional[float] = None
    refused: dict[int, str] = field(default_factory=dict)  # pool size -> why no layout on it validated


def _stage_splits(layers: int, pp: int) -> list[Optional[tuple[int, ...]]]:
    """None (the even split, when pp divides the layers) and every uneven split megatron-core takes:
    any first and last stage count, the middle stages equal."""
    out: list[Optional[tuple[int, ...]]] = [None] if not layers % pp else []
    if pp == 1:
        return out
    for first in range(1, layers):
        for last in range(1, layers - first + 1):
            middle = layers - first - last
            if pp == 2 and middle == 0 or pp > 2 and middle >= pp - 2 and not middle % (pp - 2):
                split = (first, *[middle // (pp - 2)] * (pp - 2), last) if pp > 2 else (first, last)
                if len(set(split)) > 1:
                    out.append(split)
    return out


def _pipeline_seconds(stage_s: list[float], microbatches: int) -> float:
    """1F1B (and a plain forward pipeline): the first micro-batch crosses every stage, the others
    follow at the slowest stage's pace."""
    return sum(stage_s) + (microbatches - 1) * max(stage_s)


@dataclass
class MicroBatchShape:
    """What the model runs for one micro-batch: ``rows`` rows of ``row_len`` tokens, of which
    ``scored`` positions reach the output layer (megatron_workers/packing.py)."""
    rows: int
    row_len: int
    scored: int
    masked: bool = False  # shared-prompt rows: an explicit [row_len, row_len] mask (gpu: TE's unfused attention)

    @property
    def tokens(self) -> int:
        return self.rows * self.row_len

    @classmethod
    def of(cls, mbs: int, prompt_len: int, response_len: int, n: int, shared_prompt: bool) -> "MicroBatchShape":
        """``mbs`` sequences of a ``prompt_len``-token prompt and a ``response_len``-token response;
        with ``shared_prompt``, the rows of one prompt (``n`` per group) as one row, the prompt once."""
        if not shared_prompt:
            return cls(mbs, prompt_len + response_len, mbs * response_len)
        groups = max(1, -(-mbs // n))  # a micro-batch of part of a group still runs the prompt once
        return cls(groups, prompt_len + -(-mbs // groups) * response_len, mbs * response_len, masked=True)


def _thread_speedup(share: float, gain: float) -> float:
    """How many times one thread's rate a rank computes at with ``share`` cores' worth of threads:
    under one core (more ranks than cores) its time slice; above, each thread past the first adds
    ``gain`` of one thread's rate (a calibrated constant: a second thread does not quite double a
    matmul of a micro-batch's shape)."""
    return share if share <= 1 else 1 + gain * (share - 1)


def _cpu_pass_seconds(m: ModelDims, lay: RoleLayout, shape: MicroBatchShape, microbatches: int, share: float,
                      c: dict, train: bool) -> float:
    """One forward (``train``: forward + backward) pass of ``microbatches`` micro-batches per DP rank,
    each rank computing with ``share`` cores' worth of math threads."""
    tokens, rows, row_len = shape.tokens, shape.rows, shape.row_len
    # The local attention computes the whole [row_len, row_len] score matrix of a row (masked).
    layer_flops = (2 * m.layer_params(1) * tokens + 4 * rows * row_len * row_len * m.heads * m.head_dim) / lay.tp
    output_flops = 2 * m.vocab * m.hidden * shape.scored / lay.tp  # only the scored positions
    # Memory-bound elementwise work: the attention softmax over [heads, s, s] per layer, the LM head's
    # log-softmax and entropy over [scored, vocab]; in seconds at one thread.
    layer_softmax_s = rows * m.heads / lay.tp * row_len * row_len * c["softmax_s_per_element"]
    output_softmax_s = shape.scored * m.vocab / lay.tp * c["softmax_s_per_element"]
    factor = 3 if train else 1  # the backward is twice the forward
    allreduces = 4 if train else 2  # per layer per micro-batch under TP
    ar = 0.0
    if lay.tp > 1:
        ar = allreduces * (c["allreduce_s"] + tokens * m.hidden * 4 * 2 * (lay.tp - 1) / lay.tp / c["allreduce_bytes_s"])
    overhead, per_layer = (c["microbatch_s"], c["layer_s"]) if train else (c["microbatch_forward_s"],
                                                                          c["layer_forward_s"])
    rate = c["matmul_flops"] * _thread_speedup(share, c["matmul_thread_gain"])
    softmax_speedup = _thread_speedup(share, c["softmax_thread_gain"])
    stage_s = []
    for s, n in enumerate(lay.stage_layers(m.layers)):
        last = s == lay.pp - 1
        flops = n * layer_flops + (output_flops if last else 0.0)
        elementwise = n * layer_softmax_s + (output_softmax_s if last else 0.0)
        # Launches, autograd and Python run at one thread's pace, or the rank's time slice of one.
        fixed = (n * (ar + per_layer) + overhead) / min(1.0, share)
        stage_s.append(factor * (flops / rate + elementwise / softmax_speedup) + fixed)
    return _pipeline_seconds(stage_s, microbatches)


def _cpu_optimizer_seconds(m: ModelDims, lay: RoleLayout, c: dict) -> float:
    """After the pass: DP's gradient all-reduce, then Adam over the largest stage's parameters."""
    params = max(m.stage_params(lay.tp, lay.pp, s, pp_layers=lay.pp_layers) for s in range(lay.pp))
    dp = 0.0
    if lay.dp > 1:
        dp = c["allreduce_s"] + params * 4 * 2 * (lay.dp - 1) / lay.dp / c["allreduce_bytes_s"]
    return dp + params * c["adam_s_per_param"]


def suggest_cpu(cfg, layout: JobLayout, top: int = 10, constants: Optional[dict] = None,
                cores: Optional[int] = None, memory_gb: Optional[float] = None,
                pool_sizes: Optional[list[int]] = None) -> CpuSuggestions:
    """Every actor layout (tp, pp, the stage splits, micro_batch_size) that ``rlx validate`` accepts on
    the spec's actor pool, or on pools of each of ``pool_sizes`` logical GPUs, ranked by the cpu cost
    model's seconds of the actor's passes per step; with ``memory_gb``, only those whose actor ranks
    hold at most that much host memory together (the pools share the host's memory: a DP replica
    holds the whole model, its gradients and Adam's state). A smaller pool has fewer ranks, each with
    more math threads."""
    from launch.compose import concurrent_processes, job_threads

    c = {**CPU_CALIBRATION, **(constants or {})}
    m, source = read_model(cfg)
    cores = cores or cfg.resources.num_cpus or os.cpu_count() or 1
    seq_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    step_sequences, optimizer_steps = _updates(cfg, cfg.actor)
    batch_sequences = cfg.data.batch_size * cfg.rollout.n
    pool_name = cfg.actor.pool
    sizes = sorted(set(pool_sizes or [layout.actor.gpus]))
    reference_inherits = layout.reference is not None and cfg.reference.tp is None and cfg.reference.pp is None
    on_policy = on_policy_update(cfg) or cfg.actor.use_rollout_logprobs
    found = []
    refused = {}
    for size in sizes:
        valid_here = 0
        resources = replace(cfg.resources, num_cpus=cores, pools={**cfg.resources.pools, pool_name: size})
        for tp in [t for t in _valid_tps(m, size) if not size % t]:
            for pp in [p for p in range(1, size // tp + 1) if not (size // tp) % p and p <= m.layers]:
                for split in _stage_splits(m.layers, pp):
                    for mbs in [b for b in range(1, step_sequences + 1) if not step_sequences % b]:
                        trial = replace(cfg, resources=resources, actor=replace(cfg.actor, tp=tp, pp=pp,
                                                                                  pp_layers=split,
                                                                                  micro_batch_size=mbs))
                        try:
                            trial_layout = validate(trial)
                        except ConfigError as e:
                            refused.setdefault(size, str(e))
                            continue
                        valid_here += 1
                        lay = trial_layout.actor
                        # Its ranks' threads as the job would start them; each rank computes with its
                        # threads, or with its fraction of the cores where more processes compute at
                        # once than there are cores (the engines beside the actor when sampling ahead).
                        threads = job_threads(trial, trial_layout)["actor"]
                        share = min(threads, cores / concurrent_processes(trial, trial_layout)["actor"])
                        microbatches = step_sequences // (lay.dp * mbs)
                        shape = MicroBatchShape.of(mbs, cfg.data.max_prompt_length, cfg.rollout.max_response_length,
                                                   cfg.rollout.n, cfg.actor.shared_prompt)
                        update = optimizer_steps * (_cpu_pass_seconds(m, lay, shape, microbatches, share, c, True)
                                                    + _cpu_optimizer_seconds(m, lay, c))
                        # The on-policy update needs no separate old-log-prob pass; the reference's stays.
                        forward_passes = (0 if on_policy else 1) + reference_inherits
                        batch_microbatches = max(1, batch_sequences // (lay.dp * mbs))
                        logprob = forward_passes * _cpu_pass_seconds(m, lay, shape, batch_microbatches, share, c,
                                                                     False)
                        memory = estimate(trial, trial_layout, (m, source)).roles[0].total * size
                        if memory_gb is not None and memory > memory_gb * GB:
                            continue
                        found.append(CpuCandidate(lay, threads, mbs, microbatches, logprob, update, memory))
        if valid_here:
            refused.pop(size, None)
    found.sort(key=lambda x: x.train_s)
    a = layout.actor
    spec_key = (a.gpus, a.tp, a.pp, a.pp_layers, cfg.actor.micro_batch_size)
    rank = next((i for i, x in enumerate(found, 1)
                 if (x.actor.gpus, x.actor.tp, x.actor.pp, x.actor.pp_layers, x.micro_batch_size) == spec_key), None)
    return CpuSuggestions(found[:top], len(found), rank, found[rank - 1] if rank else None, sizes, cores, c,
                          constants is not None, seq_len, m.layers, memory_gb, refused)


def format_cpu_suggestions(s: CpuSuggestions, cfg) -> str:
    pool_name = cfg.actor.pool
    sizes = " or ".join(map(str, s.pool_sizes))
    refusals = [f"no actor layout on a pool of {n} logical GPUs passes rlx validate; the first refusal: {why}"
                for n, why in sorted(s.refused.items())]
    if not s.best:
        return "\n".join([f"no actor layout on {sizes} logical GPUs divides the model and the batch"
                          + ("" if s.memory_gb is None else f" and fits --memory-gb {s.memory_gb:g}")] + refusals)
    head = ("#", "GPUs", "threads", "tp", "pp", "dp", "layers per stage", "micro_batch_size", "micro-batches",
            "actor GB", "log-prob s", "update s", "actor s")
    rows = [head]
    for i, x in enumerate(s.best, 1):
        layers = "|".join(map(str, x.actor.stage_layers(s.layers))) if x.actor.pp > 1 else "-"
        rows.append((i, x.actor.gpus, x.threads, x.actor.tp, x.actor.pp, x.actor.dp,
                     layers + ("" if x.actor.pp_layers or x.actor.pp == 1 else " (even)"), x.micro_batch_size,
                     x.microbatches, f"{x.memory / GB:.1f}", f"{x.logprob_s:.2f}", f"{x.update_s:.2f}",
                     f"{x.train_s:.2f}"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    budget = "" if s.memory_gb is None else f" within {s.memory_gb:g} GB of host memory for the actor"
    lines = [f"the {len(s.best)} best of {s.valid} actor layouts{budget} on pool {pool_name!r} of {sizes} logical "
             f"GPUs ({s.cores} cores; GPUs = resources.pools.{pool_name}, threads = each rank's math threads):"]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if s.spec_rank is not None:
        lines.append(f"the spec's own layout ranks #{s.spec_rank} of {s.valid} ({s.spec.train_s:.2f} s)")
    else:
        lines.append("the spec's own layout is not among them")
    if s.spec_rank != 1:
        lines.append("#1 as overrides: " + " ".join(s.best[0].overrides(pool_name)))
    lines += refusals
    lines.append(f"actor GB: the ranks' tensors only (weights, gradients, Adam state, activations); each rank's "
                 f"process adds its own, {CPU_RANK_PROCESS}")
    k = s.constants
    lines += ["", f"""cpu cost model (the actor's seconds per step, to rank layouts; docs/cpu-profile.md compares it with
measured steps):
  a pass = 1F1B over the stages: sum of the stage times + (micro-batches - 1) x the slowest stage's;
  stage time per micro-batch = (3 with the backward, else 1) x FLOPs / (matmul rate x speedup) + TP
  all-reduces + megatron's per-micro-batch cost per stage and per layer; speedup = 1 + gain x (threads - 1)
  (each rank's threads as `rlx train` starts them), or, where more processes compute at once than there are
  cores, the rank's share of a core, which also stretches the per-micro-batch and per-layer costs; FLOPs = 2 x params x tokens per layer + attention
  4 x rows x row length^2 x hidden, + the output layer on the last stage at the scored (response) positions only;
  rows of data.max_prompt_length + rollout.max_response_length = {s.seq_len} tokens, or with actor.shared_prompt one
  row per prompt in the micro-batch (the prompt once, then its responses); lengths are the maximum, padding to the
  longest is not known here; the on-policy update needs no separate log-prob pass;
  + softmax passes over the attention scores and the LM head's vocabulary at {k['softmax_s_per_element'] * 1e9:.1f} ns per element
  constants: matmul {k['matmul_flops'] / 1e9:.0f} GFLOP/s per thread, and {k['matmul_thread_gain']:.2f} of that per extra thread
  (softmax {k['softmax_thread_gain']:.2f}); {k['microbatch_s'] * 1e3:.1f} ms per micro-batch and stage + {k['layer_s'] * 1e3:.2f} ms per layer
  ({k['microbatch_forward_s'] * 1e3:.1f} + {k['layer_forward_s'] * 1e3:.2f} ms forward only); all-reduce {k['allreduce_s'] * 1e6:.0f} us + {k['allreduce_bytes_s'] / 1e9:.1f} GB/s
  ({'measured now' if s.measured else 'stored: measured on the 2-core development machine; --calibrate measures them here'})
  + per optimizer step: DP's gradient all-reduce and Adam over the largest stage's parameters
  ({k['adam_s_per_param'] * 1e9:.1f} ns per parameter); the rollout and the weight sync are the same for
  every actor layout here and not counted; actor GB: `rlx plan`'s memory estimate of the worst stage x ranks"""]
    return "\n".join(lines)
