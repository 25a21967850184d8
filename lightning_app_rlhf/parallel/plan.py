"""``PlacementPlan``: which ranks run each model call, and how each trainable role is wrapped. No Lightning.

The three APP placements are presets of one mechanism:

- Flattening: every call on every rank.
- Interleaving: the trainable roles on every rank; reference on one block of ranks, reward on another.
- Separation: a generation group runs ``actor.generate`` and the three forwards on shadow copies; a training
  group runs the train calls; weights flow from training to generation after every update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from lightning_app_rlhf.core.role_table import (
    ACTOR,
    CALLS,
    FROZEN_ROLES,
    REFERENCE,
    REQUIRED_ROLES,
    REWARD,
    ROLE_NAMES,
    TRAINABLE_ROLES,
    calls_of,
    role_of,
)
from lightning_app_rlhf.core.wrapper_names import FROZEN_WRAPPERS, SHARDED_WRAPPERS, check_wrapper

PIPELINE_SCHEDULES = ("1f1b", "gpipe")
"""The schedules a pipelined train call runs (torch's ``Schedule1F1B`` and ``ScheduleGPipe``,
:data:`~lightning_app_rlhf.parallel.pipeline.SCHEDULES`); a scoring call runs forwards only."""


@dataclass(frozen=True)
class PlacementPlan:
    """Ranks of every model call and the parallel wrapper of every trainable role.

    A trainable role's weights live on the ranks of its train call. Any other call of that role on ranks
    outside that group runs on a shadow copy, refreshed after every update (weight reallocation).
    """

    world_size: int
    """Number of ranks the plan covers."""
    calls: dict[str, tuple[int, ...]]
    """Call name -> the ranks that run it (sorted, no duplicates)."""
    wrappers: dict[str, str] = field(default_factory=dict)
    """Role -> its wrapper (:data:`~lightning_app_rlhf.core.wrapper_names.WRAPPER_NAMES`). A trainable role: ``ddp``
    (default), ``fsdp2``, ``zero1``, ``zero2`` or ``zero3``, on its train group. Optionally a frozen role
    (``reference``, ``reward``) -> ``fsdp2`` or ``zero3``: sharded over its forward call's group, whose ranks run the
    forward in lockstep."""
    name: str = "custom"
    """A label for summaries and logs."""
    max_staleness: int = 0
    """Bounded staleness, on a fixed schedule: each iteration trains on the rollout generated ``max_staleness``
    iterations earlier, while the generation group samples the next, so (after the first ``max_staleness``
    iterations, which train nothing) every update uses data exactly that many weight versions old. 0: on-policy;
    1: one-step off-policy (``overlap``). It pays off where generation and training run on disjoint ranks
    (Separation); on shared ranks the same schedule runs, one step after the other."""
    tp: dict[str, int] = field(default_factory=dict)
    """Call name -> its tensor-parallel degree (1 for a call left out). A call with degree ``t`` on ``n`` ranks runs
    as ``n / t`` data-parallel replicas, each a ``t``-way DTensor tensor-parallel copy of the role (the model
    family's own ``tp_plan``); replica ``i`` is the ``t`` consecutive ranks ``ranks[i * t:(i + 1) * t]``."""
    pp: dict[str, int] = field(default_factory=dict)
    """Call name -> its pipeline-parallel degree (1 for a call left out). A call with degree ``p`` (and
    tensor-parallel degree ``t``) on ``n`` ranks runs as ``n / (t * p)`` data-parallel replicas, each cutting the
    role at its decoder layers into ``p`` stages (``torch.distributed.pipelining``,
    :mod:`~lightning_app_rlhf.parallel.pipeline`). Train calls and the scoring forwards take one; ``actor.generate``
    stays data x tensor parallel, as in ReaLHF."""
    pipeline_schedule: str = "1f1b"
    """The schedule of the pipelined train calls: ``1f1b`` (one forward, one backward in the steady state: at most
    ``p`` micro-batches' activations alive) or ``gpipe`` (every forward, then every backward)."""
    unshard_for_generation: bool = True
    """A sharded actor (FSDP2, ZeRO-3) that generates on its own train group gathers its weights once per rollout
    and frees them after (the hybrid engine); False gathers them for every decoding step (less memory)."""
    free_running: bool = False
    """Bounded staleness, free-running: the generation group does not wait for the training group's iteration. It
    generates and scores rollout ``i`` as soon as it holds policy version ``i - max_staleness`` or newer (it takes
    the newest weights the training group has published), sends it to the training group point to point, and goes
    on; the training group trains on rollout ``i`` at its iteration ``i``. Staleness is between 0 and
    ``max_staleness``, as the two groups' speeds decide (not reproducible run to run beyond ``max_staleness=0``).
    Needs disjoint groups: every generate and forward call on the generation ranks, every train call on others."""
    partial_rollout: bool = False
    """Partial rollouts (slime's ``--partial-rollout``, AReaL's interruptible generation): a generation call ends once
    a batch of groups is complete, not when its longest response is; the unfinished samples keep their tokens and
    resume under the next weights (:mod:`~lightning_app_rlhf.engine.partial_rollout`). Their tokens are then one
    version older than the rest, so the schedule keeps one version of ``max_staleness`` for them
    (:attr:`schedule_staleness`): ``max_staleness=1`` is the on-policy schedule with carried tokens one version old.
    Needs ``max_staleness`` of at least 1."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "calls", {c: tuple(sorted(set(r))) for c, r in self.calls.items()})
        object.__setattr__(self, "tp", {c: int(t) for c, t in self.tp.items() if int(t) != 1})
        object.__setattr__(self, "pp", {c: int(p) for c, p in self.pp.items() if int(p) != 1})
        trainable = [r for r in TRAINABLE_ROLES if f"{r}.train" in self.calls]
        object.__setattr__(self, "wrappers", {**{r: "ddp" for r in trainable}, **self.wrappers})
        self.validate()

    @property
    def schedule_staleness(self) -> int:
        """The staleness the schedule runs at: ``max_staleness``, less the one version that partial rollouts keep for
        their carried tokens (:attr:`partial_rollout`). The fixed schedule trains on the rollout of this many
        iterations earlier; a free-running generation side waits for version ``i`` minus this many."""
        return self.max_staleness - int(self.partial_rollout)

    @property
    def overlap(self) -> bool:
        """Whether the train calls work on an earlier iteration's rollout, beside the generation of the next
        (:attr:`schedule_staleness` above 0)."""
        return self.schedule_staleness > 0

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles the plan places (those its calls name), in role-table order."""
        named = {role_of(c) for c in self.calls}
        return tuple(r for r in ROLE_NAMES if r in named)

    @property
    def trainable_roles(self) -> tuple[str, ...]:
        return tuple(r for r in self.roles if r in TRAINABLE_ROLES)

    def validate(self) -> None:
        """Raise a ``ValueError`` naming the fix for any plan that cannot run."""
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}.")
        unknown = [c for c in self.calls if c not in CALLS]
        if unknown:
            raise ValueError(f"Unknown calls {unknown}: a plan gives ranks to calls among {list(CALLS)}.")
        roles = set(self.roles) | set(REQUIRED_ROLES)
        missing = [c for c in calls_of(roles) if c not in self.calls]
        if missing:
            raise ValueError(f"A plan must give ranks to every call of the roles it places ({list(calls_of(roles))}); "
                             f"missing {missing}. Add them, or leave out every call of a role the algorithm does not "
                             "use (a critic-free algorithm has no 'critic.*' calls).")
        for call, ranks in self.calls.items():
            if not ranks:
                raise ValueError(f"Call {call!r} has an empty group: give it at least one rank.")
            bad = [r for r in ranks if not 0 <= r < self.world_size]
            if bad:
                raise ValueError(f"Call {call!r} names ranks {bad} outside the world of {self.world_size} ranks "
                                 f"(0..{self.world_size - 1}). Use ranks inside the world, or launch more devices.")
        idle = sorted(set(range(self.world_size)) - {r for ranks in self.calls.values() for r in ranks})
        if idle:
            raise ValueError(f"Ranks {idle} run no call: the plan's ranks must cover the world of "
                             f"{self.world_size}. Give them a call, or launch {self.world_size - len(idle)} devices.")
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) or self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness!r}: give a whole number of weight versions, 0 for "
                             "on-policy training, 1 for one-step off-policy (overlap), k for a rollout k updates "
                             "old.")
        if self.partial_rollout and self.max_staleness < 1:
            raise ValueError("partial_rollout=True resumes unfinished samples under the next weights, so their first "
                             "tokens are one version older than the update that trains on them: set max_staleness >= 1 "
                             "(SeparationStrategy(max_staleness=1, partial_rollout=True) keeps the on-policy schedule), "
                             "or partial_rollout=False.")
        for role in self.trainable_roles:
            wrapper = self.wrappers.get(role)
            check_wrapper(wrapper, role)  # unknown, or its package missing: the error names the fix
            train = set(self.calls[f"{role}.train"])
            if wrapper in SHARDED_WRAPPERS and len(train) > 1:
                for call, ranks in self.calls.items():
                    if role_of(call) == role and set(ranks) & train and set(ranks) != train:
                        raise ValueError(
                            f"Call {call!r} runs on ranks {list(ranks)}, part of the {wrapper} group {sorted(train)} "
                            f"of '{role}.train': a sharded role can only run a call on all of its train ranks or on "
                            "ranks outside them (shadow copies). Change the call's ranks, or use wrapper 'ddp'.")
        self._validate_tp()
        self._validate_pp()
        if self.free_running:
            self._validate_free_running()
        unknown = sorted(set(self.wrappers) - set(self.roles))
        if unknown:
            raise ValueError(f"Wrappers name unknown roles {unknown}, which the plan does not place: give wrappers "
                             f"to {list(self.trainable_roles)} and, optionally, "
                             f"{[r for r in FROZEN_ROLES if r in self.roles]}.")
        for role in FROZEN_ROLES:
            if role in self.wrappers and self.wrappers[role] not in FROZEN_WRAPPERS:
                raise ValueError(f"Frozen role {role!r} has wrapper {self.wrappers[role]!r}; a frozen role is either "
                                 f"held whole (leave it out of `wrappers`) or sharded with {list(FROZEN_WRAPPERS)} over "
                                 f"the ranks of '{role}.forward'.")
            if role in self.wrappers:
                check_wrapper(self.wrappers[role], role)

    def _validate_tp(self) -> None:
        for call, degree in self.tp.items():
            if call not in self.calls:
                raise ValueError(f"tp names call {call!r}, which the plan does not run: give degrees to calls among "
                                 f"{list(self.calls)}.")
            size = len(self.calls[call])
            if degree < 1 or size % degree:
                raise ValueError(f"Call {call!r} has tensor-parallel degree {degree} on {size} ranks: the degree must "
                                 f"divide the call's group size ({[d for d in range(1, size + 1) if size % d == 0]}).")

    def _validate_pp(self) -> None:
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule={self.pipeline_schedule!r}: use one of {list(PIPELINE_SCHEDULES)}.")
        for call, degree in self.pp.items():
            if call not in self.calls:
                raise ValueError(f"pp names call {call!r}, which the plan does not run: give degrees to calls among "
                                 f"{[c for c in self.calls if c != ACTOR.call('generate')]}.")
            if call == ACTOR.call("generate"):
                raise ValueError(f"'actor.generate' has pipeline-parallel degree {degree}: generation runs data x "
                                 "tensor parallel (a pipeline would idle its stages at every decoding step). Drop "
                                 "'actor.generate' from `pp`; give it a `tp` degree to spread the model instead.")
            size, tp = len(self.calls[call]), self.tp_degree(call)
            if degree < 1 or size % (degree * tp):
                fits = [d for d in range(1, size + 1) if size % (d * tp) == 0]
                raise ValueError(f"Call {call!r} has pipeline-parallel degree {degree}"
                                 + (f" and tensor-parallel degree {tp}" if tp > 1 else "")
                                 + f" on {size} ranks: tp x pp must divide the call's group size. Use pp among "
                                 f"{fits}{' with this tp' if tp > 1 else ''}, or give the call more ranks.")

    def _validate_free_running(self) -> None:
        """A free-running plan splits the world in two: the generation side (generate and every forward call, on the
        same ranks) and the training side (the train calls, on the other ranks)."""
        fix = ("use SeparationStrategy(max_staleness=k, free_running=True), or free_running=False for the fixed "
               "schedule, which runs on any plan")
        generation = set(self.generation_ranks)
        for call, ranks in self.calls.items():
            if call.endswith(".train") and set(ranks) & generation:
                raise ValueError(f"free_running: {call!r} runs on ranks {sorted(set(ranks) & generation)}, which also "
                                 f"generate; the training side must be disjoint from the generation side: {fix}.")
            if not call.endswith(".train") and set(ranks) != generation:
                raise ValueError(f"free_running: {call!r} runs on ranks {list(ranks)}, not on the generation ranks "
                                 f"{sorted(generation)}; every generate and forward call runs on the generation side "
                                 f"(it scores each rollout before sending it): {fix}.")
            if not call.endswith(".train") and self.tp_degree(call) > 1:
                raise ValueError(f"free_running: {call!r} has tensor-parallel degree {self.tp_degree(call)}; the "
                                 f"generation side holds whole shadow copies: drop its 'tp' entry, or {fix}.")
            if not call.endswith(".train") and self.pp_degree(call) > 1:
                raise ValueError(f"free_running: {call!r} has pipeline-parallel degree {self.pp_degree(call)}; the "
                                 f"generation side holds whole shadow copies: drop its 'pp' entry, or {fix}.")

    @property
    def generation_ranks(self) -> tuple[int, ...]:
        """The ranks of ``actor.generate``."""
        return self.calls[ACTOR.call("generate")]

    @property
    def training_ranks(self) -> tuple[int, ...]:
        """The ranks of any train call."""
        return tuple(sorted({r for c, ranks in self.calls.items() if c.endswith(".train") for r in ranks}))

    @property
    def run_ahead(self) -> int:
        """How many iterations the generation side may run ahead of the training side's: ``max_staleness + 1``
        when free-running (rollout ``i`` needs version ``i - k``, which training iteration ``i - k - 1`` makes),
        else 0 (every iteration is a collective step of the whole world)."""
        return self.schedule_staleness + 1 if self.free_running else 0

    def tp_degree(self, call: str) -> int:
        """The tensor-parallel degree of ``call`` (1 unless :attr:`tp` names it)."""
        return self.tp.get(call, 1)

    def pp_degree(self, call: str) -> int:
        """The pipeline-parallel degree of ``call`` (1 unless :attr:`pp` names it)."""
        return self.pp.get(call, 1)

    def layout_text(self, call: str) -> str:
        """``" tp2 pp2 1f1b"``: the call's tensor- and pipeline-parallel degrees where above 1 (a pipelined train
        call with its schedule), as the placement summary and ``plan`` print them; empty for a data-parallel call."""
        text = f" tp{self.tp_degree(call)}" if self.tp_degree(call) > 1 else ""
        if self.pp_degree(call) > 1:
            text += f" pp{self.pp_degree(call)}" + (f" {self.pipeline_schedule}" if call.endswith(".train") else "")
        return text

    def layout_reallocations(self) -> tuple[str, ...]:
        """Calls of a trainable role with a tensor-parallel degree that run on ranks of its train call: they run on
        a copy of the role in their own layout (even with the train call's degree, whose layout also shards over
        the replicas), into which the trained weights are redistributed after every update (ReaLHF's
        reallocation between layouts; shadow copies are :meth:`shadow_ranks`)."""
        moved = []
        for role in self.trainable_roles:
            train = f"{role}.train"
            for call, ranks in self.calls.items():
                if role_of(call) == role and call != train and set(ranks) & set(self.calls[train]) \
                        and (self.tp_degree(call) > 1 or self.runs_on_whole_copy(call)):
                    moved.append(call)
        return tuple(moved)

    def runs_on_whole_copy(self, call: str) -> bool:
        """Whether ``call`` (a generate or forward call of a trainable role, without a tensor-parallel degree) runs on
        a whole copy of its role on its train ranks: there the train call pipelines the role (each rank holds one
        stage of it) and ``call`` does not run on the same pipelines. The copy takes the trained weights, gathered
        from the stages by name, after every update."""
        role = role_of(call)
        train = f"{role}.train"
        if call == train or train not in self.calls or call not in self.calls or self.pp_degree(train) == 1:
            return False
        if self.tp_degree(call) > 1 or not set(self.calls[call]) & set(self.calls[train]):
            return False
        return not (self.pp_degree(call) == self.pp_degree(train) and self.calls[call] == self.calls[train])

    def validate_shared_reference(self) -> None:
        """Raise a ``ValueError`` naming the fix if the reference cannot run on the actor's base model.

        A LoRA actor's reference is the actor itself with adapters disabled, so every rank of ``reference.forward``
        must hold the actor (trained weights or a shadow). A sharded actor (FSDP2 / ZeRO-3 over several ranks)
        runs a forward as a collective over its train group: the reference call must then cover that whole group.
        """
        if REFERENCE.call("forward") not in self.calls:
            return  # no KL, no reference
        actor_ranks = {r for call, ranks in self.calls.items() if role_of(call) == ACTOR.name for r in ranks}
        reference = set(self.calls[REFERENCE.call("forward")])
        missing = sorted(reference - actor_ranks)
        if missing:
            raise ValueError(
                f"The reference shares the LoRA actor's base weights (adapters disabled), but ranks {missing} run "
                f"'reference.forward' without holding the actor. Put 'reference.forward' on ranks that run an actor "
                f"call ({sorted(actor_ranks)}), or give a separate `reference` model so those ranks load a copy.")
        train = set(self.calls[ACTOR.call("train")])
        if self.wrappers.get(ACTOR.name) in SHARDED_WRAPPERS and len(train) > 1 and reference & train != train \
                and reference & train:
            raise ValueError(
                f"'reference.forward' runs on ranks {sorted(reference)}, part of the {self.wrappers[ACTOR.name]} group "
                f"{sorted(train)} of 'actor.train', and the reference shares the sharded actor's base: run it on all "
                "of the actor's train ranks or on none of them, or use wrapper 'ddp'.")

    def to_dict(self) -> dict[str, Any]:
        """Plain fields (lists, not tuples): for checkpoints, JSON, and a strategy's ``plan:`` in a CLI config."""
        return {"world_size": self.world_size, "calls": {c: list(r) for c, r in self.calls.items()},
                "wrappers": dict(self.wrappers), "name": self.name, "max_staleness": self.max_staleness,
                "tp": dict(self.tp), "pp": dict(self.pp), "pipeline_schedule": self.pipeline_schedule,
                "unshard_for_generation": self.unshard_for_generation, "free_running": self.free_running,
                "partial_rollout": self.partial_rollout}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> PlacementPlan:
        """The inverse of :meth:`to_dict`; validates like the constructor. Reads the ``overlap`` flag of plans saved
        before ``max_staleness`` (``overlap: true`` is ``max_staleness: 1``)."""
        if "overlap" in fields:
            overlap = fields["overlap"]
            fields = {k: v for k, v in fields.items() if k != "overlap"}
            fields.setdefault("max_staleness", 1 if overlap else 0)
        return cls(**fields)

    def ranks(self, call: str) -> tuple[int, ...]:
        return self.calls[call]

    def for_roles(self, roles: tuple[str, ...]) -> PlacementPlan:
        """This plan without the calls, wrappers and tensor- and pipeline-parallel degrees of the roles outside ``roles`` (an
        algorithm's): a plan written for PPO's four roles places an algorithm with fewer (no critic; no reference at
        KL 0) as it stands, so a config with a plan of its own runs every algorithm. A role it lacks stays missing
        (:meth:`check_roles` names it).

        Args:
            roles: The roles the algorithm uses.
        """
        unused = set(self.roles) - set(roles)
        if not unused:
            return self
        fields = self.to_dict()
        fields["calls"] = {c: r for c, r in fields["calls"].items() if role_of(c) not in unused}
        fields["wrappers"] = {role: w for role, w in fields["wrappers"].items() if role not in unused}
        fields["tp"] = {c: t for c, t in fields["tp"].items() if role_of(c) not in unused}
        fields["pp"] = {c: p for c, p in fields["pp"].items() if role_of(c) not in unused}
        return PlacementPlan.from_dict(fields)

    def check_roles(self, roles: tuple[str, ...], algorithm: str) -> None:
        """Raise a ``ValueError`` naming the fix unless the plan places exactly ``roles`` (an algorithm's)."""
        if set(self.roles) != set(roles):
            extra = sorted(set(self.roles) - set(roles))
            missing = sorted(set(roles) - set(self.roles))
            raise ValueError(
                f"The plan {self.name!r} places roles {list(self.roles)}, but algorithm {algorithm!r} uses "
                f"{list(roles)}: " + (f"remove the calls of {extra} from the plan" if extra else "")
                + (" and " if extra and missing else "") + (f"give ranks to the calls of {missing}" if missing else "")
                + ". Presets build the right calls themselves (strategy='rlhf_flattening', ...).")

    def holds(self, role: str, rank: int) -> bool:
        """Whether ``rank`` keeps a copy of ``role`` (trained weights or a shadow)."""
        return any(rank in ranks for call, ranks in self.calls.items() if role_of(call) == role)

    def shadow_ranks(self, role: str) -> tuple[int, ...]:
        """Ranks that run a call of a trainable ``role`` without holding its trained weights."""
        if f"{role}.train" not in self.calls:
            return ()
        train = set(self.calls[f"{role}.train"])
        users = {r for call, ranks in self.calls.items() if role_of(call) == role for r in ranks}
        return tuple(sorted(users - train))


