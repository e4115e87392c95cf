"""`rlx plan`: parameter counts equal megatron-core's, the memory model's arithmetic, the real job specs,
one-sentence refusals, and `--suggest`."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket

import pytest

from launch import plan
from launch.cli import main as rlx
from rlcore.job import load_job
from rlcore.validate import validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = {
    "grpo_qwen2.5_7b_2x8": "yaml_configs/grpo_qwen2.5_7b_2x8.yaml",
    "ppo_llama3.1_8b_4x8": "yaml_configs/ppo_llama3.1_8b_4x8.yaml",
    "grpo_qwen2.5_32b_8x8": "yaml_configs/grpo_qwen2.5_32b_8x8.yaml",
}
# (tp, pp, critic, pp_layers) layouts built in one world of 2 CPU processes: the TP split and the PP
# split (where tied embeddings get a second copy on the last stage), even and uneven (megatron's
# first/last-stage counts), for the actor's model and the critic's.
LAYOUTS = [(1, 1, False, None), (2, 1, False, None), (1, 2, False, None), (1, 2, False, (1, 3)),
           (2, 1, True, None), (1, 2, True, None), (1, 2, True, (3, 1))]
WORLD = 2


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the specs name their hf_config relative to the repository


def _megatron_param_counts(rank: int, port: int, models: dict, queue) -> None:
    """One rank: for every model and layout, build megatron's GPTModel stage and count its parameters."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from megatron_workers.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    from megatron.core import parallel_state

    from megatron_workers.model import build_gpt_model, read_hf_config, transformer_config

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    counts = []
    for name, path in models.items():
        hf = read_hf_config(path)
        for tp, pp, critic, pp_layers in LAYOUTS:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            model = build_gpt_model(hf, transformer_config(hf, "cpu", "float32", tp, pp, pp_layers=pp_layers), "cpu",
                                    value_head_seed=1 if critic else None)
            counts.append((name, tp, pp, critic, pp_layers, parallel_state.get_pipeline_model_parallel_rank(),
                           sum(p.numel() for p in model.parameters())))
            parallel_state.destroy_model_parallel()
    dist.barrier()
    queue.put(counts)
    queue.close()
    queue.join_thread()
    os._exit(0)  # skip interpreter teardown: gloo and megatron threads can hold it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_parameter_counts_per_rank_equal_megatron_core(qwen2_untied, llama_tied):
    """Every rank's sum(p.numel()) of megatron's GPTModel (TP/PP splits, untied and tied embeddings, the
    critic's value head) equals the planner's count for that rank's pipeline stage."""
    models = {"qwen2_untied": qwen2_untied, "llama_tied": llama_tied}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_megatron_param_counts, args=(r, port, models, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [row for _ in procs for row in queue.get(timeout=600)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(results) == WORLD * len(models) * len(LAYOUTS)
    for name, tp, pp, critic, pp_layers, stage, numel in results:
        with open(os.path.join(models[name], "config.json")) as f:
            dims = plan.ModelDims.from_hf(json.load(f), name)
        assert dims.stage_params(tp, pp, stage, value_head=critic, pp_layers=pp_layers) == numel, \
            (name, tp, pp, critic, pp_layers, stage)


@pytest.mark.parametrize("config,params", [
    ("qwen2.5-7b-instruct.json", 7_615_616_512),  # Qwen2.5-7B: 7.62B
    ("llama-3.1-8b-instruct.json", 8_030_261_248),  # Llama-3.1-8B: 8.03B
    ("qwen2.5-32b-instruct.json", 32_763_876_352),  # Qwen2.5-32B: 32.76B
])
def test_real_models_have_their_published_sizes(config, params):
    with open(os.path.join("yaml_configs/hf_configs", config)) as f:
        dims = plan.ModelDims.from_hf(json.load(f), config)
    assert dims.total_params() == params
    # Split over TP x PP, the shards add up to the model again, plus what every TP rank replicates
    # (the two norms per layer and the final norm).
    tp, pp = 4, 2
    replicated = (tp - 1) * (2 * dims.hidden * dims.layers + dims.hidden)
    assert tp * sum(dims.stage_params(tp, pp, s) for s in range(pp)) == params + replicated


def _plan_of(spec, *overrides):
    cfg = load_job(spec, list(overrides))
    return cfg, plan.estimate(cfg, validate(cfg))


def test_memory_figures_follow_the_workers_settings():
    cfg, p = _plan_of(SPECS["grpo_qwen2.5_7b_2x8"])
    actor = next(r for r in p.roles if r.role == "actor")
    assert (actor.tp, actor.pp, actor.dp) == (2, 1, 4)
    # 28 layers / TP 2 (norms replicated) + both vocab-parallel embeddings + the final norm
    assert actor.params == 28 * 116_532_480 + 2 * 272_498_688 + 3584 == 3_807_910_400
    assert actor.weights == actor.params * 2  # bf16
    assert actor.grads == actor.params * 4  # fp32 main_grad (grad_reduce_in_fp32)
    assert actor.optimizer == actor.params * 12 / 4  # fp32 master + Adam m, v, split over DP=4
    _, plain = _plan_of(SPECS["grpo_qwen2.5_7b_2x8"], "actor.optim.use_distributed_optimizer=false")
    assert next(r for r in plain.roles if r.role == "actor").optimizer == actor.params * 12
    # Activations grow linearly with the micro-batch, the reference holds no gradients or optimizer.
    _, mb4 = _plan_of(SPECS["grpo_qwen2.5_7b_2x8"], "actor.micro_batch_size=4")
    assert next(r for r in mb4.roles if r.role == "actor").activations == pytest.approx(2 * actor.activations)
    ref = next(r for r in p.roles if r.role == "reference")
    assert ref.grads == ref.optimizer == 0
    # The rollout: utilization x GPU = weights + reserve + KV cache; KV per sequence of 3072 tokens is
    # K and V x 28 layers x 2 KV heads per TP rank (4 / TP 2) x 128 x bf16.
    ro = next(r for r in p.roles if r.role == "rollout")
    assert ro.weights + ro.activations + ro.kv_cache == pytest.approx(0.85 * 80e9)
    assert ro.kv_sequences == int(ro.kv_cache // (2 * 28 * 2 * 128 * 2 * 3072))


def test_shared_prompt_rows_on_the_gpu_profile_count_the_unfused_attentions_probabilities():
    """The gpu profile's shared-prompt rows run TE's unfused attention, which keeps [heads, L, L]
    probabilities per layer (bf16, and fp32 from the softmax: 6 bytes an element, the bound); the plain
    rows' fused attention keeps none."""
    spec = SPECS["grpo_qwen2.5_7b_2x8"]  # actor TP2, 28 layers, 28 heads; micro-batch 2 of a group of 8
    cfg, plain = _plan_of(spec)
    _, shared = _plan_of(spec, "actor.shared_prompt=true")
    shape = plan.MicroBatchShape.of(2, 1024, 2048, 8, shared_prompt=True)
    assert (shape.rows, shape.row_len, shape.masked) == (1, 1024 + 2 * 2048, True)  # 2 rows of 3072 before
    m, _ = plan.read_model(cfg)
    linear = plan._activation_bytes_per_token_layer(m, 2, "gpu", 0, 2)  # per token, whatever the length
    probabilities = (28 / 2) * 5120 * (2 + 4)
    assert plan._activation_bytes_per_token_layer(m, 2, "gpu", 5120, 2, masked=True) == linear + probabilities
    a_plain, a_shared = (next(r for r in p.roles if r.role == "actor") for p in (plain, shared))
    assert a_shared.activations - a_plain.activations == pytest.approx(
        28 * (5120 * (linear + probabilities) - 2 * 3072 * linear))


@pytest.mark.parametrize("name", SPECS)
def test_real_specs_validate_and_plan_here(name, capsys):
    assert rlx(["validate", SPECS[name]]) == 0
    assert "is not on this machine: checked against model.hf_config" in capsys.readouterr().out
    assert rlx(["plan", SPECS[name]]) == 0
    out = capsys.readouterr().out
    assert "role       pool" in out and "params/GPU" in out and "kv cache" in out
    assert "fits: every pool is within its GPU memory" in out and "tensors only" not in out
    roles = {line.split()[0] for line in out.splitlines() if line.split()[:1] in (["actor"], ["rollout"], ["critic"])}
    assert roles == ({"actor", "rollout", "critic"} if name.startswith("ppo") else {"actor", "rollout"})


@pytest.mark.parametrize("spec,overrides,message", [
    ("ppo_llama3.1_8b_4x8", ["actor.tp=16"],
     "actor.tp=16 does not divide the model's 8 key-value heads (model.hf_config="
     "yaml_configs/hf_configs/llama-3.1-8b-instruct.json: num_key_value_heads)"),
    ("grpo_qwen2.5_7b_2x8", ["actor.tp=4", "actor.pp=4"],
     "actor.tp*actor.pp=4*4=16 does not divide the 8 GPUs of pool 'actor' (resources.pools.actor=8)"),
    ("grpo_qwen2.5_7b_2x8", ["actor.optim.use_distributed_optimizer=false"],
     "pool 'actor' needs 94.0 GB per GPU (actor 84.1 + reference 10.0), more than 90% of "
     "resources.gpu_memory_gb=80"),
    ("grpo_qwen2.5_32b_8x8", ["rollout.tp=1", "rollout.engines=32"],
     "rollout.tp=1: the model's weights (65.5 GB per GPU) and vLLM's reserve"),
    ("grpo_qwen2.5_32b_8x8", ["resources.nodes=4"],
     "resources.pools need 64 GPUs but resources.nodes*resources.gpus_per_node=4*8=32"),
])
def test_plan_refuses_with_one_sentence_naming_the_key(spec, overrides, message, capsys):
    assert rlx(["plan", SPECS[spec], *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err


def test_hf_config_inline_or_as_a_path(tmp_path, capsys):
    """model.hf_config stands in for a model folder that is not here; inline or as a path, the same plan."""
    with open("yaml_configs/hf_configs/qwen2.5-7b-instruct.json") as f:
        hf = json.load(f)
    import yaml

    with open(SPECS["grpo_qwen2.5_7b_2x8"]) as f:
        spec = yaml.safe_load(f)
    spec["model"]["hf_config"] = hf
    inline = tmp_path / "inline.yaml"
    inline.write_text(yaml.safe_dump(spec))
    assert rlx(["plan", str(inline)]) == 0
    inline_out = capsys.readouterr().out
    assert "(model.hf_config (inline))" in inline_out
    assert rlx(["plan", SPECS["grpo_qwen2.5_7b_2x8"]]) == 0
    path_out = capsys.readouterr().out
    table = lambda out: out[out.index("role "):]  # noqa: E731
    assert table(inline_out) == table(path_out)
    # Without model.hf_config, a model folder that is not here is still an error.
    assert rlx(["validate", SPECS["grpo_qwen2.5_7b_2x8"], "model.hf_config=null"]) == 2
    assert "model.path=/shared/models/Qwen2.5-7B-Instruct is not a folder" in capsys.readouterr().err
    # `rlx train` always needs the files.
    assert rlx(["train", SPECS["grpo_qwen2.5_7b_2x8"]]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_suggest_ranks_valid_layouts_and_explains_its_cost_model(capsys):
    cfg = load_job(SPECS["grpo_qwen2.5_7b_2x8"], [])
    found = plan.suggest(cfg, validate(cfg), gpus_per_node=8, nodes=2, top=100)
    assert found.valid == len(found.best) > 1
    steps = [c.step_s for c in found.best]
    assert steps == sorted(steps)
    for c in found.best:
        assert c.actor.tp * c.actor.pp * c.actor.dp == c.actor.gpus
        assert c.actor.tp in (1, 2, 4)  # 4 KV heads: TP 8 never appears
        assert c.rollout_engines * c.rollout_tp + c.actor.gpus == 16
        plan.check(c.plan, cfg)  # every one fits
    assert found.spec_rank == 1  # the spec's comment says so
    assert rlx(["plan", SPECS["grpo_qwen2.5_7b_2x8"], "--suggest", "--gpus-per-node", "8", "--nodes", "2",
                "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "the 3 best of" in out and "the spec's own layout ranks #1" in out and "cost model" in out
    # Too little memory for any layout: a sentence, exit 2.
    assert rlx(["plan", SPECS["grpo_qwen2.5_7b_2x8"], "resources.gpu_memory_gb=16", "--suggest"]) == 2
    assert "no layout on 2 x 8 GPUs divides and fits" in capsys.readouterr().out


def test_suggest_for_the_critic_and_the_32b_specs():
    # The 32B spec keeps memory headroom over the 3 s per step faster TP2 x PP4 (its comment says so).
    for name, rank in (("ppo_llama3.1_8b_4x8", 1), ("grpo_qwen2.5_32b_8x8", 2)):
        cfg = load_job(SPECS[name], [])
        found = plan.suggest(cfg, validate(cfg), cfg.resources.gpus_per_node, cfg.resources.nodes, top=5)
        assert found.spec_rank == rank, name
        if name.startswith("ppo"):
            assert all(c.critic is not None for c in found.best)


def test_virtual_pipeline_stages_hold_more_activations_in_flight():
    # Interleaved 1F1B: stage 0 keeps 2(pp-1) + (vpp-1)pp + 1 chunk forwards of layers/(pp vpp) layers,
    # layers * (1 + (pp-1)/(pp vpp)) in all (64 of 64 layers at vpp=1 with pp=2: 80 at vpp=2, 72 at vpp=4).
    spec = SPECS["grpo_qwen2.5_32b_8x8"]  # actor TP4 PP2, 64 layers
    acts = {v: next(r for r in _plan_of(spec, f"actor.vpp={v}")[1].roles if r.role == "actor").activations
            for v in (1, 2, 4)}
    assert acts[2] == pytest.approx(acts[1] * 80 / 64)
    assert acts[4] == pytest.approx(acts[1] * 72 / 64)
    _, p = _plan_of(spec, "actor.vpp=2")
    assert "worst pipeline stage of 2, 2 virtual stages each" in next(r for r in p.roles if r.role == "actor").notes


# ------------------------------------------------------------------------ --suggest on the cpu profile
# SmolLM2-135M's shape (yaml_configs/smollm2_math_cpu.yaml's model), inline: the CPU job spec is planned
# without its files.
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "hidden_act": "silu"}
CPU_SPEC = "yaml_configs/smollm2_math_cpu.yaml"
# The same job on two ranks, pipelined (what sampling ahead ranks first; the spec's comment names it).
TWO_STAGES = ("resources.pools.actor=2", "actor.pp=2", "actor.pp_layers=[17,13]", "actor.micro_batch_size=8")


def _cpu_spec(tmp_path, *overrides):
    config = tmp_path / "smollm2.json"
    config.write_text(json.dumps(SMOLLM2))
    return [f"model.hf_config={config}", "model.path=/not/here/smollm2", *overrides]


def test_cpu_suggest_ranks_every_valid_actor_layout_and_balances_the_head(tmp_path, capsys):
    cfg = load_job(CPU_SPEC, _cpu_spec(tmp_path, *TWO_STAGES))
    found = plan.suggest_cpu(cfg, validate(cfg), top=1000, cores=2)
    # The spec's pool only; its 2 ranks on 2 cores get one math thread each.
    assert found.valid == len(found.best) > 10 and found.pool_sizes == [2]
    assert {(c.actor.gpus, c.threads) for c in found.best} == {(2, 1)}
    costs = [c.train_s for c in found.best]
    assert costs == sorted(costs)
    # Every candidate is a layout `rlx validate` accepts, as the overrides that select it.
    for c in found.best[:5] + found.best[-3:]:
        job = load_job(CPU_SPEC, _cpu_spec(tmp_path, *TWO_STAGES, *c.overrides("actor")))
        assert validate(job).actor == c.actor
    # The last stage also runs the 49152-wide tied head (on the scored positions): the best PP2
    # split puts more layers on the first stage, and it beats the even split at the same micro-batch.
    pp2 = [c for c in found.best if c.actor.pp == 2]
    best = pp2[0]
    assert best.actor.pp_layers[0] > best.actor.pp_layers[1]
    even = next(c for c in pp2 if c.actor.pp_layers is None and c.micro_batch_size == best.micro_batch_size)
    assert best.train_s < even.train_s
    # Unbounded, two whole replicas (DP2) come first; within 4 GB on two ranks, the two stages do.
    assert found.best[0].actor.dp == 2 and found.best[0].memory > 4e9
    bounded = plan.suggest_cpu(cfg, validate(cfg), top=1000, cores=2, memory_gb=4)
    assert bounded.valid < found.valid and all(c.memory <= 4e9 for c in bounded.best)
    assert bounded.spec_rank == 1
    assert rlx(["plan", CPU_SPEC, *_cpu_spec(tmp_path, *TWO_STAGES), "--suggest", "--memory-gb", "4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "the 3 best of" in out and "cpu cost model" in out and "the spec's own layout ranks #1" in out
    assert "within 4 GB of host memory" in out
    # The cpu profile's GB are tensors; both outputs say what each process adds on top.
    assert "actor GB: the ranks' tensors only" in out and "~0.5 GB per Megatron rank" in out
    assert rlx(["plan", CPU_SPEC, *_cpu_spec(tmp_path, *TWO_STAGES)]) == 0
    out = capsys.readouterr().out
    assert "cpu profile: the GB above are tensors only" in out and "~0.6 GB per vLLM engine" in out
    # --calibrate belongs to --suggest on the cpu profile.
    assert rlx(["plan", CPU_SPEC, *_cpu_spec(tmp_path), "--calibrate"]) == 2
    assert "--calibrate belongs to the cpu profile's cost model" in capsys.readouterr().err


def test_cpu_suggest_weighs_fewer_ranks_with_more_threads(tmp_path, capsys):
    cfg = load_job(CPU_SPEC, _cpu_spec(tmp_path))
    both = plan.suggest_cpu(cfg, validate(cfg), top=1000, cores=2, pool_sizes=[1, 2])
    spec_pool = plan.suggest_cpu(cfg, validate(cfg), top=1000, cores=2)
    two = load_job(CPU_SPEC, _cpu_spec(tmp_path, *TWO_STAGES))
    two_ranks = plan.suggest_cpu(two, validate(two), top=1000, cores=2)
    one = [c for c in both.best if c.actor.gpus == 1]
    # One rank: no TP or PP to split, a DP of 1; in the synchronous loop it has both cores.
    assert {(c.actor.tp, c.actor.pp, c.actor.dp, c.threads) for c in one} == {(1, 1, 1, 2)}
    assert spec_pool.pool_sizes == [1] and spec_pool.valid == len(one)
    assert both.valid == two_ranks.valid + len(one)
    # Within 4 GB over both pool sizes the spec's own layout (one rank, one micro-batch of 32) is first.
    assert plan.suggest_cpu(cfg, validate(cfg), top=1000, cores=2, pool_sizes=[1, 2], memory_gb=4).spec_rank == 1
    for c in one:
        job = load_job(CPU_SPEC, _cpu_spec(tmp_path, *c.overrides("actor")))
        assert validate(job).actor == c.actor
    # Its second thread adds the calibrated gain, not a second core's whole rate: at a gain of 1 the
    # arithmetic halves, at 0 it is one thread's, and the stored gain lies between.
    lay, mbs = one[0].actor, one[0].micro_batch_size

    def update_s(gain):
        found = plan.suggest_cpu(cfg, validate(cfg), top=1000, cores=2, pool_sizes=[1],
                                 constants={"matmul_thread_gain": gain, "softmax_thread_gain": gain})
        return next(c.update_s for c in found.best if c.actor == lay and c.micro_batch_size == mbs)

    assert update_s(1.0) < one[0].update_s < update_s(0.0)
    assert plan._thread_speedup(2, 0.75) == 1.75 and plan._thread_speedup(0.5, 0.75) == 0.5
    # Generating ahead, the engine computes beside the actor: one rank gets one thread, and the
    # two balanced stages rank above it (as measured: docs/cpu-profile.md).
    ahead = load_job(CPU_SPEC, _cpu_spec(tmp_path, "trainer.off_policy_steps=1"))
    found = plan.suggest_cpu(ahead, validate(ahead), top=1000, cores=2, pool_sizes=[1, 2])
    assert {c.threads for c in found.best if c.actor.gpus == 1} == {1}
    bounded = [c for c in found.best if c.memory <= 4e9]
    assert bounded[0].actor.gpus == 2 and bounded[0].actor.pp == 2
    # The spec's one rank then computes on one core beside the engine, not on both.
    assert found.spec.threads == 1 and found.spec.update_s > 1.4 * spec_pool.spec.update_s
    # On the command line: the table names each row's pool and threads, and the overrides of #1 where
    # the spec's layout is not first.
    assert rlx(["plan", CPU_SPEC, *_cpu_spec(tmp_path, *TWO_STAGES), "--suggest", "--actor-pools", "1,2",
                "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "on pool 'actor' of 1 or 2 logical GPUs" in out and "GPUs  threads" in out
    assert "#1 as overrides: resources.pools.actor=" in out
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal: usage, the message, exit 2
        rlx(["plan", CPU_SPEC, *_cpu_spec(tmp_path), "--suggest", "--actor-pools", "0,1"])
    assert refused.value.code == 2
    assert "--actor-pools: expected sizes of the actor's pool as whole numbers >= 1" in capsys.readouterr().err
    # A pool size on which nothing validates says why (31 ranks: 32 sequences do not split over DP 31).
    assert rlx(["plan", CPU_SPEC, *_cpu_spec(tmp_path), "--suggest", "--actor-pools", "1,31", "--top", "1"]) == 0
    assert ("no actor layout on a pool of 31 logical GPUs passes rlx validate; the first refusal: "
            "data.batch_size*rollout.n=4*8=32 sequences do not split") in capsys.readouterr().out
    assert rlx(["plan", CPU_SPEC, *_cpu_spec(tmp_path), "--suggest", "--actor-pools", "31"]) == 2
    assert "no actor layout on 31 logical GPUs divides the model and the batch" in capsys.readouterr().out
    assert rlx(["plan", CPU_SPEC, *_cpu_spec(tmp_path), "--actor-pools", "1"]) == 2
    assert "--actor-pools belongs to the cpu profile's cost model" in capsys.readouterr().err


def test_stage_splits_are_the_ones_megatron_takes():
    assert plan._stage_splits(4, 1) == [None]
    assert plan._stage_splits(4, 2) == [None, (1, 3), (3, 1)]  # (2, 2) is the even split, None
    splits = plan._stage_splits(8, 3)  # 8 layers do not split evenly over 3 stages
    assert None not in splits and (1, 3, 4) in splits and (2, 2, 4) in splits and (3, 2, 3) in splits
    for split in splits:
        assert sum(split) == 8 and min(split) >= 1 and len(split) == 3


@pytest.mark.slow
def test_calibration_measures_every_constant():
    from launch.calibrate import calibrate

    constants = calibrate(tokens=64, hidden=64, ffn=128, cores=2)
    assert sorted(constants) == sorted(plan.CPU_CALIBRATION)
    assert constants["matmul_flops"] > 0 and constants["allreduce_bytes_s"] > 0
    # Costs are differences of timings, clipped at 0 where the machine's noise exceeds them.
    assert all(0 <= v < float("inf") for v in constants.values())
