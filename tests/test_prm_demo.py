"""The two-step addition task and its process reward model's pairs (launch/assets/tiny.py): the rows
are what the verifier scores, and every completion of a pair ends where the PRM's step finder
(rlcore/reward_sources.py step_ends) puts a step's end, so reward-model training scores it at the token
reward.process reads."""
import pytest


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from launch.assets import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_two_step_rows_are_scored_on_their_final_number():
    from launch.assets import two_step_rows
    from rlcore.reward import numeric_verifier

    rows = two_step_rows(max_operand=2)
    assert len(rows) == 27 and len({r["prompt"][0]["content"] for r in rows}) == 27
    for row in rows:
        a, b, c = (row["extra_info"][k] for k in "abc")
        assert row["prompt"] == [{"role": "user", "content": f"{a}+{b}+{c}="}]
        d, e = a + b, a + b + c
        assert row["reward_model"]["ground_truth"] == str(e) and row["extra_info"]["first_step"] == str(d)
        score = lambda text: numeric_verifier(row["data_source"], text, str(e), row["extra_info"])
        assert score(f"{d}={e}") == 1.0
        assert score(f"{d}={(e + 1) % 10}") == 0.0
        # A wrong first step with the right final number: the verifier cannot tell, the PRM's pairs do.
        assert score(f"{(d + 1) % 10}={e}") == 1.0


def test_two_step_reward_scores_the_final_number_and_measures_the_steps():
    from launch.assets import two_step_rows
    from launch.assets.tiny import two_step_reward

    row = next(r for r in two_step_rows() if r["prompt"][0]["content"] == "1+2+1=")
    got = lambda text: two_step_reward(row["data_source"], text, row["reward_model"]["ground_truth"], row["extra_info"])
    assert got("3=4") == {"score": 1.0, "first_step": 1.0, "two_step": 1.0}
    assert got("+=4") == {"score": 1.0, "first_step": 0.0, "two_step": 0.0}  # right number, no first step
    assert got("3=5") == {"score": 0.0, "first_step": 1.0, "two_step": 0.0}
    with pytest.raises(ValueError, match="extra_info has no 'first_step'"):
        two_step_reward("x", "3=4", "4", {"a": 1})


def test_pair_completions_end_at_the_prms_step_ends(tokenizer, tmp_path):
    from launch.assets import two_step_pairs
    from launch.assets.tiny import TWO_STEP_SEPARATOR
    from rlcore.preference_data import PreferenceDataset
    from rlcore.reward_sources import step_ends
    import json

    train, held_out = two_step_pairs(max_operand=2)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in train + held_out))
    pairs = PreferenceDataset(str(path), tokenizer, max_prompt_length=16, max_response_length=3, append_eos=False)
    sep = tokenizer.convert_tokens_to_ids(TWO_STEP_SEPARATOR)
    kinds = {"first": 0, "whole": 0}
    for row, pair in zip(train + held_out, pairs):
        a, b, c = (int(ch) for ch in row["prompt"][0]["content"][:-1].split("+"))
        assert row["chosen"] in (f"{a + b}=", f"{a + b}={a + b + c}")  # the right first step, or the whole answer
        for text, ids in ((row["chosen"], pair.chosen_ids), (row["rejected"], pair.rejected_ids)):
            assert ids == tokenizer.encode(text, add_special_tokens=False)  # no eos: scored at its own last token
        if len(row["chosen"]) == 2:  # the first step alone, "d=": its last token is the first step's end in "d=e"
            kinds["first"] += 1
            assert row["chosen"].endswith(TWO_STEP_SEPARATOR) and len(pair.chosen_ids) == 2
            assert row["rejected"].endswith(TWO_STEP_SEPARATOR) and row["rejected"] != row["chosen"]
            whole = pair.chosen_ids + tokenizer.encode("0", add_special_tokens=False)
            assert step_ends(whole, tokenizer, separator_token_id=sep) == [1, 2]
            assert step_ends(whole, tokenizer, separator=TWO_STEP_SEPARATOR) == [1, 2]
        else:  # the whole answer: two steps, the last ending at its last token
            kinds["whole"] += 1
            assert step_ends(pair.chosen_ids, tokenizer, separator_token_id=sep) == [1, 2]
            assert len(pair.rejected_ids) == 3 and row["rejected"] != row["chosen"]
    assert kinds["first"] == 27 * 11 and kinds["whole"] == 27 * (11 + 11 + 1 + 40)
    # The default appends eos, as an outcome RM's completions end: the PRM's pairs need append_eos=False.
    assert PreferenceDataset(str(path), tokenizer, max_response_length=4)[0].chosen_ids[-1] == tokenizer.eos_token_id


def test_held_out_pairs_are_new_rejections_of_every_prompt():
    from launch.assets import two_step_pairs, two_step_rows

    train, held_out = two_step_pairs(max_operand=2, held_out_per_kind=1)
    key = lambda r: (r["prompt"][0]["content"], r["chosen"], r["rejected"])
    assert not {key(r) for r in train} & {key(r) for r in held_out}
    prompts = {r["prompt"][0]["content"] for r in two_step_rows(max_operand=2)}
    assert {r["prompt"][0]["content"] for r in held_out} == prompts == {r["prompt"][0]["content"] for r in train}
    assert len(held_out) == 4 * len(prompts)  # one rejected of each kind (first, final, process, random) per prompt
    with pytest.raises(ValueError, match="held_out_per_kind=11"):
        two_step_pairs(held_out_per_kind=11)


def test_prm_spec_loads_its_pairs_without_eos(tokenizer, tmp_path):
    """yaml_configs/prm_train_cpu.yaml's algorithm.rm.append_eos: false reaches the loaded pairs."""
    from launch.assets import make_two_step_pairs
    from rlcore.job import load_job
    from rlcore.preference_data import load_preference_datasets

    train, val = make_two_step_pairs(str(tmp_path))
    cfg = load_job("yaml_configs/prm_train_cpu.yaml", [f"data.train_files=[{train}]", f"data.val_files=[{val}]"])
    got_train, got_val = load_preference_datasets(cfg, tokenizer)
    assert all(p.chosen_ids[-1] != tokenizer.eos_token_id for p in [*got_train, *got_val])
    cfg = load_job("yaml_configs/prm_train_cpu.yaml", [f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                                                       "algorithm.rm.append_eos=true", "rollout.max_response_length=4"])
    assert all(p.chosen_ids[-1] == tokenizer.eos_token_id for p in load_preference_datasets(cfg, tokenizer)[0])
