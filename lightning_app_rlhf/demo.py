"""The demo task: "name things on a topic". Everything is built offline in milliseconds.

A prompt asks for words of one topic ("list some fruit:"). The reward counts *distinct* words of that topic
in the response and charges a little for words of the other topics:

    score = (distinct on-topic words - OFF_TOPIC_COST * off-topic words) / 4

A random-init model scores about 0.05. Repeating one word earns 0.25 at most. Listing words of every topic
without reading the prompt earns at most about 1.05 in 24 tokens (6 on-topic, 18 off-topic); only a policy
that reads the topic in the prompt reaches the maximum of 2.5 (all 10 words of the topic). Learnable by a
tiny model in minutes, and not by pushing up a single token or the length.
"""

from __future__ import annotations

import random
import re

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TOPICS: dict[str, tuple[str, ...]] = {
    "fruit": ("apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "peach", "pear", "plum"),
    "animals": ("cat", "dog", "horse", "lion", "tiger", "mouse", "sheep", "goat", "bear", "wolf"),
    "colors": ("red", "blue", "green", "yellow", "purple", "black", "white", "pink", "brown", "gray"),
    "weather": ("rain", "snow", "wind", "storm", "sun", "cloud", "fog", "hail", "frost", "thunder"),
}
"""Topic name -> the words that earn reward for it."""

TEMPLATES = (
    "list some {topic}:",
    "name a few {topic}:",
    "tell me about {topic}:",
    "write words about {topic}:",
    "give me {topic}, like {example}:",
    "more {topic} please, such as {example}:",
)
"""Prompt templates; ``{example}`` is one word of the topic."""

HELD_OUT_TEMPLATES = (
    "which {topic} do you know:",
    "say some {topic}:",
    "{topic}, for example {example}:",
)
"""Templates no training prompt uses: the validation prompts of :func:`val_prompts`."""

FILLER = ["the", "a", "an", "and", "or", "but", "of", "to", "in", "on", "at", "for", "with", "is", "are", "was", "were", "be", "it", "this", "that", "these", "those", "i", "you", "we", "they", "he", "she", "my", "your", "our", "their", "some", "many", "few", "more", "most", "very", "so", "too", "not", "no", "yes", "can", "will", "would", "should", "could", "like", "as", "from", "by", "about", "into", "over", "under", "after", "before", "then", "than", "when", "where", "what", "which", "who", "how", "why", "all", "any", "each", "every", "both", "other", "such", "only", "own", "same", "just", "also", "here", "there", "now", "today", "good", "bad", "big", "small", "new", "old", "long", "short", "high", "low", "first", "last", "great", "little", "right", "left", "best", "next", "few", "early", "young", "important", "public"]
"""Common words in the tokenizer's corpus, so responses can also be off-task."""

OFF_TOPIC_COST = 0.1
"""What a word of another topic costs, relative to the gain of a new on-topic word."""

WORD = re.compile(r"[a-z]+")
_WORD_TOPIC = {word: topic for topic, words in TOPICS.items() for word in words}


def prompt_topic(prompt: str) -> str:
    """The topic a prompt asks about."""
    for topic in TOPICS:
        if topic in prompt:
            return topic
    raise ValueError(f"Prompt {prompt!r} names none of the demo topics {sorted(TOPICS)}.")


def topic_score(prompt: str, response: str) -> float:
    """(distinct on-topic words - OFF_TOPIC_COST * off-topic words) / 4 for one response."""
    topic = prompt_topic(prompt)
    words = WORD.findall(response.lower())
    on_topic = {w for w in words if _WORD_TOPIC.get(w) == topic}
    off_topic = sum(1 for w in words if w in _WORD_TOPIC and _WORD_TOPIC[w] != topic)
    return (len(on_topic) - OFF_TOPIC_COST * off_topic) / 4.0


def topic_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The demo's reward function: :func:`topic_score` for each (prompt, response) pair."""
    return [topic_score(p, r) for p, r in zip(prompts, responses)]


def topic_hit_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """A pass/fail variant of the demo's reward, as DAPO's accuracy reward: 1.0 when the response names at least one
    word of the prompt's topic (and more of them than of other topics), else 0.0. A random-init policy passes about
    one prompt in ten, so many groups score alike: the task of dynamic sampling (``ppo.dynamic_sampling``)."""
    return [float(topic_score(p, r) > 0) for p, r in zip(prompts, responses)]


def prompts(num_prompts: int = 512, seed: int = 0) -> list[str]:
    """Demo prompts: every template for every topic, with random example words, in a seeded order."""
    rng = random.Random(seed)
    out = _fill_templates(TEMPLATES, num_prompts, rng)
    rng.shuffle(out)
    return out


def val_prompts(num_prompts: int = 32, seed: int = 1) -> list[str]:
    """Held-out demo prompts: every topic in templates the training prompts never use."""
    return _fill_templates(HELD_OUT_TEMPLATES, num_prompts, random.Random(seed))


def _fill_templates(templates: tuple[str, ...], num_prompts: int, rng: random.Random) -> list[str]:
    """Topic after topic, template after template, each with an example word of its topic drawn from ``rng``."""
    out = []
    for i in range(num_prompts):
        topic = list(TOPICS)[i % len(TOPICS)]
        template = templates[(i // len(TOPICS)) % len(templates)]
        out.append(template.format(topic=topic, example=rng.choice(TOPICS[topic])))
    return out


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the demo's words (milliseconds), with <pad>=0, <bos>=1, <eos>=2."""
    rng = random.Random(0)
    vocabulary = [w for words in TOPICS.values() for w in words] + list(FILLER)
    corpus = [" ".join(rng.choices(vocabulary, k=12)) for _ in range(2000)]
    corpus += [template.format(topic=t, example=e) for template in TEMPLATES for t in TOPICS for e in TOPICS[t]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
"""ChatML's shape with the demo tokenizer's own end token ``<eos>``: append-only, as multi-turn episodes need."""


def chat_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """:func:`build_tokenizer` with a chat template (:data:`CHAT_TEMPLATE`), for multi-turn episodes on the demo's tiny
    models: ``--model.tokenizer lightning_app_rlhf.demo.chat_tokenizer``. The plain demo tokenizer has none, and an
    environment refuses a tokenizer without one. A random-init tiny model plays episodes with it, but almost never
    writes a valid tool call: docs/agents.md's SmolLM2 run does."""
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
