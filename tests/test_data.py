"""Tests for ``lightning_app_rlhf.data``: prompt sources, left-padded batches, indices, truncation, row fields,
chat prompts, held-out (validation, test, predict) loaders, DatasetDict splits."""

import json
import warnings

import datasets
import lightning.pytorch as pl
import pytest
import torch
from helpers import make_module

from lightning_app_rlhf import GenerationConfig, demo
from lightning_app_rlhf.data import (
    PromptDataModule,
    PromptDataset,
    collate_left_padded,
    read_prompts,
    read_rows,
)

PROMPTS = ["list some fruit:", "red", "name a few animals: cat dog", "blue sky", "tell me about weather:"]
ANSWERS = ["apple", "1", "cat", "2", "rain"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A minimal Jinja chat template: ``<|role|>content`` lines, then the assistant header."""


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A fresh demo tokenizer with ``CHAT_TEMPLATE`` (the session fixture must not be mutated)."""
    tokenizer = demo.build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


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


def test_collate_fields_aligned_with_rows():
    """Row fields become one list per name, in batch-row order; rows without fields give an empty dict."""
    items = [
        {"input_ids": [5, 6], "index": 3, "fields": {"answer": "5", "id": 30, "meta": {"k": 1}}},
        {"input_ids": [8], "index": 9, "fields": {"answer": "7", "id": 90, "meta": None}},
        {"input_ids": [4, 4, 4], "index": 0, "fields": {"answer": "x", "id": 0, "meta": [2]}},
    ]
    batch = collate_left_padded(items, pad_token_id=0)
    assert batch["index"].tolist() == [3, 9, 0]
    assert batch["fields"] == {"answer": ["5", "7", "x"], "id": [30, 90, 0], "meta": [{"k": 1}, None, [2]]}
    assert batch["input_ids"].tolist() == [[0, 5, 6], [0, 0, 8], [4, 4, 4]]
    plain = collate_left_padded([{"input_ids": [1], "index": 0}, {"input_ids": [2], "index": 1, "fields": {}}], 0)
    assert plain["fields"] == {}


def test_collate_mismatched_fields_raises():
    """Rows with different field names cannot be collated; the error names the row and the fix."""
    items = [{"input_ids": [1], "index": 0, "fields": {"answer": "5"}}, {"input_ids": [2], "index": 1, "fields": {}}]
    with pytest.raises(ValueError, match=r"Batch row #1 has fields \[\].*missing: \['answer'\].*same fields"):
        collate_left_padded(items, pad_token_id=0)


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
        assert item == {"input_ids": encode(tokenizer, text), "index": i, "fields": {}, "prompt": text}
        assert tokenizer.bos_token_id not in item["input_ids"] and tokenizer.eos_token_id not in item["input_ids"]


def test_from_list_of_dicts_with_prompt_key(tokenizer):
    """A list of dicts reads the prompt_key field and keeps the other fields per row."""
    dm = setup_dm([{"q": p, "other": i} for i, p in enumerate(PROMPTS)], tokenizer, prompt_key="q")
    assert dm.dataset.prompts == PROMPTS
    assert [dm.dataset[i]["fields"] for i in range(5)] == [{"other": i} for i in range(5)]


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
    assert dm.dataset.fields == [{"label": i} for i in range(5)]
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


def test_read_rows_splits_prompts_and_fields():
    """read_rows gives the prompts plus each row's other fields; read_prompts gives the same prompts alone."""
    rows = [{"prompt": "red", "answer": "1"}, {"prompt": "blue sky", "answer": None}]
    assert read_rows(rows, "prompt") == (["red", "blue sky"], [{"answer": "1"}, {"answer": None}])
    assert read_prompts(rows, "prompt") == ["red", "blue sky"]
    assert read_rows(["red", "blue"], "prompt") == (["red", "blue"], [{}, {}])


def test_mismatched_fields_raise_naming_row(tokenizer):
    """Rows whose extra fields differ from row #0's raise, naming the row, the difference and the fix."""
    rows = [{"prompt": "red", "answer": "1"}, {"prompt": "blue", "answer": "2"}, {"prompt": "sky", "id": 3}]
    with pytest.raises(ValueError, match=r"Prompt row #2 has fields \['id'\].*missing: \['answer'\], extra: "
                                         r"\['id'\].*add the missing ones"):
        setup_dm(rows, tokenizer)
    with pytest.raises(ValueError, match="Prompt row #1 has fields"):
        setup_dm(["red", {"prompt": "blue", "answer": "2"}], tokenizer)
    with pytest.raises(ValueError, match="2 prompts but 1 field rows"):
        PromptDataset(["red", "blue"], tokenizer, None, [{"answer": "1"}])


def test_jsonl_answer_field_reaches_batches(tokenizer, tmp_path):
    """A JSONL `answer` field rides in batch["fields"], aligned with the (shuffled) rows' indices."""
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in zip(PROMPTS, ANSWERS)) + "\n")
    dm = setup_dm(str(path), tokenizer, batch_size=2, shuffle=True, seed=3)
    assert dm.dataset[1] == {"input_ids": encode(tokenizer, "red"), "index": 1, "fields": {"answer": "1"},
                             "prompt": "red"}
    seen = 0
    for batch in dm.train_dataloader():
        assert list(batch["fields"]) == ["answer"]
        assert batch["fields"]["answer"] == [ANSWERS[i] for i in batch["index"].tolist()]
        for row, index in enumerate(batch["index"].tolist()):
            ids = encode(tokenizer, PROMPTS[index])
            assert batch["input_ids"][row, -len(ids):].tolist() == ids
        seen += len(batch["fields"]["answer"])
    assert seen == 4


