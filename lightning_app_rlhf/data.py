"""Prompt data: a Python list, a JSONL file, a Hugging Face ``datasets`` dataset (or one split of a ``DatasetDict``,
or a directory saved with ``save_to_disk``), or an import path."""

from __future__ import annotations

import codecs
import functools
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lightning_app_rlhf.generation import context_length_error, sample_keys
from lightning_app_rlhf.models.roles import load_tokenizer, resolve_import

Messages = list[dict[str, str]]
"""A chat prompt in TRL's conversational format: ``[{"role": "user", "content": "..."}, ...]``."""


class PromptDataset(Dataset):
    """Tokenised prompts plus each row's extra fields. Each item carries its index, which keys its random draws.

    Args:
        prompts: Prompt strings, or chat message lists (TRL's conversational format).
        tokenizer: Tokenises the prompts (without special tokens) and renders chat messages.
        max_prompt_length: Truncate longer prompts to this many tokens (None keeps them whole).
        fields: Per prompt, the row's other fields (e.g. ``{"answer": "5"}``) handed to the reward in the batch.
            Every row must have the same field names. None: no fields.
        chat_template: None applies the tokenizer's chat template exactly to the message-list prompts; True also
            wraps string prompts as one user message; False refuses message lists.
    """

    def __init__(
        self,
        prompts: Sequence[str | Messages],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_length: int | None,
        fields: Sequence[dict[str, Any]] | None = None,
        chat_template: bool | None = None,
    ) -> None:
        self.fields = [dict(row) for row in fields] if fields is not None else [{} for _ in prompts]
        if len(self.fields) != len(prompts):
            raise ValueError(f"Got {len(prompts)} prompts but {len(self.fields)} field rows: give one fields dict "
                             "per prompt.")
        _check_same_fields(self.fields, "prompt row")
        self.rows = list(prompts)
        """The prompts as given (strings or message lists): what a multi-turn environment's ``reset`` reads."""
        self.prompts = render_prompts(prompts, tokenizer, chat_template)
        """The final prompt strings, after any chat template."""
        truncate = max_prompt_length is not None
        encoded = tokenizer(self.prompts, add_special_tokens=False, truncation=truncate, max_length=max_prompt_length)
        self.input_ids = encoded["input_ids"]
        empty = [i for i, ids in enumerate(self.input_ids) if not ids]
        if empty and max_prompt_length is not None and max_prompt_length < 1:  # every prompt truncated away
            raise ValueError(f"data.max_prompt_length must be >= 1 (or null to keep prompts whole), got "
                             f"{max_prompt_length}.")
        if empty:  # PromptDataModule drops blank prompts first: what is left here is text the tokenizer skips
            raise ValueError(f"Prompt #{empty[0]} ({self.prompts[empty[0]]!r}) encodes to no tokens: remove it, or "
                             "use a tokenizer that reads its characters.")

    def __len__(self) -> int:
        return len(self.prompts)

    def longest(self) -> tuple[int, int]:
        """The row of the longest tokenised prompt (the first of equals, counting from 0) and its token count."""
        lengths = [len(ids) for ids in self.input_ids]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        return longest, lengths[longest]

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.input_ids[index], "index": index, "fields": self.fields[index],
                "prompt": self.rows[index]}


def check_prompts_fit(datasets: Sequence[tuple[str, Any]], context: int | None, max_new_tokens: int) -> None:
    """Raise a ``ValueError`` naming the longest prompt (its row and start) and the fixes unless every prompt of
    ``datasets``, plus ``max_new_tokens``, fits the actor's ``context``: at setup, rather than when that prompt's batch
    comes (generation checks each batch again, for prompts that come another way).

    Args:
        datasets: ``(description, dataset)`` pairs, e.g. ``("data.prompts", dataset)``; a dataset without tokenised
            prompts (not a :class:`PromptDataset`) is skipped.
        context: The actor's context length (None: it declares none, and nothing is checked).
        max_new_tokens: ``generation.max_new_tokens``.
    """
    if context is None:
        return
    for where, dataset in datasets:
        if not isinstance(dataset, PromptDataset) or not len(dataset):
            continue
        row, length = dataset.longest()
        if length + max_new_tokens > context:
            start = dataset.prompts[row]
            start = repr(start if len(start) <= 60 else start[:57] + "...")
            raise ValueError(context_length_error(length, max_new_tokens, context,
                                                  f"The longest prompt of {where}, row #{row} ({start}),"))


