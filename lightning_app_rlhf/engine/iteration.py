"""The steps of one RLHF iteration under a placement plan, in each rank's program order. Plain Python.

This is the engine's iteration (``RLHFModule.training_step`` over :class:`~lightning_app_rlhf.engine.engine.RLHFEngine`)
written down once, as data: which call computes on which ranks, and which collectives join which ranks, in the
order every rank meets them. The planner's cost model prices exactly these steps
(:meth:`~lightning_app_rlhf.planner.cost_model.CostModel.tasks`), and ``tests/test_planner_iteration.py`` runs real
iterations on gloo processes, records what the engine's calls and :class:`~lightning_app_rlhf.parallel.placement.Placement`
collectives did on every rank, and checks it equals :func:`iteration_steps`.

One iteration (on-policy):

1. ``actor.generate`` on its ranks (no collective);
2. the rollout gathered to every rank (``Placement.gather_to_world``);
3. each forward call of the algorithm (reference, reward, then the critic) on its ranks, then one world gather of
   each call's result, in the same order;
4. each train call (role-table order: actor, then critic), each followed by a world broadcast of its statistics;
5. the reallocation of every trainable role that has shadow copies or a generation layout of its own: its train
   ranks and those copies exchange the new weights;
6. a world broadcast of each trainable role's learning rates (``refresh_learning_rates``).

With dynamic sampling (``ppo.dynamic_sampling``) an update may take several generation rounds: each round before
the last runs steps 1-3 only (``iteration_steps(plan, updates=False)``), and the last round the whole iteration on
the groups the rounds collected.

With a staleness bound (``plan.max_staleness`` k above 0) the train calls and their broadcasts run on the rollout of
k iterations earlier, right after generation (beside it, on the training group); the first k iterations have none,
and no reallocation either. Where a trainable role scores on its own train ranks (a critic forward on shared ranks:
Flattening, Interleaving, one process) they run after the scoring instead, so that the rollout is scored by the
weights that generated it: every placement then runs the same schedule, and logs the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_app_rlhf.core.role_table import ACTOR, CRITIC, REFERENCE, REWARD, role_of
from lightning_app_rlhf.parallel.plan import PlacementPlan

FORWARD_ROLES = (REFERENCE.name, REWARD.name, CRITIC.name)
"""Roles whose forward call scores the rollout, in the order the engine runs them (``engine.FORWARD_OUTPUTS``)."""
STEP_KINDS = ("call", "gather", "broadcast", "reallocate")


@dataclass(frozen=True)
class Step:
    """One step of an iteration that a group of ranks takes together."""

    kind: str
    """``call`` (a model call computes), ``gather`` (its result is all-gathered to every rank), ``broadcast`` (a
    train call's statistics, or with ``what="lr"`` its learning rates, from its leader to every rank) or
    ``reallocate`` (a trainable role's new weights, from its train ranks to its other layouts)."""
    name: str
    """The call (``actor.generate``, ``critic.train``...), or for ``reallocate`` the role."""
    ranks: tuple[int, ...]
    """Ranks that enter the step (a world collective: every rank)."""
    what: str = ""
    """``stats`` or ``lr`` for a broadcast; empty otherwise."""
    previous_rollout: bool = False
    """The step works on the previous iteration's rollout (overlap): the first iteration skips it."""

    @property
    def label(self) -> str:
        """``call actor.generate``, ``broadcast actor.train stats``, ``reallocate critic``."""
        return " ".join(x for x in (self.kind, self.name, self.what) if x)


def iteration_steps(plan: PlacementPlan, first: bool = False, updates: bool = True) -> list[Step]:
    """The steps of one iteration of ``plan``, in program order (each rank takes those whose ranks include it).

    Args:
        plan: The placement; its roles are the algorithm's (a critic-free plan has no ``critic.*`` calls).
        first: With a staleness bound, an iteration with nothing to train on yet (one of the first
            ``max_staleness``): it trains nothing and reallocates nothing.
        updates: False: a generation round of dynamic sampling that only collects groups (``ppo.dynamic_sampling``,
            never with ``overlap``): the steps up to the forward calls' gathers, no train call, reallocation or
            learning rates.
    """
    world = tuple(range(plan.world_size))
    roles = plan.roles
    trainable = plan.trainable_roles
    forwards = [f"{r}.forward" for r in FORWARD_ROLES if r in roles]
    steps = [Step("call", ACTOR.call("generate"), plan.ranks(ACTOR.call("generate")))]

    def train(previous: bool) -> list[Step]:
        out = []
        for role in trainable:
            call = f"{role}.train"
            out += [Step("call", call, plan.ranks(call), previous_rollout=previous),
                    Step("broadcast", call, world, "stats", previous_rollout=previous)]
        return out

    beside = plan.overlap and not scores_on_train_ranks(plan)
    if beside:  # the train group updates on an earlier rollout while the generation group samples and scores
        steps += train(previous=True)
    steps.append(Step("gather", ACTOR.call("generate"), world))
    steps += [Step("call", c, plan.ranks(c)) for c in forwards]
    steps += [Step("gather", c, world) for c in forwards]
    if not updates:
        return steps
    steps += train(previous=plan.overlap) if not beside else []
    for role in trainable:
        ranks = reallocation_ranks(plan, role)
        if ranks:
            steps.append(Step("reallocate", role, ranks, previous_rollout=plan.overlap))
    steps += [Step("broadcast", f"{role}.train", world, "lr") for role in trainable]
    if first:
        steps = [s for s in steps if not s.previous_rollout]
    return steps


def scores_on_train_ranks(plan: PlacementPlan) -> bool:
    """Whether a trainable role's scoring forward (the critic's values) runs on ranks that train that role. With a
    staleness bound such a plan trains after the scoring, not beside the generation: the rollout must be scored by
    the weights that generated it, which the update would change first."""
    for role in plan.trainable_roles:
        train = set(plan.ranks(f"{role}.train"))
        if any(set(plan.ranks(c)) & train for c in plan.calls if role_of(c) == role and c.endswith(".forward")):
            return True
    return False


def relayout_calls(plan: PlacementPlan, role: str) -> tuple[str, ...]:
    """Calls of a trainable ``role`` that run on a tensor-parallel copy (a generate or forward call with a degree
    above 1): the engine refreshes each copy after every update, from the trained weights (gathered when the
    training layout shards them) on the train ranks or from the shadow elsewhere (ReaLHF's parameter reallocation)."""
    if f"{role}.train" not in plan.calls:
        return ()
    return tuple(c for c in plan.calls if role_of(c) == role and not c.endswith(".train") and plan.tp_degree(c) > 1)


def reallocation_ranks(plan: PlacementPlan, role: str) -> tuple[int, ...]:
    """Ranks that take part in ``role``'s reallocation after its update: its train ranks, its shadow ranks and the
    ranks of its tensor-parallel copies (:func:`relayout_calls`); none when every call of the role runs on the
    trained weights as they are."""
    shadows = plan.shadow_ranks(role)
    relayout = relayout_calls(plan, role)
    if not shadows and not relayout:
        return ()
    return tuple(sorted({*plan.ranks(f"{role}.train"), *shadows, *(r for c in relayout for r in plan.ranks(c))}))