def test_hf_dataset_extra_columns_reach_batches(tokenizer):
    """Every datasets column other than the prompt's is kept and collated in row order."""
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "answer": ANSWERS, "level": [1, 2, 3, 4, 5]})
    dm = setup_dm(ds, tokenizer, batch_size=2)
    assert dm.dataset[4]["fields"] == {"answer": "rain", "level": 5}
    batches = list(dm.train_dataloader())
    assert [b["fields"] for b in batches] == [
        {"answer": ["apple", "1"], "level": [1, 2]},
        {"answer": ["cat", "2"], "level": [3, 4]},
    ]


def test_plain_prompts_give_empty_fields(tokenizer):
    """Plain string prompts give batch["fields"] == {}."""
    batch = next(iter(setup_dm(PROMPTS, tokenizer).train_dataloader()))
    assert batch["fields"] == {}


CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
     "answer": "5"},
    {"prompt": [{"role": "user", "content": "name a few animals:"}], "answer": "cat"},
]
CHAT_TEXTS = ["<|system|>Be brief.\n<|user|>What is 2+3?\n<|assistant|>", "<|user|>name a few animals:\n<|assistant|>"]


def test_chat_messages_render_with_template(chat_tokenizer):
    """Message-list prompts become exactly the template's text (generation prompt appended), tokenised as is."""
    assert chat_tokenizer.apply_chat_template(CHAT_ROWS[0]["prompt"], tokenize=False,
                                              add_generation_prompt=True) == CHAT_TEXTS[0]
    dm = setup_dm(CHAT_ROWS, chat_tokenizer)
    assert dm.dataset.prompts == CHAT_TEXTS
    for i, text in enumerate(CHAT_TEXTS):
        # "prompt": the row's prompt as given, what a multi-turn environment's reset reads
        assert dm.dataset[i] == {"input_ids": encode(chat_tokenizer, text), "index": i,
                                 "fields": {"answer": CHAT_ROWS[i]["answer"]}, "prompt": CHAT_ROWS[i]["prompt"]}
    batch = next(iter(dm.train_dataloader()))
    assert batch["fields"] == {"answer": ["5", "cat"]}


