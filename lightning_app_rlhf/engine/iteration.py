"""One RLHF iteration under a placement plan, written down once as data: the recipe that the engine runs and the
planner's cost model prices. Plain Python.

An iteration is five phases (:class:`Recipe`), each a list of steps in every rank's program order; a rank takes the
steps whose ranks include it, and each step is a collective of its ranks (or one rank's compute):

1. **generate**: ``actor.generate`` on its ranks (a free-running generation side first takes the newest published
   weights: ``take``);
2. **beside**: with a staleness bound, the train calls on the rollout of ``k`` iterations earlier, beside the
   generation (on the training group); empty otherwise;
3. **score**: the rollout gathered, each forward call of the algorithm (reference, reward, then the critic) on its
   ranks, then each call's result gathered, in the same order. Then the engine makes the experience (the
   algorithm's advantages) on every rank that holds the gathered results (:attr:`Recipe.experience_ranks`). With
   dynamic sampling (``ppo.dynamic_sampling``) phases 1-3 repeat, on fresh prompts, until the rounds collected a
   batch of informative groups;
4. **handoff**: free-running only: the generation leader sends the experience to every training rank;
5. **update**: each train call (role-table order: actor, then critic), each followed by a broadcast of its
   statistics;
6. **publish**: each trainable role's learning rates broadcast (after the LR schedulers step), then its new weights
   to its other layouts: a blocking reallocation (shadows, tensor-parallel copies), or free-running a ``publish``
   that the generation side takes when it needs that version.

The schedules differ only in which phases hold steps, and where:

- **on-policy**: generate, score, update, publish; every gather and broadcast reaches the world.
- **k-stale, fixed** (``plan.max_staleness`` k above 0): the update works on the rollout of k iterations ago, in
  ``beside`` (or, where a trainable role scores on its own train ranks, after the scoring: the rollout must be scored
  by the weights that generated it); the first k iterations train and reallocate nothing.
- **free-running** (``plan.free_running``): the same steps, split between two groups that meet only through the
  handoff and the published weights: the generation side (generate, score, send) runs up to ``k + 1`` iterations
  ahead of the training side (receive, update, publish). Gathers reach the generation ranks, broadcasts the training
  ranks.
- **dynamic sampling**: on-policy, with generate and score repeated per generation round (:meth:`Recipe.steps`).

``tests/test_planner_iteration.py`` runs real iterations of every schedule on gloo processes, records what each
rank's calls and :class:`~lightning_app_rlhf.parallel.placement.Placement` collectives did, in order, and checks it
equals :meth:`Recipe.steps` and the cost model's tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_app_rlhf.core.role_table import ACTOR, CRITIC, REFERENCE, REWARD, role_of
from lightning_app_rlhf.parallel.plan import PlacementPlan

FORWARD_ROLES = (REFERENCE.name, REWARD.name, CRITIC.name)
"""Roles whose forward call scores the rollout, in the order the engine runs them."""
PHASES = ("generate", "beside", "score", "handoff", "update", "publish")
"""The phases of :class:`Recipe`, in order."""


@dataclass(frozen=True)
class Step:
    """One step of an iteration that a group of ranks takes together."""

    kind: str
    """``call`` (a model call computes), ``gather`` (its result is all-gathered), ``broadcast`` (a train call's
    statistics, or with ``what="lr"`` its learning rates, from its leader), ``reallocate`` (a trainable role's new
    weights, from its train ranks to its other layouts, blocking); free-running: ``publish`` (the train ranks post a
    role's new weights and announce the version), ``take`` (the generation ranks join the posted weights of every
    version published since theirs, every published role's, waiting for version ``i - k``), ``send`` (the generation
    leader sends the experience) and ``receive`` (each training rank receives it)."""
    name: str
    """The call (``actor.generate``, ``critic.train``...); for ``reallocate`` and ``publish`` the role; for ``take``
    ``weights``; for ``send`` and ``receive`` ``experience``."""
    ranks: tuple[int, ...]
    """Ranks that enter the step."""
    what: str = ""
    """``stats`` or ``lr`` for a broadcast; empty otherwise."""
    previous_rollout: bool = False
    """The step works on the rollout of ``k`` iterations earlier (a staleness bound): the first ``k`` skip it."""
    among: str | None = None
    """The call whose group a gather or broadcast is a collective of (a free-running side); None: the world."""

    @property
    def action(self) -> str:
        """What the engine does for the step: ``generate``, ``forward`` or ``train`` (a call), ``gather_rollout``,
        ``gather_output`` (a forward call's result), ``stats``, ``lr``, ``reallocate``, ``take``, ``send``,
        ``receive`` or ``publish``."""
        if self.kind == "call":
            return self.name.split(".")[1]
        if self.kind == "gather":
            return "gather_rollout" if self.name == ACTOR.call("generate") else "gather_output"
        return self.what if self.kind == "broadcast" else self.kind

    @property
    def label(self) -> str:
        """``call actor.generate``, ``broadcast actor.train stats``, ``reallocate critic``."""
        return " ".join(x for x in (self.kind, self.name, self.what) if x)


@dataclass(frozen=True)
class Recipe:
    """One iteration of a plan, phase by phase (module docstring)."""

    generate: tuple[Step, ...]
    beside: tuple[Step, ...]
    score: tuple[Step, ...]
    handoff: tuple[Step, ...]
    update: tuple[Step, ...]
    publish: tuple[Step, ...]
    experience_ranks: tuple[int, ...]
    """Ranks that make the experience from the gathered results (every rank, or a free-running generation side)."""

    def steps(self, rounds: int = 1) -> list[Step]:
        """Every step of the iteration in program order; ``rounds`` generation rounds (dynamic sampling) repeat the
        generate, beside and score phases."""
        rollout = [*self.generate, *self.beside, *self.score]
        return [*(rollout * rounds), *self.handoff, *self.update, *self.publish]


def iteration_recipe(plan: PlacementPlan, first: bool = False) -> Recipe:
    """The recipe of one iteration of ``plan``.

    Args:
        plan: The placement; its roles are the algorithm's (a critic-free plan has no ``critic.*`` calls).
        first: With a staleness bound on the fixed schedule, an iteration with nothing to train on yet (one of the
            first ``max_staleness``): it trains nothing and reallocates nothing.
    """
    recipe = _free_running_recipe(plan) if plan.free_running else _fixed_recipe(plan)
    if not first or plan.free_running:
        return recipe
    kept = {phase: tuple(s for s in getattr(recipe, phase) if not s.previous_rollout) for phase in PHASES}
    return Recipe(**kept, experience_ranks=recipe.experience_ranks)


def iteration_steps(plan: PlacementPlan, first: bool = False, rounds: int = 1) -> list[Step]:
    """Every step of one iteration of ``plan``, in program order (:meth:`Recipe.steps`)."""
    return iteration_recipe(plan, first).steps(rounds)


def _fixed_recipe(plan: PlacementPlan) -> Recipe:
    """On-policy and k-stale on the fixed schedule: every rank meets every gather and broadcast."""
    world = tuple(range(plan.world_size))
    previous = plan.overlap
    beside = previous and not scores_on_train_ranks(plan)
    update = _update_steps(plan, world, previous, among=None)
    publish = [Step("broadcast", f"{role}.train", world, "lr") for role in plan.trainable_roles]
    for role in plan.trainable_roles:
        ranks = reallocation_ranks(plan, role)
        if ranks:
            publish.append(Step("reallocate", role, ranks, previous_rollout=previous))
    return Recipe(
        generate=(Step("call", ACTOR.call("generate"), plan.ranks(ACTOR.call("generate"))),),
        beside=update if beside else (),
        score=_score_steps(plan, world, among=None),
        handoff=(),
        update=() if beside else update,
        publish=tuple(publish),
        experience_ranks=world,
    )


def _free_running_recipe(plan: PlacementPlan) -> Recipe:
    """Free-running: the generation side generates, scores and sends; the training side receives, updates and
    publishes. Its gathers reach the generation ranks only, its broadcasts the training ranks only."""
    generate, train = plan.generation_ranks, plan.training_ranks
    leader = (generate[0],)
    published = published_roles(plan)
    return Recipe(
        generate=(*((Step("take", "weights", generate),) if published else ()),
                  Step("call", ACTOR.call("generate"), generate)),
        beside=(),
        score=_score_steps(plan, generate, among=ACTOR.call("generate")),
        handoff=(Step("send", "experience", leader), Step("receive", "experience", train)),
        update=_update_steps(plan, train, False, among="train"),
        publish=(*(Step("broadcast", f"{role}.train", plan.ranks(f"{role}.train"), "lr", among=f"{role}.train")
                   for role in plan.trainable_roles),
                 *(Step("publish", role, plan.ranks(f"{role}.train")) for role in published)),
        experience_ranks=generate,
    )


def _score_steps(plan: PlacementPlan, ranks: tuple[int, ...], among: str | None) -> tuple[Step, ...]:
    """The rollout's gather, the forward calls, then their gathers, each gather a collective of ``ranks``."""
    forwards = [f"{r}.forward" for r in FORWARD_ROLES if r in plan.roles]
    return (Step("gather", ACTOR.call("generate"), ranks, among=among),
            *(Step("call", c, plan.ranks(c)) for c in forwards),
            *(Step("gather", c, ranks, among=among) for c in forwards))


def _update_steps(plan: PlacementPlan, ranks: tuple[int, ...], previous: bool, among: str | None) -> tuple[Step, ...]:
    """Each train call, then the broadcast of its statistics to ``ranks`` (with ``among="train"``: to the call's own
    ranks, each role's statistics a collective of its train group)."""
    steps: list[Step] = []
    for role in plan.trainable_roles:
        call = f"{role}.train"
        to = plan.ranks(call) if among == "train" else ranks
        steps += [Step("call", call, plan.ranks(call), previous_rollout=previous),
                  Step("broadcast", call, to, "stats", previous_rollout=previous,
                       among=call if among == "train" else None)]
    return tuple(steps)


def published_roles(plan: PlacementPlan) -> tuple[str, ...]:
    """Free-running: the trainable roles with shadow copies, whose versions the training side publishes."""
    return tuple(role for role in plan.trainable_roles if plan.shadow_ranks(role))


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
    """Calls of a trainable ``role`` that run on a copy in a layout of their own: a tensor-parallel copy (a generate or
    forward call with a degree above 1), or a whole copy beside a pipelined train call
    (:meth:`~lightning_app_rlhf.parallel.plan.PlacementPlan.runs_on_whole_copy`). The engine refreshes each copy after
    every update, from the trained weights (gathered when the training layout shards or pipelines them) on the train
    ranks or from the shadow elsewhere (ReaLHF's parameter reallocation)."""
    if f"{role}.train" not in plan.calls:
        return ()
    return tuple(c for c in plan.calls if role_of(c) == role and not c.endswith(".train")
                 and (plan.tp_degree(c) > 1 or plan.runs_on_whole_copy(c)))


def reallocation_ranks(plan: PlacementPlan, role: str) -> tuple[int, ...]:
    """Ranks that take part in ``role``'s reallocation after its update: its train ranks, its shadow ranks and the
    ranks of its tensor-parallel copies (:func:`relayout_calls`); none when every call of the role runs on the
    trained weights as they are."""
    shadows = plan.shadow_ranks(role)
    relayout = relayout_calls(plan, role)
    if not shadows and not relayout:
        return ()
    return tuple(sorted({*plan.ranks(f"{role}.train"), *shadows, *(r for c in relayout for r in plan.ranks(c))}))
