"""Prompt data: a Python list, a JSONL file, a Hugging Face ``datasets`` dataset, or an import path."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lightning_app_rlhf.roles import load_tokenizer, resolve_import

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
        self.prompts = render_prompts(prompts, tokenizer, chat_template)
        """The final prompt strings, after any chat template."""
        truncate = max_prompt_length is not None
        encoded = tokenizer(self.prompts, add_special_tokens=False, truncation=truncate, max_length=max_prompt_length)
        self.input_ids = encoded["input_ids"]
        empty = [i for i, ids in enumerate(self.input_ids) if not ids]
        if empty:
            raise ValueError(f"Prompt #{empty[0]} ({self.prompts[empty[0]]!r}) encodes to no tokens: remove it.")

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.input_ids[index], "index": index, "fields": self.fields[index]}


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
        ``fields``: one list per field name, aligned with the rows (``{}`` when the rows have none).
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
    return {"input_ids": input_ids, "attention_mask": attention_mask, "index": index, "fields": fields}


def read_prompts(source: Any, prompt_key: str) -> list[str | Messages]:
    """Prompts from a list, a JSONL path, an import path ("pkg.module:name"), or a ``datasets`` dataset.

    Args:
        source: See :func:`read_rows`.
        prompt_key: Field or column that holds the prompt.

    Returns:
        The prompts: strings, or chat message lists where the rows hold those.
    """
    return read_rows(source, prompt_key)[0]


def read_rows(source: Any, prompt_key: str) -> tuple[list[str | Messages], list[dict[str, Any]]]:
    """Prompts plus each row's other fields, from any source :class:`PromptDataModule` accepts.

    Args:
        source: A list of strings, message lists, or dicts holding ``prompt_key``; a JSONL file path; a
            ``datasets.Dataset``; or an import path ``"package.module:name"`` to one of those or to a function
            returning one.
        prompt_key: Field or column that holds the prompt.

    Returns:
        ``(prompts, fields)``: per row, its prompt and a dict of its other fields (``{}`` for bare prompts).
    """
    if isinstance(source, str):
        if os.path.isfile(source):
            with open(source, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            return _split_rows(rows, prompt_key, source)
        if os.path.exists(source):
            raise ValueError(f"Prompt source {source!r} is not a file: give a .jsonl file with one object per line.")
        looks_like_path = os.sep in source or source.endswith((".jsonl", ".json", ".txt", ".csv")) or not any(c in source for c in ".:")
        if looks_like_path:
            raise FileNotFoundError(f"Prompt file {source!r} does not exist. Give a .jsonl file with one prompt "
                                    "per line, or an import path 'package.module:name'.")
        target = resolve_import(source)
        return read_rows(target() if callable(target) else target, prompt_key)
    if hasattr(source, "column_names"):  # a datasets.Dataset
        return _split_dataset(source, prompt_key)
    return _split_rows(source, prompt_key, "the prompt list")


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


class PromptDataModule(pl.LightningDataModule):
    """Prompts for PPO rollouts, tokenised without special tokens and left-padded per batch.

    Rows may carry fields besides the prompt (e.g. ``{"prompt": "What is 2+3?", "answer": "5"}``); each batch
    holds them under ``batch["fields"]``, one list per field name aligned with the rows, for verifiable rewards.

    Args:
        prompts: A list of strings, chat message lists, or dicts with ``prompt_key``; a JSONL file path; a
            ``datasets.Dataset``; or an import path ``"package.module:name"`` to such a list or to a function
            returning one. Every row must have the same extra fields.
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
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}.")
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.seed = seed
        self.chat_template = chat_template
        self.dataset: PromptDataset | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.dataset is not None:
            return
        self.tokenizer = load_tokenizer(self.tokenizer)
        prompts, fields = read_rows(self.prompts, self.prompt_key)
        if not prompts:
            raise ValueError(f"The prompt dataset is empty (source: {_describe(self.prompts)}). Give at least "
                             f"data.batch_size={self.batch_size} prompts.")
        if len(prompts) < self.batch_size:
            raise ValueError(f"The prompt dataset has {len(prompts)} prompts, fewer than data.batch_size="
                             f"{self.batch_size}, so not one full batch can be drawn. Add prompts or lower "
                             "data.batch_size.")
        self.dataset = PromptDataset(prompts, self.tokenizer, self.max_prompt_length, fields, self.chat_template)

    @override
    def train_dataloader(self) -> DataLoader:
        """Every rank gets the same global batches; a resumed run starts at the checkpoint's iteration."""
        assert self.dataset is not None, "call setup() first"
        seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        sampler = PromptSampler(len(self.dataset), self.batch_size, self.shuffle, seed)
        if self.trainer is not None:
            sampler.start_batch = self.trainer.global_step  # restored before dataloaders are built
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,  # every iteration sees a full batch
            num_workers=self.num_workers,
            collate_fn=functools.partial(collate_left_padded, pad_token_id=self.tokenizer.pad_token_id),
        )


def _describe(source: Any) -> str:
    return repr(source) if isinstance(source, str) else type(source).__name__
