"""``python -m launch.assets``: the quickstart's tiny model, its addition data, the addition task's
preference pairs (reward-model training), the judge demo's judge, and the two-step addition task with
its process reward model's step pairs, built locally."""
import argparse

from launch.assets.tiny import (make_addition_data, make_addition_pairs, make_tiny_model, make_two_step_data,
                               make_two_step_pairs)

p = argparse.ArgumentParser(prog="python -m launch.assets", description="Builds the quickstart's model and data locally: nothing is downloaded.")
p.add_argument("--model-dir", default=".cache/tiny-qwen2")
p.add_argument("--data-dir", default=".cache/tiny-addition")
p.add_argument("--two-step-dir", default=".cache/tiny-two-step", help="the two-step task and its PRM pairs")
p.add_argument("--tie-word-embeddings", action="store_true")
p.add_argument("--judge-dir", default=".cache/tiny-judge", help="the judge demo's judge: the tiny Qwen2 of another seed")
a = p.parse_args()
print(make_tiny_model(a.model_dir, tie_word_embeddings=a.tie_word_embeddings))
print(make_addition_data(a.data_dir))
print(make_tiny_model(a.judge_dir, seed=1))
print(*make_addition_pairs(a.data_dir), sep="\n")
print(make_two_step_data(a.two_step_dir))
print(*make_two_step_pairs(a.two_step_dir), sep="\n")
