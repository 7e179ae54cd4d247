"""The chat requests `specserve distill` ships: the target answers them, and the draft learns from its answers.

Built from templates and subjects written for this purpose (code and prose), so the
set is available offline and its size is chosen by the caller. None of them is a
benchmark prompt (bench/spec_prompts.py), which the benchmarks use as held-out data.
"""

from __future__ import annotations

import random

_CODE_TASKS = [
    "reverses the words in a sentence",
    "checks whether a string is a palindrome",
    "merges two sorted lists",
    "counts how often each word appears in a text",
    "computes the n-th Fibonacci number iteratively",
    "flattens a nested list",
    "removes duplicates from a list while keeping the order",
    "parses a CSV line into fields",
    "finds the largest prime factor of a number",
    "converts a Roman numeral to an integer",
    "validates an email address with a regular expression",
    "reads a JSON file and returns a dictionary",
    "computes the median of a list of numbers",
    "groups a list of records by a key",
    "implements binary search",
    "rotates a matrix by 90 degrees",
    "returns the longest common prefix of several strings",
    "formats a number of seconds as hours, minutes and seconds",
    "splits a list into chunks of a given size",
    "checks whether two strings are anagrams",
    "computes the greatest common divisor of two numbers",
    "implements a simple LRU cache",
    "walks a directory tree and lists every file larger than 1 MB",
    "retries a function call with exponential backoff",
    "tokenizes an arithmetic expression",
    "transposes a list of lists",
    "computes a running average over a stream of numbers",
    "finds all pairs in a list that sum to a target",
    "converts a string from snake_case to camelCase",
    "sorts a list of dictionaries by two keys",
]
_CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Rust", "Go", "C", "TypeScript"]
_CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Show me how to write a {lang} function that {task}, with a short explanation.",
    "Write a {lang} function that {task}, and add a few unit tests for it.",
    "How would you write code in {lang} that {task}? Keep it simple.",
]
_CONCEPTS = [
    "recursion",
    "a hash table",
    "the TCP handshake",
    "garbage collection",
    "inflation",
    "compound interest",
    "the greenhouse effect",
    "plate tectonics",
    "how vaccines work",
    "the difference between weather and climate",
    "supply and demand",
    "a neural network",
    "public-key cryptography",
    "the immune system",
    "how a bill becomes law",
    "black holes",
    "the theory of evolution",
    "how a refrigerator works",
    "the stock market",
    "version control with git",
    "the Pythagorean theorem",
    "probability",
    "how airplanes stay in the air",
    "the causes of the seasons",
    "DNS",
    "containers and virtual machines",
    "the scientific method",
    "opportunity cost",
    "tides",
    "entropy",
]
_PROSE_TEMPLATES = [
    "Explain {concept} to a beginner.",
    "Explain {concept} in three short paragraphs.",
    "What is {concept}? Give an example.",
    "Write a short lesson plan for teaching {concept} to teenagers.",
]
_THINGS = [
    "a lighthouse keeper",
    "a lost umbrella",
    "a city under the sea",
    "an old map",
    "a talking cat",
    "the last bookstore",
    "a winter festival",
    "a broken clock",
    "a journey by train",
    "a garden on the moon",
    "a shy dragon",
    "a forgotten song",
    "two rival bakers",
    "a storm at sea",
    "a village without electricity",
    "a time capsule",
]
_STORY_TEMPLATES = [
    "Write a short story about {thing}.",
    "Write a poem about {thing}.",
    "Describe {thing} in vivid detail.",
]
_ACTIVITIES = [
    "running a first marathon",
    "starting a vegetable garden",
    "saving money on groceries",
    "working from home",
    "preparing for a job interview",
    "learning to play the guitar",
    "sleeping better",
    "writing a cover letter",
    "planning a trip abroad",
    "keeping a houseplant alive",
    "studying for an exam",
    "public speaking",
    "cooking for a large group",
    "organising a small wedding",
    "reducing screen time",
    "training a puppy",
]
_ADVICE_TEMPLATES = [
    "Give me five tips for {activity}.",
    "What are common mistakes people make when {activity}?",
    "Write a checklist for {activity}.",
]
_TOPICS = [
    "the printing press",
    "the Roman Empire",
    "the Industrial Revolution",
    "the internet",
    "the Olympic Games",
    "electric cars",
    "renewable energy",
    "social media",
    "space exploration",
    "the history of coffee",
    "remote work",
    "nuclear power",
    "city cycling lanes",
    "open-source software",
    "online education",
]
_ESSAY_TEMPLATES = [
    "What are the pros and cons of {topic}?",
    "Write a short essay about {topic}.",
    "Summarize the history of {topic} in a few paragraphs.",
]


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct requests in a fixed order for a seed,
    taken in turn from each kind (code, explanations, stories, ...)."""
    kinds = [
        [
            t.format(lang=lang, task=task)
            for t in _CODE_TEMPLATES
            for lang in sorted(set(_CODE_LANGUAGES))
            for task in _CODE_TASKS
        ],
        [t.format(concept=c) for t in _PROSE_TEMPLATES for c in _CONCEPTS],
        [t.format(thing=x) for t in _STORY_TEMPLATES for x in _THINGS],
        [t.format(activity=a) for t in _ADVICE_TEMPLATES for a in _ACTIVITIES],
        [t.format(topic=x) for t in _ESSAY_TEMPLATES for x in _TOPICS],
    ]
    rng = random.Random(seed)
    for kind in kinds:
        rng.shuffle(kind)
    available = sum(len(kind) for kind in kinds)
    if count > available:
        raise ValueError(f"at most {available} distinct training prompts are shipped, {count} were asked for")
    chosen: list[str] = []
    for i in range(max(len(kind) for kind in kinds)):
        chosen.extend(kind[i] for kind in kinds if i < len(kind))
    return chosen[:count]


# How the requests the target writes itself begin (`distill.data.write_requests`): "" leaves
# the whole request to the target; the others steer a share of them to code and to the
# kinds of questions users ask, which a free-running small model writes too rarely.
REQUEST_OPENINGS = [
    "",
    "",
    "",
    "",
    "",
    "",
    "Write a Python function",
    "Write a Python class",
    "Write a Python script",
    "How do I",
    "How can I",
    "What is the difference between",
    "Explain",
    "Can you explain",
    "What does",
    "Why",
    "Write a JavaScript",
    "Write a SQL query",
    "Write a bash script",
    "Show me how to",
    "Give me",
    "Write a short story",
    "Write a poem",
    "Describe",
    "Summarize",
    "What are",
    "What should I",
    "Tips for",
    "Write an essay",
    "Compare",
]


def request_openings(count: int, *, may_be_empty: bool = True) -> list[str]:
    """The opening of each of `count` self-written requests, taken in turn; only non-empty ones unless `may_be_empty`
    (a target without a chat template has no user turn to start from)."""
    openings = REQUEST_OPENINGS if may_be_empty else [o for o in REQUEST_OPENINGS if o]
    return [openings[i % len(openings)] for i in range(count)]
