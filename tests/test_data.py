"""Tests for ``lightning_app_rlhf.data``: prompt sources, left-padded batches, indices, truncation."""

import json

import datasets
import pytest
import torch

from lightning_app_rlhf import demo
from lightning_app_rlhf.data import PromptDataModule, PromptDataset, collate_left_padded, read_prompts

PROMPTS = ["list some fruit:", "red", "name a few animals: cat dog", "blue sky", "tell me about weather:"]


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def setup_dm(prompts, tokenizer, **kwargs):
    kwargs.setdefault("batch_size", 2)
    kwargs.setdefault("shuffle", False)
    dm = PromptDataModule(prompts=prompts, tokenizer=tokenizer, **kwargs)
    dm.setup("fit")
    return dm


def test_collate_left_padded_hand_case():
    """Two prompts of lengths 3 and 1 are left-padded with the pad id, with mask and index."""
    batch = collate_left_padded(
        [{"input_ids": [5, 6, 7], "index": 3}, {"input_ids": [8], "index": 9}], pad_token_id=0
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["index"].tolist() == [3, 9]
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == batch["index"].dtype == torch.long


def test_collate_uses_given_pad_id():
    """Padding uses the pad id passed in, not a hard-coded 0."""
    batch = collate_left_padded([{"input_ids": [4], "index": 0}, {"input_ids": [5, 6], "index": 1}], pad_token_id=7)
    assert batch["input_ids"].tolist() == [[7, 4], [5, 6]]
    assert batch["attention_mask"].tolist() == [[0, 1], [1, 1]]


def test_from_python_list(tokenizer):
    """A list of strings is tokenised without special tokens; items carry their index."""
    dm = setup_dm(PROMPTS, tokenizer)
    assert dm.dataset.prompts == PROMPTS
    assert len(dm.dataset) == 5
    for i, text in enumerate(PROMPTS):
        item = dm.dataset[i]
        assert item == {"input_ids": encode(tokenizer, text), "index": i}
        assert tokenizer.bos_token_id not in item["input_ids"] and tokenizer.eos_token_id not in item["input_ids"]


def test_from_list_of_dicts_with_prompt_key(tokenizer):
    """A list of dicts reads the prompt_key field."""
    dm = setup_dm([{"q": p, "other": 1} for p in PROMPTS], tokenizer, prompt_key="q")
    assert dm.dataset.prompts == PROMPTS


def test_from_jsonl_default_key(tokenizer, tmp_path):
    """A JSONL file with {"prompt": ...} objects (blank lines ignored) gives those prompts in order."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(PROMPTS)) + "\n\n")
    dm = setup_dm(str(path), tokenizer)
    assert dm.dataset.prompts == PROMPTS


def test_from_jsonl_custom_key(tokenizer, tmp_path):
    """A JSONL file with a custom field is read through prompt_key."""
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps({"question": p}) for p in PROMPTS))
    dm = setup_dm(str(path), tokenizer, prompt_key="question")
    assert dm.dataset.prompts == PROMPTS


def test_jsonl_missing_key_names_prompt_key(tokenizer, tmp_path):
    """A JSONL row without the field raises, telling the user to set data.prompt_key."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "red"}) + "\n")
    with pytest.raises(ValueError, match="data.prompt_key"):
        setup_dm(str(path), tokenizer, batch_size=1)


def test_from_hf_dataset(tokenizer):
    """A datasets.Dataset is read by column; a missing column raises naming data.prompt_key."""
    ds = datasets.Dataset.from_dict({"text": PROMPTS, "label": list(range(5))})
    dm = setup_dm(ds, tokenizer, prompt_key="text")
    assert dm.dataset.prompts == PROMPTS
    with pytest.raises(ValueError, match="no column 'prompt'.*data.prompt_key"):
        setup_dm(ds, tokenizer)


@pytest.mark.parametrize("target", ["lightning_app_rlhf.demo:prompts", "lightning_app_rlhf.demo.prompts"])
def test_from_import_path(tokenizer, target):
    """An import path to a function returning prompts is called: the demo's 512 seeded prompts."""
    dm = setup_dm(target, tokenizer, batch_size=32)
    assert dm.dataset.prompts == demo.prompts()
    assert len(dm.dataset) == 512


def test_tokenizer_from_import_path():
    """The tokenizer may be given as an import path to a builder function."""
    dm = setup_dm(PROMPTS, "lightning_app_rlhf.demo:build_tokenizer")
    assert dm.tokenizer.pad_token_id == 0 and dm.tokenizer.eos_token_id == 2
    assert dm.dataset[1]["input_ids"] == encode(demo.build_tokenizer(), "red")


def test_batches_left_padded_with_index(tokenizer):
    """Dataloader batches are left-padded to the longest prompt and carry the samples' indices."""
    dm = setup_dm(PROMPTS, tokenizer, batch_size=2)
    batches = list(dm.train_dataloader())
    assert [b["index"].tolist() for b in batches] == [[0, 1], [2, 3]]  # drop_last: prompt #4 is left out
    for batch in batches:
        width = batch["input_ids"].shape[1]
        for row, index in enumerate(batch["index"].tolist()):
            ids = encode(tokenizer, PROMPTS[index])
            pad = width - len(ids)
            assert batch["input_ids"][row].tolist() == [tokenizer.pad_token_id] * pad + ids
            assert batch["attention_mask"][row].tolist() == [0] * pad + [1] * len(ids)
        assert width == max(len(encode(tokenizer, PROMPTS[i])) for i in batch["index"].tolist())
    # "red" is shorter than "list some fruit:", so row 1 of batch 0 is padded.
    assert batches[0]["attention_mask"][1, 0] == 0


def test_drop_last_full_batches_only(tokenizer):
    """With 5 prompts and batch_size 3, one full batch is drawn per epoch (shuffled or not)."""
    for shuffle in (False, True):
        dm = setup_dm(PROMPTS, tokenizer, batch_size=3, shuffle=shuffle)
        batches = list(dm.train_dataloader())
        assert len(batches) == 1
        assert batches[0]["input_ids"].shape[0] == 3
        assert len(set(batches[0]["index"].tolist())) == 3


def test_shuffled_batches_cover_distinct_indices(tokenizer):
    """A shuffled epoch of 4 batches of 8 demo prompts draws 32 distinct indices, each matching its tokens."""
    torch.manual_seed(0)
    prompts = demo.prompts(32)
    dm = setup_dm(prompts, tokenizer, batch_size=8, shuffle=True)
    seen = []
    for batch in dm.train_dataloader():
        assert batch["input_ids"].shape[0] == 8
        for row, index in enumerate(batch["index"].tolist()):
            ids = encode(tokenizer, prompts[index])
            assert batch["input_ids"][row, -len(ids):].tolist() == ids
        seen += batch["index"].tolist()
    assert sorted(seen) == list(range(32))


def test_max_prompt_length_truncates(tokenizer):
    """max_prompt_length=3 caps every prompt at 3 tokens (the tokenizer's truncation side); short ones stay whole."""
    long_prompt = "name a few animals: cat dog"
    full = encode(tokenizer, long_prompt)
    assert len(full) > 3
    dm = setup_dm([long_prompt, "red"], tokenizer, max_prompt_length=3)
    assert dm.dataset[0]["input_ids"] == full[:3]  # the demo tokenizer truncates on the right
    assert dm.dataset[1]["input_ids"] == encode(tokenizer, "red")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[1] == 3


def test_setup_is_idempotent(tokenizer):
    """A second setup() keeps the same dataset object."""
    dm = setup_dm(PROMPTS, tokenizer)
    dataset = dm.dataset
    dm.setup("fit")
    assert dm.dataset is dataset


def test_read_prompts_plain_rows():
    """read_prompts accepts a mix of strings and dicts, and rejects a non-string field."""
    assert read_prompts(["a", {"prompt": "b"}], "prompt") == ["a", "b"]
    with pytest.raises(ValueError, match="string 'prompt' field"):
        read_prompts([{"prompt": 3}], "prompt")


def test_prompt_encoding_to_no_tokens_is_rejected(tokenizer):
    """An empty prompt string (no tokens) raises naming the prompt."""
    with pytest.raises(ValueError, match=r"Prompt #1 \(''\) encodes to no tokens"):
        PromptDataset(["red", ""], tokenizer, None)
