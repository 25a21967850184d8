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


class PromptDataset(Dataset):
    """Tokenised prompts. Each item carries its index, which keys the sample's random draws."""

    def __init__(self, prompts: Sequence[str], tokenizer: PreTrainedTokenizerBase, max_prompt_length: int | None):
        self.prompts = list(prompts)
        truncate = max_prompt_length is not None
        encoded = tokenizer(self.prompts, add_special_tokens=False, truncation=truncate, max_length=max_prompt_length)
        self.input_ids = encoded["input_ids"]
        empty = [i for i, ids in enumerate(self.input_ids) if not ids]
        if empty:
            raise ValueError(f"Prompt #{empty[0]} ({self.prompts[empty[0]]!r}) encodes to no tokens: remove it.")

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.input_ids[index], "index": index}


def collate_left_padded(items: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-pad a list of token-id lists into ``input_ids`` / ``attention_mask`` plus the sample ``index``."""
    length = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), length), dtype=torch.long)
    for row, item in enumerate(items):
        ids = item["input_ids"]
        input_ids[row, length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, length - len(ids) :] = 1
    index = torch.tensor([item["index"] for item in items], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "index": index}


def read_prompts(source: Any, prompt_key: str) -> list[str]:
    """Prompts from a list, a JSONL path, an import path ("pkg.module:name"), or a ``datasets`` dataset."""
    if isinstance(source, str):
        if os.path.isfile(source):
            with open(source, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            return [_prompt_of(row, prompt_key, source) for row in rows]
        if os.path.exists(source):
            raise ValueError(f"Prompt source {source!r} is not a file: give a .jsonl file with one object per line.")
        looks_like_path = os.sep in source or source.endswith((".jsonl", ".json", ".txt", ".csv")) or not any(c in source for c in ".:")
        if looks_like_path:
            raise FileNotFoundError(f"Prompt file {source!r} does not exist. Give a .jsonl file with one prompt "
                                    "per line, or an import path 'package.module:name'.")
        target = resolve_import(source)
        return read_prompts(target() if callable(target) else target, prompt_key)
    if hasattr(source, "column_names"):  # a datasets.Dataset
        if prompt_key not in source.column_names:
            raise ValueError(f"The dataset has no column {prompt_key!r}; its columns are {source.column_names}. "
                             "Set data.prompt_key to the column that holds the prompts.")
        return list(source[prompt_key])
    return [_prompt_of(row, prompt_key, "the prompt list") for row in source]


def _prompt_of(row: Any, prompt_key: str, where: str) -> str:
    if isinstance(row, str):
        return row
    if isinstance(row, dict) and isinstance(row.get(prompt_key), str):
        return row[prompt_key]
    raise ValueError(f"Each row of {where} must be a string or an object with a string {prompt_key!r} field; got "
                     f"{row!r}. Set data.prompt_key to the field that holds the prompt.")


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

    Args:
        prompts: A list of strings (or dicts with ``prompt_key``), a JSONL file path, a ``datasets.Dataset``,
            or an import path ``"package.module:name"`` to such a list or to a function returning one.
        tokenizer: A tokenizer, a local tokenizer directory, or ``"package.module:function"`` building one.
        batch_size: Prompts per PPO iteration (the rollout batch).
        prompt_key: Field or column that holds the prompt text.
        max_prompt_length: Truncate longer prompts to this many tokens (None keeps them whole).
        shuffle: Reshuffle prompts every epoch.
        num_workers: DataLoader workers.
        seed: Keys the epoch permutations. Default: the seed of ``seed_everything``, else 0.
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
        self.dataset: PromptDataset | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.dataset is not None:
            return
        self.tokenizer = load_tokenizer(self.tokenizer)
        prompts = read_prompts(self.prompts, self.prompt_key)
        if not prompts:
            raise ValueError(f"The prompt dataset is empty (source: {_describe(self.prompts)}). Give at least "
                             f"data.batch_size={self.batch_size} prompts.")
        if len(prompts) < self.batch_size:
            raise ValueError(f"The prompt dataset has {len(prompts)} prompts, fewer than data.batch_size="
                             f"{self.batch_size}, so not one full batch can be drawn. Add prompts or lower "
                             "data.batch_size.")
        self.dataset = PromptDataset(prompts, self.tokenizer, self.max_prompt_length)

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
            drop_last=True,  # every PPO iteration sees a full batch
            num_workers=self.num_workers,
            collate_fn=functools.partial(collate_left_padded, pad_token_id=self.tokenizer.pad_token_id),
        )


def _describe(source: Any) -> str:
    return repr(source) if isinstance(source, str) else type(source).__name__
