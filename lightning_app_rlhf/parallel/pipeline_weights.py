"""A pipelined role's weights by parameter name: gather the whole role from its stages, or load a whole role into a
stage, bit for bit. Plain PyTorch.

A stage is the role's own module with the other stages' parts removed, so its ``state_dict`` names are the
unpipelined model's. These are what moves a role between a pp training layout and a dp or tp generation layout
(reallocation), and what a checkpoint of a pipelined role writes and reads under another layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_app_rlhf.parallel.pipeline import PipelinedRole


def stage_state_dict(role: PipelinedRole) -> dict[str, torch.Tensor]:
    """This stage's weights, by the unpipelined model's names (detached views, not copies)."""
    return {name: t.detach() for name, t in role.module.role.state_dict().items()}


def gather_full_state_dict(role: PipelinedRole) -> dict[str, torch.Tensor]:
    """The whole role's state dict on every stage of its pipeline, with the unpipelined model's names and values, bit
    for bit: each tensor broadcast by the first stage that holds it (a tensor at a time, each wait bounded by the
    pipeline's timeout). Every stage of the pipeline must call it."""
    mine = stage_state_dict(role)
    if role.pipeline.num_stages == 1:
        return {name: t.clone() for name, t in mine.items()}
    layout = {name: (tuple(t.shape), t.dtype) for name, t in mine.items()}
    layouts: list[dict[str, tuple[tuple[int, ...], torch.dtype]] | None] = [None] * role.pipeline.num_stages
    with role._failure("exchange of the stages' parameter names"):
        dist.all_gather_object(layouts, layout, group=role.pipeline.group)
    full: dict[str, torch.Tensor] = {}
    for stage, names in enumerate(layouts):
        assert names is not None
        for name, (shape, dtype) in names.items():
            if name in full:
                continue  # held by two stages (a name repeated after a cut): the first one's is sent
            tensor = mine[name].clone() if stage == role.stage_index else torch.empty(shape, dtype=dtype,
                                                                                      device=role.device)
            with role._failure(f"broadcast of {name!r} from stage {stage}"):
                work = dist.broadcast(tensor, src=role.pipeline.ranks[stage], group=role.pipeline.group,
                                      async_op=True)
                work.wait(role.pipeline.timeout)
            full[name] = tensor
    return full


@torch.no_grad()
def load_full_state_dict(role: PipelinedRole, full: dict[str, torch.Tensor]) -> int:
    """Copy this stage's tensors out of a whole role's state dict (the unpipelined model's names), bit for bit; the
    other stages' names are ignored. Returns the bytes written. No communication.

    Raises:
        KeyError: ``full`` lacks a tensor this stage holds (it is not the same model), naming them.
        ValueError: A tensor's shape differs.
    """
    targets = role.module.role.state_dict()
    missing = sorted(set(targets) - set(full))
    if missing:
        raise KeyError(f"The state dict lacks {len(missing)} tensors that stage {role.stage_index} of {role.what} "
                       f"holds, e.g. {missing[:3]}: it is not a state dict of this model.")
    written = 0
    for name, target in targets.items():
        source = full[name]
        if tuple(source.shape) != tuple(target.shape):
            raise ValueError(f"{name!r} of {role.what} has shape {tuple(target.shape)}, the state dict gives "
                             f"{tuple(source.shape)}.")
        target.copy_(source.to(device=target.device, dtype=target.dtype))
        written += target.numel() * target.element_size()
    return written
