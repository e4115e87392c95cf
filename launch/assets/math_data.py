"""Arithmetic prompts from DeepMind's ``mathematics_dataset`` as train/validation parquet files in
verl's schema (nothing is downloaded: the package generates the questions and their answers).

    .venv/bin/python -m launch.assets.math_data [--out .cache/math-arith] [--train 512] [--val 64] [--seed 0]

Questions come from the package's own arithmetic modules (``add_or_sub`` and ``mul``: "What is -3
plus 12?", "Work out 7 * -4.", ...) at a low entropy, so operands are small integers; questions with
decimal operands are skipped. Each prompt appends ``INSTRUCTION``, which asks for a bare number: the
form the built-in ``numeric`` verifier scores (the response's last number must equal the answer).
SmolLM2-135M-Instruct answers 17 of the 64 default validation questions right greedily (16 new
tokens) before training; asked for ``\\boxed{}`` instead it often wrote a literal "\\boxed{N}".
Train and validation questions are disjoint; the files are the same for the same arguments.
"""
from __future__ import annotations

import os
import random
import re

DATA_SOURCE = "mathematics_dataset/arithmetic"
INSTRUCTION = "Answer with just the final number."
DEFAULT_OUT = ".cache/math-arith"
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


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--train", type=int, default=512, help="training questions")
    p.add_argument("--val", type=int, default=64, help="held-out questions (validation.parquet)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for path in make_math_data(a.out, a.train, a.val, a.seed):
        print(path)