def test_chat_messages_from_jsonl_and_dataset(chat_tokenizer, tmp_path):
    """Conversational rows read the same from a JSONL file and from a datasets.Dataset."""
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in CHAT_ROWS))
    ds = datasets.Dataset.from_list(CHAT_ROWS)
    for source in (str(path), ds):
        dm = setup_dm(source, chat_tokenizer)
        assert dm.dataset.prompts == CHAT_TEXTS
        assert dm.dataset.fields == [{"answer": "5"}, {"answer": "cat"}]


def test_chat_template_none_leaves_strings_alone(chat_tokenizer):
    """By default only message lists are templated; plain strings in the same source stay verbatim."""
    dm = setup_dm(["red", [{"role": "user", "content": "blue sky"}]], chat_tokenizer)
    assert dm.dataset.prompts == ["red", "<|user|>blue sky\n<|assistant|>"]


def test_chat_template_true_wraps_strings(chat_tokenizer):
    """chat_template=True renders each string as one user message."""
    dm = setup_dm(["red", "blue sky"], chat_tokenizer, chat_template=True)
    assert dm.dataset.prompts == ["<|user|>red\n<|assistant|>", "<|user|>blue sky\n<|assistant|>"]
    assert dm.dataset[0]["input_ids"] == encode(chat_tokenizer, "<|user|>red\n<|assistant|>")


def test_chat_template_false_leaves_strings_alone(chat_tokenizer):
    """chat_template=False tokenises plain strings verbatim even when the tokenizer has a template."""
    dm = setup_dm(["red", "blue sky"], chat_tokenizer, chat_template=False)
    assert dm.dataset.prompts == ["red", "blue sky"]


def test_missing_chat_template_names_the_fix(tokenizer):
    """Message lists (or chat_template=True) with a template-less tokenizer raise, naming both fixes."""
    assert tokenizer.chat_template is None
    fix = r"no chat template.*Use a tokenizer that has a chat template.*data.chat_template: false.*plain-text"
    with pytest.raises(ValueError, match=r"the prompts are chat message lists.*" + fix[len("no chat template"):]):
        setup_dm(CHAT_ROWS, tokenizer)
    with pytest.raises(ValueError, match=fix):
        setup_dm(PROMPTS, tokenizer, chat_template=True)


def test_chat_template_false_refuses_messages(chat_tokenizer):
    """chat_template=False with a message-list prompt raises naming the row and the setting to change."""
    with pytest.raises(ValueError, match=r"Prompt #0 is a list of chat messages, but data.chat_template is false"):
        setup_dm(CHAT_ROWS, chat_tokenizer, chat_template=False)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([{"role": "user"}], r"Prompt #1, message #0 .*string \"role\" and \"content\""),
        ([{"role": "user", "content": 3}], r"Prompt #1, message #0"),
        (["hello"], r"Prompt #1, message #0"),
        ([], r"Prompt #1 is an empty message list"),
    ],
)
def test_invalid_messages_name_the_row(chat_tokenizer, bad, match):
    """Malformed message lists raise, naming the row (and message) and the expected shape."""
    with pytest.raises(ValueError, match=match):
        setup_dm(["red", bad], chat_tokenizer, batch_size=1)


