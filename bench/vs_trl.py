"""This trainer against TRL's ``GRPOTrainer`` on the same job, back to back in one command: TRL first
(``bench/trl_grpo.py`` in ``.venv-trl``), then the job through this trainer (``rlcore.trainer``, the
real Ray + Megatron + vLLM stack, in this process as ``bench/e2e_step.py`` runs it), each for N
steps; prints a markdown table of the median step times and their ratio, the peak memory of both
and the held-out greedy accuracy of both before and after the N steps.

    bash bench/install_trl.sh        # once: .venv-trl with trl 1.16 beside the same CPU torch
    .venv/bin/python -m bench.vs_trl yaml_configs/smollm2_math_cpu.yaml --steps 10 [key.sub=value ...]

The same job on both sides: the job spec's HF model folder, train and validation files, reward
function (scored by ``rlcore.reward`` on both sides), rollout.n (TRL's num_generations),
temperature, top-p/top-k, max new tokens, learning rate (constant, Adam's betas, epsilon, weight
decay, gradient clipping), batch (data.batch_size prompts x n samples per optimizer step),
``num_iterations=1``, the clip range, ``beta`` = actor.loss.kl_coeff (both k3), the loss
aggregation (token-mean = TRL's ``dapo``, seq-mean-token-mean = ``grpo``, seq-mean-token-sum-norm =
``dr_grpo``), the precision (model.dtype: float32, or bfloat16 = TRL's ``bf16``), and the training
prompts in the same order: the trainer's loader order, fed to TRL unshuffled. A setting TRL's trainer
cannot reproduce is an error naming the key. Everything else is TRL's default, as a user gets it:
HF ``generate`` in one process on ``--trl-threads`` threads (default 2), gradient checkpointing on
(``--trl-no-gradient-checkpointing`` turns it off: faster, more memory; this trainer does not
recompute activations).

Step time: median over the N steps of each (``--skip N`` leaves the first steps out of both medians).
Peak memory: TRL's one process; ours summed over every process of the job (driver, each Megatron
rank, each vLLM engine). Held-out accuracy: greedy decoding of every validation prompt with
rollout.max_response_length new tokens, scored by the job's reward function (TRL: HF generate;
ours: the trainer's own validation through vLLM). Raw figures go to ``--out`` (default
``<trainer.run_dir>-vs-trl/``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.memory import PeakTreePss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# actor.loss_agg_mode -> TRL's loss_type with the same normalisation over the batch.
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


class NotComparable(ValueError):
    """A job setting TRL's GRPOTrainer has no equivalent for."""


def trl_job(cfg, dtype: str, steps: int, threads: int, gradient_checkpointing: bool, out_dir: str) -> dict:
    """The JSON job for bench/trl_grpo.py: the job spec's settings in TRL's terms (``dtype``: the
    resolved model dtype; the training order is added by the caller)."""
    a, r, alg, loss = cfg.actor, cfg.rollout, cfg.algorithm, cfg.actor.loss

    def refuse(key: str, value, expected: str):
        raise NotComparable(f"{key}={value!r}: TRL's GRPOTrainer has no equivalent; vs_trl needs {expected}")

    if alg.adv_estimator != "grpo":
        refuse("algorithm.adv_estimator", alg.adv_estimator, "grpo")
    if a.loss_agg_mode not in LOSS_TYPES:
        refuse("actor.loss_agg_mode", a.loss_agg_mode, f"one of {sorted(LOSS_TYPES)}")
    if loss.policy_loss != "vanilla":
        refuse("actor.loss.policy_loss", loss.policy_loss, "vanilla (PPO's clipped surrogate)")
    if loss.kl_coeff and loss.kl_estimator != "k3":
        refuse("actor.loss.kl_estimator", loss.kl_estimator, "k3 (TRL's KL term) when actor.loss.kl_coeff > 0")
    if loss.entropy_coeff:
        refuse("actor.loss.entropy_coeff", loss.entropy_coeff, "0")
    if loss.rollout_correction != "none":
        refuse("actor.loss.rollout_correction", loss.rollout_correction, "none (TRL samples from its own model)")
    if a.ppo_epochs != 1:
        refuse("actor.ppo_epochs", a.ppo_epochs, "1 (num_iterations=1)")
    if a.ppo_mini_batch_size not in (None, cfg.data.batch_size):
        refuse("actor.ppo_mini_batch_size", a.ppo_mini_batch_size, "null (one optimizer step per step)")
    if alg.kl_in_reward:
        refuse("algorithm.kl_in_reward", True, "false")
    if alg.dynamic_sampling.enable:
        refuse("algorithm.dynamic_sampling.enable", True, "false")
    if alg.overlong_buffer.enable:
        refuse("algorithm.overlong_buffer.enable", True, "false")
    if not cfg.data.apply_chat_template:
        refuse("data.apply_chat_template", False, "true (TRL formats chat prompts with the template)")
    if not cfg.data.val_files:
        refuse("data.val_files", [], "a validation file (the held-out accuracy)")
    o = a.optim
    return dict(
        model_path=os.path.abspath(cfg.model.path),
        train_files=[os.path.abspath(f) for f in cfg.data.train_files],
        val_files=[os.path.abspath(f) for f in cfg.data.val_files], prompt_key=cfg.data.prompt_key,
        reward_function=cfg.reward.function, steps=steps, seed=cfg.trainer.seed, threads=threads,
        prompts_per_step=cfg.data.batch_size, n=r.n, temperature=r.temperature, top_p=r.top_p,
        top_k=0 if r.top_k < 0 else r.top_k, max_new_tokens=r.max_response_length,
        lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps, clip_grad=o.clip_grad, beta=loss.kl_coeff,
        clip_ratio_low=loss.clip_ratio_low, clip_ratio_high=loss.clip_ratio_high,
        loss_type=LOSS_TYPES[a.loss_agg_mode], scale_rewards="group" if alg.norm_adv_by_std else "none",
        bf16=dtype == "bfloat16", gradient_checkpointing=gradient_checkpointing, out_dir=out_dir,
    )


