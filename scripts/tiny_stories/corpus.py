"""Deterministic generator of short, simple-English stories ("tiny stories").

Nothing is downloaded: every story is built from word lists and a small
story grammar (a cast with names and pronouns, places with their own
activities and hiding spots, objects with colours and verbs, feelings, and
nine plot shapes: a lost toy, sharing, a rainy day, helping an animal, being
brave, baking, a birthday present, a new friend, and a bedtime story).  Each
story starts with an opening such as "Once upon a time, ..." and ends with
"The end."

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
from dataclasses import dataclass

# --------------------------------------------------------------------------
# Word lists
# --------------------------------------------------------------------------

GIRL_NAMES = [
    "Lily", "Mia", "Sue", "Anna", "Emma", "Lucy", "Sara", "Amy", "Ella", "Zoe",
    "Kate", "Rose", "Molly", "Daisy", "Grace", "Nina", "Ruby", "Jane", "Alice",
    "Ivy", "Lola", "Maya", "Hannah", "Chloe",
]
BOY_NAMES = [
    "Tom", "Ben", "Max", "Sam", "Jack", "Leo", "Tim", "Finn", "Noah", "Jake",
    "Luke", "Oscar", "Theo", "Adam", "Owen", "Paul", "Dan", "Eli", "Henry",
    "Joe", "Bob", "Ollie", "Ryan", "Peter",
]
# Animal characters: (kind, gender, name)
ANIMAL_CAST = [
    ("dog", "m", "Spot"), ("dog", "f", "Bella"), ("cat", "f", "Kitty"),
    ("cat", "m", "Whiskers"), ("bunny", "f", "Fluffy"), ("bunny", "m", "Hops"),
    ("bear", "m", "Bruno"), ("bird", "f", "Tweety"), ("duck", "m", "Quack"),
    ("frog", "m", "Freddy"), ("mouse", "f", "Minnie"), ("mouse", "m", "Pip"),
    ("fox", "f", "Foxy"), ("puppy", "m", "Buddy"), ("kitten", "f", "Coco"),
    ("pig", "m", "Pinky"), ("squirrel", "f", "Nutmeg"), ("owl", "m", "Hoot"),
]

CHAR_ADJ = [
    "little", "happy", "kind", "curious", "brave", "shy", "silly", "friendly",
    "clever", "cheerful", "sweet", "playful", "small", "funny",
]

# grown-ups a child goes out with; "his mom", "her grandpa", ...
GROWN_UPS = ["mom", "dad", "grandma", "grandpa", "aunt", "uncle"]
SIBLINGS = ["big sister", "big brother", "little sister", "little brother"]


@dataclass(frozen=True)
class Place:
    name: str               # "park" -> "the park"
    activities: tuple       # verb phrases: "play on the swings"
    sights: tuple           # noun phrases seen there
    spots: tuple            # where something lost can be found
    shelter: str            # where to hide from rain


PLACES = [
    Place("park",
          ("play on the swings", "slide down the big slide", "run on the grass",
           "feed the ducks", "play in the sandbox"),
          ("tall trees", "children playing", "a big fountain", "ducks in the pond"),
          ("under a bench", "behind a big tree", "in the tall grass", "near the swings"),
          "under a big tree"),
    Place("beach",
          ("build a sandcastle", "look for shells", "splash in the waves", "dig in the sand"),
          ("big waves", "white birds", "pretty shells", "little crabs"),
          ("under a pile of sand", "behind a big rock", "near the water", "next to a beach towel"),
          "under a big umbrella"),
    Place("forest",
          ("look at the tall trees", "listen to the birds sing", "pick berries",
           "walk on the soft moss"),
          ("tall trees", "a little stream", "red mushrooms", "a family of deer"),
          ("under a pile of leaves", "behind an old log", "next to a big rock",
           "near a little stream"),
          "under a big tree"),
    Place("garden",
          ("smell the flowers", "water the plants", "dig in the dirt", "watch the butterflies"),
          ("pretty flowers", "busy bees", "red tomatoes", "yellow butterflies"),
          ("under a big leaf", "behind the flower pots", "next to the roses", "in the tall grass"),
          "in the little shed"),
    Place("farm",
          ("feed the chickens", "pet the cows", "ride on the tractor", "see the baby pigs"),
          ("a red barn", "fat pigs", "a big brown horse", "baby chicks"),
          ("in the hay", "behind the red barn", "next to the fence", "near the pig pen"),
          "in the big red barn"),
    Place("playground",
          ("climb the monkey bars", "go down the slide", "play on the swings",
           "play tag with the other children"),
          ("a tall slide", "many children", "a red seesaw", "a sandbox"),
          ("under the slide", "in the sandbox", "next to the seesaw", "behind the swings"),
          "under the big slide"),
    Place("lake",
          ("throw stones into the water", "watch the fish swim", "sit on the dock",
           "feed the ducks"),
          ("a small boat", "white ducks", "little fish", "green frogs"),
          ("near the dock", "behind a bush", "on a flat rock", "in the reeds"),
          "under a big tree"),
    Place("zoo",
          ("see the lions", "watch the monkeys play", "look at the tall giraffes",
           "wave at the elephants"),
          ("a big lion", "funny monkeys", "tall giraffes", "a baby elephant"),
          ("near the monkey house", "under a bench", "next to the gate", "behind a sign"),
          "in the monkey house"),
    Place("hill",
          ("roll down the grass", "look at the town below", "pick wild flowers",
           "watch the clouds"),
          ("the whole town", "white clouds", "wild flowers", "a windmill"),
          ("behind a rock", "in the tall grass", "under a bush", "near the old fence"),
          "under an old tree"),
    Place("meadow",
          ("chase butterflies", "pick flowers", "run in the grass", "look for bugs"),
          ("many flowers", "bright butterflies", "a little bunny", "green grass"),
          ("in the tall grass", "under a bush", "behind a rock", "next to a tree stump"),
          "under a big tree"),
    Place("backyard",
          ("jump on the trampoline", "play in the sprinkler", "dig in the dirt",
           "swing on the tire swing"),
          ("a big tree", "a little bird house", "a wooden fence", "green grass"),
          ("under the porch", "behind the shed", "next to the fence", "in the flower bed"),
          "under the porch"),
    Place("river",
          ("throw sticks into the water", "look for frogs", "skip stones", "watch the boats"),
          ("a wooden bridge", "little fish", "green frogs", "a red boat"),
          ("under the bridge", "behind a big rock", "in the reeds", "near the water"),
          "under the bridge"),
]


@dataclass(frozen=True)
class Thing:
    noun: str
    plays: tuple            # what one does with it, with "it"
    adjs: tuple             # extra adjectives besides colours


THINGS = [
    Thing("ball", ("kick it", "throw it high", "bounce it"), ("big", "shiny", "bouncy")),
    Thing("kite", ("fly it",), ("big", "shiny")),
    Thing("teddy bear", ("hug it", "carry it everywhere"), ("soft", "fluffy", "old")),
    Thing("toy car", ("race it", "push it on the floor"), ("shiny", "fast", "little")),
    Thing("doll", ("play with it", "dress it up"), ("pretty", "little", "old")),
    Thing("book", ("read it", "look at the pictures"), ("big", "new", "old")),
    Thing("hat", ("wear it",), ("big", "funny", "new")),
    Thing("balloon", ("hold it", "watch it float"), ("big", "shiny")),
    Thing("toy boat", ("sail it", "float it in the bath"), ("little", "wooden")),
    Thing("drum", ("play it", "bang on it"), ("little", "loud")),
    Thing("scarf", ("wear it",), ("soft", "warm", "long")),
    Thing("robot", ("play with it", "make it walk"), ("shiny", "little", "silver")),
    Thing("yo-yo", ("spin it", "play with it"), ("shiny", "little")),
    Thing("toy train", ("push it", "play with it"), ("little", "wooden")),
    Thing("bucket", ("carry it", "fill it with sand"), ("little", "plastic")),
    Thing("whistle", ("blow it",), ("shiny", "little", "loud")),
]
COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white"]

# (adjective, how one looks)
FEELINGS_GOOD = ["happy", "glad", "excited", "proud", "joyful"]
FEELINGS_BAD = ["sad", "upset", "worried", "scared", "lonely"]

ANIMALS_TO_HELP = [
    # (animal, problem sentence with {it}, fix sentence with {c} (the hero), ending sentence)
    ("kitten", "a little kitten stuck up in a tree",
     "{c.He} asked {c.his} {g} for help, and {c.his} {g} got a ladder and lifted the kitten down",
     "The kitten purred and rubbed against {c.his} legs"),
    ("bird", "a small bird with a hurt wing",
     "{c.He} put the bird in a soft box and gave it some water",
     "After a few days, the bird's wing was better and it flew up into the sky"),
    ("puppy", "a little puppy that was lost",
     "{c.He} read the name on its collar and helped it find its home",
     "The puppy's owner was so happy and gave {c.Name} a big hug"),
    ("duck", "a baby duck that could not find its mother",
     "{c.He} walked along the water with the duck until they saw the mother duck",
     "The baby duck quacked and swam to its mother"),
    ("bunny", "a little bunny that was very hungry",
     "{c.He} gave the bunny a fresh carrot from {c.his} bag",
     "The bunny ate the carrot and wiggled its nose"),
    ("turtle", "a small turtle that was stuck on its back",
     "{c.He} gently turned the turtle over",
     "The turtle walked slowly back to the pond"),
    ("squirrel", "a little squirrel that could not reach a nut",
     "{c.He} picked up the nut and put it near the squirrel",
     "The squirrel took the nut and ran up the tree"),
    ("frog", "a little frog caught in a net",
     "{c.He} carefully opened the net and let the frog out",
     "The frog jumped back into the water with a big splash"),
]

BRAVE_TASKS = [
    # (infinitive, worry, what goes wrong, success sentence)
    ("ride a bike", "What if I fall?", "{c.he} wobbled and fell down", "{c.he} rode all the way down the street"),
    ("swim in the pool", "What if I sink?", "{c.he} splashed and swallowed some water",
     "{c.he} swam from one side of the pool to the other"),
    ("climb the big tree", "What if I fall?", "{c.his} foot slipped and {c.he} slid back down",
     "{c.he} reached the top and waved at everyone below"),
    ("sing in the school show", "What if I forget the words?", "{c.his} voice shook and {c.he} forgot the words",
     "{c.he} sang the whole song, and everyone clapped"),
    ("jump into the lake", "What if the water is too cold?", "{c.he} stood at the edge for a long time",
     "{c.he} jumped in with a big splash"),
    ("go down the tall slide", "What if I go too fast?", "{c.he} sat at the top and held on tight",
     "{c.he} went down the slide very fast and laughed"),
    ("read a story to the class", "What if I say a word wrong?", "{c.he} said some words wrong",
     "{c.he} read the whole story, and the class loved it"),
    ("skate on the ice", "What if I slip?", "{c.he} slipped and fell on the ice",
     "{c.he} skated in a big circle all by {c.himself}"),
]

BAKES = [
    # (thing, ingredients, shape sentence)
    ("cake", "flour, eggs, milk and sugar", "They poured the batter into a round pan"),
    ("cookies", "flour, butter, sugar and chocolate chips",
     "They made little balls of dough and put them on a tray"),
    ("apple pie", "apples, flour, butter and sugar", "They put the apples into the pie crust"),
    ("bread", "flour, water, salt and yeast", "They pushed and folded the soft dough"),
    ("muffins", "flour, eggs, milk and blueberries", "They spooned the batter into little cups"),
    ("pancakes", "flour, eggs and milk", "They poured round circles of batter into the hot pan"),
]

GIFTS = [
    # (gift, how it is made or found)
    ("a card", "{c.He} drew a big heart on it with {c.his} crayons"),
    ("a necklace", "{c.He} put colorful beads on a long string"),
    ("a picture", "{c.He} painted a picture of the two of them playing"),
    ("a bunch of flowers", "{c.He} picked the prettiest flowers in the garden"),
    ("a paper crown", "{c.He} cut out a crown and glued shiny stars on it"),
    ("a little cake", "{c.He} baked a little cake with {c.his} {g}"),
    ("a box of shells", "{c.He} filled a small box with the shells {c.he} found at the beach"),
]

# (first mention, later mention, pronoun, how one says good night to it)
BEDTIME_THINGS = [
    ("the moon", "the moon", "it", "moon"),
    ("the stars", "the stars", "they", "stars"),
    ("a sleepy owl", "the sleepy owl", "it", "owl"),
    ("a little cloud", "the little cloud", "it", "little cloud"),
]

WEATHER_BAD = [
    ("the sky turned dark and it began to rain", "the rain stopped"),
    ("big gray clouds came and it started to rain", "the clouds went away"),
    ("the wind blew hard and rain began to fall", "the wind grew calm"),
]

TIMES = ["One day", "One sunny day", "One morning", "One afternoon", "One bright morning",
         "One warm day", "One Saturday"]


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


# --------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------

def plot_lost_toy(st: Story):
    c, f = st.names["c"], st.names["f"]
    place = st.pick(PLACES)
    thing = st.pick(THINGS)
    tp = thing_phrase(st, thing)
    g = grown_up(st)
    opening(st, c)
    st.add(f"{{c.He}} had {art(tp)} that {{c.he}} loved very much")
    st.add(f"{{c.He}} liked to {st.pick(thing.plays)} every day")
    st.add(f"{st.pick(TIMES)}, {{c.Name}} went to the {place.name} with {{c.his}} {g}")
    st.add(f"{{c.He}} took {{c.his}} {thing.noun} with {{c.him}}")
    st.add(f"At the {place.name}, {{c.Name}} wanted to {st.pick(place.activities)}")
    st.add(f"{{c.He}} put the {thing.noun} down and ran off to play")
    st.add(f"When {{c.he}} came back, the {thing.noun} was gone!")
    st.add(f"{{c.Name}} looked and looked, but {{c.he}} could not find it")
    bad = st.pick(["sad", "upset", "worried"])
    st.add(f"{{c.He}} felt very {bad} and began to cry")
    helper_is_friend = st.chance(0.6)
    if helper_is_friend:
        st.add(f"Just then, {{c.his}} friend {{f.Name}} came by")
        st.say(f, "Why are you crying, {c.Name}?", verb="asked")
        st.say(c, f"I lost my {thing.noun}")
        st.say(f, "Don't worry. I will help you look for it")
        who = "{f.Name}"
    else:
        st.add(f"{{c.His}} {g} gave {{c.him}} a hug")
        st.add(f'"Don\'t be {bad}," said {{c.his}} {g}. "Let\'s look for it together."')
        who = f"{{c.his}} {g}"
    s1, s2 = st.rng.sample(list(place.spots), 2)
    st.add(f"They looked {s1}, but it was not there")
    st.add(f"Then {who} looked {s2}")
    st.add(f'"I found it!" said {who}.')
    st.add(f"There was the {tp}!")
    st.add(f"{{c.Name}} was so {st.pick(['happy', 'glad', 'relieved'])}")
    if helper_is_friend:
        st.say(c, "Thank you, {f.Name}! You are a good friend")
        st.add(f"Then the two friends played with the {thing.noun} together until it was time to go home")
    else:
        st.say(c, f"Thank you, {g}!")
        st.add(f"{{c.He}} held the {thing.noun} tight all the way home")
    ending(st, c, st.pick([
        f"From that day on, {{c.Name}} always kept {{c.his}} {thing.noun} close",
        f"{{c.Name}} learned to take good care of {{c.his}} things",
        "{c.Name} learned that it is good to have help when you need it",
    ]))


def plot_sharing(st: Story):
    c, f = st.names["c"], st.names["f"]
    place = st.pick(PLACES)
    thing = st.pick(THINGS)
    tp = thing_phrase(st, thing)
    opening(st, c)
    likes(st, c, place)
    st.add(f"{st.pick(TIMES)}, {{c.Name}} got {art(tp)} from {{c.his}} {grown_up(st)}")
    st.add(f"{{c.He}} was very {st.pick(['happy', 'excited', 'glad'])} and took it to the {place.name}")
    st.add(f"At the {place.name}, {{c.he}} met {art(st.pick(CHAR_ADJ) + ' ' + st.names['f'].kind)} named {{f.Name}}")
    st.add(f"{{f.Name}} saw the {thing.noun} and wanted to play with it too")
    st.say(f, f"Can I play with your {thing.noun}, please?", verb="asked")
    st.say(c, f"No, it is my {thing.noun}")
    st.add(f"{{f.Name}} felt {st.pick(['sad', 'lonely', 'upset'])} and sat down on the grass")
    st.add(f"{{c.Name}} played alone, but it was not much fun")
    st.add("{c.He} looked at {f.Name} and thought about how {f.he} felt")
    st.add(f"Then {{c.Name}} walked over to {{f.Name}} and held out the {thing.noun}")
    st.say(c, "I am sorry. Let's play together")
    st.add("{f.Name} smiled a big smile")
    st.add(f"They took turns with the {thing.noun} and {st.pick(['laughed and played', 'had lots of fun', 'played'])} all afternoon")
    st.add("Playing together was much more fun than playing alone")
    ending(st, c, st.pick([
        "{c.Name} learned that sharing makes everyone happy",
        "From that day on, {c.Name} and {f.Name} were best friends",
        "{c.Name} learned that it is better to share",
    ]))


def plot_rain(st: Story):
    c, f = st.names["c"], st.names["f"]
    place = st.pick(PLACES)
    bad, good = st.pick(WEATHER_BAD)
    opening(st, c)
    likes(st, c, place)
    with_friend = st.chance(0.5)
    if with_friend:
        st.add(f"{st.pick(TIMES)}, {{c.Name}} and {{c.his}} friend {{f.Name}} went to the {place.name}")
        st.add(f"They wanted to {st.pick(place.activities)}")
        who = "they"
    else:
        st.add(f"{st.pick(TIMES)}, {{c.Name}} went to the {place.name} with {{c.his}} {grown_up(st)}")
        st.add(f"{{c.He}} wanted to {st.pick(place.activities)}")
        who = "{c.he}"
    s1, s2 = st.rng.sample(list(place.sights), 2)
    st.add(f"They saw {s1} and {s2}")
    st.add(f"But then {bad}")
    st.add(f"{cap(who)} felt {st.pick(['wet', 'cold', 'scared', 'sad'])}")
    st.add(f"{cap(who)} ran to hide {place.shelter}")
    if with_friend:
        st.say(f, "Oh no! Now we cannot play")
        st.say(c, st.pick(["Let's wait. The rain will stop soon",
                           "Don't be sad. We can sing a song while we wait"]))
        st.add("So they sat close together and sang a happy song")
    else:
        st.say(c, "Will the rain stop soon?", verb="asked")
        st.add("They waited and waited")
    st.add(f"After a while, {good} and the sun came out")
    st.add(st.pick(["Then they saw a big rainbow in the sky",
                    "There was a beautiful rainbow over the " + place.name,
                    "Everything was fresh and shiny"]))
    st.add(f"{cap(who)} jumped in the puddles and laughed")
    ending(st, c, st.pick([
        "{c.Name} learned that after the rain, the sun always comes back",
        "It was the best day ever",
        "Even a rainy day can be a happy day",
    ]))


def plot_help_animal(st: Story):
    c = st.names["c"]
    place = st.pick(PLACES)
    animal, problem, fix, after = st.pick(ANIMALS_TO_HELP)
    g = grown_up(st)
    opening(st, c)
    likes(st, c, place)
    st.add(f"{st.pick(TIMES)}, {{c.Name}} was walking in the {place.name} when {{c.he}} heard a small sound")
    st.add(f"{{c.He}} looked around and saw {problem}")
    st.add(f"The {animal} looked {st.pick(['scared', 'sad', 'tired', 'worried'])}")
    st.say(c, f"Poor little {animal}! I will help you")
    st.add(fix, g=g)
    st.add(after)
    st.add(f"{{c.Name}} felt warm and {st.pick(FEELINGS_GOOD)} inside")
    if st.chance(0.5):
        st.add(f"When {{c.he}} got home, {{c.he}} told {{c.his}} {g} all about the {animal}")
        st.say(c, f"I helped a little {animal} today!")
        st.add(f'"You were very kind," said {{c.his}} {g}.')
    else:
        st.add(f"Every day after that, {{c.Name}} went back to the {place.name} to say hello to the {animal}")
    ending(st, c, st.pick([
        "{c.Name} learned that it is good to help others",
        "Helping others made {c.Name} very happy",
        f"The {animal} and {{c.Name}} became good friends",
    ]))


def plot_brave(st: Story):
    c = st.names["c"]
    task, worry, fail, win = st.pick(BRAVE_TASKS)
    g = grown_up(st)
    fear = st.pick(["scared", "afraid", "nervous"])
    opening(st, c)
    likes(st, c)
    st.add(f"{{c.Name}} wanted to {task}, but {{c.he}} was {fear}")
    st.add(f"{st.pick(TIMES)}, {{c.his}} {g} said, \"Today you can try to {task}.\"")
    st.say(c, f"But I am {fear}. {worry}")
    st.add(f'"It is okay to be {fear}," said {{c.his}} {g}. "I will be right here with you."')
    st.add(f"{{c.Name}} took a deep breath and tried")
    st.add(f"At first, {fail}")
    st.add(f"{{c.He}} felt {st.pick(['sad', 'upset', 'silly'])} and wanted to stop")
    st.add(f'"Try again," said {{c.his}} {g}. "You can do it!"')
    st.add("So {c.Name} tried again, and again")
    st.add(f"Then, at last, {win}!")
    st.say(c, f"I did it! I can {task}!", verb="shouted")
    st.add(f"{{c.His}} {g} clapped and gave {{c.him}} a big hug")
    st.add(f"{{c.Name}} felt very {st.pick(['proud', 'happy', 'brave'])}")
    ending(st, c, st.pick([
        "{c.Name} learned that if you keep trying, you can do hard things",
        "From that day on, {c.Name} was not " + fear + " anymore",
        "Being brave is not easy, but it is worth it",
    ]))


def plot_bake(st: Story):
    c, f = st.names["c"], st.names["f"]
    food, ingredients, shape = st.pick(BAKES)
    g = st.pick(["mom", "dad", "grandma", "grandpa"])
    opening(st, c)
    likes(st, c)
    st.add(f"{st.pick(TIMES)}, {{c.Name}} and {{c.his}} {g} decided to make {food}")
    st.add(f"They put on their aprons and got out {ingredients}")
    st.add(f"{{c.Name}} helped to mix everything in a big bowl")
    if st.chance(0.5):
        st.add("A little flour went on {c.his} nose, and {c.his} " + g + " laughed")
    st.add(shape)
    st.add(f"Then {{c.his}} {g} put the {food} in the oven")
    st.add(f"Soon the whole house smelled warm and sweet")
    st.say(c, f"Is it ready yet?", verb="asked")
    st.add(f'"Not yet," said {{c.his}} {g}. "We have to wait."')
    st.add(f"At last, the {food} {'was' if food in ('cake', 'apple pie', 'bread') else 'were'} ready")
    if st.chance(0.6):
        st.add(f"{{c.Name}} took some {food} to {{c.his}} friend {{f.Name}}")
        st.say(f, "Yum! This is so good. Thank you!")
        st.add("The two friends ate together and smiled")
    else:
        st.add(f"The whole family sat at the table and ate the {food} together")
        if food in ("cookies", "muffins", "pancakes"):
            st.add(f"They were the best {food} {{c.Name}} had ever tasted")
        else:
            st.add(f"It was the best {food} {{c.Name}} had ever tasted")
    ending(st, c, st.pick([
        "{c.Name} learned that things made with love taste the best",
        "{c.Name} could not wait to bake again",
        "It was a happy day for everyone",
    ]))


def plot_gift(st: Story):
    c, f = st.names["c"], st.names["f"]
    gift, how = st.pick(GIFTS)
    g = grown_up(st)
    opening(st, c)
    st.add("{c.His} best friend was {f.Name}")
    st.add(f"{st.pick(TIMES)}, {{c.Name}} found out that it was {{f.Name}}'s birthday")
    st.add("{c.He} wanted to give {f.Name} a special present")
    st.add(f"But {{c.he}} did not have any money")
    st.say(c, "What can I give my friend?", verb="asked")
    st.add(f"{{c.His}} {g} said, \"The best presents come from the heart.\"")
    st.add(f"So {{c.Name}} decided to make {gift}")
    st.add(how, g=g)
    st.add(f"It took a long time, but {{c.he}} did not give up")
    st.add(f"At the party, {{c.Name}} gave {{f.Name}} the present")
    st.add(f"{{f.Name}} opened it and smiled")
    st.say(f, st.pick([f"Wow! I love it! Thank you, {{c.Name}}!",
                       "This is the best present ever!",
                       "You made this for me? Thank you!"]))
    st.add(f"{{c.Name}} felt very {st.pick(FEELINGS_GOOD)}")
    st.add("They played games and ate cake all afternoon")
    ending(st, c, st.pick([
        "{c.Name} learned that a gift made with love is the best gift of all",
        "It was the best birthday party ever",
        "{c.Name} and {f.Name} were friends forever",
    ]))


def plot_new_friend(st: Story):
    c, f = st.names["c"], st.names["f"]
    place = st.pick(PLACES)
    a1, a2 = st.rng.sample(list(place.activities), 2)
    opening(st, c)
    st.add(f"{{c.Name}} was new in town and did not have any friends")
    st.add(f"{{c.He}} felt {st.pick(['lonely', 'shy', 'sad'])}")
    st.add(f"{st.pick(TIMES)}, {{c.Name}} went to the {place.name}")
    st.add(f"{{c.He}} saw {art(st.pick(CHAR_ADJ) + ' ' + f.kind)} who was trying to {a1}")
    st.add(f"{{c.Name}} wanted to say hello, but {{c.he}} was too shy")
    if st.chance(0.5):
        st.add(f"Then the {f.kind} looked up and waved")
    else:
        st.add(f"Then {{c.Name}} took a deep breath and walked over")
    st.say(c, "Hello! My name is {c.Name}. What is your name?")
    st.say(f, "My name is {f.Name}. Do you want to play with me?")
    st.add(f"{{c.Name}} smiled and said yes")
    st.add("They played together all day")
    st.add(f"First they tried to {a1} together, and then they went to {a2}")
    st.add(f"When the sun went down, {{f.Name}} said, \"Can we play again tomorrow?\"")
    st.say(c, "Yes! See you tomorrow")
    st.add(f"{{c.Name}} walked home feeling {st.pick(FEELINGS_GOOD)}")
    ending(st, c, st.pick([
        "{c.Name} was not lonely anymore",
        "{c.Name} and {f.Name} became best friends",
        "{c.Name} learned that saying hello is the first step to a new friend",
    ]))


def plot_bedtime(st: Story):
    c = st.names["c"]
    thing, thing2, pron, voc = st.pick(BEDTIME_THINGS)
    g = st.pick(["mom", "dad", "grandma", "grandpa"])
    toy = st.pick([t for t in THINGS if t.noun in ("teddy bear", "doll", "book", "scarf", "robot")])
    opening(st, c)
    likes(st, c)
    st.add("One night, {c.Name} could not sleep")
    st.add(f"{{c.He}} looked out of the window and saw {thing}")
    st.say(c, f"{g.capitalize()}, I am not sleepy", verb="said")
    st.add(f"{{c.His}} {g} sat on the bed and told {{c.him}} a story about {thing}")
    st.add(f"In the story, {thing2} said good night to all the animals")
    st.add(f"{pron} said good night to the {st.pick(['birds', 'cows', 'fish'])}, and it said good night to the {st.pick(['bunnies', 'bears', 'foxes'])}")
    st.add(f"{{c.Name}} held {{c.his}} {thing_phrase(st, toy)} and listened")
    st.add("{c.His} eyes felt heavy")
    st.say(c, f"Good night, {voc}", verb="whispered")
    st.add(f"{{c.His}} {g} kissed {{c.him}} on the head")
    st.add("Soon {c.Name} was fast asleep, dreaming happy dreams")
    ending(st, c, None)


PLOTS = [plot_lost_toy, plot_sharing, plot_rain, plot_help_animal, plot_brave,
         plot_bake, plot_gift, plot_new_friend, plot_bedtime]


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
