"""Responses of uneven length, as the cost model prices ``actor.generate``: the decode steps of a call that runs until
its longest row, and a deterministic simulation of partial rollouts' pool. Plain Python (the simulation drives the
engine's own :class:`~lightning_app_rlhf.engine.partial_rollout.PartialRollouts` on synthetic rounds).

A response stops after a geometric number of tokens ``L`` of mean ``m`` (a stop at every token with probability
``p = 1 / m``, as the bench's stop ids make a random-init model's rows stop), cut at the budget ``n``
(``generation_length``): ``P(L > t) = (1 - p)^t`` for ``t < n``. The longest of ``b`` rows, ``M``, has
``P(M > t) = 1 - (1 - (1 - p)^t)^b``, and ``E[M] = sum_{t=0}^{n-1} P(M > t)`` (:func:`expected_max_length`). A call's
decoder runs its prefill (the first token) and then decode step ``t = 1 .. M - 1`` while any row lasts: step ``t``
runs with probability ``P(M > t)`` (:func:`decode_steps`). docs/planner.md, "Partial rollouts and uneven lengths".
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import torch

from lightning_app_rlhf.engine.partial_rollout import PartialRollouts, fill_pool

DROPS_FINISHED_ROWS = frozenset({"continuous", "vllm"})
"""Generation backends whose decode steps run only the rows still generating (continuous batching: the ``continuous``
backend's slots, vLLM's scheduler). The others (``eager``, ``static``, one of your own) keep a finished row in the
batch until the chunk's longest row ends: every step costs the whole chunk."""
SIMULATED_CALLS = 16
"""Partial-rollout calls the simulation prices (after :data:`WARMUP_CALLS`): their mean is the steady state."""
WARMUP_CALLS = 4
"""Partial-rollout calls simulated first and left out: the pool fills with carried samples over the first calls."""
SIMULATION_SEED = 0
"""Seeds the simulated lengths: the same workload gets the same price on every machine and run."""


def survival(mean: float, t: int) -> float:
    """``P(L > t)``: a response of geometric length of ``mean`` has more than ``t`` tokens (``t`` below its cap)."""
    return (1.0 - min(1.0, 1.0 / mean)) ** t


def max_survival(mean: float, t: int, rows: int) -> float:
    """``P(M > t)``: the longest of ``rows`` responses has more than ``t`` tokens."""
    return 1.0 - (1.0 - survival(mean, t)) ** rows


def expected_max_length(mean: float, cap: int, rows: int) -> float:
    """``E[M] = sum_{t=0}^{cap-1} P(M > t)``: the expected length of the longest of ``rows`` responses of geometric
    lengths of ``mean``, each cut at ``cap`` tokens."""
    return sum(max_survival(mean, t, rows) for t in range(cap))


@functools.lru_cache(maxsize=1024)
def decode_steps(mean: float, cap: int, rows: int, slowest_of: int = 1,
                 drops: bool = False) -> tuple[tuple[float, int, float], ...]:
    """The decode steps of a chunk of ``rows`` rows that runs until its longest row ends, on the slowest of
    ``slowest_of`` replicas running a chunk alike (the call waits for it): ``(expected steps, rows per step, mean
    step index)`` groups. Step ``t`` (1 .. ``cap - 1``; the prefill made the first token) runs with probability
    ``P(longest of rows x slowest_of > t)``. A backend that keeps finished rows (``drops`` False) runs each at
    ``rows``; one that drops them (:data:`DROPS_FINISHED_ROWS`) at the rows still generating, ``rows x P(L > t)``
    rounded (at least 1: the step runs), steps of one row count grouped.

    Args:
        mean: The mean response length.
        cap: The response budget (``generation_length``).
        rows: Rows of the chunk.
        slowest_of: Replicas that run such a chunk at once.
        drops: Whether the backend drops finished rows.
    """
    groups: dict[int, list[float]] = {}
    for t in range(1, cap):
        runs = max_survival(mean, t, rows * slowest_of)
        if runs < 1e-9:
            break
        active = max(1, round(rows * survival(mean, t))) if drops else rows
        weight_offset = groups.setdefault(active, [0.0, 0.0])
        weight_offset[0] += runs
        weight_offset[1] += runs * t
    return tuple((w, active, offset / w) for active, (w, offset) in groups.items() if w > 0)


@dataclass(frozen=True)
class Round:
    """One round of a simulated partial-rollout call."""

    max_new: int
    """Tokens it decodes at most (``PartialRollouts.round_inputs``)."""
    carried: int
    """The most tokens a row of it already has: its prefill's context beyond the prompt (rows are left-padded to the
    longest prompt and tokens so far)."""
    rows: int
    """Unfinished rows of the pool it decodes, over all generating replicas."""
    replicas: tuple[tuple[tuple[int, ...], ...], ...]
    """Per replica, per chunk of the generation batch, the tokens each row decodes in the round (before its budget
    cuts them: the decoder runs a row until its stop or ``max_new``)."""