def test_chat_template_from_yaml():
    """jsonargparse (as LightningCLI) reads data.chat_template from YAML as true / false / null."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(PromptDataModule, "data")
    for text, value in (("true", True), ("false", False), ("null", None)):
        cfg = parser.parse_string(f"data:\n  prompts: p.jsonl\n  tokenizer: tok\n  chat_template: {text}\n")
        assert cfg.data.chat_template is value
    assert parser.parse_string("data:\n  prompts: p.jsonl\n  tokenizer: tok\n").data.chat_template is None


# ---- held-out prompts: validation, test, predict ----

VAL_PROMPTS = ["blue", "list some fruit:", "cat dog", "weather:", "red sky"]


def test_val_loader_every_prompt_in_order_last_batch_kept(tokenizer):
    """The val and test loaders go once through the held-out prompts in dataset order, keep the last partial
    batch, and left-pad and collate as training does (input ids, mask, index, fields)."""
    rows = [{"prompt": p, "answer": str(i)} for i, p in enumerate(VAL_PROMPTS)]
    dm = setup_dm(PROMPTS, tokenizer, batch_size=4, shuffle=True, val_prompts=rows, val_batch_size=2)
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        batches = list(loader)
        assert [b["index"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
        assert [b["fields"] for b in batches] == [{"answer": ["0", "1"]}, {"answer": ["2", "3"]}, {"answer": ["4"]}]
        for batch in batches:
            width = batch["input_ids"].shape[1]
            for row, index in enumerate(batch["index"].tolist()):
                ids = encode(tokenizer, VAL_PROMPTS[index])
                assert batch["input_ids"][row].tolist() == [tokenizer.pad_token_id] * (width - len(ids)) + ids
                assert batch["attention_mask"][row].tolist() == [0] * (width - len(ids)) + [1] * len(ids)
    assert [len(b["index"]) for b in dm.train_dataloader()] == [4]  # training still drops the last partial batch


def test_val_batch_size_defaults_to_batch_size(tokenizer):
    """Without val_batch_size the eval loaders batch like training: 5 prompts in batches of 2 give 2, 2, 1."""
    dm = setup_dm(PROMPTS, tokenizer, batch_size=2, val_prompts=VAL_PROMPTS)
    assert dm.val_batch_size == 2
    assert [len(b["index"]) for b in dm.val_dataloader()] == [2, 2, 1]
    with pytest.raises(ValueError, match="data.val_batch_size must be >= 1"):
        PromptDataModule(PROMPTS, tokenizer, val_prompts=VAL_PROMPTS, val_batch_size=0)


def test_predict_loader_defaults(tokenizer):
    """predict reads predict_prompts, else the held-out prompts, else the training prompts; in order, all of them."""
    def predicted(**kwargs):
        dm = PromptDataModule(tokenizer=tokenizer, batch_size=2, val_batch_size=3, **kwargs)
        dm.setup("predict")
        assert dm.dataset is None and dm.val_dataset is None  # predict builds only its own prompts
        batches = list(dm.predict_dataloader())
        return dm.predict_dataset.prompts, [b["index"].tolist() for b in batches]

    assert predicted(prompts=PROMPTS) == (PROMPTS, [[0, 1, 2], [3, 4]])
    assert predicted(prompts=PROMPTS, val_prompts=VAL_PROMPTS[:4]) == (VAL_PROMPTS[:4], [[0, 1, 2], [3]])
    assert predicted(prompts=PROMPTS, val_prompts=VAL_PROMPTS, predict_prompts=["red"]) == (["red"], [[0]])


def test_setup_builds_only_what_the_stage_reads(tokenizer):
    """fit builds training and held-out prompts, validate/test only the held-out ones, predict only its own;
    a repeated setup keeps every dataset already built, and predict reuses the held-out one."""
    dm = PromptDataModule(PROMPTS, tokenizer, batch_size=2, val_prompts=VAL_PROMPTS)
    dm.setup("validate")
    assert dm.dataset is None and dm.val_dataset.prompts == VAL_PROMPTS and dm.predict_dataset is None
    val = dm.val_dataset
    dm.setup("test")
    dm.setup("fit")
    assert dm.val_dataset is val and dm.dataset.prompts == PROMPTS
    train = dm.dataset
    dm.setup("fit")
    dm.setup("predict")
    assert dm.dataset is train and dm.val_dataset is val and dm.predict_dataset is val
    with pytest.raises(ValueError, match="Unknown stage 'train'"):
        dm.setup("train")


def test_no_val_prompts_means_no_val_batches(tokenizer):
    """Without held-out prompts the val loader has no batches (RLHFModule then sets limit_val_batches=0) and
    validate/test raise naming data.val_prompts."""
    dm = PromptDataModule(PROMPTS, tokenizer, batch_size=2)
    assert not dm.has_val_prompts
    for stage in ("validate", "test"):
        with pytest.raises(ValueError, match=rf"trainer.{stage}\(\) reads held-out prompts.*Set data.val_prompts"):
            dm.setup(stage)
    dm.setup("fit")
    assert dm.val_dataset is None and dm.val_dataloader() == []


def test_empty_val_prompts_raise(tokenizer):
    """An empty held-out set raises naming the setting; a val set smaller than a batch is fine."""
    with pytest.raises(ValueError, match=r"The prompts of data.val_prompts are empty.*at least one prompt"):
        setup_dm(PROMPTS, tokenizer, val_prompts=[])
    dm = setup_dm(PROMPTS, tokenizer, batch_size=4, val_prompts=["red"])
    assert [b["index"].tolist() for b in dm.val_dataloader()] == [[0]]


class _Recorder(pl.LightningModule):
    """Records the index of every batch each stage reads; learns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: dict[str, list[list[int]]] = {"train": [], "val": [], "test": [], "predict": []}

    def training_step(self, batch, batch_idx):
        self.seen["train"].append(batch["index"].tolist())
        return self.weight.sum() * 0

    def predict_step(self, batch, batch_idx):
        self.seen["predict"].append(batch["index"].tolist())
        return batch["index"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ValRecorder(_Recorder):
    def validation_step(self, batch, batch_idx):
        self.seen["val"].append(batch["index"].tolist())

    def test_step(self, batch, batch_idx):
        self.seen["test"].append(batch["index"].tolist())


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def test_trainer_reads_held_out_loaders(tokenizer):
    """Under a Trainer, fit validates on every held-out prompt in order, and validate, test and predict read
    them all once, the last batch partial."""
    dm = PromptDataModule(PROMPTS, tokenizer, batch_size=2, val_prompts=VAL_PROMPTS, val_batch_size=2)
    module = _ValRecorder()
    _trainer().fit(module, dm)
    assert len(module.seen["train"]) == 2 and module.seen["val"] == [[0, 1], [2, 3], [4]]
    _trainer().validate(module, dm, verbose=False)
    _trainer().test(module, dm, verbose=False)
    _trainer().predict(module, dm)
    assert module.seen["val"] == [[0, 1], [2, 3], [4]] * 2
    assert module.seen["test"] == module.seen["predict"] == [[0, 1], [2, 3], [4]]


def test_fit_without_val_prompts_is_quiet(tokenizer):
    """Without held-out prompts RLHFModule's fit runs no validation and Lightning says nothing about a val loader."""
    module = make_module(reward_fn=lambda prompts, responses: [0.0] * len(prompts),
                         generation=GenerationConfig(max_new_tokens=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer()
        trainer.fit(module, PromptDataModule(PROMPTS, tokenizer, batch_size=2))
    assert trainer.limit_val_batches == 0 and trainer.global_step == 2
    about_val = ("val_dataloader", "validation", "val loop", "length of")  # "length of": an empty list
    assert [str(w.message) for w in caught if any(word in str(w.message) for word in about_val)] == []
    with pytest.raises(ValueError, match="Set data.val_prompts"):
        _trainer().validate(_ValRecorder(), PromptDataModule(PROMPTS, tokenizer, batch_size=2))


# ---- DatasetDict splits ----


@pytest.fixture
def dataset_dict():
    return datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"prompt": PROMPTS, "answer": ANSWERS}),
        "test": datasets.Dataset.from_dict({"prompt": VAL_PROMPTS[:3], "answer": ["x", "y", "z"]}),
    })


