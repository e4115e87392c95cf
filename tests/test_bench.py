"""The benchmarks' own arithmetic and mappings (no timing here: speed is measured by bench/, never
asserted): the update's FLOP count, the overlap figure, and how bench/vs_trl.py states a job in TRL's
terms, refusing what TRL cannot reproduce."""
import pytest
import torch

from bench.e2e_step import TOTAL, executed_rows, higher_of, logprob_gap_line, overlap, reading_note, update_flops_per_row
from bench.vs_trl import NotComparable, trl_job
from rlcore.hf_config import parse_hf_config
from rlcore.job import load_job

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 32}


def test_update_flops_hand_computed():
    hf = parse_hf_config(TINY, "tiny")  # head_dim 4: q width 8, kv width 4
    # per layer: q 8*8 + k,v 2*8*4 + out 8*8 + SwiGLU 3*8*16 = 576 weights; 3 tokens attend to 1+2+3
    # positions: 4 * 8 * 6 = 192; output layer 2 * 8 * 10 on the 1 scored position.
    forward = 2 * (2 * 576 * 3 + 192) + 2 * 8 * 10 * 1
    assert update_flops_per_row(hf, tokens=3, scored=1) == 3 * forward


def test_overlap_is_step_over_the_sum_of_phases():
    sequential = {TOTAL: 10.0, "timing/rollout_s": 4.0, "timing/update_s": 6.0}
    overlapped = {TOTAL: 6.0, "timing/rollout_s": 4.0, "timing/update_s": 6.0}
    assert overlap([(sequential, 0, 0, 0.0)]) == pytest.approx(1.0)
    assert overlap([(overlapped, 0, 0, 0.0), (overlapped, 0, 0, 0.0)]) == pytest.approx(0.6)


def test_the_cpu_matmul_reference_is_the_higher_of_its_readings_before_and_after_the_job():
    # A neighbour's load during one reading only lowers it: keeping the lower would flatter the update.
    before = [{"label": "1 thread", "threads": 1, "flops": 90e9}, {"label": "2 threads", "threads": 2, "flops": 141e9}]
    after = [{"label": "1 thread", "threads": 1, "flops": 88e9}, {"label": "2 threads", "threads": 2, "flops": 199e9}]
    merged = higher_of(before, after)
    assert [m["flops"] for m in merged] == [90e9, 199e9]
    assert merged[1]["readings"] == (141e9, 199e9) and merged[1]["threads"] == 2
    assert reading_note(merged[1], 1e9) == "; the higher of 141.0 before and 199.0 after the job"
    assert reading_note(before[0], 1e9) == ""
    with pytest.raises(ValueError, match="matmul references differ"):
        higher_of(before, after[::-1])


def test_the_logprob_gap_line_says_when_trajectories_were_sampled_by_older_weights():
    synchronous = {"rollout/logprob_diff_max": 8.6e-5, "rollout/staleness_max": 0.0}
    ahead = {"rollout/logprob_diff_max": 0.74, "rollout/staleness_max": 1.0}
    assert logprob_gap_line([({}, 0, 0, 0.0)]) is None
    line = logprob_gap_line([(synchronous, 0, 0, 0.0)])
    assert line == "Largest engine/trainer log-prob gap over the measured steps: 8.6e-05."
    line = logprob_gap_line([(synchronous, 0, 0, 0.0), (ahead, 0, 0, 0.0)])
    assert line.startswith("Largest engine/trainer log-prob gap over the measured steps: 0.74 (trajectories up to "
                           "1 weight version(s) old")


def test_trl_job_states_the_same_job():
    cfg = load_job("yaml_configs/smollm2_math_cpu.yaml", [])
    job = trl_job(cfg, "float32", steps=3, threads=2, gradient_checkpointing=True, out_dir="/tmp/x")
    assert (job["loss_type"], job["beta"], job["n"], job["prompts_per_step"]) == ("dapo", 0.0, 8, 4)
    assert (job["temperature"], job["max_new_tokens"], job["lr"], job["top_k"]) == (0.7, 16, 1e-5, 0)
    assert (job["scale_rewards"], job["reward_function"], job["steps"]) == ("group", "numeric", 3)
    assert (job["bf16"], job["gradient_checkpointing"]) == (False, True)
    mean = trl_job(load_job("yaml_configs/smollm2_math_cpu.yaml", ["actor.loss_agg_mode=seq-mean-token-mean"]),
                   "float32", 3, 2, True, "/tmp/x")
    assert mean["loss_type"] == "grpo"


