"""Trained weights out of a placed run: the actor in Hugging Face format, and each trained role whole on rank 0 (what
a ``fork`` or ``spawn`` launch hands back to its main process). Plain PyTorch, no Lightning.

Whichever ranks train a role (Separation's training ranks, not rank 0), its train call's leader holds the weights;
a role sharded over its train group (FSDP2, ZeRO-3) is gathered over that group first, a bucket at a time.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_app_rlhf.checkpoint.format import recv_state, send_state
from lightning_app_rlhf.core.role_table import ACTOR
from lightning_app_rlhf.models.roles import ModelSpec, is_lora
from lightning_app_rlhf.parallel.placed_roles import Models, PlacedRoles


def export_actor(
    models: Models, actor_spec: ModelSpec, placed: PlacedRoles, tokenizer: PreTrainedTokenizerBase,
    directory: str | Path, merge: bool,
) -> Path | None:
    """Save the trained actor and the tokenizer in Hugging Face format from the lowest rank of ``actor.train``; the
    path there, None on the other ranks. Collective over the actor's train group when it is sharded.

    Args:
        models: This rank's module of each role.
        actor_spec: The actor's spec (its LoRA settings).
        placed: The placement and this rank's wrappers.
        tokenizer: Saved beside the weights.
        directory: Where to write; created if missing.
        merge: Full weights with any LoRA adapter merged in (``True``), or the adapter alone.
    """
    if not merge and actor_spec.lora is None:
        raise ValueError("The actor has no LoRA adapter to export: use merge=True to save its full weights.")
    placement, actor = placed.placement, models(ACTOR.name)
    gathered = None
    if placement.sharded_here(ACTOR.name):
        if actor_spec.lora is not None:
            raise ValueError(f"Exporting a LoRA actor sharded with {placement.plan.wrappers[ACTOR.name]} is not "
                             "supported: train a LoRA actor with wrapper 'ddp' (its adapters are small).")
        if not all(p.requires_grad for p in actor.parameters()):
            raise ValueError("Exporting a sharded actor with frozen parameters is not supported: train every "
                             "parameter, or use wrapper 'ddp'.")
        gathered = full_trainable_weights(actor, placed, ACTOR.name)
    if placement.rank != placement.leader(ACTOR.call("train")):
        return None
    if actor is None:
        raise RuntimeError("The actor is not built yet: export after `fit` (or after `configure_model`).")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if not merge:
        actor.save_pretrained(path)  # peft writes the adapter from whichever rank calls it
    elif is_lora(actor):
        # Merge into a copy: the live actor keeps its adapters (and its reference, the base with them off).
        save_hf_model(copy.deepcopy(actor).merge_and_unload(), path)
    else:
        save_hf_model(actor, path, gathered)
    tokenizer.save_pretrained(path)
    return path


def full_trainable_weights(model: nn.Module, placed: PlacedRoles, role: str) -> dict[str, torch.Tensor]:
    """The trainable parameters of a sharded role, whole, by name, on the CPU: a collective over its train group, a
    bucket at a time (the device never holds the whole role)."""
    names = iter([name for name, p in model.named_parameters() if p.requires_grad])
    return {next(names): p.detach().cpu().clone() for bucket in placed.wrappers[role].full_parameter_buckets()
            for p in bucket}


def gather_trained_weights(
    models: Models, placed: PlacedRoles, trainable_roles: tuple[str, ...]
) -> dict[str, dict[str, torch.Tensor]] | None:
    """Each trained role's weights, whole and on the CPU, on global rank 0 (None on the other ranks). Collective:
    every rank calls it. A whole role comes from the leader of its train call, all of its state dict; a sharded role
    is gathered over its train group first, its trainable parameters only (frozen ones never change)."""
    placement = placed.placement
    gathered: dict[str, dict[str, torch.Tensor]] = {}
    for role in trainable_roles:
        leader = placement.leader(f"{role}.train")
        state = None
        if placement.sharded_here(role):
            state = full_trainable_weights(models(role), placed, role)
        elif placement.rank == leader:
            state = {name: tensor.detach() for name, tensor in models(role).state_dict().items()}
        if leader != 0 and placement.rank == leader:
            send_state({name: tensor.to(placement.device) for name, tensor in state.items()}, dst=0)
        elif leader != 0 and placement.rank == 0:
            state = recv_state(leader, placement.device)
        if placement.rank == 0:
            gathered[role] = {name: tensor.cpu() for name, tensor in state.items()}
    return gathered if placement.rank == 0 else None


def load_trained_weights(models: Models, weights: dict[str, dict[str, torch.Tensor]]) -> None:
    """Load what :func:`gather_trained_weights` returned into this process's models."""
    for role, state in weights.items():
        result = models(role).load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(f"The trained {role} does not match the {role} built here: unexpected weights "
                               f"{result.unexpected_keys[:5]}. Build the module with the same model specs.")


def save_hf_model(model: nn.Module, path: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """What ``model.save_pretrained(path)`` writes (config, generation config, ``model.safetensors``), from any
    rank: under torch.distributed, transformers writes the weights only on global rank 0, which under Separation
    does not hold the trained actor."""
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if state_dict is None:  # tied weights once (named_parameters dedups them); copies, as a flat buffer's views
        keys = set(model.state_dict())
        state_dict = {name: tensor for name, tensor in (*model.named_parameters(), *model.named_buffers())
                      if name in keys}
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
