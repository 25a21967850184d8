"""``PipelineDDPWrapper``: a trained role pipelined over its train ranks, data parallel over pipelines. Plain PyTorch.

Each rank holds one stage of the role (:class:`~lightning_app_rlhf.parallel.pipeline.PipelinedRole`, cut in place from
the role's module, so the role's optimizer takes the stage's parameters). A minibatch's share runs through torch's
schedule (:meth:`PipelineDDPWrapper.train_pipeline`); with several pipelines, each stage's gradients are then summed
over the ranks that hold the same stage (DDP's all-reduce, one per minibatch, on a group created with a timeout).
Clipping takes the whole role's norm over the pipeline; the role's whole weights, gathered from the stages by name,
stream out in the unpipelined role's ``parameters()`` order, which is what its shadows and copies take.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from lightning_app_rlhf.parallel.failures import named_failure
from lightning_app_rlhf.parallel.pipeline import LossFn, PipelinedRole, PipelineGroup, PipelineInputs
from lightning_app_rlhf.parallel.pipeline_weights import gather_full_state_dict
from lightning_app_rlhf.parallel.wrappers.base import (
    REALLOCATION_BUCKET_NUMEL,
    RoleWrapper,
    parameter_buckets,
)


class PipelineDDPWrapper(RoleWrapper):
    """A trained role's stage on this rank, gradients summed over the pipelines.

    Args:
        module: The role's whole module on this rank; :meth:`wrap` cuts it to this rank's stage.
        group: The train call's group (None with one rank).
        group_size: Ranks of the train call.
        group_rank: This rank's index among them.
        device: This rank's device.
        pipeline: This rank's pipeline.
        stage_group: The ranks holding this stage in every pipeline (None with one pipeline).
        rank: This process's global rank.
        call: The train call (named by errors).
        schedule: The training schedule, ``1f1b`` or ``gpipe``.
    """

    name = "ddp"  # the plan's wrapper for the role: DDP, applied per stage group

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, group_size: int, group_rank: int,
                 device: torch.device, *, pipeline: PipelineGroup, stage_group: dist.ProcessGroup | None, rank: int,
                 call: str, schedule: str) -> None:
        super().__init__(module, group, group_size, group_rank, device)
        self.pipeline, self.stage_group, self.rank, self.call, self.schedule = pipeline, stage_group, rank, call, schedule
        self.role: PipelinedRole | None = None
        self.full_names: list[str] = []
        self.full_bytes = 0

    @override
    def wrap(self) -> None:
        # The unpipelined role's trainable names, in parameters() order: what its shadows and copies take.
        self.full_names = [name for name, p in self.module.named_parameters() if p.requires_grad]
        self.full_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters() if p.requires_grad)
        self.role = PipelinedRole(self.module, self.pipeline, self.rank, self.device, self.call, self.schedule)

    @property
    def stage(self) -> PipelinedRole:
        assert self.role is not None, "wrap() cuts the role first"
        return self.role

    @property
    def timeout(self) -> datetime.timedelta:
        return self.pipeline.timeout

    # ---- training ----

    def micro_batches(self, rows: int, wanted: int) -> int:
        """The micro-batch count of a pipeline's ``rows``: the smallest divisor of ``rows`` that is at least
        ``wanted`` (the engine's count for its micro-batch size) and, under 1F1B, the number of stages (torch's
        schedules take equal micro-batches, and 1F1B needs one per stage). Smaller micro-batches than asked never
        change the update: their losses are shares of the whole minibatch.

        Raises:
            ValueError: ``rows`` is below that floor, naming the fix.
        """
        stages = self.pipeline.num_stages
        floor = max(wanted, stages if self.schedule == "1f1b" else 1, 1)
        for count in range(floor, rows + 1):
            if rows % count == 0:
                return count
        raise ValueError(f"{self.call}: a pipeline trains on {rows} rows of each minibatch, fewer than the {floor} "
                         f"micro-batches its {self.schedule} schedule over {stages} stages needs. Use fewer "
                         "ppo.num_minibatches or a larger batch, the gpipe schedule (pipeline_schedule: gpipe), or a "
                         "lower pp.")

    def train_pipeline(self, inputs: PipelineInputs, loss_fn: LossFn, n_microbatches: int,
                       logits_to_keep: int = 0) -> None:
        """Forward and backward of this pipeline's share of a minibatch through the schedule, then each stage's
        gradients summed over the pipelines (the loss functions divide by the whole minibatch's sizes, so the sum is
        the minibatch's gradient)."""
        self.stage.backward(inputs, loss_fn, n_microbatches, logits_to_keep)
        self._sum_over_pipelines()

    def _sum_over_pipelines(self) -> None:
        if self.stage_group is None:
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in parameter_buckets(params, REALLOCATION_BUCKET_NUMEL):
            flat = torch.cat([p.grad.reshape(-1) for p in params[bucket]])
            with named_failure(f"Rank {self.rank}: the gradient all-reduce of {self.call} over the pipelines' stage "
                               f"{self.stage.stage_index}", self.timeout):
                dist.all_reduce(flat, group=self.stage_group, async_op=True).wait(self.timeout)
            offset = 0
            for p in params[bucket]:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    @override
    def clip_gradients(self) -> float:
        """The whole role's gradient norm over the pipeline (a tied weight counted once), clipped to
        ``max_grad_norm`` as ``clip_grad_norm_`` clips the unpipelined role."""
        norm = self.stage.grad_norm()
        if self.max_grad_norm is not None and torch.isfinite(norm):
            factor = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            for p in self.stage.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
        return float(norm)

    # ---- the role's whole weights ----

    def gathered_bytes(self) -> int:
        """Bytes this rank receives to hold the role's trainable weights whole: those of the other stages."""
        held = sum(p.numel() * p.element_size() for p in self.stage.parameters() if p.requires_grad)
        return max(0, self.full_bytes - held)

    @override
    def full_parameter_buckets(self, bucket_numel: int = REALLOCATION_BUCKET_NUMEL) -> Iterator[list[torch.Tensor]]:
        """The whole role's trainable parameters, gathered from the stages by name (bit for bit), in the unpipelined
        role's ``parameters()`` order. Collective over the pipeline: each of its stages draws every bucket."""
        full = gather_full_state_dict(self.stage)
        params = [full[name] for name in self.full_names]
        for bucket in parameter_buckets(params, bucket_numel):
            yield params[bucket]