def training_order(cfg, steps: int) -> tuple[list[int], list[list[int]]]:
    """The dataset indices the trainer's loader draws in ``steps`` steps, batch after batch (a fresh
    loader with the job's seed: the one the trainer builds draws the same), and the chat-template
    token ids of the first validation prompts (TRL's side checks its template renders the same)."""
    from rlcore.data import load_task

    task = load_task(cfg)
    order = [item.index for _ in range(steps) for item in next(task.loader)]
    return order, [item.prompt_ids for item in list(task.val_set)[:4]]


def run_trl(job: dict, python: str, out_dir: str, timeout_s: float) -> dict:
    spec_path, result_path = os.path.join(out_dir, "trl_job.json"), os.path.join(out_dir, "trl_result.json")
    with open(spec_path, "w") as f:
        json.dump(job, f, indent=1)
    if os.path.exists(result_path):
        os.remove(result_path)
    # Only this repository on the path (rlcore.data / rlcore.reward), never the project venv's packages.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS=str(job["threads"]), MKL_NUM_THREADS=str(job["threads"]),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, os.path.join(ROOT, "bench", "trl_grpo.py"), spec_path, result_path],
                            env=env, stdout=sys.stderr)  # TRL prints its logs on stdout
    with PeakTreePss(proc.pid) as pss:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    if proc.returncode != 0 or not os.path.exists(result_path):
        raise RuntimeError(f"the TRL run ({python} bench/trl_grpo.py {spec_path}) exited with {proc.returncode}; "
                           "its output is above")
    with open(result_path) as f:
        result = json.load(f)
    result["wall_s"] = time.perf_counter() - t0
    result["peak_pss_mb"] = pss.mb
    return result


