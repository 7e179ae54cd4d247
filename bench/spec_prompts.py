"""Real prompts for the speculation benchmark: editing tasks whose answers repeat the prompt, and ordinary chat.

Random token prompts would make the model repeat itself and n-gram lookup accept nearly
everything; these are the kinds of requests users send. JSON_BY_SCHEMA adds requests
answered under a JSON schema, where the grammar forces part of every answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_FUNCTION_1 = """def merge_intervals(intervals):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
"""

_FUNCTION_2 = """def word_counts(path, min_length, ignore_case):
    counts = {}
    with open(path) as handle:
        for line in handle:
            for word in line.split():
                word = word.strip(".,;:!?")
                if ignore_case:
                    word = word.lower()
                if len(word) < min_length:
                    continue
                counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda item: item[1], reverse=True)
"""

_FUNCTION_3 = """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity, price):
        if name in self.items:
            self.items[name]["quantity"] += quantity
        else:
            self.items[name] = {"quantity": quantity, "price": price}

    def remove(self, name, quantity):
        if name not in self.items:
            raise KeyError(name)
        self.items[name]["quantity"] -= quantity
        if self.items[name]["quantity"] <= 0:
            del self.items[name]

    def total_value(self):
        return sum(item["quantity"] * item["price"] for item in self.items.values())
"""

_PARAGRAPH_1 = (
    "The comittee met on tuesday to discus the new budjet for the libary. Most members agred that the "
    "childrens section needed more books, but their was a long debate about weather the computer room "
    "should be expanded. In the end they decided to postpone the desicion untill the next meeting, when "
    "the tresurer will present a more detailed report on the costs of both projects."
)

_PARAGRAPH_2 = (
    "Our hiking trip started early in the morning. We drove to the trailhead, packed our bags and began "
    "the climb through the pine forest. After two hours we reached the lake, where we stopped for lunch "
    "and watched the clouds move over the mountains. In the afternoon the weather changed, so we walked "
    "back quickly and arrived at the car just before the rain started."
)

EDITING: list[str] = [
    f"Rewrite this Python function with type hints. Keep everything else the same.\n\n{_FUNCTION_1}",
    f"Add type hints to this function and return only the code.\n\n{_FUNCTION_2}",
    f"Rename the method total_value to total and return the whole class.\n\n{_FUNCTION_3}",
    f"Fix the spelling mistakes in this paragraph and return the corrected paragraph.\n\n{_PARAGRAPH_1}",
    f"Rewrite this paragraph in the present tense.\n\n{_PARAGRAPH_2}",
    f"Add a docstring to this function and return the full code.\n\n{_FUNCTION_1}",
    f"Convert this function to use collections.Counter, keeping its behaviour, and return the code.\n\n{_FUNCTION_2}",
    f"Repeat this paragraph exactly, but replace 'lake' with 'river'.\n\n{_PARAGRAPH_2}",
]

CHAT: list[str] = [
    "Explain how photosynthesis works in a few paragraphs.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me some tips for learning a new language as an adult.",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "Write a short story about a robot who learns to paint.",
    "What should I consider when buying a used car?",
    "Summarize the causes of the French Revolution.",
]

# Programming questions, none of them among `specserve distill`'s training requests (distill/prompts.py).
CODE: list[str] = [
    "Write a Python class for a bank account with deposit and withdraw methods that refuses overdrafts.",
    "Explain the difference between a process and a thread, with a short Python example.",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "How do I read a large file line by line in Python without loading it all into memory?",
    "Write a bash script that renames every .txt file in a folder to .md.",
    "What does the yield keyword do in Python? Show an example.",
    "Write a Python decorator that measures how long a function takes to run.",
    "How do I sort a dictionary by its values in Python?",
]

WORKLOADS: dict[str, list[str]] = {"editing": EDITING, "chat": CHAT, "code": CODE}

# Requests for tuning a draft's rules (how far to trust each kind of guess): neither
# benchmark workload nor training data, so figures measured on the workloads above stay
# held out. Not a benchmark workload.
TUNING: list[str] = [
    "What are the health benefits of regular exercise?",
    "Explain how a bill becomes a law in the United States.",
    "Write a short poem about autumn leaves.",
    "What is the difference between weather and climate?",
    "Give me a simple recipe for pancakes.",
    "How do vaccines train the immune system?",
    "Describe the life cycle of a butterfly.",
    "What are some good habits for better sleep?",
    "Explain what inflation is and why it matters.",
    "Write a polite email asking a colleague for feedback on a report.",
    "Write a Python function that checks whether a number is prime, with a docstring.",
    "Explain list comprehensions in Python with three examples.",
    "Write a JavaScript function that debounces another function.",
    "How do I handle exceptions in Python? Give an example with try, except and finally.",
    "Write a Python script that downloads a web page and counts the links on it.",
    "What is the difference between == and is in Python?",
    "Write a C function that reverses a linked list.",
    "Explain recursion with a Python example that computes a factorial.",
    "Write a Python class that represents a 2D vector with addition and length.",
    "How do I create and activate a virtual environment in Python?",
]


@dataclass(frozen=True)
class SchemaPrompt:
    """A request answered as compact JSON that `schema` validates (SamplingParams.structured_output.json_schema)."""

    text: str
    schema: dict[str, Any]


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """Every property required and no other: the keys, braces and commas are then forced,
    as in real extraction schemas."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _text(max_length: int) -> dict[str, Any]:
    """A bounded string: a small model may otherwise fill the whole output inside one value."""
    return {"type": "string", "maxLength": max_length}


