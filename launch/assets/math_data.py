"""Arithmetic prompts from DeepMind's ``mathematics_dataset`` as train/validation parquet files in
verl's schema (nothing is downloaded: the package generates the questions and their answers).

    .venv/bin/python -m launch.assets.math_data [--out .cache/math-arith] [--train 512] [--val 64] [--seed 0]
    .venv/bin/python -m launch.assets.math_data --pairs   # DPO's pairs into .cache/math-arith-pairs

Questions come from the package's own arithmetic modules (``add_or_sub`` and ``mul``: "What is -3
plus 12?", "Work out 7 * -4.", ...) at a low entropy, so operands are small integers; questions with
decimal operands are skipped. Each prompt appends ``INSTRUCTION``, which asks for a bare number: the
form the built-in ``numeric`` verifier scores (the response's last number must equal the answer).
SmolLM2-135M-Instruct answers 17 of the 64 default validation questions right greedily (16 new
tokens) before training; asked for ``\\boxed{}`` instead it often wrote a literal "\\boxed{N}".
Train and validation questions are disjoint; the files are the same for the same arguments.

``--pairs`` writes the same questions as preference pairs (``rlcore/preference_data.py``'s schema):
the right number as ``chosen``, a near miss (off by 1-10, or one digit changed) as ``rejected``, both as
"The answer is N." (``ANSWER_FORMAT``); and
the held-out questions again in verl's schema, for DPO's greedy held-out accuracy.
"""
from __future__ import annotations

import os
import random
import re

DATA_SOURCE = "mathematics_dataset/arithmetic"
INSTRUCTION = "Answer with just the final number."
DEFAULT_OUT = ".cache/math-arith"
DEFAULT_PAIRS_OUT = ".cache/math-arith-pairs"
# How a preference pair's completions state the number: the form SmolLM2-135M-Instruct itself answers in
# greedily ("The answer is 1."; it rarely writes a bare number), so chosen and rejected differ only in the
# number. With bare numbers ("-3" vs "-1") DPO on the default spec pushed both completions' log-probs down
# (-10 -> -15 for the chosen ones in 40 steps) and the greedy held-out accuracy fell from 0.27 to 0.11.
ANSWER_FORMAT = "The answer is {}."
# name -> the package's module function; ``None`` lets the module pick its own answer.
MODULES = ("add_or_sub", "mul")
# Entropy (log10 of the number of values sampled from) per question, spread over the two operands:
# mostly one-digit signed operands ("What is -3 + 5?", "-4 * 2"), some two-digit ones. At (2, 3)
# (operands up to about +-50) SmolLM2 solved ~5% of its T=0.7 samples: too few groups had a signal.
ENTROPY = (1.0, 2.0)
_DECIMAL = re.compile(r"\d\.\d")


def _import_arithmetic():
    """``mathematics_dataset.modules.arithmetic``, importable on current sympy.

    mathematics_dataset 1.0.1 imports ``base_solution_linear`` from ``sympy.solvers.diophantine``;
    since sympy 1.7 it lives one module deeper (``...diophantine.diophantine``), and torch needs a
    recent sympy. Re-export it under the old name before the import."""
    import importlib
    import sys

    importlib.import_module("sympy.solvers.diophantine")
    # sys.modules, not attribute access: sympy.solvers.diophantine is also a function's name.
    package = sys.modules["sympy.solvers.diophantine"]
    if not hasattr(package, "base_solution_linear"):
        from sympy.solvers.diophantine.diophantine import base_solution_linear

        package.base_solution_linear = base_solution_linear
    from mathematics_dataset.modules import arithmetic
    from mathematics_dataset.util import composition

    return arithmetic, composition


def _sample_problems(count: int, seed: int, modules=MODULES, entropy=ENTROPY) -> list[dict]:
    """``count`` distinct (question, answer, module) dicts with integer operands and answers."""
    import numpy as np

    arithmetic, composition = _import_arithmetic()

    unknown = [m for m in modules if m not in ("add_or_sub", "mul")]
    if unknown:
        raise ValueError(f"modules {unknown}: expected add_or_sub and/or mul")
    # The package draws from Python's and numpy's global generators: seed both.
    random.seed(seed)
    np.random.seed(seed)
    sample_args = composition.PreSampleArgs(1, 1, *entropy)
    seen, problems = set(), []
    attempts = 0
    while len(problems) < count:
        attempts += 1
        if attempts > 50 * count:
            raise RuntimeError(f"only {len(problems)} distinct integer questions in {attempts} draws; "
                               f"raise the entropy range {entropy} or ask for fewer than {count}")
        module = modules[len(problems) % len(modules)]  # alternate: an even mix of operations
        problem = getattr(arithmetic, module)(None, sample_args)
        question, answer = str(problem.question), str(problem.answer)
        if _DECIMAL.search(question) or not re.fullmatch(r"-?\d+", answer) or question in seen:
            continue
        seen.add(question)
        problems.append({"question": question, "answer": answer, "module": module})
    return problems