def render_prompts(
    prompts: Sequence[str | Messages], tokenizer: PreTrainedTokenizerBase, chat_template: bool | None = None
) -> list[str]:
    """The prompt strings to tokenise: plain strings as they are, chat messages through the tokenizer's template.

    Args:
        prompts: Prompt strings or chat message lists.
        tokenizer: Its ``chat_template`` renders message lists.
        chat_template: None renders just the message lists; True also wraps strings as one user message;
            False refuses message lists.

    Returns:
        One string per prompt.

    Raises:
        ValueError: A prompt is neither a string nor a valid message list, message lists are given with
            ``chat_template=False``, or a template is needed and the tokenizer has none.
    """
    for i, prompt in enumerate(prompts):
        _check_prompt(prompt, i, chat_template)
    wrap = chat_template is True
    if not (wrap or any(isinstance(prompt, list) for prompt in prompts)):
        return list(prompts)
    if getattr(tokenizer, "chat_template", None) is None:
        why = "data.chat_template is true" if wrap else "the prompts are chat message lists"
        raise ValueError(f"The tokenizer has no chat template, but {why}. Use a tokenizer that has a chat template "
                         "(an instruct/chat model's), or set data.chat_template: false and give plain-text prompts.")
    return [_apply_template(prompt, tokenizer) if wrap or isinstance(prompt, list) else prompt for prompt in prompts]


def _check_prompt(prompt: Any, row: int, chat_template: bool | None) -> None:
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise ValueError(f"Prompt #{row} is a {type(prompt).__name__} ({prompt!r}); give a string or a list of chat "
                         'messages like [{"role": "user", "content": "..."}].')
    if chat_template is False:
        raise ValueError(f"Prompt #{row} is a list of chat messages, but data.chat_template is false. Set "
                         "data.chat_template to null (or true) to apply the tokenizer's chat template, or give "
                         "plain-text prompts.")
    if not prompt:
        raise ValueError(f"Prompt #{row} is an empty message list: give at least one message, or remove the row.")
    for m, message in enumerate(prompt):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"Prompt #{row}, message #{m} is {message!r}: each chat message must be an object with "
                             'string "role" and "content" fields, like {"role": "user", "content": "..."}.')


def _apply_template(prompt: str | Messages, tokenizer: PreTrainedTokenizerBase) -> str:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    # Ends with the assistant's turn header so the actor answers; the template writes any BOS itself, hence
    # tokenising later with add_special_tokens=False (as TRL does) to avoid a doubled BOS.
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _check_same_fields(rows: Sequence[dict[str, Any]], what: str) -> None:
    """Fields are collated into one list per name, so every row must have the same names."""
    if not rows:
        return
    expected = set(rows[0])
    for i, row in enumerate(rows):
        if set(row) != expected:
            missing, extra = sorted(expected - set(row)), sorted(set(row) - expected)
            raise ValueError(f"{what.capitalize()} #{i} has fields {sorted(row)}, but {what} #0 has "
                             f"{sorted(expected)} (missing: {missing}, extra: {extra}). Give every row the same "
                             "fields besides the prompt: add the missing ones (e.g. as null) or drop the extra ones.")