@functools.lru_cache(maxsize=64)
def simulate_partial(groups: int, group_size: int, replicas: int, chunk: int | None, cap: int, segment: int,
                     mean: float | None) -> tuple[tuple[Round, ...], ...]:
    """The rounds of :data:`SIMULATED_CALLS` steady-state partial-rollout calls (after :data:`WARMUP_CALLS`), driving
    the engine's :class:`~lightning_app_rlhf.engine.partial_rollout.PartialRollouts` with synthetic rounds: each
    admitted row draws its geometric stop length (seeded, :data:`SIMULATION_SEED`; ``mean`` None: every row runs to
    ``cap``), a round's rows are split over the replicas as ``Placement.shard`` splits them (contiguous, in pool
    order) and each replica's into chunks of ``chunk`` rows, and each row decodes until its stop or the round's
    ``max_new``. Each call's policy version is one above the previous (the steady state's one update per call).

    Args:
        groups: Groups per rollout (``batch_size``).
        group_size: Responses per prompt (``num_samples``).
        replicas: Data-parallel replicas of ``actor.generate``.
        chunk: Rows a replica decodes together (None: all of its rows).
        cap: The response budget (``generation_length``).
        segment: Tokens a round decodes at most (``segment_tokens``).
        mean: The mean response length (None: every row runs to ``cap``).
    """
    rng = random.Random(SIMULATION_SEED)
    stop_at: dict[int, int] = {}
    pool = PartialRollouts(group_size, cap, segment, pad_token_id=0)
    cpu = torch.device("cpu")

    def prompts(_: dict | None = None, __: int = 0) -> dict:
        rows = groups * group_size
        base = len(stop_at)
        for key in range(base, base + rows):
            stop_at[key] = _geometric(rng, mean) if mean is not None else cap
        return {"input_ids": torch.ones((rows, 1), dtype=torch.long), "attention_mask": torch.ones((rows, 1)),
                "index": torch.arange(base, base + rows), "sample": torch.zeros(rows, dtype=torch.long),
                "keys": torch.arange(base, base + rows)}

    calls = []
    for version in range(WARMUP_CALLS + SIMULATED_CALLS):
        fill_pool(pool, prompts(), groups, lambda batch, _: batch["keys"], lambda drawn: prompts())
        rounds = []
        while not pool.call_done(groups, version):
            rows = pool.unfinished()
            _, _, _, max_new = pool.round_inputs(rows, cpu)
            tokens = [min(stop_at[s.key] - len(s.tokens), max_new) for s in rows]
            rounds.append(Round(max_new, max(len(s.tokens) for s in rows), len(rows),
                                _split(tokens, replicas, chunk)))
            pool.record(rows, _round_output(tokens, max_new, [stop_at[s.key] - len(s.tokens) <= max_new
                                                               for s in rows]), version)
        pool.take(groups, cpu)
        if version >= WARMUP_CALLS:
            calls.append(tuple(rounds))
    return tuple(calls)


def _geometric(rng: random.Random, mean: float) -> int:
    """A length >= 1 with ``P(L > t) = (1 - 1/mean)^t`` (uncut: the pool's budget cuts it)."""
    p = min(1.0, 1.0 / mean)
    if p >= 1.0:
        return 1
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


def _split(tokens: list[int], replicas: int, chunk: int | None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``tokens`` (one per row) over ``replicas`` as ``Placement.shard`` (contiguous ``linspace`` bounds), each
    replica's in chunks of ``chunk``."""
    bounds = [round(i * len(tokens) / replicas) for i in range(replicas + 1)]
    out = []
    for r in range(replicas):
        mine = tokens[bounds[r] : bounds[r + 1]]
        size = chunk or max(1, len(mine))
        out.append(tuple(tuple(mine[i : i + size]) for i in range(0, len(mine), size)))
    return tuple(out)


def _round_output(tokens: list[int], width: int, stopped: list[bool]) -> dict[str, torch.Tensor]:
    """What a round's gather hands ``PartialRollouts.record``: ``tokens[i]`` tokens of row ``i`` (ids of no meaning),
    stopped where its stop fell within the round."""
    mask = torch.arange(width)[None, :] < torch.tensor(tokens)[:, None]
    return {"responses": torch.full((len(tokens), width), 5, dtype=torch.long), "response_mask": mask.long(),
            "logprobs": torch.zeros((len(tokens), width)), "stopped": torch.tensor(stopped)}