def test_dataset_dict_with_split(tokenizer, dataset_dict):
    """A DatasetDict is read through data.split; val_split picks the held-out split of the same DatasetDict, or
    of a DatasetDict given as val_prompts."""
    dm = setup_dm(dataset_dict, tokenizer, split="train", val_split="test")
    assert dm.dataset.prompts == PROMPTS and dm.dataset.fields[0] == {"answer": "apple"}
    assert dm.val_dataset.prompts == VAL_PROMPTS[:3]
    assert [b["fields"]["answer"] for b in dm.val_dataloader()] == [["x", "y"], ["z"]]
    dm = setup_dm(PROMPTS, tokenizer, val_prompts=dataset_dict, val_split="test")
    assert dm.dataset.prompts == PROMPTS and dm.val_dataset.prompts == VAL_PROMPTS[:3]
    assert read_rows(dataset_dict, "prompt", split="test")[0] == VAL_PROMPTS[:3]
    assert read_prompts({"train": PROMPTS[:2]}, "prompt", split="train") == PROMPTS[:2]  # a dict of splits too


def test_dataset_dict_without_split_names_the_splits(tokenizer, dataset_dict):
    """A DatasetDict without a split raises naming its splits and the setting to add, not data.prompt_key."""
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train', 'test'\], but data.split is not set.*"
                                         r"Set data.split: train") as info:
        setup_dm(dataset_dict, tokenizer)
    assert "prompt_key" not in str(info.value)
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\], but data.val_split is not set.*"
                                         r"Set data.val_split: test"):
        setup_dm(PROMPTS, tokenizer, val_prompts=dataset_dict)
    with pytest.raises(ValueError, match=r"data.predict_split is not set.*Set data.predict_split: test"):
        PromptDataModule(PROMPTS, tokenizer, predict_prompts=dataset_dict).setup("predict")


