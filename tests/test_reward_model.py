"""Reward models in the RL loop: the score head (megatron_workers/score_head.py) against transformers'
own *ForSequenceClassification, and the reward sources (rlcore/reward_sources.py).

The reward model is the tiny Qwen2 loaded as ``Qwen2ForSequenceClassification`` (one label, a pad id)
with a seeded random ``score`` layer, saved as an HF SeqCls checkpoint in the test's own folder.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from launch.assets import make_tiny_model
from rlcore.batch import Batch
from rlcore.roles import RoleSpec
from tests.batches import right_padded_rows

TOL = 1e-5
BATCH, SEQ, MICRO_BATCH = 6, 18, 2


def make_seqcls_checkpoint(out_dir: str, base_dir: str, seed: int = 0) -> str:
    """``base_dir``'s causal LM as a Qwen2ForSequenceClassification (num_labels 1, the tokenizer's pad
    id), its ``score`` drawn from ``seed``, saved with the base's tokenizer into ``out_dir``."""
    import shutil

    import transformers

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Unit-scale scores (std 1/sqrt(hidden)): 1e-5 is then a float32 tolerance, not a relative one.
        weight = model.score.weight
        weight.copy_(torch.randn(weight.shape, generator=g) * weight.shape[1] ** -0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(base_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(base_dir, name), out_dir)
    return out_dir


@pytest.fixture(scope="module")
def seqcls_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    base = make_tiny_model(str(root / "base"), arch="qwen2")
    return make_seqcls_checkpoint(str(root / "rm"), base)


def score_rows(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    input_ids, response_mask = right_padded_rows(g, BATCH, SEQ, vocab=16, min_response=1)
    return Batch(input_ids=input_ids, attention_mask=(input_ids != 0).long())


def transformers_scores(path: str, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(SeqCls logits [B] (the last non-pad token's), the score at every position [B, S])."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.score.bias is None
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits[:, 0]
        hidden = model.model(batch["input_ids"]).last_hidden_state
        every = model.score(hidden)[..., 0]
    return logits, every


@pytest.fixture(scope="module")
def placement(ray_pools):
    return ray_pools({"rm": 4}, {"rm": "rm"}).placement("rm")


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_score_head_matches_transformers_seqcls(seqcls_path, placement, tp, pp):
    """The score head's [B, S] scores are the SeqCls score at every real position (not shifted), and
    at each row's last attention-mask position they are transformers' SeqCls logits; the export
    gives the checkpoint's tensors back (score.weight, no bias, no lm_head)."""
    from safetensors.torch import load_file

    from megatron_workers.group import MegatronGroup
    from megatron_workers.score_head import last_token_scores

    batch = score_rows()
    group = MegatronGroup(RoleSpec("rm", seqcls_path, tp=tp, pp=pp, dp=1, micro_batch_size=MICRO_BATCH,
                                   profile="cpu", dtype="float32", seed=0, head="score"), placement)
    try:
        scores = group.forward(batch)["scores"]
        exported = group.hf_state_dict() if (tp, pp) == (1, 1) else None
    finally:
        group.shutdown()
    logits, every = transformers_scores(seqcls_path, batch)
    mask = batch["attention_mask"].bool()
    assert scores.shape == (BATCH, SEQ) and scores.dtype == torch.float32
    torch.testing.assert_close(scores[mask], every[mask], atol=TOL, rtol=0)
    torch.testing.assert_close(last_token_scores(scores, batch["attention_mask"]), logits, atol=TOL, rtol=0)
    assert logits.abs().min() > 10 * TOL  # the seeded score layer was loaded, not left near 0
    if exported is not None:
        saved = load_file(os.path.join(seqcls_path, "model.safetensors"))
        assert sorted(exported) == sorted(saved) and "score.weight" in saved and "lm_head.weight" not in saved
        for name, tensor in saved.items():
            torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0, msg=name)