def _count(ratio: float, world_size: int, what: str) -> int:
    count = Fraction(ratio).limit_denominator(1000) * world_size
    if not 0 < ratio <= 1 or count.denominator != 1:
        raise ValueError(f"The {what} ratio {ratio} on {world_size} ranks gives {float(count):g} ranks; it must be "
                         f"in (0, 1] and give a whole number. Use a multiple of 1/{world_size}.")
    return int(count)


def _trainable_wrappers(roles: tuple[str, ...], wrapper: str) -> dict[str, str]:
    return {r: wrapper for r in roles if r in TRAINABLE_ROLES}


def flattening_plan(world_size: int, wrapper: str = "ddp", roles: tuple[str, ...] = ROLE_NAMES) -> PlacementPlan:
    """Every call on every rank, data parallel (DeepSpeed-Chat / TRL style). ``roles``: the algorithm's roles."""
    everyone = tuple(range(world_size))
    return PlacementPlan(world_size, {c: everyone for c in calls_of(roles)}, _trainable_wrappers(roles, wrapper),
                         name="flattening")


def interleaving_plan(
    world_size: int,
    reference_ratio: float = 0.5,
    reward_ratio: float = 0.5,
    wrapper: str = "ddp",
    roles: tuple[str, ...] = ROLE_NAMES,
) -> PlacementPlan:
    """The trainable roles on every rank; reference on the first block of ranks, reward on the next.

    The blocks are contiguous and disjoint (APP's Model Placement Ratio): on 8 ranks with 0.5 / 0.5,
    reference on ranks 0-3 and reward on ranks 4-7.
    """
    if world_size < 2:
        raise ValueError("Interleaving needs at least 2 ranks (reference and reward on disjoint groups); "
                         "use flattening on a single device.")
    n_ref = _count(reference_ratio, world_size, REFERENCE.name) if REFERENCE.name in roles else 0
    n_reward = _count(reward_ratio, world_size, REWARD.name)
    if n_ref + n_reward > world_size:
        raise ValueError(f"Reference ({reference_ratio}) and reward ({reward_ratio}) ratios sum to more than 1: "
                         "interleaving puts them on disjoint groups. Lower them so they sum to at most 1.")
    everyone = tuple(range(world_size))
    calls = {c: everyone for c in calls_of(roles)}
    if REFERENCE.name in roles:  # an algorithm without KL has none: the reward then starts at rank 0
        calls[REFERENCE.call("forward")] = tuple(range(n_ref))
    calls[REWARD.call("forward")] = tuple(range(n_ref, n_ref + n_reward))
    return PlacementPlan(world_size, calls, _trainable_wrappers(roles, wrapper), name="interleaving")


