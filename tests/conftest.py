"""Shared fixtures: the offline demo tokenizer and a tiny random-init GPT-2 config. Nothing touches a hub. The plain
helpers (subprocesses with one thread, gloo ranks, ``make_module``) are in tests/helpers.py."""

import os

import helpers
import pytest
import torch
import torch.distributed as dist
from helpers import TINY_GPT2

from lightning_app_rlhf.core.upstream_warnings import UPSTREAM_WARNINGS

torch.set_num_threads(1)


def pytest_configure(config):
    """pyproject.toml makes every deprecation an error; these are the ones raised by dependencies' own calls. Added
    after the ini's entries, so they take precedence."""
    for upstream in UPSTREAM_WARNINGS:
        config.addinivalue_line("filterwarnings", upstream.pytest_filter())


@pytest.fixture(scope="session")
def tokenizer():
    """The demo byte-level BPE tokenizer (<pad>=0, <bos>=1, <eos>=2, 512 tokens, left padding). Do not mutate."""
    return helpers.demo_tokenizer()


@pytest.fixture
def tiny_gpt2_config():
    """A fresh copy of the tiny GPT-2 config dict, safe to modify in a test."""
    return dict(TINY_GPT2)


@pytest.fixture(scope="session")
def demo_tokenizer(tokenizer):
    """Alias of ``tokenizer`` (the same session-wide demo tokenizer) for tests that use this name."""
    return tokenizer


@pytest.fixture(autouse=True)
def no_process_group_or_rank_variables_left_behind():
    """Each test ends with the environment it started with and no process group. A Trainer or Fabric run in this
    process under a placement keeps its gloo group (listening on ``MASTER_PORT``) and leaves ``MASTER_ADDR``,
    ``MASTER_PORT``, ``LOCAL_RANK`` and ``NODE_RANK`` in ``os.environ``: a later test's CLI run would inherit them, and
    Lightning, seeing ``LOCAL_RANK``, would wait for ranks it believes someone else launches."""
    environment = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)
