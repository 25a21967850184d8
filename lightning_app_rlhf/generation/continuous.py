"""The ``continuous`` generation backend: continuous batching over a slot KV cache. Plain PyTorch.

A call's rows run through at most ``generation.batch_size`` slots (all rows at once without it). Each slot holds one
row: its prompt's keys and values from position 0 on, then one more per generated token. When a row ends (a stop,
or ``max_new_tokens``), its slot takes the next waiting prompt; when none waits, the last occupied slot moves into
the hole, so the occupied slots stay a prefix and each decode step runs only the rows still generating. A batch of
uneven response lengths then costs about its tokens, not its longest row times its rows (the ``static`` backend's
chunks each run until their longest row ends, finished rows included).

How a row gets the tokens it would get alone:

- Its prompt is prefilled alone (batch 1, no padding, the model's own dynamic cache), and the keys and values are
  copied into its slot: the prefill's numbers are the solo ones.
- Each decode step gives every slot its own position (``position_ids``) and a 4D attention mask that shows it its
  own positions only, so a slot never attends to another row's, or a previous occupant's, keys.
- The draw is keyed by the row's seed and its own response column
  (:func:`~lightning_app_rlhf.generation.sampling.keyed_uniforms`), whichever slot and batch it runs in.

As in ``static``, the batched decode step rounds floats in other places than a solo one; the tokens are eager's, and
the log-probabilities equal within float tolerance.

Weighed first, and not used: transformers' own continuous batching (``generate_batch``, paged attention). It draws
from one global generator with no per-request key, so a request's tokens depend on what else is in the batch; it
returns filtered log-probabilities, has no stop strings, and splits prompts into chunks by the scheduler's budget
(transformers 5.24, ``generation/continuous_batching``).

Supported: models whose every layer is full attention through transformers' ``Cache`` API (GPT-2, Llama,
Qwen2/Qwen3, SmolLM2); a sliding-window or hybrid model is refused with the fix. Not in a lockstep group (a sharded
actor), which must run the same forwards on every rank: use ``eager`` or ``static`` there. Uncompiled: the number of
occupied slots changes as rows end.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from lightning_app_rlhf.generation.backend import (
    DecodeRequest,
    GenerationBackend,
    register_backend,
    transformers_config,
)
from lightning_app_rlhf.generation.hf_cache import cache_kwargs, returned_cache
from lightning_app_rlhf.generation.rollout import Rollout
from lightning_app_rlhf.generation.sampling import keyed_seeds, next_token


class SlotLayer(StaticLayer):
    """One layer's keys and values, ``[slots, heads, length, head_dim]``, written at each slot's own position.

    A decode step writes its one new key and value per occupied slot at ``positions[slot]`` (the cache's shared
    [slots] tensor) and returns the first ``occupied`` slots' buffers (views, no copy): the attention mask hides every
    position a slot has not written for its row.
    """

    def __init__(self, max_cache_len: int, cache: SlotCache) -> None:
        super().__init__(max_cache_len)
        self.slots = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            raise RuntimeError("A slot layer is written by SlotCache.fill before its first decode step.")
        occupied = self.slots.occupied
        if key_states.shape[0] != occupied or key_states.shape[2] != 1:
            raise RuntimeError(f"A slot cache decodes one token for each of its {occupied} occupied slots; got keys of "
                               f"shape {tuple(key_states.shape)}.")
        rows = torch.arange(occupied, device=self.keys.device)
        positions = self.slots.positions[:occupied]
        self.keys[rows, :, positions] = key_states[:, :, 0]
        self.values[rows, :, positions] = value_states[:, :, 0]
        return self.keys[:occupied], self.values[:occupied]


class SlotCache(Cache):
    """transformers' ``Cache`` of :class:`SlotLayer` s: ``slots`` rows of ``length`` positions each, a write position
    per slot, and the first ``occupied`` slots in use.

    Args:
        num_layers: The model's decoder layers.
        slots: Rows decoded at once.
        length: Positions per slot: the longest prompt plus ``max_new_tokens``.
    """

    def __init__(self, num_layers: int, slots: int, length: int) -> None:
        super().__init__(layers=[SlotLayer(length, self) for _ in range(num_layers)])
        self.num_slots, self.length = slots, length
        self.positions = torch.zeros(slots, dtype=torch.int64)
        self.occupied = 0

    def fill(self, slot: int, prefill: Any) -> None:
        """Copy a solo prefill's keys and values (a ``DynamicCache`` of one row) into positions ``0..P-1`` of
        ``slot``, and set its write position to ``P``."""
        for layer, solo in zip(self.layers, prefill.layers, strict=True):
            keys, values = solo.keys, solo.values
            if not layer.is_initialized:
                self._allocate(layer, keys, values)
            length = keys.shape[2]
            layer.keys[slot, :, :length] = keys[0]
            layer.values[slot, :, :length] = values[0]
        self.positions[slot] = prefill.layers[0].keys.shape[2]

    def move(self, source: int, target: int) -> None:
        """Move slot ``source``'s row into slot ``target`` (its keys and values up to its write position)."""
        length = int(self.positions[source])
        for layer in self.layers:
            layer.keys[target, :, :length] = layer.keys[source, :, :length]
            layer.values[target, :, :length] = layer.values[source, :, :length]
        self.positions[target] = self.positions[source]

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[occupied, 1, 1, length] additive mask of a decode step: 0 on positions ``0..positions[slot]`` (the prompt,
        the tokens so far and the one written now), the dtype's minimum elsewhere."""
        positions = self.positions[: self.occupied]
        visible = torch.arange(self.length, device=positions.device) <= positions.unsqueeze(-1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
        return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None, None, :]

    def _allocate(self, layer: SlotLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
        layer.device = keys.device
        layer.keys = keys.new_zeros(self.num_slots, keys.shape[1], self.length, keys.shape[3])
        layer.values = values.new_zeros(self.num_slots, values.shape[1], self.length, values.shape[3])
        layer.is_initialized = True
        self.positions = self.positions.to(keys.device)


def _check_full_attention(model: torch.nn.Module) -> int:
    """The model's number of decoder layers; refuses a model with sliding-window or other non-full layers."""
    text = transformers_config(model, ContinuousBackend.name).get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True) or any(
            kind != "full_attention" for kind in layer_types):
        raise NotImplementedError(
            f"generation.backend='continuous' keeps full-attention slots; {type(model).__name__} has sliding-window "
            f"or other layers ({sorted(set(layer_types)) or 'sliding_window'}). Use generation.backend='static' or "
            "'eager'."
        )
    return int(text.num_hidden_layers)