# Small schemas, each answer a few dozen tokens: free values (titles, names, numbers) between
# the keys and punctuation the grammar forces.
JSON_BY_SCHEMA: list[SchemaPrompt] = [
    SchemaPrompt(
        "Give a JSON object describing a well-known novel, with its title, author and year of publication.",
        _object(
            {"title": _text(60), "author": _text(40), "year": {"type": "integer", "minimum": 1500, "maximum": 2030}}
        ),
    ),
    SchemaPrompt(
        "Describe the city of Lisbon as a JSON object: its name, its country, its population and whether "
        "it is a capital.",
        _object(
            {
                "name": _text(30),
                "country": _text(30),
                "population": {"type": "integer", "minimum": 0},
                "is_capital": {"type": "boolean"},
            }
        ),
    ),
    SchemaPrompt(
        "Write a JSON object for a simple pancake recipe with its name, the number of servings and up to "
        "five ingredients.",
        _object(
            {
                "name": _text(40),
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {"type": "array", "items": _text(30), "minItems": 1, "maxItems": 5},
            }
        ),
    ),
    SchemaPrompt(
        "Return a JSON object about the planet Saturn: its name, how many moons it has, whether it has "
        "rings, and what kind of planet it is.",
        _object(
            {
                "name": _text(20),
                "moons": {"type": "integer", "minimum": 0, "maximum": 500},
                "has_rings": {"type": "boolean"},
                "kind": {"enum": ["rocky", "gas giant", "ice giant", "dwarf"]},
            }
        ),
    ),
    SchemaPrompt(
        "Make up a weather report for Oslo as JSON, with the city, the temperature in degrees Celsius, "
        "the conditions and the wind speed in km/h.",
        _object(
            {
                "city": _text(30),
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
                "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 250},
            }
        ),
    ),
    SchemaPrompt(
        "Describe a software engineer called Priya as a JSON object with her name, her job title, her "
        "years of experience and three of her skills.",
        _object(
            {
                "name": _text(30),
                "job_title": _text(40),
                "years_of_experience": {"type": "integer", "minimum": 0, "maximum": 50},
                "skills": {"type": "array", "items": _text(25), "minItems": 1, "maxItems": 3},
            }
        ),
    ),
    SchemaPrompt(
        "Give a JSON object for a classic film: its title, its director, the year it came out and up to three genres.",
        _object(
            {
                "title": _text(60),
                "director": _text(40),
                "year": {"type": "integer", "minimum": 1890, "maximum": 2030},
                "genres": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {"enum": ["drama", "comedy", "action", "science fiction", "animation", "thriller"]},
                },
            }
        ),
    ),
    SchemaPrompt(
        "Create a JSON object describing a laptop for sale: the brand, the model, the price in euros, the "
        "memory in gigabytes and whether it is new.",
        _object(
            {
                "brand": _text(20),
                "model": _text(30),
                "price_eur": {"type": "number", "minimum": 0},
                "memory_gb": {"type": "integer", "minimum": 1, "maximum": 256},
                "new": {"type": "boolean"},
            }
        ),
    ),
]
