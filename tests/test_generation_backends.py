"""The generation backends: ``static`` (preallocated cache, device-side keyed sampling) against ``eager``.

Every test builds real random-init Hugging Face models (GPT-2 and a Llama-style config with grouped-query attention)
whose LM head gets a bias on EOS, so that rows end at different steps and some run to the limit. The GPU-marked tests
run only where CUDA is available; CI skips them.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import fit_demo, run_ranks
from lightning.fabric.utilities import move_data_to_device
from torch import nn
from torch.testing import assert_close

from lightning_app_rlhf.core.config import GENERATION_BACKENDS, GenerationConfig
from lightning_app_rlhf.data import collate_left_padded
from lightning_app_rlhf.generation import (
    DecodeRequest,
    EagerBackend,
    Rollout,
    generate,
    get_backend,
    register_backend,
    registered_backends,
    sample_keys,
    static,
)
from lightning_app_rlhf.generation.hf_cache import cache_kwargs
from lightning_app_rlhf.generation.sampling import keyed_seeds, next_token, position_ids_from_mask
from lightning_app_rlhf.generation.stopping import stop_condition
from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm

PAD, EOS = 0, 2
FAMILIES = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 512, "n_positions": 64,
             "bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": PAD},
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 512, "max_position_embeddings": 64,
              "bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": PAD},
}
"""Two layers, 32 dims, the demo tokenizer's 512 tokens; Llama with 4 query and 2 key/value heads."""
PROMPTS = ["name a fruit", "list some fruit please", "a", "the colour of the sky is", "dogs", "say hello to me"]
SETTINGS = {
    "sample": {},
    "top_k_top_p_temperature": {"top_k": 20, "top_p": 0.9, "temperature": 0.7},
    "greedy": {"do_sample": False},
    "chunks_of_4": {"batch_size": 4},
    "stop_strings_and_ids": {"stop_strings": ["e"], "stop_token_ids": [5]},
}


def with_eos_bias(model: nn.Module, bias: float) -> nn.Module:
    """Give the (untied) LM head a bias of ``bias`` on EOS, so random-init responses end at different steps."""
    head = model.lm_head
    biased = nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[EOS] = bias
    model.lm_head = biased
    return model


def build(family: str, bias: float = 3.0, seed: int = 0) -> nn.Module:
    """A tiny random-init model of ``family`` (the package's builder: dropout off), EOS-biased."""
    return with_eos_bias(build_causal_lm(ModelSpec(config=dict(FAMILIES[family]), init_seed=seed)), bias)


@pytest.fixture(scope="module")
def batch(tokenizer) -> dict[str, torch.Tensor]:
    """Six prompts of 1 to 7 tokens, left-padded by the package's collate."""
    items = [{"input_ids": tokenizer(p, add_special_tokens=False)["input_ids"], "index": i}
             for i, p in enumerate(PROMPTS)]
    return collate_left_padded(items, pad_token_id=PAD)


def run(model: nn.Module, batch: dict[str, torch.Tensor], config: GenerationConfig, tokenizer=None) -> Rollout:
    keys = sample_keys(7, 3, batch["index"])
    return generate(model, batch["input_ids"], batch["attention_mask"], config, keys, EOS, PAD, tokenizer=tokenizer)