def math_rows(problems: list[dict], split: str) -> list[dict]:
    """verl rows: one user message (question + instruction), the answer as ground truth."""
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{p['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": p["answer"]},
        "extra_info": {"split": split, "index": i, "module": p["module"], "question": p["question"]},
    } for i, p in enumerate(problems)]


def make_math_data(out_dir: str = DEFAULT_OUT, train_size: int = 512, val_size: int = 64,
                   seed: int = 0) -> tuple[str, str]:
    """Writes ``train.parquet`` and ``validation.parquet`` into ``out_dir`` (kept if both exist;
    the folder name should change with the arguments). Returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if train_size < 1 or val_size < 1:
        raise ValueError(f"train_size={train_size} and val_size={val_size} must be >= 1")
    paths = os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "validation.parquet")
    if all(os.path.isfile(p) for p in paths):
        return paths
    problems = _sample_problems(train_size + val_size, seed)
    # Validation first, so the held-out set is the same whatever the training size.
    splits = {"validation": problems[:val_size], "train": problems[val_size:]}
    os.makedirs(out_dir, exist_ok=True)
    for split, path in zip(("train", "validation"), paths):
        pq.write_table(pa.Table.from_pylist(math_rows(splits[split], split)), path + ".part")
        os.replace(path + ".part", path)
    return paths


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer close to the right one: off by 1-10 either way, or one digit changed (never the answer)."""
    value = int(answer)
    while True:
        if rng.random() < 0.5:
            wrong = str(value + rng.choice([-1, 1]) * rng.randint(1, 10))
        else:
            digits = [i for i, c in enumerate(answer) if c.isdigit()]
            i = rng.choice(digits)
            wrong = answer[:i] + rng.choice([d for d in "0123456789" if d != answer[i]]) + answer[i + 1:]
            wrong = str(int(wrong))  # a leading digit changed to 0 drops, as a model would write it
        if wrong != answer:
            return wrong


def preference_rows(problems: list[dict], seed: int) -> list[dict]:
    """Preference pairs: the question (with ``INSTRUCTION``) as the prompt, the right number as ``chosen``,
    a near miss as ``rejected``, both in ``ANSWER_FORMAT``."""
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": f"{p['question']} {INSTRUCTION}"}],
             "chosen": ANSWER_FORMAT.format(p["answer"]),
             "rejected": ANSWER_FORMAT.format(near_miss(p["answer"], rng))} for p in problems]


def make_math_preference_data(out_dir: str = DEFAULT_PAIRS_OUT, train_size: int = 512, val_size: int = 64,
                              seed: int = 0) -> tuple[str, str, str]:
    """Writes ``train.parquet`` and ``validation.parquet`` (preference pairs) and ``validation_prompts.parquet``
    (the held-out questions in verl's schema, for the greedy accuracy) into ``out_dir``. The questions are
    those of ``make_math_data`` with the same arguments: the held-out ones are its validation set. Kept if
    all three exist. Returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if train_size < 1 or val_size < 1:
        raise ValueError(f"train_size={train_size} and val_size={val_size} must be >= 1")
    paths = tuple(os.path.join(out_dir, f) for f in ("train.parquet", "validation.parquet",
                                                      "validation_prompts.parquet"))
    if all(os.path.isfile(p) for p in paths):
        return paths
    problems = _sample_problems(train_size + val_size, seed)
    val, train = problems[:val_size], problems[val_size:]
    os.makedirs(out_dir, exist_ok=True)
    tables = (preference_rows(train, seed), preference_rows(val, seed + 1), math_rows(val, "validation"))
    for rows, path in zip(tables, paths):
        pq.write_table(pa.Table.from_pylist(rows), path + ".part")
        os.replace(path + ".part", path)
    return paths


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--train", type=int, default=512, help="training questions")
    p.add_argument("--val", type=int, default=64, help="held-out questions (validation.parquet)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pairs", action="store_true",
                   help="preference pairs (chosen: the answer, rejected: a near miss) for DPO instead, into "
                        f"--out (default {DEFAULT_PAIRS_OUT})")
    a = p.parse_args()
    if a.pairs:
        paths = make_math_preference_data(DEFAULT_PAIRS_OUT if a.out == DEFAULT_OUT else a.out, a.train, a.val, a.seed)
    else:
        paths = make_math_data(a.out, a.train, a.val, a.seed)
    for path in paths:
        print(path)