def separation_plan(
    world_size: int,
    generation_ranks: tuple[int, ...] | list[int] | None = None,
    training_ranks: tuple[int, ...] | list[int] | None = None,
    generation_ratio: float = 0.5,
    wrapper: str = "ddp",
    max_staleness: int = 0,
    roles: tuple[str, ...] = ROLE_NAMES,
    free_running: bool = False,
    partial_rollout: bool = False,
) -> PlacementPlan:
    """Generation and the forward calls on one group, the train calls on another.

    Args:
        world_size: Ranks in the job.
        generation_ranks: Explicit generation group. Default: the first ``generation_ratio`` of the ranks.
        training_ranks: Explicit training group. Default: the ranks not generating.
        generation_ratio: Fraction of ranks that generate, when no explicit lists are given.
        wrapper: Parallel wrapper of the trainable roles on the training group.
        max_staleness: Train on the rollout of ``max_staleness`` iterations earlier while the next one is generated
            (:attr:`PlacementPlan.max_staleness`); 0: on-policy.
        roles: The algorithm's roles (a critic-free algorithm has no critic calls).
        free_running: The generation group runs ahead of the training group within ``max_staleness`` versions,
            instead of the fixed schedule (:attr:`PlacementPlan.free_running`).
        partial_rollout: Unfinished samples resume under the next weights (:attr:`PlacementPlan.partial_rollout`).
    """
    if world_size < 2:
        raise ValueError("Separation needs at least 2 ranks (one generating, one training); use flattening on "
                         "a single device.")
    if generation_ranks is None:
        generation_ranks = tuple(range(_count(generation_ratio, world_size, "generation")))
    if training_ranks is None:
        training_ranks = tuple(r for r in range(world_size) if r not in set(generation_ranks))
    shared = set(generation_ranks) & set(training_ranks)
    if shared:
        raise ValueError(f"Ranks {sorted(shared)} are in both the generation and the training group; separation "
                         "needs disjoint groups. Use flattening or a custom PlacementPlan to share ranks.")
    gen, train = tuple(generation_ranks), tuple(training_ranks)
    calls = {c: train if c.endswith(".train") else gen for c in calls_of(roles)}
    return PlacementPlan(world_size, calls, _trainable_wrappers(roles, wrapper), name="separation",
                         max_staleness=max_staleness, free_running=free_running, partial_rollout=partial_rollout)
