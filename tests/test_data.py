"""Prompt datasets (parquet and JSONL in verl's schema): good rows load and tokenize, each malformed
row is a DataError naming file and row; the loader is an endless, reshuffling, resumable iterator."""
import json
import itertools

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlcore.data import DataError, PromptDataset, PromptItem, PromptLoader

WORDS = ["<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>",
         "what", "is", "two", "plus", "three", "?", "be", "brief", "q0", "q1", "q2", "q3", "q4", "q5",
         "q6", "q7", "q8", "q9"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(chat_template=CHAT_TEMPLATE):
    """A word-level tokenizer over WORDS (whitespace split), built locally: no downloads."""
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                   chat_template=chat_template)


def ids(*words):
    return [WORDS.index(w) for w in words]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def row(content="what is two plus two ?", ground_truth=4, data_source="toy", extra_info=None, **changes):
    r = {"prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": ground_truth,
                                                                            "style": "rule"},
         "data_source": data_source}
    if extra_info is not None:
        r["extra_info"] = extra_info
    r.update(changes)
    return r


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def load_error(files, tokenizer, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        PromptDataset(files, tokenizer, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------------- good rows
def test_parquet_rows_load_with_chat_template(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus three ?"}]
    path = write_parquet(tmp_path / "train.parquet", [
        row(extra_info={"split": "train", "index": 0}),
        {**row(ground_truth=5, data_source="gsm8k", extra_info={"split": "train", "index": 1}),
         "prompt": messages},
    ])
    ds = PromptDataset([path], tokenizer)
    assert len(ds) == 2
    assert ds[0] == PromptItem(index=0, prompt_ids=ids("<|user|>", "what", "is", "two", "plus", "two", "?",
                                                       "<|assistant|>"),
                               ground_truth="4", data_source="toy", extra_info={"split": "train", "index": 0})
    # Nested parquet columns come back as lists/dicts; both messages go through the template.
    assert ds[1].prompt_ids == ids("<|system|>", "be", "brief", "<|user|>", "what", "is", "two", "plus",
                                   "three", "?", "<|assistant|>")
    assert ds[1].ground_truth == "5" and ds[1].data_source == "gsm8k"


def test_jsonl_without_chat_template_concatenates_contents(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "what is "}, {"role": "user", "content": "three ?"}]
    path = write_jsonl(tmp_path / "train.jsonl", [row(prompt=messages, ground_truth="1,000")])
    ds = PromptDataset(path, tokenizer, apply_chat_template=False)
    # The contents are joined, then encoded without special tokens: no role markers.
    assert ds[0].prompt_ids == ids("what", "is", "three", "?")
    assert ds[0].ground_truth == "1,000"
    assert ds[0].extra_info == {}  # optional column


def test_several_files_are_indexed_in_order_and_blank_jsonl_lines_skipped(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [row(ground_truth=1), row(ground_truth=2)])
    with open(a, "a") as f:
        f.write("\n")
    b = write_parquet(tmp_path / "b.parquet", [row(ground_truth=3)])
    ds = PromptDataset([a, b], tokenizer)
    assert [(item.index, item.ground_truth) for item in ds] == [(0, "1"), (1, "2"), (2, "3")]


def test_custom_prompt_key(tmp_path, tokenizer):
    r = row()
    r["messages"] = r.pop("prompt")
    ds = PromptDataset(write_jsonl(tmp_path / "t.jsonl", [r]), tokenizer, prompt_key="messages")
    assert ds[0].prompt_ids[0] == WORDS.index("<|user|>")


# ---------------------------------------------------------------------------- malformed rows
@pytest.mark.parametrize("bad_row, expected", [
    (row(prompt="what is two"), "'prompt' must be a non-empty list of {role, content} messages, got str"),
    (row(prompt=[]), "'prompt' must be a non-empty list of {role, content} messages, got an empty list"),
    (row(prompt=[{"role": "user"}]), "'prompt' must be a non-empty list"),
    ({k: v for k, v in row().items() if k != "prompt"}, "'prompt' must be a non-empty list"),
    (row(reward_model={"style": "rule"}), "missing reward_model.ground_truth"),
    ({k: v for k, v in row().items() if k != "reward_model"}, "missing reward_model.ground_truth"),
    (row(reward_model={"ground_truth": [1, 2]}), "reward_model.ground_truth must be a string or a number, got list"),
    (row(data_source=None), "'data_source' must be a non-empty string, got null"),
    (row(extra_info=[1]), "'extra_info' must be a mapping, got list"),
    ([1, 2], "a row must be a mapping of columns, got list"),
])
def test_malformed_jsonl_row_names_file_row_and_cause(tmp_path, tokenizer, bad_row, expected):
    path = write_jsonl(tmp_path / "train.jsonl", [row(), row(), bad_row])
    message = load_error([path], tokenizer)
    assert f"{path} row 2 (line 3): " in message
    assert expected in message


def test_invalid_json_line(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row()) + "\n{not json\n")
    message = load_error([str(path)], tokenizer)
    assert f"{path} row 1 (line 2): not valid JSON" in message


def test_malformed_parquet_rows_name_file_and_row(tmp_path, tokenizer):
    # Parquet columns have one type, so the bad rows are nulls and empty lists, not mixed types.
    missing_truth = write_parquet(tmp_path / "a.parquet", [row(), row(), row(reward_model={"ground_truth": None,
                                                                                         "style": "rule"})])
    assert f"{missing_truth} row 2: missing reward_model.ground_truth" in load_error([missing_truth], tokenizer)

    empty_prompt = write_parquet(tmp_path / "b.parquet", [row(), row(prompt=[])])
    assert f"{empty_prompt} row 1: 'prompt' must be a non-empty list" in load_error([empty_prompt], tokenizer)

    string_prompts = write_parquet(tmp_path / "c.parquet", [row(prompt="what is two")])
    assert (f"{string_prompts} row 0: 'prompt' must be a non-empty list of {{role, content}} messages, got str"
            in load_error([string_prompts], tokenizer))


def test_prompt_longer_than_max_prompt_length(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "train.parquet", [row(content="two"), row(content="what is two plus two ?")])
    message = load_error([path], tokenizer, max_prompt_length=5)
    assert f"{path} row 1: the prompt is 8 tokens, longer than data.max_prompt_length=5" in message


def test_tokenizer_without_chat_template(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [row()])
    message = load_error([path], make_tokenizer(chat_template=None))
    assert "no chat template" in message and "data.apply_chat_template=false" in message


def test_bad_files(tmp_path, tokenizer):
    assert "file not found" in load_error([str(tmp_path / "gone.jsonl")], tokenizer)
    csv = tmp_path / "train.csv"
    csv.write_text("a,b\n")
    assert "expected .parquet or .jsonl" in load_error([str(csv)], tokenizer)
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("hello")
    assert "cannot read as parquet" in load_error([str(not_parquet)], tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "no rows" in load_error([str(empty)], tokenizer)


# ------------------------------------------------------------------------------------- loader
@pytest.fixture(scope="module")
def ten_prompts(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("data") / "ten.jsonl"
    return PromptDataset(write_jsonl(path, [row(content=f"q{i}", ground_truth=i) for i in range(10)]), tokenizer)


def indices(batch):
    return [item.index for item in batch]


def test_loader_epochs_are_shuffled_permutations_with_the_last_partial_batch_dropped(ten_prompts):
    loader = PromptLoader(ten_prompts, batch_size=3, shuffle=True, seed=7)
    assert loader.batches_per_epoch == 3
    epochs = [[indices(next(loader)) for _ in range(3)] for _ in range(4)]
    for epoch in epochs:
        seen = sum(epoch, [])
        assert all(len(b) == 3 for b in epoch)
        assert len(set(seen)) == 9  # 9 distinct prompts; the 10th is in the dropped partial batch
    orders = [sum(e, []) for e in epochs]
    assert len({tuple(o) for o in orders}) == 4  # reshuffled every epoch
    assert loader.state_dict()["epoch"] == 3


def test_loader_order_depends_only_on_seed_and_epoch(ten_prompts):
    def first_batches(seed, n=7):
        return [indices(b) for b in itertools.islice(PromptLoader(ten_prompts, 4, True, seed), n)]

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)


def test_loader_without_shuffle_keeps_file_order(ten_prompts):
    loader = PromptLoader(ten_prompts, batch_size=4, shuffle=False, seed=0)
    assert [indices(next(loader)) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5])  # mid-epoch and exactly at an epoch's end
def test_loader_resumes_exactly_from_its_state(ten_prompts, stop_after):
    uninterrupted = PromptLoader(ten_prompts, batch_size=3, shuffle=True, seed=3)
    expected = [indices(next(uninterrupted)) for _ in range(8)]

    first = PromptLoader(ten_prompts, batch_size=3, shuffle=True, seed=3)
    got = [indices(next(first)) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a round trip through a checkpoint file
    resumed = PromptLoader(ten_prompts, batch_size=3, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    got += [indices(next(resumed)) for _ in range(8 - stop_after)]
    assert got == expected


def test_loader_rejects_bad_state_and_too_small_dataset(ten_prompts):
    loader = PromptLoader(ten_prompts, batch_size=3, shuffle=True, seed=0)
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="does not fit"):
        loader.load_state_dict({"epoch": 0, "position": 4})
    with pytest.raises(DataError, match="fewer than one batch"):
        PromptLoader(ten_prompts, batch_size=11, shuffle=False, seed=0)
