"""How a rollout batch splits into minibatches, ranks and micro-batches, and the check that it does. Plain Python.

Checked once, before the first iteration (when the batch size is known) and again only when a batch of another size
comes: every rank of a train group must run the same number of micro-batches, since a sharded wrapper's passes are
collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_app_rlhf.parallel.plan import PlacementPlan


def micro_batch_count(minibatch: int, ranks: int, micro_batch_size: int | None) -> int:
    """Micro-batches per rank for one minibatch: the same on every rank of the group (a sharded wrapper's forward
    and backward are collectives), enough for the largest share."""
    if micro_batch_size is None:
        return 1
    largest_share = -(-minibatch // ranks)
    return -(-largest_share // micro_batch_size)


def check_batch_split(
    prompts: int,
    num_samples: int,
    num_minibatches: int,
    micro_batch_size: int | None,
    plan: PlacementPlan,
    trainable_roles: Sequence[str],
) -> None:
    """Raise a ``ValueError`` naming the fix unless ``prompts`` per iteration, times ``num_samples``, split into
    ``num_minibatches`` and over the ranks of every call of ``plan``, with the same number of micro-batches on every
    rank of each train call.

    Args:
        prompts: Prompts per iteration (``data.batch_size``).
        num_samples: Responses per prompt (``generation.num_samples``).
        num_minibatches: ``ppo.num_minibatches``.
        micro_batch_size: ``ppo.micro_batch_size`` (None: one micro-batch per share).
        plan: Which ranks run each call.
        trainable_roles: The algorithm's trained roles.
    """
    samples = prompts * num_samples
    size = f"{samples}" if num_samples == 1 else f"{samples} ({prompts} prompts x generation.num_samples={num_samples})"
    fix = "data.batch_size" if num_samples == 1 else "data.batch_size (or generation.num_samples)"
    if samples % num_minibatches:
        raise ValueError(f"The rollout batch size {size} is not divisible by ppo.num_minibatches={num_minibatches}. "
                         f"Pick a {fix} that makes it a multiple of it, or a num_minibatches that divides {samples}.")
    widest = max(plan.calls, key=lambda call: len(plan.ranks(call)))
    if samples < len(plan.ranks(widest)):
        what = f"{prompts} prompts" if num_samples == 1 else f"{size} samples"
        raise ValueError(f"The rollout batch of {what} is split over the {len(plan.ranks(widest))} ranks of "
                         f"{widest!r}: raise {fix} to at least that.")
    minibatch = samples // num_minibatches
    for role in trainable_roles:
        ranks = len(plan.ranks(f"{role}.train"))
        if minibatch < ranks:
            times_g = " x num_samples" if num_samples > 1 else ""
            raise ValueError(f"Each PPO minibatch of {minibatch} samples is split over the {ranks} ranks of "
                             f"'{role}.train': raise data.batch_size or lower ppo.num_minibatches so that "
                             f"batch_size{times_g} / num_minibatches >= {ranks}.")
        check_micro_batches(role, minibatch, ranks, micro_batch_size)


def check_micro_batches(role: str, minibatch: int, ranks: int, size: int | None) -> None:
    """Every rank of a train group runs the same number of micro-batches, so the smallest share of a minibatch needs
    at least that many samples."""
    if size is None:
        return
    smallest = minibatch // ranks
    if smallest >= micro_batch_count(minibatch, ranks, size):
        return
    fits = next(m for m in range(size, minibatch + 1) if micro_batch_count(minibatch, ranks, m) <= smallest)
    raise ValueError(f"ppo.micro_batch_size={size} splits the largest share of a {minibatch}-sample minibatch over "
                     f"the {ranks} ranks of '{role}.train' into {micro_batch_count(minibatch, ranks, size)} "
                     f"micro-batches, and every rank must run as many, but the smallest share has {smallest} "
                     f"samples. Use ppo.micro_batch_size >= {fits}, or a minibatch divisible by {ranks}.")