class ContinuousBackend(GenerationBackend):
    """``generation.backend: continuous``: continuous batching over :class:`SlotCache` slots (``generation.batch_size``
    of them; every row at once without it). Same tokens as ``eager``."""

    name = "continuous"
    schedules_rows = True

    def decode(self, model: torch.nn.Module, request: DecodeRequest) -> Rollout:
        if request.lockstep_group is not None or not request.active:
            raise NotImplementedError(
                "generation.backend='continuous' decodes a rank's rows on its own, but actor.generate runs on a "
                "sharded model here (tensor parallel, FSDP2 or ZeRO-3), whose ranks must run the same forwards. Use "
                "generation.backend='static' or 'eager' for this placement."
            )
        input_ids, attention_mask, config = request.input_ids, request.attention_mask, request.config
        rows, prompt_length = input_ids.shape
        steps, device, pad_token_id = config.max_new_tokens, input_ids.device, request.pad_token_id
        num_layers = _check_full_attention(model)
        slots = min(rows, config.batch_size or rows)
        cache = SlotCache(num_layers, slots, prompt_length + steps)
        seeds = keyed_seeds(request.keys).to(device)  # greedy decoding reads none
        tokens = torch.full((rows, steps), pad_token_id, dtype=input_ids.dtype, device=device)
        logprobs = torch.zeros(rows, steps, device=device)
        lengths = [0] * rows
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        waiting = deque(range(rows))
        occupant = [-1] * slots  # the row in each slot
        last = torch.zeros(slots, dtype=input_ids.dtype, device=device)  # each slot's latest token
        no_row_done = torch.zeros(slots, dtype=torch.bool, device=device)
        first_column = torch.zeros(1, dtype=torch.int64, device=device)
        window = request.stops.window
        # The mask's dtype: the attention's (autocast's, else the parameters'), the same at every step.
        autocast = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else next(model.parameters()).dtype

        def record(slot: int, token: torch.Tensor, logprob: torch.Tensor, stop_id: bool) -> bool:
            """Write the slot's row's next token (``stop_id``: it is a stop id); whether the row has ended."""
            row = occupant[slot]
            step = lengths[row]
            tokens[row, step], logprobs[row, step], lengths[row] = token, logprob, step + 1
            last[slot] = token
            if not stop_id and request.stops.strings is not None:  # the row's own latest columns, as static reads
                stop_id = bool(request.stops.ended_window(tokens[row : row + 1, max(0, step + 1 - window) : step + 1]))
            stopped[row] = stop_id
            return stop_id or step + 1 == steps

        def admit(slot: int) -> None:
            """Prefill waiting rows into ``slot`` until one is still generating after its first token, or none
            waits; then ``occupant[slot]`` is that row (or -1)."""
            while waiting:
                row = waiting.popleft()
                prompt = input_ids[row : row + 1, attention_mask[row].bool()]
                solo = model(input_ids=prompt, position_ids=torch.arange(prompt.shape[1], device=device)[None],
                             use_cache=True, logits_to_keep=1, **cache_kwargs(DynamicCache()))
                occupant[slot] = row
                token, logprob = next_token(solo.logits[:, -1, :], config, seeds[row : row + 1], first_column,
                                            no_row_done[:1], pad_token_id)
                if not record(slot, token[0], logprob[0], bool(torch.isin(token, request.stops.token_ids))):
                    cache.fill(slot, returned_cache(solo))
                    return
            occupant[slot] = -1

        for slot in range(slots):
            admit(slot)
        occupied = [slot for slot in range(slots) if occupant[slot] >= 0]
        self._compact(cache, occupant, last, occupied)
        while cache.occupied:
            n = cache.occupied
            running = [occupant[slot] for slot in range(n)]
            columns = torch.tensor([lengths[row] for row in running], device=device)  # each row's own step
            out = model(input_ids=last[:n].unsqueeze(-1), attention_mask=cache.attention_mask(dtype),
                        position_ids=cache.positions[:n].unsqueeze(-1).clone(), use_cache=True,
                        **cache_kwargs(cache))
            token, logprob = next_token(out.logits[:, -1, :], config, seeds[running], columns, no_row_done[:n],
                                        pad_token_id)
            cache.positions[:n] += 1
            stop_ids = torch.isin(token, request.stops.token_ids).tolist()
            ended = [slot for slot in range(n) if record(slot, token[slot], logprob[slot], stop_ids[slot])]
            for slot in ended:
                admit(slot)
            if ended:
                self._compact(cache, occupant, last, [slot for slot in range(n) if occupant[slot] >= 0])
        width = max(max(lengths), 1)
        response_mask = (torch.arange(width, device=device) < torch.tensor(lengths, device=device)[:, None])
        return Rollout.from_responses(input_ids, attention_mask, tokens[:, :width],
                                      response_mask.to(attention_mask.dtype), logprobs[:, :width], stopped)

    @staticmethod
    def _compact(cache: SlotCache, occupant: list[int], last: torch.Tensor, occupied: list[int]) -> None:
        """Move the rows of ``occupied`` (ascending slots) into slots ``0..len-1``, so the slots in use stay a
        prefix; set ``cache.occupied``."""
        for target, source in enumerate(occupied):
            if source != target:
                cache.move(source, target)
                occupant[target], last[target] = occupant[source], last[source]
                occupant[source] = -1
        cache.occupied = len(occupied)


register_backend(ContinuousBackend())
