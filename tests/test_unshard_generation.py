"""Unshard-once generation (the hybrid engine): a sharded actor that generates on its own train group all-gathers its
weights once per rollout, not for every decoding step, and frees them after. On 2 forked gloo processes, with every
collective counted at the dispatcher (``c10d`` ops: what FSDP2's and DeepSpeed's all-gathers reach, whichever Python
function issued them)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import metrics_rows, run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_app_rlhf import GenerationConfig
from lightning_app_rlhf.engine.role_calls import RoleCalls
from lightning_app_rlhf.generation import generate
from lightning_app_rlhf.parallel.wrappers import WRAPPERS, is_available

ALL_GATHER = "c10d._allgather_base_"
"""The dispatcher op of FSDP2's ``all_gather_single`` and of DeepSpeed's parameter all-gathers on gloo."""
EMBED = 192
"""Model width: ZeRO-3 keeps parameters under 1e5 elements gathered for good (its persistence threshold); at 192 the
blocks' MLP and QKV matrices and the embedding are above it, so ZeRO-3 really partitions them."""
needs_deepspeed = pytest.mark.skipif(not is_available("zero3"), reason="deepspeed is not installed")
SHARDED = [pytest.param("fsdp2"), pytest.param("zero3", marks=needs_deepspeed)]


class Collectives(TorchDispatchMode):
    """Counts the ``c10d`` collectives issued inside the block, by op name, and the bytes all-gathered (the size of
    each all-gather's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.gathered_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func.overloadpacket)
        if name.startswith(("c10d.", "_c10d_functional.")):
            self.ops[name] += 1
        if name == ALL_GATHER:
            self.gathered_bytes += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


# ---- the wrappers: one gather per rollout, freed after ----


def _local_state(wrapper_name: str, module: torch.nn.Module) -> list[Any]:
    """Per parameter: FSDP2, whether it is a DTensor and its local shape; ZeRO-3, its status and data size."""
    if wrapper_name == "fsdp2":
        return [[type(p).__name__, list(getattr(p, "to_local", lambda p=p: p)().shape)] for p in module.parameters()]
    return [[p.ds_status.name, p.data.numel()] for p in module.parameters()]


def _generate_both_ways(rank: int, port: int, out: str, wrapper_name: str) -> None:
    """Rank 0 generates for 3 prompts, rank 1 for 2, one prompt per chunk: per-step gathering (in lockstep), then
    unshard-once for 4 and for 10 new tokens (FSDP2: no lockstep, so rank 0 runs more forwards than rank 1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=EMBED, n_head=2, vocab_size=512, n_positions=64,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    wrapper = WRAPPERS[wrapper_name](model, group, 2, rank, torch.device("cpu"))
    wrapper.wrap()
    wrapper.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), 1.0)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    rows = 3 - rank
    prompts = torch.randint(3, 512, (rows, 6), generator=torch.Generator().manual_seed(rank))
    keys = torch.arange(rows) + 10 * rank

    def run(tokens: int, once: bool) -> dict[str, Any]:
        config = GenerationConfig(max_new_tokens=tokens, batch_size=1)
        lockstep = group if not once or wrapper.lockstep_when_unsharded else None
        forwards[0] = 0
        memory = wrapper.memory_bytes()
        with wrapper.running(), Collectives() as counted, wrapper.unsharded() if once else contextlib.nullcontext():
            rollout = generate(model, prompts, torch.ones_like(prompts), config, keys, 2, 0, lockstep)
        return {"gathers": counted.ops[ALL_GATHER], "bytes": counted.gathered_bytes, "ops": dict(counted.ops),
                "forwards": forwards[0],
                "responses": rollout.responses.tolist(), "logprobs": rollout.logprobs.tolist(),
                "memory_before": list(memory), "memory_after": list(wrapper.memory_bytes()),
                "state_after": _local_state(wrapper_name, model)}

    results = {"sharded": _local_state(wrapper_name, model)}
    results["once"] = {tokens: run(tokens, once=True) for tokens in (4, 10)}
    with wrapper.running(), Collectives() as counted, wrapper.unsharded():
        pass
    results["bare"] = counted.ops[ALL_GATHER]
    results["bare_bytes"] = counted.gathered_bytes
    results["param_bytes"] = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()) * 4
    results["step"] = run(10, once=False)
    # Training after unshard-once generation: FSDP2 re-gathers in its forward, reduces in backward, as always.
    with wrapper.running():
        loss = wrapper.train_module(input_ids=prompts).logits.float().mean()
    wrapper.backward(loss)
    results["grad_norm"] = wrapper.step().grad_norm
    results["state_after_step"] = _local_state(wrapper_name, model)
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.parametrize("wrapper_name", SHARDED)
def test_a_sharded_actor_gathers_its_weights_once_per_rollout_and_frees_them(tmp_path, wrapper_name):
    """Unshard-once generation gathers the full weights on entry only (FSDP2: one all-gather per FSDP unit, the two
    blocks and the root; ZeRO-3: one coalesced all-gather), the same collectives and bytes for 4 and 10 new tokens,
    against per-step gathering's two (FSDP2: one per block) or one (ZeRO-3) for every forward, over ten times the
    bytes. The tokens and log-probabilities are identical, every parameter is back to its local shard afterwards,
    with the same bytes, and the role trains after it. Under FSDP2 the forwards inside run no collective at all, so
    the ranks decode without lockstep: rank 0 (3 chunks) runs more forwards than rank 1 (2)."""
    run_ranks(_generate_both_ways, 2, str(tmp_path), wrapper_name)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, got in enumerate(ranks):
        step, once = got["step"], got["once"]
        # Once: the same gathers and bytes for 4 and 10 new tokens as entering and leaving alone: the full weights.
        assert once["4"]["gathers"] == once["10"]["gathers"] == got["bare"], rank
        assert once["4"]["bytes"] == once["10"]["bytes"] == got["bare_bytes"] >= got["param_bytes"], rank
        assert once["4"]["forwards"] < once["10"]["forwards"], rank
        # Per step: at least one gather per forward, and more than ten times the bytes for 10 tokens.
        assert step["gathers"] >= step["forwards"] >= once["10"]["forwards"], rank
        assert step["bytes"] > 10 * got["bare_bytes"], rank
        if wrapper_name == "fsdp2":
            assert got["bare"] == 3, rank  # one per FSDP unit: the two blocks and the root
            assert once["10"]["ops"] == {ALL_GATHER: 3}, rank  # and no other collective: no lockstep all-reduce
            # Per step, each block per forward; the root at the first forward, then it stays gathered (FSDP2 never
            # reshards the root after a forward).
            assert step["gathers"] == 2 * step["forwards"] + 1, rank
        else:
            assert got["bare"] == 1, rank  # one coalesced all-gather
        assert step["responses"] == once["10"]["responses"] and step["logprobs"] == once["10"]["logprobs"], rank
        # The full weights are freed: every parameter is its local shard again. (Per step, FSDP2 keeps the root
        # gathered after generation until the next backward: it never reshards the root after a forward.)
        for run in (once["4"], once["10"]):
            assert run["memory_after"] == run["memory_before"], rank
            assert run["state_after"] == got["sharded"], rank
    if wrapper_name == "fsdp2":
        assert all(got["state_after_step"] == got["sharded"] for got in ranks)  # the backward resharded the root
        assert ranks[0]["once"]["10"]["forwards"] > ranks[1]["once"]["10"]["forwards"]
        assert all(state[0] == "DTensor" for state in ranks[0]["sharded"])
    else:
        assert any(state == ["NOT_AVAILABLE", 0] for state in ranks[0]["sharded"])
    assert ranks[0]["grad_norm"] == pytest.approx(ranks[1]["grad_norm"]) and ranks[0]["grad_norm"] > 0


