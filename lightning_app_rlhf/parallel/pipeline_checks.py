"""Which plans with pipeline-parallel degrees (``PlacementPlan.pp``) the engine runs, and the fix for the others.
Plain Python.

The engine pipelines the train calls (``actor.train``, ``critic.train``) and the scoring calls (``reference.forward``,
``reward.forward``, ``critic.forward``); generation stays data x tensor parallel (the plan refuses ``pp`` there). A
pipelined call's role is cut in place into one stage per rank (:class:`~.pipeline.PipelinedRole`), so:

- a trainable role's other calls on its pipelined train ranks run either on the same pipeline (``critic.forward``
  with the train call's ranks and degree) or on a copy of the role in their own layout (a whole copy, or a
  tensor-parallel one), refreshed by name after every update;
- its ranks data-parallel over pipelines sum each stage's gradients over the ranks holding that stage (DDP's
  all-reduce, per stage group): the sharding wrappers (FSDP2, ZeRO) are not combined with stages yet;
- a frozen role is cut on its forward ranks and needs no wrapper.
"""

from __future__ import annotations

from lightning_app_rlhf.core.role_table import TRAINABLE_ROLES, role_of
from lightning_app_rlhf.parallel.plan import PlacementPlan

PIPELINED_CALLS = ("actor.train", "critic.train", "reference.forward", "reward.forward", "critic.forward")
"""The calls a plan may give a pipeline-parallel degree."""


def same_pipeline(plan: PlacementPlan, call: str, other: str) -> bool:
    """Whether ``call`` and ``other`` run on the same pipelines: the same ranks, in the same order, and degree."""
    return (call in plan.calls and other in plan.calls and plan.pp_degree(call) == plan.pp_degree(other)
            and tuple(plan.ranks(call)) == tuple(plan.ranks(other)))


def check_pipeline_parallel(plan: PlacementPlan) -> None:
    """Raise a ``ValueError`` naming the fix for a ``pp`` degree the engine cannot run.

    Args:
        plan: The placement plan, already validated (every ``tp x pp`` divides its call's group size).
    """
    if not plan.pp:
        return
    if plan.free_running or plan.overlap:
        raise ValueError(f"The plan gives pipeline-parallel degrees {plan.pp} and runs stale rollouts (max_staleness="
                         f"{plan.max_staleness}{', free_running' if plan.free_running else ''}); pipelined calls run "
                         "on-policy only for now. Set max_staleness: 0, or remove `pp`.")
    for call, degree in plan.pp.items():
        role = role_of(call)
        if call not in PIPELINED_CALLS:
            raise ValueError(f"Call {call!r} has pipeline-parallel degree {degree}; only {list(PIPELINED_CALLS)} can "
                             f"be pipelined. Remove {call!r} from `pp`.")
        if plan.tp_degree(call) > 1:
            raise ValueError(f"Call {call!r} has tensor-parallel degree {plan.tp_degree(call)} and pipeline-parallel "
                             f"degree {degree}; the engine runs one of the two per call. Remove {call!r} from `tp` or "
                             "from `pp`.")
        wrapper = plan.wrappers.get(role)
        if call.endswith(".train") and wrapper not in (None, "ddp"):
            raise ValueError(f"Call {call!r} is pipelined (pp={degree}) with wrapper {wrapper!r}: a pipelined train "
                             "call sums each stage's gradients over the pipelines (DDP, per stage group); sharding "
                             f"stages (FSDP2, ZeRO) is not supported. Set wrappers: {{{role}: ddp}}, or remove "
                             f"{call!r} from `pp`.")
        if not call.endswith(".train") and role not in TRAINABLE_ROLES and wrapper is not None:
            raise ValueError(f"Call {call!r} is pipelined (pp={degree}), which already spreads {role!r} over its "
                             f"ranks; the plan also shards it with {wrapper!r}. Remove {role!r} from `wrappers`, or "
                             f"{call!r} from `pp`.")
    for role in TRAINABLE_ROLES:
        train = f"{role}.train"
        for call in plan.calls:
            if role_of(call) != role or call == train:
                continue
            if plan.pp_degree(call) > 1 and not same_pipeline(plan, call, train):
                raise ValueError(
                    f"Call {call!r} is pipelined (pp={plan.pp_degree(call)}) on ranks {list(plan.ranks(call))}, but "
                    f"not on {train!r}'s pipelines: a trained role's scoring call is pipelined only on the stages "
                    f"that train it. Give {call!r} the ranks and pp of {train!r}, or remove {call!r} from `pp`.")


def check_pipelined_checkpoint(plan: PlacementPlan) -> None:
    """Raise a ``ValueError`` naming the fix when a checkpoint would hold a pipelined role: a checkpoint takes each
    role whole from its owner rank, which holds one stage of a pipelined role, so it would lose the other stages.
    (The weights gather by name, :func:`~.pipeline_weights.gather_full_state_dict`; the optimizer state per stage
    has no by-name writer yet.)

    Args:
        plan: The placement plan of the run being saved.
    """
    if plan.pp:
        raise ValueError(f"The plan pipelines {sorted(plan.pp)}, and checkpoints of a pipelined role are not written "
                         "yet (a role's owner rank holds only its first stage, and its optimizer state lives per "
                         "stage). Train this plan without checkpoints (--trainer.enable_checkpointing false, no "
                         "ModelCheckpoint callback, and --model.preemption_checkpoint false where the job may be "
                         "preempted), or remove `pp` from the plan to checkpoint.")
