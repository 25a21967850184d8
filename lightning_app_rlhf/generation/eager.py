"""The ``eager`` generation backend (the default): a dynamic Hugging Face KV cache and a host sync per token. Plain
PyTorch; it registers itself on import.
"""

from __future__ import annotations

import torch

from lightning_app_rlhf.generation.backend import DecodeRequest, GenerationBackend, register_backend
from lightning_app_rlhf.generation.hf_cache import cache_kwargs, returned_cache
from lightning_app_rlhf.generation.rollout import Rollout
from lightning_app_rlhf.generation.sampling import keyed_seeds, next_token, position_ids_from_mask
from lightning_app_rlhf.generation.stopping import all_done


class EagerBackend(GenerationBackend):
    """Today's decoder: a dynamic Hugging Face cache, the mask grown per token, a host sync per token to stop as
    soon as every row is done. Works with any model on any device
    (also stand-ins that only share a Hugging Face causal LM's call signature)."""

    name = "eager"

    def decode(self, model: torch.nn.Module, request: DecodeRequest) -> Rollout:
        input_ids, attention_mask, config = request.input_ids, request.attention_mask, request.config
        batch_size = input_ids.shape[0]
        seeds = keyed_seeds(request.keys).to(input_ids.device) if config.do_sample else None  # greedy: none
        position_ids = position_ids_from_mask(attention_mask)
        # Only the last prompt position's logits are needed: with a large vocabulary the LM head dominates a prefill.
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                    logits_to_keep=1)
        done = torch.full((batch_size,), not request.active, dtype=torch.bool, device=input_ids.device)
        tokens, logprobs, masks = [], [], []
        mask = attention_mask
        for step in range(config.max_new_tokens):
            column = None if seeds is None else torch.tensor([step], device=input_ids.device)
            token, logprob = next_token(out.logits[:, -1, :], config, seeds, column, done, request.pad_token_id)
            masks.append(~done)
            logprobs.append(logprob)
            tokens.append(token)
            # Each rank detects its own stops (ids and strings) before the group's all-done check: ranks stay paired.
            done = done | request.stops.ended(tokens)
            # The last step runs no forward: its logits would predict a token that is never sampled.
            if all_done(done, request.lockstep_group) or step == config.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = model(input_ids=token.unsqueeze(-1), attention_mask=mask, position_ids=position_ids, use_cache=True,
                        **cache_kwargs(returned_cache(out)))
        response_mask = torch.stack(masks, dim=1).to(attention_mask.dtype)
        return Rollout.from_responses(input_ids, attention_mask, torch.stack(tokens, dim=1), response_mask,
                                      torch.stack(logprobs, dim=1), done)


register_backend(EagerBackend())