# ---- the engine: Flattening with a sharded actor, both modes ----


_ROLLOUTS: list[dict[str, Any]] = []
"""Each ``generate_shard`` of this process: the collectives it ran and its outputs."""


def _counted_generate_shard(original: Callable[..., Any]) -> Callable[..., Any]:
    def generate_shard(self: RoleCalls, batch: dict[str, Any], iteration: int, policy_version: int | None) -> Any:
        with Collectives() as counted:
            part = original(self, batch, iteration, policy_version)
        _ROLLOUTS.append({"ops": dict(counted.ops), "bytes": counted.gathered_bytes,
                          "width": part["responses"].shape[1], "responses": part["responses"].tolist(),
                          "logprobs": part["logprobs"].tolist()})
        return part

    generate_shard.counted = True
    return generate_shard


class RecordGeneration(pl.Callback):
    """Runs the strategy's plan with ``unshard_for_generation`` as given, counts the collectives of every
    ``actor.generate`` on this rank (``RoleCalls.generate_shard``), and writes them, the rollouts, and the actor's
    bytes and shard state at fit start and after every iteration to ``out/rank{r}.json``.

    Args:
        out: Directory of the records.
        unshard_for_generation: The plan's setting for this run.
    """

    def __init__(self, out: str, unshard_for_generation: bool = True) -> None:
        self.out = Path(out)
        self.unshard_for_generation = unshard_for_generation
        self.after: list[dict[str, Any]] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        strategy.apply_plan(dataclasses.replace(strategy.placement_plan,
                                                unshard_for_generation=self.unshard_for_generation))
        if not hasattr(RoleCalls.generate_shard, "counted"):  # this rank's process only (forked)
            RoleCalls.generate_shard = _counted_generate_shard(RoleCalls.generate_shard)

    def _actor(self, pl_module: Any) -> dict[str, Any]:
        wrapper = pl_module.placed_roles.wrappers["actor"]
        return {"memory": list(wrapper.memory_bytes()), "state": _local_state(wrapper.name, wrapper.module)}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = self._actor(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append(self._actor(pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {"plan": trainer.strategy.placement_plan.to_dict(), "start": self.start, "after": self.after,
                  "rollouts": _ROLLOUTS}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit_rank(rank: int, port: int, out: str, wrapper_name: str, unshard: bool, actor: dict[str, Any]) -> None:
    """One rank of a Lightning run that these forked processes make themselves (Lightning sees ``LOCAL_RANK`` and
    launches nothing): two iterations of PPO on the demo task, Flattening with actor and critic under
    ``wrapper_name``."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_app_rlhf import PPOConfig, PromptDataModule, RLHFModule, demo
    from lightning_app_rlhf.strategies import FlatteningStrategy

    torch.set_num_threads(1)
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tokenizer = demo.build_tokenizer()
    module = RLHFModule(actor=actor, tokenizer=tokenizer, reward_fn=demo.topic_reward, seed=0,
                        generation=GenerationConfig(max_new_tokens=10), ppo=PPOConfig(num_minibatches=2))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=2, log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=out,
        logger=CSVLogger(out, name="log"),
        strategy=FlatteningStrategy(wrapper=wrapper_name, timeout=120),
        callbacks=[RecordGeneration(out, unshard_for_generation=unshard)],
    )
    trainer.fit(module, PromptDataModule(demo.prompts(16), tokenizer, batch_size=8))


def _fit(tmp_path: Path, wrapper_name: str, unshard: bool, actor: dict[str, Any],
         ) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """:func:`_fit_rank` on 2 forked processes; each rank's record and the logged metric rows."""
    out = tmp_path / f"unshard_{unshard}"
    out.mkdir()
    run_ranks(_fit_rank, 2, str(out), wrapper_name, unshard, actor)
    rows = metrics_rows(out / "log")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)], rows


def _padded(values: list[list[float]], width: int, pad: float) -> list[list[float]]:
    return [row + [pad] * (width - len(row)) for row in values]


TIMING = ("time/", "perf/", "throughput")
"""Logged values that measure wall time, not the training."""


def _check_engine_run(tmp_path: Path, wrapper_name: str, width: int) -> None:
    actor = {"config": {"model_type": "gpt2", "n_layer": 2, "n_embd": width, "n_head": 4, "vocab_size": 512,
                        "n_positions": 64, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, "init_seed": 0}
    once, once_rows = _fit(tmp_path, wrapper_name, True, actor)
    step, step_rows = _fit(tmp_path, wrapper_name, False, actor)
    assert once[0]["plan"]["unshard_for_generation"] and not step[0]["plan"]["unshard_for_generation"]
    for rank in (0, 1):
        assert len(once[rank]["rollouts"]) == len(step[rank]["rollouts"]) == 2
        for iteration, (a, b) in enumerate(zip(once[rank]["rollouts"], step[rank]["rollouts"], strict=True)):
            where = (rank, iteration)
            # Per step, the group decodes in lockstep to its longest response; unshard-once, FSDP2 ranks stop alone.
            width = max(a["width"], b["width"])
            assert _padded(a["responses"], width, 0) == _padded(b["responses"], width, 0), where
            assert _padded(a["logprobs"], width, 0.0) == _padded(b["logprobs"], width, 0.0), where
            assert b["ops"][ALL_GATHER] >= b["width"] and b["bytes"] > 5 * a["bytes"], where  # per forward
            assert b["ops"]["c10d.allreduce_"] == b["width"], where  # the lockstep's all-done check per step
            if wrapper_name == "fsdp2":
                assert a["ops"] == {ALL_GATHER: 3}, where  # once per FSDP unit per rollout, nothing else
                assert b["ops"][ALL_GATHER] == 2 * b["width"] + 1, where  # per forward per block, and the root
            else:
                assert a["ops"][ALL_GATHER] == 1, where  # one coalesced all-gather per rollout
        for run in (once[rank], step[rank]):
            assert all(after["memory"] == run["start"]["memory"] for after in run["after"]), rank
        # After each iteration the actor is its shards (the root too: the train call's backward resharded it).
        assert once[rank]["after"] == step[rank]["after"], rank
        if wrapper_name == "fsdp2":
            assert all(after["state"] == once[rank]["start"]["state"] for after in once[rank]["after"]), rank
    logged = [row for row in once_rows if "reward/mean" in row]
    assert len(logged) == 2
    for got, want in zip(logged, [row for row in step_rows if "reward/mean" in row], strict=True):
        assert got.keys() == want.keys()
        for key in got:
            if not key.startswith(TIMING):
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    memory = [next({k: v for k, v in row.items() if k.startswith("memory/")} for row in rows
                   if "memory/param_bytes_rank0" in row) for rows in (once_rows, step_rows)]
    assert memory[0] == memory[1]


def test_flattening_with_an_fsdp2_actor_gathers_once_per_rollout_and_trains_the_same(tmp_path):
    """PPO on the demo task on 2 ranks, Flattening with actor and critic under FSDP2, two iterations with
    ``unshard_for_generation`` on (the default) and off. On: each ``actor.generate`` runs exactly 3 all-gathers (the
    two blocks and the root, once) and no other collective; off: two per decoding forward plus the root, and a
    lockstep all-reduce per step. The responses and log-probabilities are identical, every logged value is the same,
    and the actor's bytes and shards after each iteration are those at fit start."""
    _check_engine_run(tmp_path, "fsdp2", 64)


@pytest.mark.slow
@needs_deepspeed
def test_flattening_with_a_zero3_actor_gathers_once_per_rollout_and_trains_the_same(tmp_path):
    """The same under ZeRO-3 (DeepSpeed's CPU accelerator), with an actor wide enough for ZeRO-3 to partition
    (:data:`EMBED`): fewer all-gathers in each ``actor.generate`` with unshard-once, identical rollouts and logged
    values, unchanged bytes."""
    _check_engine_run(tmp_path, "zero3", EMBED)



# ---- reallocation streams a sharded role: one bucket whole at a time ----


def test_parameter_buckets_cut_consecutive_runs_by_full_size_and_dtype():
    """Hand-counted: at most 100 elements a bucket, a larger parameter alone, a dtype change starts a bucket."""
    from lightning_app_rlhf.parallel.wrappers.base import parameter_buckets

    params = [torch.zeros(60), torch.zeros(40), torch.zeros(10), torch.zeros(150), torch.zeros(5),
              torch.zeros(5, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16)]
    assert parameter_buckets(params, 100) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5), slice(5, 7)]
    assert parameter_buckets([], 100) == []


