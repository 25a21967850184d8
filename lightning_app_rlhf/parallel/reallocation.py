"""The weights a reallocation moves: a trained role's, a bucket at a time from its wrapper, and a shadow's in the same
buckets (:meth:`~lightning_app_rlhf.parallel.placement.Placement.reallocate_weights` sends the first into the
second). Plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lightning_app_rlhf.parallel.wrappers import RoleWrapper
from lightning_app_rlhf.parallel.wrappers.base import REALLOCATION_BUCKET_NUMEL, parameter_buckets


def trained_buckets(wrapper: RoleWrapper, shadow_precision: str | None) -> Iterator[list[torch.Tensor]]:
    """A trained role's weights, whole, a bucket at a time from its wrapper (a gather per bucket when sharded), in
    its shadows' precision: what :meth:`Placement.reallocate_weights` sends to them."""
    for bucket in wrapper.full_parameter_buckets():
        if shadow_precision == "bf16-true":  # bf16 shadows: round here, send half the bytes
            bucket = [p.detach().to(torch.bfloat16) for p in bucket]
        yield bucket


def shadow_buckets(shadow: nn.Module) -> list[list[torch.Tensor]]:
    """A shadow's trainable parameters in the buckets its train leader sends (:func:`trained_buckets`)."""
    params = [p for p in shadow.parameters() if p.requires_grad]
    return [params[bucket] for bucket in parameter_buckets(params, REALLOCATION_BUCKET_NUMEL)]