@pytest.mark.parametrize("override, key", [
    ("actor.loss_agg_mode=seq-mean-token-sum", "actor.loss_agg_mode"),
    ("algorithm.adv_estimator=rloo", "algorithm.adv_estimator"),
    ("actor.loss.policy_loss=gspo", "actor.loss.policy_loss"),
    ("actor.ppo_epochs=2", "actor.ppo_epochs"),
    ("algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.enable"),
])
def test_trl_job_refuses_what_trl_cannot_reproduce(override, key):
    cfg = load_job("yaml_configs/smollm2_math_cpu.yaml", [override])
    with pytest.raises(NotComparable, match=f"^{key}="):
        trl_job(cfg, "float32", 3, 2, True, "/tmp/x")


def test_trl_side_scores_with_the_trainers_reward_rule(tmp_path):
    """bench/trl_grpo.py (TRL's venv imports it too: only rlcore.data and rlcore.reward) reads the rows
    in dataset order and scores a completion from its token ids as the trainer does."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.trl_grpo import load_rows, make_reward

    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus 2?"}], "data_source": "arith",
             "reward_model": {"ground_truth": str(a + 2)}} for a in (1, 5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    loaded = load_rows([str(tmp_path / "train.parquet")], "prompt")
    assert [(r["row_index"], r["ground_truth"], json.loads(r["extra_info"])) for r in loaded] == \
        [(0, "3", {}), (1, "7", {})]

    class CharTokenizer:  # ids are character codes; 0 is a special token the decode drops
        def decode(self, ids, skip_special_tokens):
            return "".join(chr(i) for i in ids if i or not skip_special_tokens)

    reward = make_reward("numeric", CharTokenizer())
    completions = [[ord(c) for c in "It is 3."] + [0], [ord(c) for c in "8"]]
    scores = reward(prompts=None, completions=None, completion_ids=completions,
                    **{k: [r[k] for r in loaded] for k in ("ground_truth", "data_source", "extra_info", "row_index")})
    assert scores == [1.0, 0.0]

    # Its prompts are templated by the trainer's own code (the driver checks the first ones' ids).
    class ChatTokenizer(CharTokenizer):  # transformers 5: a BatchEncoding of a batch of one
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<a>" if add_generation_prompt else "")
            return {"input_ids": [[ord(c) for c in text]]}

    from bench.trl_grpo import prompt_ids
    from rlcore.data import chat_ids

    ids = prompt_ids(ChatTokenizer(), loaded[0]["prompt"])
    assert ids == chat_ids(ChatTokenizer(), loaded[0]["prompt"])
    assert "".join(map(chr, ids)) == "<user>What is 1 plus 2?<a>"


def test_executed_rows_count_a_shared_prompt_once():
    from rlcore.batch import Trajectory, build_batch

    trajs = [Trajectory(0, [5, 6, 7], [8, 9], [0.0, 0.0], "stop", 0), Trajectory(0, [5, 6, 7], [10], [0.0], "stop", 0),
             Trajectory(1, [5, 6], [11, 12, 13], [0.0] * 3, "stop", 0)]
    batch = build_batch(trajs, pad_id=0)
    assert executed_rows(batch, shared_prompt=False) == [(5, 2), (4, 1), (5, 3)]
    assert executed_rows(batch, shared_prompt=True) == [(3 + 2 + 1, 3), (2 + 3, 3)]


def test_tree_pss_counts_a_childs_memory_once():
    import os
    import subprocess
    import sys
    import time

    from bench.memory import PeakTreePss, tree_pss_mb

    before = tree_pss_mb(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(80 * 2**20); x[::4096] = b'1' * "
                              "len(x[::4096]); print('ok', flush=True); time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ok"
        with PeakTreePss(interval_s=0.05) as peak:
            time.sleep(0.3)
        assert tree_pss_mb(os.getpid()) - before > 70  # the child's 80 MB, counted under its parent
        assert peak.mb >= tree_pss_mb(child.pid) > 70
    finally:
        child.kill()
        child.wait()


# ------------------------------------------------------------------------- bench/gpu_shared_prompt.py
def test_gpu_shared_prompt_bench_times_the_row_the_engine_runs():
    """The timing table's packed row is packing.py's: prompt + n responses, each response token seeing
    the prompt and its own earlier tokens only."""
    from bench.gpu_shared_prompt import ATTENTION_SHAPES, packed_mask

    assert ATTENTION_SHAPES[0] == (43, 16, 8)  # the SmolLM2 job's: ~43 prompt tokens, up to 16 new, n = 8
    prompt, response, n = 5, 3, 4
    mask = packed_mask(prompt, response, n, "cpu")
    length = prompt + n * response
    assert mask.shape == (1, 1, length, length) and mask.dtype == torch.bool
    visible = (~mask[0, 0]).sum(1)
    assert visible[:prompt].tolist() == list(range(1, prompt + 1))
    assert visible[prompt:].tolist() == [prompt + j + 1 for _ in range(n) for j in range(response)]


def test_gpu_shared_prompt_bench_needs_a_gpu(capsys):
    from bench.gpu_shared_prompt import main

    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_update_breakdown_refuses_an_unknown_malloc_mode_before_it_starts(capsys):
    from bench.update_breakdown import main

    with pytest.raises(SystemExit):
        main(["yaml_configs/smollm2_math_cpu.yaml", "--malloc", "glibc,kep"])
    err = capsys.readouterr().err
    assert "--malloc: unknown mode(s) ['kep']" in err and "glibc, keep, keep-trim" in err



def test_update_breakdown_keeps_its_batches_as_data_and_replays_them(tmp_path, capsys):
    """--batches FILE: the kept updates are saved as tensors and plain fields (torch.load's weights-only
    unpickler reads them back), and a file with fewer batches than --steps is refused before any run."""
    from bench.update_breakdown import load_batches, main, save_batches
    from rlcore.config import LossConfig

    path = str(tmp_path / "batches.pt")
    batch = {"input_ids": torch.arange(6).view(2, 3), "advantages": torch.randn(2, 3)}
    save_batches([(batch, LossConfig(clip_ratio_high=0.28), {"temperature": 0.7, "on_policy": True})], path)
    [(loaded, loss_cfg, head_args)] = load_batches(path)
    assert sorted(loaded) == sorted(batch) and all(torch.equal(loaded[k], v) for k, v in batch.items())
    assert loss_cfg == LossConfig(clip_ratio_high=0.28) and head_args == {"temperature": 0.7, "on_policy": True}
    with pytest.raises(SystemExit):
        main(["yaml_configs/smollm2_math_cpu.yaml", "--steps", "2", "--batches", path])
    assert f"--batches {path} holds 1 batches, fewer than --steps=2" in capsys.readouterr().err


def test_update_breakdown_rounds_replay_every_kept_batch_after_one_warm_up(capsys):
    """--rounds K: batch 0 once (not counted), then every kept batch K times over; the per-update table
    has one row per counted update, each rank's cells, and the update's place on CLOCK_MONOTONIC."""
    from bench.update_breakdown import main, per_update_rows, replay_order

    assert replay_order(3, 1) == [0, 0, 1, 2]
    assert replay_order(2, 3) == [0, 0, 1, 0, 1, 0, 1]
    run = dict(total=4.5, system=0.11, faults=29)
    results = {r: {"runs": [dict(run, batch=b, start=10.0 + b, end=14.5 + b, faults=29 + r) for b in (0, 1)]}
               for r in (0, 1)}
    rows = per_update_rows(results, {0: [450e9, 900e9], 1: [225e9, 450e9]})  # a stage's FLOPs per batch
    assert len(rows) == 4 and rows[0].count("rank ") == 2
    assert rows[2] == "| 1 | 0 | 4.50, 100, 0.11, 29 | 4.50, 50, 0.11, 30 | 10.00, 14.50 |"
    assert rows[3] == "| 2 | 1 | 4.50, 200, 0.11, 29 | 4.50, 100, 0.11, 30 | 11.00, 15.50 |"
    with pytest.raises(SystemExit):
        main(["yaml_configs/smollm2_math_cpu.yaml", "--rounds", "0"])
    assert "--rounds=0 must be >= 1" in capsys.readouterr().err


def test_first_touch_table_rates_each_size_and_compares_the_two_writes():
    from bench.first_touch import table

    rows = {"4 KB pages": [{"mb": 128, "fresh_s": 0.064, "resident_s": 0.008, "sys_s": 0.1, "faults": 32768}],
            "huge pages": [{"mb": 256, "fresh_s": 3.072, "resident_s": 0.016, "sys_s": 4.5, "faults": 640}]}
    lines = table(rows).splitlines()
    assert lines[2] == "| 4 KB pages | 128 | 0.064 | 0.50 | 0.10 | 32,768 | 0.008 | 8 |"
    assert lines[3] == "| huge pages | 256 | 3.072 | 12.00 | 4.50 | 640 | 0.016 | 192 |"


@pytest.mark.parametrize("sizes", ["x", "0", "128,"])
def test_first_touch_refuses_sizes_that_are_not_whole_megabytes(sizes, capsys):
    from bench.first_touch import main

    with pytest.raises(SystemExit):
        main(["--mb", sizes])
    assert "--mb: expected" in capsys.readouterr().err
