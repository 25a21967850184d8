"""Shared fixtures: the offline demo tokenizer and a tiny random-init GPT-2 config. Nothing touches a hub."""

import pytest
import torch

from lightning_app_rlhf.demo import build_tokenizer
from lightning_app_rlhf.upstream_warnings import UPSTREAM_WARNINGS

torch.set_num_threads(1)


def pytest_configure(config):
    """pyproject.toml makes every deprecation an error; these are the ones raised by dependencies' own calls. Added
    after the ini's entries, so they take precedence."""
    for upstream in UPSTREAM_WARNINGS:
        config.addinivalue_line("filterwarnings", upstream.pytest_filter())

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 1,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 512,
    "n_positions": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
"""One layer, 32 dims: builds in milliseconds and matches the demo tokenizer's 512 tokens."""


@pytest.fixture(scope="session")
def tokenizer():
    """The demo byte-level BPE tokenizer (<pad>=0, <bos>=1, <eos>=2, 512 tokens, left padding). Do not mutate."""
    return build_tokenizer()


@pytest.fixture
def tiny_gpt2_config():
    """A fresh copy of the tiny GPT-2 config dict, safe to modify in a test."""
    return dict(TINY_GPT2)


@pytest.fixture(scope="session")
def demo_tokenizer(tokenizer):
    """Alias of ``tokenizer`` (the same session-wide demo tokenizer) for tests that use this name."""
    return tokenizer