def collate_left_padded(items: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Left-pad a list of dataset items into one batch.

    Args:
        items: ``{"input_ids": list[int], "index": int, "fields": dict}`` each; ``fields`` may be absent.
        pad_token_id: Fills the left padding.

    Returns:
        ``input_ids`` and ``attention_mask`` (long, ``[rows, longest]``), ``index`` (long, ``[rows]``), and
        ``fields``: one list per field name, aligned with the rows (``{}`` when the rows have none), and
        ``prompts``: the items' prompts as the dataset holds them, when they carry them (``prompt``).
    """
    length = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), length), dtype=torch.long)
    for row, item in enumerate(items):
        ids = item["input_ids"]
        input_ids[row, length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, length - len(ids) :] = 1
    index = torch.tensor([item["index"] for item in items], dtype=torch.long)
    rows = [item.get("fields", {}) for item in items]
    _check_same_fields(rows, "batch row")
    fields = {name: [row[name] for row in rows] for name in rows[0]}
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "index": index, "fields": fields}
    if all("prompt" in item for item in items):
        batch["prompts"] = [item["prompt"] for item in items]
    return batch


def read_prompts(source: Any, prompt_key: str, split: str | None = None) -> list[str | Messages]:
    """Prompts from a list, a JSONL path, an import path ("pkg.module:name"), or a ``datasets`` dataset.

    Args:
        source: See :func:`read_rows`.
        prompt_key: Field or column that holds the prompt.
        split: The split to read when ``source`` is a ``DatasetDict`` (see :func:`read_rows`).

    Returns:
        The prompts: strings, or chat message lists where the rows hold those.
    """
    return read_rows(source, prompt_key, split)[0]


def read_rows(
    source: Any, prompt_key: str, split: str | None = None
) -> tuple[list[str | Messages], list[dict[str, Any]]]:
    """Prompts plus each row's other fields, from any source :class:`PromptDataModule` accepts.

    Args:
        source: A list of strings, message lists, or dicts holding ``prompt_key``; a JSONL file path; a
            ``datasets.Dataset``; a ``datasets.DatasetDict`` (or any mapping of split name to one of these) with
            ``split``; a directory written by ``save_to_disk``; or an import path ``"package.module:name"`` to one
            of those or to a function returning one. Nothing is downloaded.
        prompt_key: Field or column that holds the prompt.
        split: Which split of a ``DatasetDict`` to read; required for one, refused for any other source.

    Returns:
        ``(prompts, fields)``: per row, its prompt and a dict of its other fields (``{}`` for bare prompts).
    """
    return _read_rows(source, prompt_key, split, "data.split")


def _read_rows(
    source: Any, prompt_key: str, split: str | None, split_setting: str
) -> tuple[list[str | Messages], list[dict[str, Any]]]:
    """:func:`read_rows`, whose errors name ``split_setting`` (``data.split``, ``data.val_split``, ...)."""
    if isinstance(source, str):
        if os.path.isdir(source) and _is_saved_dataset(source):
            return _read_rows(_load_from_disk(source), prompt_key, split, split_setting)
        if os.path.isfile(source):
            _refuse_split(source, split, split_setting)
            return _split_rows(_read_jsonl(source), prompt_key, source)
        if os.path.exists(source):
            raise ValueError(f"Prompt source {source!r} is not a file: give a .jsonl file with one object per line, "
                             "or a directory written by a datasets Dataset's or DatasetDict's save_to_disk().")
        looks_like_path = os.sep in source or source.endswith((".jsonl", ".json", ".txt", ".csv")) or not any(c in source for c in ".:")
        if looks_like_path:
            raise FileNotFoundError(f"Prompt file {source!r} does not exist. Give a .jsonl file with one prompt "
                                    "per line, or an import path 'package.module:name'.")
        target = resolve_import(source)
        return _read_rows(target() if callable(target) else target, prompt_key, split, split_setting)
    if isinstance(source, Mapping):  # a datasets.DatasetDict (a dict subclass), or a plain dict of splits
        return _read_rows(_pick_split(source, split, split_setting), prompt_key, None, split_setting)
    _refuse_split(source, split, split_setting)
    if hasattr(source, "column_names"):  # a datasets.Dataset
        return _split_dataset(source, prompt_key)
    return _split_rows(source, prompt_key, "the prompt list")


_PREFERRED_SPLITS = {
    "data.split": ("train",),
    "data.val_split": ("validation", "valid", "val", "test"),
    "data.predict_split": ("test", "validation", "valid", "val"),
}
"""The split each setting's error suggests first, when the source has it."""


def _read_jsonl(path: str) -> list[Any]:
    """The JSON value of each non-blank line of ``path``. Errors name the file and the 1-based line, and for bytes
    that are not UTF-8 the byte offset in the file."""
    with open(path, "rb") as f:
        data = f.read()
    offset = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # Windows editors write one
    rows = []
    for number, line in enumerate(data[offset:].splitlines(keepends=True), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"Prompt file {path!r} is not valid UTF-8: byte offset {offset + err.start} (line "
                             f"{number}) holds {line[err.start:err.end]!r} ({err.reason}). Save the file as UTF-8, "
                             "e.g. `iconv -f LATIN1 -t UTF-8 in.jsonl > out.jsonl`.") from err
        offset += len(line)
        if not text.strip():
            continue
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError as err:
            raise ValueError(f"Prompt file {path!r}, line {number}, column {err.colno}: not valid JSON ({err.msg}). "
                             'Each non-blank line must hold one JSON value, e.g. {"prompt": "..."}.') from err
    return rows


def _drop_blank_prompts(
    prompts: list[str | Messages], fields: list[dict[str, Any]], what: str
) -> tuple[list[str | Messages], list[dict[str, Any]], int]:
    """Leave out the prompt strings that are empty or whitespace only, with one warning naming how many and the
    first rows; returns the kept prompts, their fields, and how many were dropped."""
    blank = [i for i, prompt in enumerate(prompts) if isinstance(prompt, str) and not prompt.strip()]
    if not blank:
        return prompts, fields, 0
    shown = ", ".join(f"#{i}" for i in blank[:5]) + (", ..." if len(blank) > 5 else "")
    # A warning, not an error: blank lines creep into generated prompt files, and one should not stop a run.
    warnings.warn(f"Dropped {len(blank)} of the {len(prompts)} prompts of {what}: they are empty or whitespace "
                  f"only (rows {shown}, counting from 0). Remove them from the source to silence this warning.",
                  stacklevel=3)
    dropped = set(blank)
    kept = [i for i in range(len(prompts)) if i not in dropped]
    return [prompts[i] for i in kept], [fields[i] for i in kept], len(blank)


def _pick_split(splits: Mapping[str, Any], split: str | None, split_setting: str) -> Any:
    names = list(splits)
    kind = type(splits).__name__
    if not names:
        raise ValueError(f"The prompt source is an empty {kind}: it has no splits to read. Give a non-empty "
                         "dataset.")
    if split is None:
        suggestion = next((name for name in _PREFERRED_SPLITS.get(split_setting, ()) if name in names), names[0])
        raise ValueError(f"The prompt source is a {kind} with splits {names}, but {split_setting} is not set, so "
                         f"it is unclear which split to read. Set {split_setting}: {suggestion} (or another of "
                         f"{names}), or give that split's dataset itself.")
    if split not in splits:
        raise ValueError(f"{split_setting}={split!r} is not a split of the prompt source ({kind}); its splits are "
                         f"{names}. Set {split_setting} to one of them.")
    return splits[split]


def _refuse_split(source: Any, split: str | None, split_setting: str) -> None:
    if split is not None:
        raise ValueError(f"{split_setting}={split!r} is set, but the prompt source ({_describe(source)}) has no "
                         f"splits: only a DatasetDict (or a dict of split name to prompts) has. Remove "
                         f"{split_setting}.")


def _is_saved_dataset(directory: str) -> bool:
    """A directory written by ``Dataset.save_to_disk`` (``state.json``) or ``DatasetDict.save_to_disk``."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in ("state.json", "dataset_dict.json"))


def _load_from_disk(directory: str) -> Any:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"Prompt source {directory!r} is a saved Hugging Face dataset; reading it needs the "
                          "`datasets` package: pip install 'lightning-app-rlhf[data]'.") from err
    return datasets.load_from_disk(directory)


def _split_dataset(dataset: Any, prompt_key: str) -> tuple[list[str | Messages], list[dict[str, Any]]]:
    if prompt_key not in dataset.column_names:
        raise ValueError(f"The dataset has no column {prompt_key!r}; its columns are {dataset.column_names}. "
                         "Set data.prompt_key to the column that holds the prompts.")
    prompts = list(dataset[prompt_key])
    others = {name: list(dataset[name]) for name in dataset.column_names if name != prompt_key}
    fields = [{name: values[i] for name, values in others.items()} for i in range(len(prompts))]
    return prompts, fields


def _split_rows(rows: Any, prompt_key: str, where: str) -> tuple[list[str | Messages], list[dict[str, Any]]]:
    prompts, fields = [], []
    for row in rows:
        prompts.append(_prompt_of(row, prompt_key, where))
        fields.append({k: v for k, v in row.items() if k != prompt_key} if isinstance(row, dict) else {})
    return prompts, fields


def _prompt_of(row: Any, prompt_key: str, where: str) -> str | Messages:
    if isinstance(row, (str, list)):  # a bare prompt: text or chat messages
        return row
    if isinstance(row, dict) and isinstance(row.get(prompt_key), (str, list)):
        return row[prompt_key]
    raise ValueError(f"Each row of {where} must be a string, a list of chat messages, or an object with a string "
                     f"{prompt_key!r} field (or a chat-message list there); got {row!r}. Set data.prompt_key to the "
                     "field that holds the prompt.")


class PromptSampler(Sampler[int]):
    """Whole batches of prompt indices, in an order fixed by (seed, epoch), that can start at any iteration.

    Iteration ``i`` always reads the same prompts: epoch ``i // batches_per_epoch``, batch ``i % batches_per_epoch``
    of that epoch's permutation. Resuming at ``start_batch = global_step`` therefore continues the data exactly
    where the interrupted run was, on every rank, whatever Lightning prefetched.

    Args:
        num_samples: Prompts in the dataset.
        batch_size: Prompts per iteration; the last partial batch of an epoch is dropped.
        shuffle: Permute the prompts every epoch (else dataset order).
        seed: Keys the permutations.
    """

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool, seed: int) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.batches_per_epoch = num_samples // batch_size
        self.start_batch = 0
        """The iteration the next ``__iter__`` starts at; advanced to the next epoch's start by each epoch."""

    def __len__(self) -> int:
        return self.batches_per_epoch * self.batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self):
        epoch, skip = divmod(self.start_batch, self.batches_per_epoch)
        order = self.epoch_order(epoch)[: len(self)]
        self.start_batch = (epoch + 1) * self.batches_per_epoch
        yield from order[skip * self.batch_size :]


