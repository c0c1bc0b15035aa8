"""The story generator's grammar (corpus.py): characters and pronouns, a sentence collector, the cast,
and the openings and endings every plot shares."""

from __future__ import annotations

import random
import re

from words import ANIMAL_CAST, BOY_NAMES, CHAR_ADJ, COLORS, GIRL_NAMES, GROWN_UPS, Place, Thing


# --------------------------------------------------------------------------
# Grammar helpers
# --------------------------------------------------------------------------

def art(word: str) -> str:
    """'a ball', 'an apple', 'an old hat'."""
    return ("an " if word[0].lower() in "aeio" else "a ") + word


def cap(s: str) -> str:
    return s[0].upper() + s[1:] if s else s


class Char:
    """A story character: name, kind ('girl', 'dog', ...) and pronouns."""

    def __init__(self, name: str, gender: str, kind: str):
        self.Name = name
        self.gender = gender
        self.kind = kind
        f = gender == "f"
        self.he = "she" if f else "he"
        self.him = "her" if f else "him"
        self.his = "her" if f else "his"
        self.himself = "herself" if f else "himself"
        self.He = cap(self.he)
        self.His = cap(self.his)

    def __repr__(self):
        return f"Char({self.Name}, {self.kind})"


class Story:
    """Collects sentences; the format helpers fill {c.He}, {f.Name}, ..."""

    def __init__(self, rng: random.Random, **names):
        self.rng = rng
        self.names = names
        self.sents: list[str] = []

    def pick(self, seq):
        return self.rng.choice(seq)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def fmt(self, s: str, **extra) -> str:
        return s.format(**self.names, **extra)

    def add(self, s: str, **extra):
        s = self.fmt(s, **extra).strip()
        s = cap(s)
        if s[-1] not in '.!?"':
            s += "."
        self.sents.append(s)

    def say(self, who: Char, line: str, verb: str = "said", **extra):
        """Dialogue in one of two orders: X said, "..." / "...," said X."""
        line = cap(self.fmt(line, **extra))
        if line[-1] not in ".!?":
            line += "."
        if self.chance(0.5):
            self.sents.append(f'{who.Name} {verb}, "{line}"')
        else:
            if line.endswith("."):
                line = line[:-1] + ","
            self.sents.append(f'"{line}" {verb} {who.Name}.')

    def text(self) -> str:
        out = " ".join(self.sents)
        out = re.sub(r"\s+", " ", out)
        return out


def make_cast(rng: random.Random, n: int, allow_animals: bool = True) -> list[Char]:
    """n characters with distinct names. The first may be an animal."""
    cast: list[Char] = []
    used: set[str] = set()
    for i in range(n):
        while True:
            if i == 0 and allow_animals and rng.random() < 0.2:
                kind, g, name = rng.choice(ANIMAL_CAST)
            elif rng.random() < 0.5:
                kind, g, name = "girl", "f", rng.choice(GIRL_NAMES)
            else:
                kind, g, name = "boy", "m", rng.choice(BOY_NAMES)
            if name not in used:
                break
        used.add(name)
        cast.append(Char(name, g, kind))
    # A friend of an animal hero is an animal too; of a child, a child.
    if cast[0].kind not in ("girl", "boy"):
        for j in range(1, n):
            while True:
                kind, g, name = rng.choice(ANIMAL_CAST)
                if name not in used and kind != cast[0].kind:
                    break
            used.add(name)
            cast[j] = Char(name, g, kind)
    return cast


def thing_phrase(st: Story, thing: Thing) -> str:
    """'red ball', 'big shiny kite', 'soft teddy bear'."""
    r = st.rng.random()
    if r < 0.45:
        return f"{st.pick(COLORS)} {thing.noun}"
    if r < 0.75:
        return f"{st.pick(thing.adjs)} {thing.noun}"
    a = st.pick(thing.adjs)
    return f"{a} {st.pick(COLORS)} {thing.noun}"


def grown_up(st: Story) -> str:
    return st.pick(GROWN_UPS)


# --------------------------------------------------------------------------
# Openings and endings
# --------------------------------------------------------------------------

def opening(st: Story, c: Char):
    adj = st.pick(CHAR_ADJ)
    who = f"{adj} {c.kind}"
    where = st.pick(["a small town", "a big city", "a quiet village", "a little house by the sea",
                     "a house near the woods", "a busy town", "a cozy little house"])
    forms = [
        f"Once upon a time, there was {art(who)} named {c.Name}.",
        f"Once upon a time, in {where}, there lived {art(who)} named {c.Name}.",
        f"Once upon a time, {art(who)} named {c.Name} lived in {where}.",
        f"Once upon a time, there was {art(who)}. {c.His} name was {c.Name}.",
        f"There once was {art(who)} named {c.Name}.",
        f"Once there was {art(who)} named {c.Name} who lived in {where}.",
    ]
    weights = [5, 3, 2, 2, 1, 1]
    st.sents.append(st.rng.choices(forms, weights)[0])


def likes(st: Story, c: Char, place: Place | None = None):
    if place is not None and st.chance(0.5):
        st.add(f"{{c.He}} loved to go to the {place.name} and {st.pick(place.activities)}")
    else:
        st.add(st.pick([
            "{c.He} loved to play outside with {c.his} friends",
            "{c.He} liked to run, jump and laugh all day",
            "{c.He} loved to sing songs and dance",
            "{c.He} liked to draw pictures of animals",
            "{c.He} loved to help {c.his} mom and dad",
            "{c.He} liked to look at the clouds and make up stories",
            "Every day, {c.he} played with {c.his} toys and sang happy songs",
        ]))


def ending(st: Story, c: Char, moral: str | None = None):
    if moral and st.chance(0.7):
        st.add(moral)
    st.sents.append("The end.")
