"""The chat template's side of a multi-turn episode: the opening prompt's tokens, and each observation's tokens as the
suffix the template adds after an assistant turn. Plain Python.

Append only. An episode's tokens are the prompt, then each turn's sampled tokens as sampled, then the observation's
suffix, and so on; no earlier turn is ever rendered or tokenized again. Re-rendering the whole conversation each turn
drifts: decoding the sampled tokens and encoding the text may give other tokens (BPE merges across a turn boundary,
a template that trims whitespace or drops reasoning), so the trained sequence would not be the one the behaviour
log-probabilities were computed on (veRL #6854, slime #2263).

The suffix is read off the template itself: render a fixed conversation that ends with an assistant turn, render it
again with the observation messages and the next generation prompt appended, and take the difference, preceded by
what the template writes after the assistant's end-of-turn token (ChatML's newline after ``<|im_end|>``). That
newline belongs to the observation, not to the sampled turn: the model never sampled it, so it gets no loss (the
SkyRL #710 bug trains on it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_app_rlhf.agents.environment import Messages
from lightning_app_rlhf.agents.tools import template_renders_tools, tools_system_prompt

_PROBE: Messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                    {"role": "assistant", "content": "A"}]
"""The fixed conversation whose rendering is subtracted (a system message, so no template inserts its default)."""


class ChatRenderer:
    """Tokens of an episode's prompt and of its observations, from ``tokenizer``'s chat template.

    Args:
        tokenizer: The actor's tokenizer, with a chat template.
        tools: The environment's tools: passed to the template where it renders them, else described in the first
            system message (:func:`~lightning_app_rlhf.agents.tools.tools_system_prompt`).
        end_of_turn_ids: Token ids that end an assistant turn (the EOS and the actor's other end ids).

    Raises:
        ValueError: The tokenizer has no chat template, or its template is not append-only (rendering more messages
            changes the text of earlier ones), so no suffix can be read off it.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Callable[..., Any]], end_of_turn_ids: Sequence[int]) -> None:
        if not tokenizer.chat_template:
            raise ValueError("Multi-turn rollouts render observations with the tokenizer's chat template, and this "
                             "tokenizer has none: use an instruct model's tokenizer (docs/agents.md runs SmolLM2's), "
                             "or set tokenizer.chat_template; on the demo's tiny models, --model.tokenizer "
                             "lightning_app_rlhf.demo.chat_tokenizer is the demo tokenizer with one.")
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.template_tools = bool(self.tools) and template_renders_tools(tokenizer)
        self.end_of_turn_ids = set(end_of_turn_ids)
        base = self._render(_PROBE, False)
        content_end = base.rindex("A") + 1
        end_texts = [tokenizer.decode([i]) for i in self.end_of_turn_ids]
        after = base[content_end:]
        ends = [text for text in end_texts if text and after.startswith(text)]
        self._base = base
        self._after_content = after
        """What the template writes after an assistant turn's content (ChatML: ``<|im_end|>\\n``)."""
        self._after_end = after[len(ends[0]):] if ends else after
        """What it writes after the end-of-turn token (ChatML: ``\\n``); the whole tail when no end id appears."""

    def prompt_ids(self, messages: Messages) -> list[int]:
        """The opening messages rendered with the generation prompt (and the tools), as token ids."""
        return self._encode(self._render(self._with_tools(messages), True))

    def observation_ids(self, messages: Messages, turn_ended: bool) -> list[int]:
        """The tokens that follow an assistant turn: the rest of the template's turn end, the observation messages,
        and the next generation prompt.

        Args:
            messages: The observation (e.g. tool results).
            turn_ended: Whether the sampled turn ended with an end-of-turn token; else (a stop string ended it) the
                template's whole turn end is part of the suffix.
        """
        full = self._render(_PROBE + messages, True)
        if not full.startswith(self._base):
            raise ValueError("The chat template is not append-only: rendering observation messages after an assistant "
                             "turn changes the text before them, so no observation suffix can be appended. Use a "
                             "template that renders each message independently (ChatML, Llama-3, Qwen2.5).")
        tail = self._after_end if turn_ended else self._after_content
        return self._encode(tail + full[len(self._base):])

    def _with_tools(self, messages: Messages) -> Messages:
        if not self.tools or self.template_tools:
            return messages
        description = tools_system_prompt(self.tools)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + description}, *messages[1:]]
        return [{"role": "system", "content": description}, *messages]

    def _render(self, messages: Messages, generation_prompt: bool) -> str:
        tools = self.tools if self.template_tools else None
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
