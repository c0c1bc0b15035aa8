"""Deterministic generator of short, simple-English stories ("tiny stories").

Nothing is downloaded: every story is built from word lists and a small
story grammar (a cast with names and pronouns, places with their own
activities and hiding spots, objects with colours and verbs, feelings, and
nine plot shapes: a lost toy, sharing, a rainy day, helping an animal, being
brave, baking, a birthday present, a new friend, and a bedtime story).  Each
story starts with an opening such as "Once upon a time, ..." and ends with
"The end."

The parts live beside this file: the word lists and data tables in
``words.py``, the grammar (characters, the sentence collector, openings and
endings) in ``grammar.py``, the nine plots in ``plots.py``; this module draws
the stories and the splits.

The same seed always gives the same stories, in the same order::

    from corpus import make_splits
    train, val = make_splits(seed=0, n_train=40000, n_val=1000)

Run it as a script to print a few samples and some statistics::

    python scripts/tiny_stories/corpus.py --n 2000 --show 3
"""

from __future__ import annotations

import argparse
import random
import re

from grammar import Story, make_cast
from plots import PLOTS


def make_story(rng: random.Random) -> str:
    cast = make_cast(rng, 2)
    st = Story(rng, c=cast[0], f=cast[1])
    rng.choice(PLOTS)(st)
    return st.text()


def make_stories(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [make_story(rng) for _ in range(n)]


def make_splits(seed: int = 0, n_train: int = 40000, n_val: int = 1000):
    """(train, val) lists of stories. Validation stories are drawn from a
    different stream (seed + 1) and any exact duplicates of training
    stories are dropped from validation."""
    train = make_stories(seed, n_train)
    seen = set(train)
    val = [s for s in make_stories(seed + 1, n_val) if s not in seen]
    return train, val


def sentences(stories) -> set[str]:
    out = set()
    for s in stories:
        out.update(x for x in re.split(r'(?<=[.!?"])\s+', s) if x)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--show", type=int, default=3)
    args = ap.parse_args()
    stories = make_stories(args.seed, args.n)
    for s in stories[: args.show]:
        print(s, "\n")
    words = sum(len(s.split()) for s in stories)
    print(f"{len(stories)} stories, {len(set(stories))} distinct, {words / len(stories):.1f} words/story, "
          f"{len(sentences(stories))} distinct sentences")


if __name__ == "__main__":
    main()