def render(spec: str, overrides: list[str], cfg, steps: int, skip: int, trl: dict, ours: dict) -> str:
    trl_step = statistics.median(trl["step_s"][skip:])
    our_steps = [m["timing/step_s"] for m, *_ in ours["measured"]]
    our_step = statistics.median(our_steps)
    trl_mem = trl["peak_rss_mb"]
    our_mem = sum(map(sum, ours["memory"].values()))
    processes = sum(len(v) for v in ours["memory"].values())
    lay = ours["layout"]
    v = trl["versions"]
    lines = [
        f"`{spec}`{' ' + ' '.join(overrides) if overrides else ''}: {cfg.data.batch_size} prompts x "
        f"{cfg.rollout.n} samples, T={cfg.rollout.temperature}, <= {cfg.rollout.max_response_length} new tokens, "
        f"lr {cfg.actor.optim.lr:g}, {steps} steps each"
        f"{f' (medians leave out the first {skip})' if skip else ''}, back to back.",
        f"TRL {v['trl']} GRPOTrainer (transformers {v['transformers']}, HF generate, one process, "
        f"{trl['threads']} threads, loss_type={LOSS_TYPES[cfg.actor.loss_agg_mode]}, beta={cfg.actor.loss.kl_coeff:g}, "
        f"num_iterations=1, gradient checkpointing {'on' if trl['gradient_checkpointing'] else 'off'}, "
        f"{'bf16' if trl['bf16'] else 'fp32'}) vs this trainer (actor TP{lay.actor.tp} PP{lay.actor.pp} DP{lay.actor.dp}"
        f"{' + reference' if lay.reference else ''}, {lay.rollout.engines} vLLM engine(s), {processes} processes).",
        "",
        "| | TRL | ours | ours / TRL |",
        "|---|---:|---:|---:|",
        f"| median step, s | {trl_step:.2f} | {our_step:.2f} | **{our_step / trl_step:.2f}** |",
        f"| peak memory, MiB (ours: summed over {processes} processes) | {trl_mem:.0f} | {our_mem:.0f} | "
        f"{our_mem / trl_mem:.2f} |",
        f"| peak memory counted once, MiB (summed PSS of the process tree; ours: Ray's own processes too) | "
        f"{trl['peak_pss_mb']:.0f} | {ours['peak_pss_mb']:.0f} | {ours['peak_pss_mb'] / trl['peak_pss_mb']:.2f} |",
        f"| held-out greedy accuracy, step 0 ({trl['val_questions']} questions) | {trl['val_before']:.4f} | "
        f"{ours['val_before']:.4f} | |",
        f"| held-out greedy accuracy, after step {steps} | {trl['val_after']:.4f} | {ours['val_after']:.4f} | "
        f"{round(ours['val_after'] - trl['val_after'], 6) + 0.0:+.4f} (difference) |",
    ]
    trl_rewards = [log["reward"] for log in trl["logs"] if "reward" in log]
    our_rewards = [m["reward/mean"] for m, *_ in ours["measured"]]
    if trl_rewards:
        lines.append(f"| mean sampled reward over the {steps} steps | {statistics.mean(trl_rewards):.3f} | "
                     f"{statistics.mean(our_rewards):.3f} | |")
    lines.append(f"| start-up (not in the step times), s | {trl['startup_s']:.0f} | {ours['startup_s']:.0f} | |")
    lines += ["", "Per step, s: TRL " + ", ".join(f"{t:.1f}" for t in trl["step_s"])
              + "; ours " + ", ".join(f"{t:.1f}" for t in our_steps) + "."]
    phases = [(k[len("timing/"):-2], statistics.median(m[k] for m, *_ in ours["measured"]))
              for k in ("timing/rollout_s", "timing/logprob_s", "timing/update_s", "timing/weight_sync_s")
              if all(k in m for m, *_ in ours["measured"])]
    lines.append("Ours, median phases, s: " + ", ".join(f"{name} {value:.2f}" for name, value in phases) + ".")
    lines.append("Ours, peak RSS per process, MiB: " + "; ".join(
        f"{role} {', '.join(f'{x:.0f}' for x in values)}" for role, values in ours["memory"].items()) + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides (applied to both sides)")
    p.add_argument("--steps", type=int, default=10, help="training steps of each trainer (default 10)")
    p.add_argument("--skip", type=int, default=0, help="first steps left out of both step-time medians (default 0)")
    p.add_argument("--trl-python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"),
                   help="the TRL venv's python (default .venv-trl/bin/python; bench/install_trl.sh makes it)")
    p.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (default 2)")
    p.add_argument("--trl-no-gradient-checkpointing", action="store_true",
                   help="TRL keeps activations instead of recomputing them (TRL's default: recompute)")
    p.add_argument("--trl-timeout", type=float, default=7200, help="seconds the TRL run may take (default 7200)")
    p.add_argument("--out", help="folder for the raw figures (default <trainer.run_dir>-vs-trl)")
    a = p.parse_args(argv)
    if a.steps < 1 or not 0 <= a.skip < a.steps:
        p.error(f"--steps={a.steps} must be >= 1 and 0 <= --skip={a.skip} < --steps")
    if a.trl_threads < 1:
        p.error(f"--trl-threads={a.trl_threads} must be >= 1")
    if not os.path.isfile(a.spec):
        p.error(f"job spec {a.spec!r} not found")
    if not os.access(a.trl_python, os.X_OK):
        p.error(f"--trl-python {a.trl_python!r} is not an executable; run `bash bench/install_trl.sh` first")

    from bench.e2e_step import run_bench
    from rlcore.job import ConfigError, load_job
    from rlcore.validate import validate

    try:
        cfg = load_job(a.spec, a.overrides)
        layout = validate(cfg)
        out = a.out or cfg.trainer.run_dir.rstrip("/") + "-vs-trl"
        os.makedirs(out, exist_ok=True)
        job = trl_job(cfg, layout.dtype, a.steps, a.trl_threads, not a.trl_no_gradient_checkpointing,
                      os.path.abspath(out))
    except (ConfigError, NotComparable) as e:
        print(f"vs_trl: {e}", file=sys.stderr)
        return 2
    job["order"], job["val_prompt_ids_check"] = training_order(cfg, a.steps)

    print(f"vs_trl: TRL GRPOTrainer, {a.steps} steps ({a.trl_python})", file=sys.stderr, flush=True)
    trl = run_trl(job, a.trl_python, out, a.trl_timeout)
    print(f"vs_trl: this trainer, {a.steps} steps", file=sys.stderr, flush=True)
    ours = run_bench(a.spec, a.overrides, a.steps, warmup=0, validate_around=True, matmul=False,
                     run_dir_suffix="-vs-trl/ours")
    ours["measured"] = ours["measured"][a.skip:]
    table = render(a.spec, a.overrides, cfg, a.steps, a.skip, trl, ours)
    with open(os.path.join(out, "ours_result.json"), "w") as f:
        json.dump({"step_s": [m["timing/step_s"] for m, *_ in ours["measured"]],
                   "metrics": [m for m, *_ in ours["measured"]], "memory_mb": ours["memory"],
                   "peak_pss_mb": ours["peak_pss_mb"],
                   "val_before": ours["val_before"], "val_after": ours["val_after"],
                   "startup_s": ours["startup_s"]}, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"(raw figures: {out}/trl_result.json, {out}/ours_result.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
