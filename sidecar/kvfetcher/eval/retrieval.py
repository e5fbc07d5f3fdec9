"""retrieval: a lookup task whose answers exist only in the cached prefix.

The prefix is a list of records "The code for <word> is <number>." in random order; a probe
appends "The code for <word> is" for the record at a chosen depth (0: the first record, 1: the
last) and the model must continue with its number. The numbers are random, so nothing but the
prefix's KV can supply them: a cache that lost them fails the probe. Scored by exact match of the
first word generated.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

#: The record keys: common, distinct, one word each.
WORDS = (
    "apple anchor badger basket candle canyon dolphin drum eagle engine falcon fern garnet glacier harbor "
    "helmet iris island jacket jungle kettle kiwi lantern lemon magnet meadow needle nutmeg orchid otter "
    "pepper piano quartz quill raven ribbon saddle salmon tiger tulip umbrella valley violin walnut willow "
    "yacht zebra acorn beacon cactus dragon ember feather goblet hammer igloo jasmine kayak ladder marble "
    "nectar oyster parrot pebble rocket sponge thistle turnip velvet wagon whistle yarrow bison cobalt "
    "daisy elbow fossil gravel hazel ivory juniper koala lobster mango nickel olive panda radish spruce"
).split()

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Probe:
    question: str
    answer: str
    depth: float


def record(word: str, number: str) -> str:
    return f"The code for {word} is {number}.\n"


def build(n_records: int, depths: tuple[float, ...] = DEPTHS, seed: int = 0) -> tuple[str, list[Probe]]:
    """(context, probes): ``n_records`` records and one probe per depth."""
    if not 1 <= n_records <= len(WORDS):
        raise ValueError(f"n_records must be 1..{len(WORDS)}, got {n_records}")
    rng = random.Random(seed)
    words = rng.sample(WORDS, n_records)
    numbers = [str(rng.randrange(1000, 10000)) for _ in words]
    context = "Reference list. Each code is a four-digit number.\n" + "".join(map(record, words, numbers))
    probes = []
    for d in depths:
        i = round(d * (n_records - 1))
        probes.append(Probe(f"\nQuestion: what is the code for {words[i]}?\nThe code for {words[i]} is", numbers[i], d))
    return context, probes


def exact_match(generated: str, answer: str) -> bool:
    """True if the first word of ``generated`` (trailing punctuation dropped) is ``answer``."""
    m = re.match(r"\s*(\S+)", generated)
    return m is not None and m.group(1).rstrip(".,;:!?") == answer
