"""Word lists and data tables of the story generator (corpus.py): cast, places, things and each plot's data."""

from __future__ import annotations

from dataclasses import dataclass

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