class PromptLoader(DataLoader):
    """The training prompts' ``DataLoader``, resumable in Lightning's sense (it has ``state_dict`` and
    ``load_state_dict``, so a resume mid-epoch is not warned about): its position is the trainer's iteration, which
    :class:`PromptSampler` starts at when the loader is built (``start_batch = global_step``), so there is nothing else
    to save or restore."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the sampler already starts at the checkpoint's iteration."""


class PromptDataModule(pl.LightningDataModule):
    """Prompts for PPO rollouts, tokenised without special tokens and left-padded per batch.

    Rows may carry fields besides the prompt (e.g. ``{"prompt": "What is 2+3?", "answer": "5"}``); each batch
    holds them under ``batch["fields"]``, one list per field name aligned with the rows, for verifiable rewards.

    Training draws full batches of ``prompts`` (see :class:`PromptSampler`). Validation and test go once through
    the held-out ``val_prompts``, prediction through ``predict_prompts``, in dataset order, in batches of
    ``val_batch_size`` (the last one may be smaller). Every rank reads the same global batches, as in training:
    the placement shards rows inside the step, and the placement strategies keep Lightning from injecting a
    ``DistributedSampler``. Without held-out prompts ``val_dataloader`` has no batches and ``RLHFModule`` runs no
    validation (``limit_val_batches=0``); ``validate`` and ``test`` raise naming ``val_prompts``.

    Args:
        prompts: A list of strings, chat message lists, or dicts with ``prompt_key``; a JSONL file path; a
            ``datasets.Dataset``; a ``datasets.DatasetDict`` (with ``split``); a directory written by
            ``save_to_disk``; or an import path ``"package.module:name"`` to one of those or to a function
            returning one. Every row must have the same extra fields. Nothing is downloaded.
        tokenizer: A tokenizer, a local tokenizer directory, or ``"package.module:function"`` building one.
        batch_size: Prompts per iteration (the rollout batch holds ``batch_size x generation.num_samples`` samples).
        prompt_key: Field or column that holds the prompt text.
        max_prompt_length: Truncate longer prompts to this many tokens (None keeps them whole).
        shuffle: Reshuffle prompts every epoch.
        num_workers: DataLoader workers.
        seed: Keys the epoch permutations. Default: the seed of ``seed_everything``, else 0.
        chat_template: Whether to render prompts with the tokenizer's chat template (with the generation prompt
            appended). None: exactly the prompts that are chat message lists (``[{"role": ..., "content": ...}]``).
            True: also plain-text prompts, each as one user message. False: plain text only; message lists raise.
        split: The split of ``prompts`` to train on when it is a ``DatasetDict`` (e.g. ``"train"``).
        val_prompts: Held-out prompts for ``validate`` and ``test`` (and for ``fit``'s validation), from any
            source ``prompts`` accepts. None: none, unless ``val_split`` names another split of ``prompts``.
        val_split: The split of ``val_prompts`` when it is a ``DatasetDict`` (e.g. ``"test"``); without
            ``val_prompts``, that split of ``prompts``.
        val_batch_size: Prompts per validation, test and predict batch. Default: ``batch_size``.
        predict_prompts: Prompts for ``predict``. Default: the held-out prompts if any, else ``prompts``.
        predict_split: The split of the predict prompts when they are a ``DatasetDict``. Default: the split of the
            source they default to.
    """

    def __init__(
        self,
        prompts: Any,
        tokenizer: str | PreTrainedTokenizerBase,
        batch_size: int = 32,
        prompt_key: str = "prompt",
        max_prompt_length: int | None = None,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int | None = None,
        chat_template: bool | None = None,
        split: str | None = None,
        val_prompts: Any = None,
        val_split: str | None = None,
        val_batch_size: int | None = None,
        predict_prompts: Any = None,
        predict_split: str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}.")
        if val_batch_size is not None and val_batch_size < 1:
            raise ValueError(f"data.val_batch_size must be >= 1 (or null for data.batch_size), got {val_batch_size}.")
        self.prompts, self.prompt_key, self.split, self.chat_template = prompts, prompt_key, split, chat_template
        self.tokenizer, self.max_prompt_length = tokenizer, max_prompt_length
        self.batch_size, self.shuffle, self.num_workers, self.seed = batch_size, shuffle, num_workers, seed
        self.val_prompts, self.val_split = val_prompts, val_split
        self.val_batch_size = val_batch_size if val_batch_size is not None else batch_size
        self.predict_prompts, self.predict_split = predict_prompts, predict_split
        self.dataset: PromptDataset | None = None
        """The training prompts, after ``setup("fit")``."""
        self.val_dataset: PromptDataset | None = None
        """The held-out prompts, after ``setup`` for ``fit`` (when there are any), ``validate`` or ``test``."""
        self.predict_dataset: PromptDataset | None = None
        """The prompts of ``predict``, after ``setup("predict")``."""

    @property
    def has_val_prompts(self) -> bool:
        """Whether held-out prompts were given: ``val_prompts``, or ``val_split`` of ``prompts``."""
        return self.val_prompts is not None or self.val_split is not None

    @override
    def setup(self, stage: str) -> None:
        """Build the datasets ``stage`` reads (``fit``: training and any held-out prompts; ``validate`` and
        ``test``: the held-out prompts; ``predict``: the predict prompts). A dataset already built is kept."""
        if stage not in ("fit", "validate", "test", "predict"):
            raise ValueError(f"Unknown stage {stage!r}: expected 'fit', 'validate', 'test' or 'predict'.")
        self.tokenizer = load_tokenizer(self.tokenizer)
        if stage == "fit" and self.dataset is None:
            self.dataset = self._train_dataset()
        if stage in ("validate", "test") and not self.has_val_prompts:
            raise ValueError(f"trainer.{stage}() reads held-out prompts, but the datamodule has none. Set "
                             "data.val_prompts (or data.val_split to evaluate another split of data.prompts).")
        if stage in ("fit", "validate", "test") and self.has_val_prompts and self.val_dataset is None:
            self.val_dataset = self._held_out_dataset()
        if stage == "predict" and self.predict_dataset is None:
            self.predict_dataset = self._predict_dataset()

    def _train_dataset(self) -> PromptDataset:
        prompts, fields = _read_rows(self.prompts, self.prompt_key, self.split, "data.split")
        prompts, fields, dropped = _drop_blank_prompts(prompts, fields, "data.prompts")
        after = f" after dropping {dropped} blank ones" if dropped else ""
        if not prompts:
            raise ValueError(f"The prompt dataset is empty{after} (source: {_describe(self.prompts)}). Give at least "
                             f"data.batch_size={self.batch_size} prompts.")
        if len(prompts) < self.batch_size:
            raise ValueError(f"The prompt dataset has {len(prompts)} prompts{after}, fewer than data.batch_size="
                             f"{self.batch_size}, so not one full batch can be drawn. Add prompts or lower "
                             "data.batch_size.")
        return PromptDataset(prompts, self.tokenizer, self.max_prompt_length, fields, self.chat_template)

    def _held_out_dataset(self) -> PromptDataset:
        if self.val_prompts is not None:
            return self._eval_dataset(self.val_prompts, self.val_split, "data.val_split", "data.val_prompts")
        return self._eval_dataset(self.prompts, self.val_split, "data.val_split",
                                  f"data.prompts (split {self.val_split!r})")

    def _eval_dataset(self, source: Any, split: str | None, split_setting: str, what: str) -> PromptDataset:
        prompts, fields = _read_rows(source, self.prompt_key, split, split_setting)
        prompts, fields, dropped = _drop_blank_prompts(prompts, fields, what)
        if not prompts:
            after = f" after dropping {dropped} blank ones" if dropped else ""
            raise ValueError(f"The prompts of {what} are empty{after} (source: {_describe(source)}). Give at least "
                             "one prompt.")
        return PromptDataset(prompts, self.tokenizer, self.max_prompt_length, fields, self.chat_template)

    def _predict_dataset(self) -> PromptDataset:
        if self.predict_prompts is not None:
            return self._eval_dataset(self.predict_prompts, self.predict_split, "data.predict_split",
                                      "data.predict_prompts")
        if self.has_val_prompts:  # default to the held-out prompts
            source = self.val_prompts if self.val_prompts is not None else self.prompts
            split, shared, what = self.val_split, self.val_dataset, "the held-out prompts"
        else:
            source, split, shared, what = self.prompts, self.split, self.dataset, "data.prompts"
        if self.predict_split is not None and self.predict_split != split:
            split, shared, what = self.predict_split, None, f"{what} (split {self.predict_split!r})"
        # The same rows as the held-out (else the training) set: reuse that dataset when it is built.
        return shared if shared is not None else self._eval_dataset(source, split, "data.predict_split", what)

    @override
    def train_dataloader(self) -> DataLoader:
        """Every rank gets the same global batches; a resumed run starts at the checkpoint's iteration."""
        if self.dataset is None:
            raise RuntimeError("Call setup('fit') before train_dataloader().")
        sampler = PromptSampler(len(self.dataset), self.batch_size, self.shuffle, self._seed())
        if self.trainer is not None:
            sampler.start_batch = self.trainer.global_step  # restored before dataloaders are built
        return PromptLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,  # every iteration sees a full batch
            num_workers=self.num_workers,
            collate_fn=functools.partial(collate_left_padded, pad_token_id=self.tokenizer.pad_token_id),
        )

    def refill_batch(self, iteration: int, generation_round: int) -> dict[str, Any]:
        """``batch_size`` training prompts for a further generation round of dynamic sampling
        (``ppo.dynamic_sampling``), drawn without replacement from the whole training set in an order keyed by
        (seed, iteration, round): the same on every rank and after a resume, whatever the placement.

        Args:
            iteration: The iteration that is short of informative groups.
            generation_round: Its generation round (1 for the first refill).
        """
        if self.dataset is None:
            raise RuntimeError("Call setup('fit') before refill_batch().")
        key = int(sample_keys(self._seed(), iteration, torch.tensor([generation_round]))[0])
        rows = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(key))[: self.batch_size]
        return collate_left_padded([self.dataset[i] for i in rows.tolist()], self.tokenizer.pad_token_id)

    def _seed(self) -> int:
        return self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", "0"))

    @override
    def val_dataloader(self) -> DataLoader:
        """Every held-out prompt once, in order, in batches of ``val_batch_size`` (the last may be smaller); no
        batches without held-out prompts (``RLHFModule`` then turns validation off: ``limit_val_batches=0``)."""
        if not self.has_val_prompts:
            return []  # type: ignore[return-value]
        return self._eval_dataloader(self.val_dataset, "validate")

    @override
    def test_dataloader(self) -> DataLoader:
        """The held-out prompts, as :meth:`val_dataloader`."""
        return self._eval_dataloader(self.val_dataset, "test")

    @override
    def predict_dataloader(self) -> DataLoader:
        """Every predict prompt once, in order, in batches of ``val_batch_size`` (the last may be smaller)."""
        return self._eval_dataloader(self.predict_dataset, "predict")

    def _eval_dataloader(self, dataset: PromptDataset | None, stage: str) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"Call setup({stage!r}) before the {stage} dataloader.")
        return DataLoader(
            dataset,
            batch_size=self.val_batch_size,
            shuffle=False,  # dataset order: metrics and predictions line up with the rows
            drop_last=False,  # every prompt is evaluated once
            num_workers=self.num_workers,
            collate_fn=functools.partial(collate_left_padded, pad_token_id=self.tokenizer.pad_token_id),
        )


def _describe(source: Any) -> str:
    return repr(source) if isinstance(source, str) else type(source).__name__
