"""The nine plot shapes of the story generator (corpus.py), each filling a Story with sentences, and PLOTS."""

from __future__ import annotations

from grammar import Story, art, cap, ending, grown_up, likes, opening, thing_phrase
from words import (ANIMALS_TO_HELP, BAKES, BEDTIME_THINGS, BRAVE_TASKS, CHAR_ADJ, FEELINGS_GOOD, GIFTS, PLACES,
                   THINGS, TIMES, WEATHER_BAD)


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
    st.add("{c.Name} looked and looked, but {c.he} could not find it")
    bad = st.pick(["sad", "upset", "worried"])
    st.add(f"{{c.He}} felt very {bad} and began to cry")
    helper_is_friend = st.chance(0.6)
    if helper_is_friend:
        st.add("Just then, {c.his} friend {f.Name} came by")
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
        "{c.Name} learned to take good care of {c.his} things",
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
    st.add("{c.Name} played alone, but it was not much fun")
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
    st.add("{c.Name} took a deep breath and tried")
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
    st.add("{c.Name} helped to mix everything in a big bowl")
    if st.chance(0.5):
        st.add("A little flour went on {c.his} nose, and {c.his} " + g + " laughed")
    st.add(shape)
    st.add(f"Then {{c.his}} {g} put the {food} in the oven")
    st.add("Soon the whole house smelled warm and sweet")
    st.say(c, "Is it ready yet?", verb="asked")
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
    st.add("But {c.he} did not have any money")
    st.say(c, "What can I give my friend?", verb="asked")
    st.add(f"{{c.His}} {g} said, \"The best presents come from the heart.\"")
    st.add(f"So {{c.Name}} decided to make {gift}")
    st.add(how, g=g)
    st.add("It took a long time, but {c.he} did not give up")
    st.add("At the party, {c.Name} gave {f.Name} the present")
    st.add("{f.Name} opened it and smiled")
    st.say(f, st.pick(["Wow! I love it! Thank you, {c.Name}!",
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
    st.add("{c.Name} was new in town and did not have any friends")
    st.add(f"{{c.He}} felt {st.pick(['lonely', 'shy', 'sad'])}")
    st.add(f"{st.pick(TIMES)}, {{c.Name}} went to the {place.name}")
    st.add(f"{{c.He}} saw {art(st.pick(CHAR_ADJ) + ' ' + f.kind)} who was trying to {a1}")
    st.add("{c.Name} wanted to say hello, but {c.he} was too shy")
    if st.chance(0.5):
        st.add(f"Then the {f.kind} looked up and waved")
    else:
        st.add("Then {c.Name} took a deep breath and walked over")
    st.say(c, "Hello! My name is {c.Name}. What is your name?")
    st.say(f, "My name is {f.Name}. Do you want to play with me?")
    st.add("{c.Name} smiled and said yes")
    st.add("They played together all day")
    st.add(f"First they tried to {a1} together, and then they went to {a2}")
    st.add("When the sun went down, {f.Name} said, \"Can we play again tomorrow?\"")
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
