"""Short instruction prompts, each with the answers that count as correct, and the reward on them.

The reward asks for what a reader wants from a quick question: the right item, said briefly. A response
scores 1 if it names an accepted item (whole word, any case), minus 0.05 per word beyond the first two,
so a correct one- or two-word answer scores 1.0 and a correct 12-word sentence 0.5.
"""

from __future__ import annotations

import re

QUESTIONS: dict[str, tuple[str, ...]] = {
    "Name a fruit that is red.": ("apple", "apples", "strawberry", "strawberries", "cherry", "cherries",
                                  "raspberry", "raspberries", "tomato", "pomegranate", "watermelon", "cranberry"),
    "Name a fruit that is yellow.": ("banana", "bananas", "lemon", "lemons", "pineapple", "mango", "grapefruit"),
    "Name a planet in our solar system.": ("mercury", "venus", "earth", "mars", "jupiter", "saturn", "uranus",
                                           "neptune"),
    "Name a primary color.": ("red", "blue", "yellow"),
    "Name a mammal that lives in the ocean.": ("whale", "whales", "dolphin", "dolphins", "seal", "seals", "orca",
                                               "manatee", "walrus", "otter", "porpoise"),
    "Name a capital city in Europe.": ("paris", "london", "berlin", "madrid", "rome", "vienna", "lisbon", "athens",
                                       "dublin", "amsterdam", "brussels", "prague", "warsaw", "stockholm", "oslo"),
    "Name a musical instrument with strings.": ("guitar", "violin", "cello", "harp", "bass", "viola", "banjo",
                                                "ukulele", "piano", "mandolin", "sitar"),
    "Name a vegetable that is green.": ("broccoli", "spinach", "lettuce", "cucumber", "peas", "kale", "celery",
                                        "cabbage", "zucchini", "asparagus", "beans"),
    "Name a bird that cannot fly.": ("penguin", "penguins", "ostrich", "emu", "kiwi", "cassowary", "dodo", "rhea"),
    "Name a programming language.": ("python", "java", "javascript", "c", "c++", "rust", "go", "ruby", "swift",
                                     "kotlin", "haskell", "perl", "php", "typescript", "scala", "r", "julia"),
    "Name a country in South America.": ("brazil", "argentina", "chile", "peru", "colombia", "venezuela",
                                         "ecuador", "bolivia", "uruguay", "paraguay", "guyana", "suriname"),
    "Name a metal.": ("iron", "gold", "silver", "copper", "aluminum", "aluminium", "steel", "zinc", "lead", "tin",
                      "nickel", "titanium", "platinum"),
    "Name a day of the week.": ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"),
    "Name a month of the year.": ("january", "february", "march", "april", "may", "june", "july", "august",
                                  "september", "october", "november", "december"),
    "Name an animal with a long neck.": ("giraffe", "giraffes", "swan", "ostrich", "camel", "llama", "flamingo",
                                         "alpaca", "brachiosaurus"),
    "Name a sport played with a ball.": ("football", "soccer", "basketball", "tennis", "baseball", "volleyball",
                                         "golf", "rugby", "cricket", "handball", "hockey"),
    "Name a gas in the air we breathe.": ("oxygen", "nitrogen", "argon", "carbon", "co2", "helium"),
    "Name an ocean.": ("pacific", "atlantic", "indian", "arctic", "southern"),
    "Name a continent.": ("africa", "asia", "europe", "antarctica", "australia", "oceania", "america"),
    "Name a shape with corners.": ("square", "triangle", "rectangle", "pentagon", "hexagon", "octagon", "cube",
                                   "diamond", "rhombus", "trapezoid", "parallelogram"),
    "Name a tool used in a kitchen.": ("knife", "spoon", "fork", "whisk", "spatula", "pan", "pot", "ladle",
                                       "grater", "peeler", "blender", "oven", "tongs", "colander"),
    "Name an insect.": ("ant", "ants", "bee", "bees", "butterfly", "beetle", "fly", "mosquito", "grasshopper",
                        "ladybug", "wasp", "moth", "cricket", "dragonfly", "termite"),
    "Name a flower.": ("rose", "roses", "tulip", "tulips", "daisy", "lily", "sunflower", "orchid", "daffodil",
                       "lavender", "violet", "carnation", "poppy", "iris", "jasmine", "marigold", "peony"),
    "Name a season of the year.": ("spring", "summer", "autumn", "fall", "winter"),
    "Name a drink made from leaves or beans.": ("tea", "coffee", "cocoa", "chocolate", "mate", "espresso"),
    "Name a body part.": ("hand", "head", "arm", "leg", "foot", "eye", "ear", "nose", "heart", "finger", "knee",
                          "mouth", "brain", "shoulder", "elbow", "toe"),
    "Name a piece of furniture.": ("chair", "table", "sofa", "couch", "bed", "desk", "bookshelf", "cabinet",
                                   "dresser", "stool", "wardrobe", "bench"),
    "Name a vehicle with wheels.": ("car", "bicycle", "bike", "bus", "truck", "motorcycle", "train", "scooter",
                                    "van", "tractor", "wagon"),
}
"""Training questions -> accepted answers (lower case)."""

HELD_OUT: dict[str, tuple[str, ...]] = {
    "Name a fruit that is orange.": ("orange", "oranges", "tangerine", "mandarin", "apricot", "peach", "papaya",
                                     "mango", "cantaloupe", "persimmon", "clementine", "kumquat"),
    "Name a big cat.": ("lion", "tiger", "leopard", "jaguar", "cheetah", "puma", "cougar", "panther", "lynx"),
    "Name a chess piece.": ("king", "queen", "rook", "bishop", "knight", "pawn", "castle"),
    "Name a planet with rings.": ("saturn", "jupiter", "uranus", "neptune"),
}
"""Questions never trained on, for the before/after samples."""

ALL = {**QUESTIONS, **HELD_OUT}
FREE_WORDS = 2
"""Words a response may use without a length penalty."""
WORD_COST = 0.05
"""Penalty per word beyond ``FREE_WORDS``."""


def answer_score(question: str, response: str) -> float:
    """1 for naming an accepted item, minus ``WORD_COST`` per word beyond ``FREE_WORDS``."""
    words = re.findall(r"[a-z0-9+]+", response.lower())
    correct = any(word in ALL[question] for word in words)
    return float(correct) - WORD_COST * max(0, len(words) - FREE_WORDS)


def question_of(prompt: str) -> str:
    """The question inside a chat-formatted prompt."""
    for question in ALL:
        if question in prompt:
            return question
    raise ValueError(f"No known question in the prompt {prompt!r}.")


def concise_correct_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The reward function given to RLHFModule: ``answer_score`` of each (prompt, response)."""
    return [answer_score(question_of(p), r) for p, r in zip(prompts, responses)]