def _stream_buckets(rank: int, port: int, out: str, wrapper_name: str) -> None:
    """The wrapper's full weights drawn as buckets of at most 1e5 elements: which parameters each bucket holds, the
    largest number of elements gathered at once, and whether they equal the whole module's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_app_rlhf.parallel.wrappers.base import parameter_buckets

    torch.set_num_threads(1)
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=EMBED, n_head=2, vocab_size=512, n_positions=64))
    whole = [p.detach().clone() for p in model.parameters()]
    expected = [[s.start, s.stop] for s in parameter_buckets(whole, 100_000)]
    wrapper = WRAPPERS[wrapper_name](model, dist.new_group([0, 1]), 2, rank, torch.device("cpu"))
    wrapper.wrap()
    wrapper.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), 1.0)
    drawn, largest, equal, start = [], 0, True, 0
    with Collectives() as counted:
        for bucket in wrapper.full_parameter_buckets(100_000):
            drawn.append([start, start + len(bucket)])
            largest = max(largest, sum(p.numel() for p in bucket))
            equal &= all(torch.equal(p, w) for p, w in zip(bucket, whole[start:], strict=False))
            start += len(bucket)
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "drawn": drawn, "expected": expected, "largest": largest, "equal": equal, "count": start,
        "params": len(whole), "biggest_param": max(p.numel() for p in whole),
        "gathers": sum(n for op, n in counted.ops.items() if "gather" in op)}))


@pytest.mark.parametrize("wrapper_name", SHARDED)
def test_a_sharded_role_streams_its_full_weights_one_bucket_at_a_time(tmp_path, wrapper_name):
    """What shadows and tensor-parallel copies are refreshed from: every parameter, whole and bit-exact, in the
    buckets both sides cut from the full shapes, never more than one bucket (or one larger parameter) whole."""
    run_ranks(_stream_buckets, 2, str(tmp_path), wrapper_name)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["drawn"] == r["expected"] and len(r["drawn"]) > 3, r["drawn"]
        assert r["equal"] and r["count"] == r["params"]
        assert r["largest"] <= max(100_000, r["biggest_param"])
        assert r["gathers"] > 0  # the shards were gathered, bucket by bucket
