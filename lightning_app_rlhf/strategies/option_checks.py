"""The placement strategies' own options, checked against the world size with messages that name the option both
ways (``generation_ratio``, ``--trainer.strategy.generation_ratio``) and the values that work on this many ranks:
the presets' plan builders (:mod:`lightning_app_rlhf.parallel.plan`) refuse the same settings, but only in terms of
the plan."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

from lightning_app_rlhf.core.wrapper_names import WRAPPER_TRAITS

MAX_WORLD_SIZE_HINT = 64
"""The largest world size a message suggests."""


def check_wrapper_option(strategy: str, wrapper: str) -> None:
    """Refuse an unknown ``wrapper`` when the strategy is built, naming the choices (a known wrapper whose package
    is missing is refused with the plan, naming the install command)."""
    if wrapper not in WRAPPER_TRAITS:
        raise ValueError(f"{strategy}: wrapper={wrapper!r} (--trainer.strategy.wrapper) is no wrapper: choose one of "
                         f"{list(WRAPPER_TRAITS)}.")


def ranks_of(ratio: float, world_size: int) -> Fraction:
    """The ranks that ``ratio`` of ``world_size`` gives, as the plan builders count them."""
    return Fraction(ratio).limit_denominator(1000) * world_size


def ratio_text(count: int, world_size: int) -> str:
    """The shortest decimal that gives ``count`` of ``world_size`` ranks (``1, 3`` -> ``0.3333``)."""
    for digits in range(1, 7):
        text = f"{count / world_size:.{digits}g}"
        if ranks_of(float(text), world_size) == count:
            return text
    return repr(count / world_size)


def _world_sizes(fits: Callable[[int], bool], world_size: int) -> str:
    """The nearest world sizes below and above ``world_size`` for which ``fits(n)`` holds, as "2 or 4"."""
    below = next((n for n in range(world_size - 1, 1, -1) if fits(n)), None)
    above = next((n for n in range(world_size + 1, MAX_WORLD_SIZE_HINT + 1) if fits(n)), None)
    return " or ".join(str(n) for n in (below, above) if n is not None)


def _whole(ratio: float, world_size: int, low: int, high: int) -> bool:
    count = ranks_of(ratio, world_size)
    return 0 < ratio <= 1 and count.denominator == 1 and low <= count <= high


def _fewer_than_two(strategy: str, world_size: int, why: str) -> ValueError:
    return ValueError(f"{strategy} needs at least 2 ranks ({why}); this run has {world_size}. Set --trainer.devices "
                      "2 or more (devices x num_nodes ranks), or use --trainer.strategy rlhf_flattening on one device.")


def check_separation_options(world_size: int, generation_ratio: float, explicit_ranks: bool) -> None:
    """Refuse a generation ratio that gives no whole number of generating ranks, or leaves none to train."""
    if world_size < 2:
        raise _fewer_than_two("rlhf_separation", world_size, "one generating, one training")
    if explicit_ranks or _whole(generation_ratio, world_size, 1, world_size - 1):
        return
    count = ranks_of(generation_ratio, world_size)
    why = ("not a whole number" if count.denominator != 1 else
           "leaving none to train" if count >= world_size else "none to generate")
    choices = (", ".join(ratio_text(k, world_size) for k in range(1, world_size)) if world_size <= 8 else
               f"a multiple of 1/{world_size} below 1 (e.g. {ratio_text(world_size // 2, world_size)})")
    sizes = _world_sizes(lambda n: _whole(generation_ratio, n, 1, n - 1), world_size)
    devices = f", or run {sizes} processes (--trainer.devices)" if sizes else ""
    raise ValueError(f"rlhf_separation: the generation ratio {generation_ratio} on {world_size} ranks gives "
                     f"{float(count):g} ranks, {why}. Set --trainer.strategy.generation_ratio (generation_ratio=) "
                     f"to {'one of ' if world_size <= 8 else ''}{choices}{devices}.")


def check_interleaving_options(world_size: int, reference_ratio: float | None, reward_ratio: float) -> None:
    """Refuse reference and reward ratios (None: no reference, for an algorithm without KL) that give no whole
    number of ranks each, or more ranks together than there are."""
    if world_size < 2:
        raise _fewer_than_two("rlhf_interleaving", world_size, "reference and reward on disjoint groups")

    def fits(n: int) -> bool:
        ref = ranks_of(reference_ratio, n) if reference_ratio is not None else 0
        return ((reference_ratio is None or _whole(reference_ratio, n, 1, n)) and _whole(reward_ratio, n, 1, n)
                and ref + ranks_of(reward_ratio, n) <= n)

    if fits(world_size):
        return
    ratios = {"reference": reference_ratio, "reward": reward_ratio}
    bad = [(name, ratio, float(ranks_of(ratio, world_size))) for name, ratio in ratios.items()
           if ratio is not None and not _whole(ratio, world_size, 1, world_size)]
    parts = [f"the {name} ratio {ratio}" + (f" on {world_size} ranks" if i == 0 else "") + f" gives {count:g} ranks"
             for i, (name, ratio, count) in enumerate(bad)]
    what = (" and ".join(parts) + (", not whole numbers" if len(bad) > 1 else ", not a whole number") if bad else
            f"the reference ratio {reference_ratio} and the reward ratio {reward_ratio} on {world_size} ranks sum "
            "to more than 1 (the two groups are disjoint)")
    half = world_size // 2
    example = (f"e.g. {ratio_text(half, world_size)} and {ratio_text(world_size - half, world_size)}"
               if reference_ratio is not None else f"e.g. {ratio_text(half, world_size)}")
    flags = ("--trainer.strategy.reference_ratio and --trainer.strategy.reward_ratio to multiples of "
             f"1/{world_size} (reference_ratio=, reward_ratio=) that sum to at most 1" if reference_ratio is not None else
             f"--trainer.strategy.reward_ratio (reward_ratio=) to a multiple of 1/{world_size}")
    sizes = _world_sizes(fits, world_size)
    devices = f", or run {sizes} processes (--trainer.devices)" if sizes else ""
    raise ValueError(f"rlhf_interleaving: {what}. Set {flags} ({example}){devices}.")