def assert_same_rollout(got: Rollout, want: Rollout, atol: float = 1e-5) -> None:
    """Same tokens, masks and stop flags; log-probs within float tolerance."""
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.attention_mask, want.attention_mask)
    assert torch.equal(got.response_mask, want.response_mask)
    assert torch.equal(got.stopped, want.stopped)
    assert got.prompt_length == want.prompt_length
    assert_close(got.logprobs, want.logprobs, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_gives_the_tokens_of_eager(family, setting, batch, tokenizer):
    """Same keys: ``static`` samples exactly eager's tokens, masks and stop flags, with log-probs within 1e-5, for
    left-padded prompts whose rows stop at EOS (or a stop string / id) at different steps or run to the limit."""
    # Random-init logits spread only ~0.3; temperature 0.7 sharpens the EOS bias, so that setting gets less.
    model = build(family, bias={"greedy": 0.3, "top_k_top_p_temperature": 1.5}.get(setting, 3.0))
    config = GenerationConfig(max_new_tokens=12, **SETTINGS[setting])
    eager = run(model, batch, config, tokenizer)
    static = run(model, batch, replace(config, backend="static"), tokenizer)
    assert_same_rollout(static, eager)
    assert batch["attention_mask"][:, 0].tolist().count(0) >= 4  # left padding on most rows
    lengths = eager.response_mask.sum(1)
    assert eager.stopped.any() and lengths.min() < lengths.max()  # some rows stop, at different steps
    if setting in ("sample", "greedy"):
        assert not eager.stopped.all() and lengths.max() == 12  # and one runs to the limit (a missing EOS)
    for row in range(len(PROMPTS)):  # only pad after a row's end; a row not stopped was cut at the limit
        length = int(lengths[row])
        assert static.responses[row, length:].eq(PAD).all() and static.logprobs[row, length:].eq(0).all()
        assert bool(static.stopped[row]) or length == 12
        if length < 12:
            assert static.stopped[row]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_under_bf16_autocast_gives_the_tokens_of_eager(family, batch):
    """Under bf16 autocast (``precision: bf16-mixed``), where a RoPE model's keys come out float32 and its values
    bfloat16, ``static`` stores both and still samples eager's tokens (log-probs within bf16 rounding)."""
    model = build(family)
    config = GenerationConfig(max_new_tokens=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = run(model, batch, config)
        static = run(model, batch, replace(config, backend="static"))
    assert_same_rollout(static, eager, atol=2e-3)
    assert eager.stopped.any() and not eager.stopped.all()


def count_forwards(model: nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize("sync_every", [1, 3, 64])
def test_sync_every_changes_only_the_number_of_decode_steps(sync_every, batch):
    """The "all rows stopped?" check runs every ``sync_every`` tokens: the rollout is the same, and the decode
    runs min(ceil(W / k) * k, T) forwards (W: the longest response) where eager runs W."""
    model = build("gpt2", bias=6.0)  # every row stops early
    config = GenerationConfig(max_new_tokens=20)
    eager_calls = count_forwards(model)
    eager = run(model, batch, config)
    width = eager.response_mask.shape[1]
    assert eager.stopped.all() and width < 20 and len(eager_calls) == width
    eager_calls.clear()
    static = run(model, batch, replace(config, backend="static", sync_every=sync_every))
    assert_same_rollout(static, eager)
    assert len(eager_calls) == min(math.ceil(width / sync_every) * sync_every, 20)


def test_static_reuses_its_cache_and_resets_it(batch):
    """A second call of the same shape reuses the preallocated cache (same storage: fixed addresses for a CUDA
    graph) and still gives eager's tokens; another shape gets a new cache."""
    backend = get_backend("static")
    model = build("llama")
    config = GenerationConfig(max_new_tokens=10, backend="static")
    first = run(model, batch, config)
    cache = backend._states[model].cache
    pointer = cache.layers[0].keys.data_ptr()
    second = run(model, {**batch, "index": batch["index"] + 100}, config)
    assert backend._states[model].cache is cache and cache.layers[0].keys.data_ptr() == pointer
    assert_same_rollout(second, run(model, {**batch, "index": batch["index"] + 100}, replace(config, backend="eager")))
    assert not torch.equal(first.responses, second.responses)  # other keys, other tokens
    run(model, batch, replace(config, max_new_tokens=11))
    assert backend._states[model].cache is not cache


def test_static_makes_a_new_cache_when_inference_mode_changes(batch):
    """A cache made under ``inference_mode=True`` (the engine's choice for an unwrapped model) holds inference
    tensors, which a reset outside inference mode may not write: a call of the same shape without it gets a new
    cache, and both give eager's tokens."""
    backend = get_backend("static")
    model = build("gpt2")
    config = GenerationConfig(max_new_tokens=6, backend="static")
    keys = sample_keys(7, 3, batch["index"])
    args = (model, batch["input_ids"], batch["attention_mask"], config, keys, EOS, PAD)
    fast = generate(*args, inference_mode=True)
    cache = backend._states[model].cache
    assert cache.layers[0].keys.is_inference()
    plain = generate(*args)
    assert backend._states[model].cache is not cache
    assert_same_rollout(fast, plain, atol=0)
    assert_same_rollout(plain, run(model, batch, replace(config, backend="eager")))


class CallSignatureOnly(nn.Module):
    """Has a causal LM's call signature but no transformers config (eager can run such stand-ins)."""

    def forward(self, input_ids, attention_mask, position_ids, use_cache=True, **kwargs):
        raise AssertionError("static must refuse before any forward")


@pytest.mark.parametrize("backend", ["static", "continuous"])
def test_cache_backends_refuse_a_model_without_a_transformers_config(batch, backend):
    with pytest.raises(TypeError, match=f"generation.backend='{backend}' needs a Hugging Face causal LM.*"
                                        "generation.backend='eager'"):
        run(CallSignatureOnly(), batch, GenerationConfig(backend=backend))


@pytest.mark.parametrize("fields,message", [
    ({"backend": "sglang"}, "must be one of \\['eager', 'static', 'continuous', 'vllm'\\]"),
    ({"sync_every": 0}, "sync_every must be an integer >= 1"),
    ({"compile": "yes"}, "compile must be true, false or null"),
])
def test_generation_config_rejects_bad_backend_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**fields)


def test_eager_is_the_default_backend():
    assert GenerationConfig().backend == "eager" and get_backend("eager").name == "eager"


class CountingBackend(EagerBackend):
    """A backend of the user's own, defined outside the package: eager's loop, counting the decodes it runs."""

    name = "counting"

    def __init__(self) -> None:
        self.decodes = 0

    def decode(self, model: nn.Module, request: DecodeRequest) -> Rollout:
        self.decodes += 1
        return super().decode(model, request)


@pytest.fixture
def counting_backend():
    """``CountingBackend`` registered by its one call, removed after the test (other tests list the built-ins)."""
    backend = register_backend(CountingBackend())
    yield backend
    GENERATION_BACKENDS.unregister(CountingBackend.name)


def test_a_registered_backend_is_selected_by_name(counting_backend, batch):
    """One ``register_backend`` call, no edit of the package: the config accepts the name, ``generate`` decodes with
    it (in chunks too), and unknown names are refused with the new name listed."""
    config = GenerationConfig(max_new_tokens=8, backend="counting", batch_size=4)
    model = build("gpt2")
    rollout = run(model, batch, config)
    assert counting_backend.decodes == 2  # six rows in chunks of at most 4
    assert_same_rollout(rollout, run(model, batch, replace(config, backend="eager")))
    assert registered_backends() == ["eager", "static", "continuous", "vllm", "counting"]
    with pytest.raises(ValueError, match=r"must be one of \['eager', 'static', 'continuous', 'vllm', 'counting'\], got "
                                         r"'countng'\. "
                                         r"Did you mean 'counting'\?.*register_backend"):
        GenerationConfig(backend="countng")


def test_register_backend_decorates_a_class_and_refuses_a_nameless_one():
    """``@register_backend`` on a class registers an instance and leaves the class as it was; a class without a
    ``name``, or anything but a backend, is refused with what to change."""

    @register_backend
    class Decorated(CountingBackend):
        name = "decorated"

    try:
        assert isinstance(Decorated, type) and isinstance(get_backend("decorated"), Decorated)
        assert GenerationConfig(backend="decorated").backend == "decorated"
    finally:
        GENERATION_BACKENDS.unregister("decorated")
    assert "decorated" not in registered_backends()

    class Nameless(EagerBackend):
        name = ""

    with pytest.raises(ValueError, match="set the class attribute `name"):
        register_backend(Nameless)
    with pytest.raises(TypeError, match="subclass lightning_app_rlhf.generation.GenerationBackend"):
        register_backend(object())


def test_cli_help_lists_the_registered_backends(counting_backend, capsys, monkeypatch):
    """``fit --help`` shows the registered backends in the option's usage and help: the built-in ones and one
    registered by the user's code before the command line is read."""
    from lightning_app_rlhf.cli import main

    monkeypatch.setattr("sys.argv", ["lightning-app-rlhf"])  # pytest's own arguments are not the command line
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "--model.generation.backend {eager,static,continuous,vllm,counting}" in printed
    assert "Registered: eager, static, continuous, vllm, counting." in " ".join(printed.split())


def test_the_compiled_cpu_step_takes_math_attention_in_float32_only():
    """The compiled step on the CPU in float32 runs SDPA's math backend (Inductor fuses it; the flash kernel is an
    opaque call); uncompiled, in bfloat16 (parameters or autocast) and on CUDA, the default kernels stay."""
    model, cpu = build("gpt2"), torch.device("cpu")
    assert static._step_function(model, True, cpu) is static._decode_step_with_math_attention
    assert static._step_function(model, False, cpu) is static._decode_step
    assert static._step_function(model, True, torch.device("cuda")) is static._decode_step
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert static._step_function(model, True, cpu) is static._decode_step
    assert static._step_function(model.to(torch.bfloat16), True, cpu) is static._decode_step


@pytest.mark.parametrize("setting", ["sample", "top_k_top_p_temperature", "greedy"])
def test_the_decode_step_with_its_draw_is_one_graph(setting, batch):
    """Dynamo sees the static decode step, the forward and the keyed draw (temperature, top-k/top-p filter,
    exponential race, log-probability) together, as one graph without a break: what a CUDA graph captures whole."""
    model = build("llama")
    config = GenerationConfig(max_new_tokens=4, **SETTINGS[setting])
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    rows, length = input_ids.shape
    cache = static.OneDtypeStaticCache(config=model.config, max_cache_len=length + 4)
    mask = attention_mask.new_ones(rows, length + 4)
    mask[:, :length] = attention_mask
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                    position_ids=position_ids_from_mask(attention_mask), **cache_kwargs(cache))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        position = position_ids_from_mask(attention_mask)[:, -1:] + 1
        seeds = keyed_seeds(sample_keys(7, 3, batch["index"])) if config.do_sample else None
        column = torch.ones(1, dtype=torch.int64) if config.do_sample else None
        explanation = torch._dynamo.explain(static._decode_step)(
            model, cache, token, position, mask, config, seeds, column, torch.zeros(rows, dtype=torch.bool), PAD)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.slow  # torch.compile on the CPU: ~20-70 s of compilation
def test_compiled_static_decode_gives_the_tokens_of_eager(batch):
    """``generation.compile: true`` on the CPU (inductor; the cache length rounded up to 64): eager's tokens, also
    when calls alternate between batch sizes (each call's first step checks every guard and picks the graph of its
    shape; the later steps skip the guards that cannot fail), and the compiler's stance is the user's again after."""
    model = build("llama")
    config = GenerationConfig(max_new_tokens=12)
    four = {key: batch[key][:4] for key in ("input_ids", "attention_mask", "index")}
    for rows in (batch, four, batch):
        assert_same_rollout(run(model, rows, replace(config, backend="static", compile=True)), run(model, rows, config))
    filtered = GenerationConfig(max_new_tokens=12, **SETTINGS["top_k_top_p_temperature"])  # the filters compiled too
    assert_same_rollout(run(model, batch, replace(filtered, backend="static", compile=True)), run(model, batch, filtered))
    doubled = torch.compile(lambda x: x * 2)
    assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(doubled(torch.ones(3)), torch.full((3,), 2.0))  # guards run again: a graph for 3 elements


@pytest.mark.slow  # torch.compile on the CPU
def test_compiled_static_decode_refuses_a_forward_that_recompiles_at_every_token(batch):
    """A forward that breaks the graph and then depends on a per-token Python value would need a graph per token;
    the decode steps after the first skip the guards, so that is an error naming the fix, not a wrong graph."""
    model = build("llama")

    class BreaksOnPosition(type(model)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            last = int(kwargs["position_ids"].max())  # a graph break, then a guard on this token's position
            out.logits = out.logits + (last - last)
            return out

    model.__class__ = BreaksOnPosition
    with pytest.raises(RuntimeError, match="needs a new graph at every token.*generation.compile: false"):
        run(model, batch, GenerationConfig(max_new_tokens=4, backend="static", compile=True))


def test_decode_harness_times_every_decoder_on_full_length_rows():
    """``bench decode``: each decoder generates batch x new_tokens tokens (no stop), speed-ups are relative to
    eager, and static samples eager's tokens on the harness's prompts."""
    from lightning_app_rlhf.bench.decode import check_equal_tokens, compare_decoders, decode_table

    rows = compare_decoders(["tiny", "llama-small"], [3], new_tokens=5, prompt_tokens=6,
                            decoders=["eager", "static", "hf"], device="cpu", dtype="float32", warmup=0, repeats=1)
    assert [(r["model"], r["decoder"]) for r in rows] == [(m, d) for m in ("tiny", "llama-small")
                                                            for d in ("eager", "static", "hf")]
    assert all(r["tokens"] == 15 and r["tokens_per_s"] == pytest.approx(15 / r["seconds"]) for r in rows)
    assert [r["speedup_vs_eager"] for r in rows if r["decoder"] == "eager"] == [1.0, 1.0]
    assert decode_table(rows).count("\n") == len(rows) + 1
    assert check_equal_tokens("llama-small", 3, 5, 6, "cpu")


# ---- continuous batching: a finished row's slot takes the next prompt ----


@pytest.mark.parametrize("setting", ["sample", "top_k_top_p_temperature", "greedy", "stop_strings_and_ids"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_continuous_gives_every_row_its_solo_tokens(family, setting, batch, tokenizer):
    """Six rows of uneven prompt and response lengths through 2 slots (each finished row's slot takes the next waiting
    prompt; the rows still running stay a prefix): every row gets the tokens, stop flag and (within float tolerance)
    log-probs eager gives it decoded alone, unpadded; the whole rollout is eager's on all rows."""
    model = build(family, bias={"greedy": 0.3, "top_k_top_p_temperature": 1.5}.get(setting, 3.0))
    config = GenerationConfig(max_new_tokens=12, **SETTINGS[setting])
    continuous = run(model, batch, replace(config, backend="continuous", batch_size=2), tokenizer)
    assert_same_rollout(continuous, run(model, batch, config, tokenizer))
    lengths = continuous.response_mask.sum(1)
    assert lengths.min() < lengths.max()  # uneven: slots are freed at different steps
    for row in range(len(PROMPTS)):
        real = batch["attention_mask"][row].bool()
        alone = {"input_ids": batch["input_ids"][row : row + 1, real], "index": batch["index"][row : row + 1],
                 "attention_mask": batch["attention_mask"][row : row + 1, real]}
        solo = run(model, alone, config, tokenizer)
        length = int(lengths[row])
        assert solo.response_mask.sum() == length
        assert torch.equal(continuous.responses[row, :length], solo.responses[0, :length])
        assert bool(continuous.stopped[row]) == bool(solo.stopped[0])
        assert_close(continuous.logprobs[row, :length], solo.logprobs[0, :length], atol=1e-5, rtol=1e-4)


def test_continuous_refuses_a_sharded_model_and_a_sliding_window_model(batch):
    """A lockstep group (a sharded actor) must run the same forwards on every rank; a sliding-window model's cache is
    not full attention: both are refused with the backends that serve them."""
    config = GenerationConfig(max_new_tokens=4, backend="continuous")
    request = DecodeRequest(batch["input_ids"], batch["attention_mask"], config, sample_keys(0, 0, batch["index"]),
                            stop_condition(config, EOS), PAD)
    with pytest.raises(NotImplementedError, match="sharded model.*'static' or 'eager'"):
        get_backend("continuous").decode(build("llama"), request.stand_in())
    mistral = {**FAMILIES["llama"], "model_type": "mistral", "sliding_window": 4}
    model = build_causal_lm(ModelSpec(config=mistral, init_seed=0))
    with pytest.raises(NotImplementedError, match="sliding-window.*generation.backend='static'"):
        run(model, batch, config)


def test_decode_harness_measures_useful_tokens_on_uneven_rows():
    """``bench decode --mean_length``: rows stop after geometric lengths (a stop-id set of vocab / mean ids); static
    and continuous decode the same tokens, counted up to each row's stop."""
    from lightning_app_rlhf.bench.decode import compare_decoders, decode_table, stop_ids

    assert stop_ids(8192, 32) == list(range(3, 259)) and stop_ids(8192, None) == []
    rows = compare_decoders(["llama-small"], [8], new_tokens=24, prompt_tokens=6, decoders=["static", "continuous"],
                            device="cpu", dtype="float32", warmup=0, repeats=1, mean_length=6, slots=3)
    static_row, continuous_row = rows
    assert static_row["tokens"] == continuous_row["tokens"] < 8 * 24  # the same useful tokens, most rows cut short
    assert continuous_row["speedup_vs_static"] == pytest.approx(static_row["seconds"] / continuous_row["seconds"])
    assert "| vs static |" in decode_table(rows)


# ---- a lockstep group (sharded model): ranks with different row counts stay paired ----


def _lockstep_ranks(rank: int, port: int, world: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = build("gpt2", bias=2.0)
    rows = 5 if rank == 0 else 2  # rank 1 runs stand-in chunks
    ids = torch.randint(3, 500, (rows, 6), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    keys = sample_keys(0, 0, torch.arange(rows) + 10 * rank)
    results = {}
    for backend in ("eager", "static"):
        config = GenerationConfig(max_new_tokens=10, batch_size=2, backend=backend, sync_every=3)
        rollout = generate(model, ids, mask, config, keys, EOS, PAD, lockstep_group=dist.group.WORLD)
        results[backend] = {"sequences": rollout.sequences.tolist(), "logprobs": rollout.logprobs.tolist(),
                            "stopped": rollout.stopped.tolist()}
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_static_in_a_lockstep_group_matches_eager(tmp_path):
    """2 gloo processes sharing a lockstep group (as FSDP2 ranks do), 5 and 2 rows in chunks of 2: rank 1 takes part
    in the third chunk with a stand-in row. Both backends stay paired and give the same rollouts."""
    run_ranks(_lockstep_ranks, 2, 2, str(tmp_path), timeout=120)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["static"]["sequences"] == result["eager"]["sequences"]
        assert result["static"]["stopped"] == result["eager"]["stopped"]
        assert_close(torch.tensor(result["static"]["logprobs"]), torch.tensor(result["eager"]["logprobs"]),
                     atol=1e-5, rtol=1e-4)
        assert len(result["eager"]["sequences"]) == (5, 2)[rank]


# ---- placements: a Trainer run with the static backend keeps the trajectory ----


@pytest.fixture(scope="module")
def eager_one_process(tmp_path_factory):
    """The PPO demo on one process with ``eager``: the trajectory every placement logs."""
    return fit_demo(tmp_path_factory.mktemp("eager"), "eager", steps=2)


FSDP2_FLATTENING = ("lightning_app_rlhf.strategies.FlatteningStrategy", "--trainer.strategy.wrapper", "fsdp2")


@pytest.mark.parametrize("strategy", [
    pytest.param(("rlhf_flattening",), marks=pytest.mark.slow, id="flattening"),
    pytest.param(("rlhf_interleaving",), marks=pytest.mark.slow, id="interleaving"),
    pytest.param(("rlhf_separation",), marks=pytest.mark.slow, id="separation"),  # a shadow
    pytest.param(FSDP2_FLATTENING, marks=pytest.mark.slow, id="flattening-fsdp2"),  # a lockstep group
])
def test_static_backend_keeps_every_placements_trajectory(tmp_path, eager_one_process, strategy):
    """``generation.backend: static`` on 2 processes logs, step by step, the values eager logs on one process."""
    assert_same_trajectory(tmp_path, eager_one_process, "static", strategy)


@pytest.mark.parametrize("strategy", [
    pytest.param(("rlhf_flattening",), marks=pytest.mark.slow, id="flattening"),
    pytest.param(("rlhf_separation",), marks=pytest.mark.slow, id="separation"),  # a shadow
])
def test_continuous_backend_keeps_the_placements_trajectory(tmp_path, eager_one_process, strategy):
    """``generation.backend: continuous`` (2 slots: rows wait for a slot) on 2 processes logs, step by step, the
    values eager logs on one process."""
    assert_same_trajectory(tmp_path, eager_one_process, "continuous", strategy, "--model.generation.batch_size", "2")


def assert_same_trajectory(tmp_path, eager_one_process, backend, strategy, *extra) -> None:
    """A 2-process demo run with ``backend`` logs the one-process eager run's values, step by step."""
    from test_placements import COMPARED

    rows = fit_demo(tmp_path, backend, "--trainer.devices", "2", "--trainer.strategy", *strategy,
                    "--model.generation.backend", backend, *extra, steps=2)
    got = [r for r in rows if "reward/mean" in r]
    want = [r for r in eager_one_process if "reward/mean" in r]
    assert [r["step"] for r in got] == [0, 1]
    for step, (row, reference) in enumerate(zip(got, want, strict=True)):
        for metric in COMPARED:
            assert row[metric] == pytest.approx(reference[metric], rel=1e-4, abs=1e-6), (strategy, step, metric)


# ---- CUDA (the lent GPU machine; CI skips these) ----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_static_gives_the_tokens_of_eager(family, batch):
    """On CUDA, float32: the compiled (CUDA-graph) static decoder samples eager's tokens for the same keys."""
    model = build(family).cuda()
    cuda_batch = move_data_to_device(batch, "cuda")
    config = GenerationConfig(max_new_tokens=16)
    eager = run(model, cuda_batch, config)
    for _ in range(2):  # the second call replays the captured graph on the reused cache
        assert_same_rollout(run(model, cuda_batch, replace(config, backend="static")), eager, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_static_decode_runs(batch):
    """A bf16 Llama-style model decodes with the compiled static backend: valid masks, finite log-probs at or below
    0, and mostly eager's tokens (bf16 rounding differs between the two attention lengths)."""
    model = build("llama").to("cuda", torch.bfloat16)
    cuda_batch = move_data_to_device(batch, "cuda")
    config = GenerationConfig(max_new_tokens=16)
    static = run(model, cuda_batch, replace(config, backend="static"))
    eager = run(model, cuda_batch, config)
    lengths = static.response_mask.sum(1)
    columns = torch.arange(static.response_mask.shape[1], device="cuda")
    assert torch.equal(static.response_mask.bool(), columns < lengths[:, None])  # a prefix of ones per row
    assert torch.isfinite(static.logprobs).all() and (static.logprobs <= 0).all()
    assert static.logprobs.dtype == torch.float32
    assert torch.equal(static.responses[:, 0], eager.responses[:, 0])


@pytest.mark.gpu
@needs_cuda
def test_cuda_compiled_sampling_over_a_real_vocabulary_gives_eager_tokens():
    """The sampling arithmetic compiled on CUDA over a SmolLM2-sized vocabulary (49152, where Inductor could not
    compile the former float64 CDF scan) picks eager's tokens for the same seeds and columns."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49152, generator=generator).cuda()
    seeds = keyed_seeds(torch.arange(8)).cuda()
    done = torch.zeros(8, dtype=torch.bool, device="cuda")
    config = GenerationConfig(top_k=50, top_p=0.9)
    compiled = torch.compile(next_token, dynamic=False)
    for step in range(2):
        column = torch.tensor([step], device="cuda")
        got = compiled(logits, config, seeds, column, done, 0)
        want = next_token(logits, config, seeds, column, done, 0)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