def test_wrong_split_names_the_fix(tokenizer, dataset_dict):
    """An unknown split lists the real ones; a split on a source without splits says to remove it."""
    with pytest.raises(ValueError, match=r"data.split='validation' is not a split.*its splits are \['train', "
                                         r"'test'\]. Set data.split to one of them"):
        setup_dm(dataset_dict, tokenizer, split="validation")
    with pytest.raises(ValueError, match=r"data.split='train' is set, but the prompt source \(list\) has no "
                                         r"splits.*Remove data.split"):
        setup_dm(PROMPTS, tokenizer, split="train")
    with pytest.raises(ValueError, match=r"data.val_split='test' is set.*Remove data.val_split"):
        setup_dm(PROMPTS, tokenizer, val_split="test")


def test_dataset_dict_saved_to_disk(tokenizer, dataset_dict, tmp_path):
    """A directory written by save_to_disk (a DatasetDict, or one Dataset) is read locally, split by split."""
    dataset_dict.save_to_disk(tmp_path / "dd")
    dataset_dict["test"].save_to_disk(tmp_path / "test")
    dm = setup_dm(str(tmp_path / "dd"), tokenizer, split="train", val_prompts=str(tmp_path / "test"))
    assert dm.dataset.prompts == PROMPTS and dm.val_dataset.prompts == VAL_PROMPTS[:3]
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\], but data.split is not set"):
        setup_dm(str(tmp_path / "dd"), tokenizer)


def test_split_settings_from_yaml():
    """jsonargparse (as LightningCLI) reads the held-out and split settings from YAML."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(PromptDataModule, "data")
    cfg = parser.parse_string("data:\n  prompts: p.jsonl\n  tokenizer: tok\n  split: train\n  val_prompts: v.jsonl\n"
                              "  val_split: test\n  val_batch_size: 4\n  predict_prompts: q.jsonl\n")
    assert (cfg.data.split, cfg.data.val_prompts, cfg.data.val_split) == ("train", "v.jsonl", "test")
    assert (cfg.data.val_batch_size, cfg.data.predict_prompts, cfg.data.predict_split) == (4, "q.jsonl", None)
