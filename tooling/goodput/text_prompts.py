"""Real-text prompts for goodput workloads (`pdserve bench --prompts text`). Orchestrator side.

`CORPUS` is a small built-in body of varied English prose (cooking, astronomy, history, code
review, weather, travel, gardening, economics, music, medicine, sport, a letter, a recipe, a
story), written for this repository: no download, no licence to track. `corpus_ids(model_dir)`
tokenizes it once with the served model's own tokenizer (`tokenizer.json` in the model folder,
no BOS) into one token stream, and the load generator cuts every prompt out of that stream
(`traces.prompt_tokens` with a corpus): a window of exactly the spec's `input_len` tokens at a
seeded offset, wrapping around the end. So prompt lengths stay exact, prefix groups still share
their leading tokens, and the model reads English rather than random ids, which matters for
its numerics only through the attention pattern (outputs keep their fixed length:
`ignore_eos`, see `openai_load` / `loadgen`).
"""

from __future__ import annotations

from pathlib import Path

CORPUS = """\
To make a good loaf of bread you need little more than flour, water, salt and time. Mix the
flour and water first and let them rest for half an hour; the flour drinks the water and the
gluten begins to form on its own. Then add the salt and the starter, fold the dough every
half hour for two hours, shape it, and leave it in the refrigerator overnight. In the morning
bake it in a very hot covered pot, uncover it after twenty minutes, and wait until the crust
is dark brown before you take it out.

Jupiter is the largest planet in the solar system, more than three hundred times as massive
as the Earth. Its bands of cloud are made of ammonia crystals, and the Great Red Spot is a
storm wider than our whole planet that has been watched for more than three centuries. Four
large moons circle it: Io, covered in volcanoes; Europa, whose ice hides a salty ocean;
Ganymede, the largest moon of all; and Callisto, old and full of craters.

The printing press changed Europe faster than anyone at the time expected. Before it, a book
was copied by hand over months, and a library of a few hundred volumes was a treasure. Within
fifty years of the first printed bibles, millions of books were in circulation, prices had
fallen, and pamphlets carried arguments about religion and politics from one city to the
next in a matter of weeks.

Dear Maria, thank you for your letter and for the photographs of the new house. The garden
looks wonderful, and I can see why you wanted the room with the big window for your study. We
are all well here. The children started school last week and talk about nothing but their
new teacher. I hope we can visit in the spring, when the roads are open again.

When you review a pull request, read the description before the code: it should say what
problem the change solves and how the author checked it. Then look at the tests. A test that
would have passed before the fix tells you nothing. Ask for smaller functions when a change
is hard to follow, and be specific: point at the line, say what you expected, and suggest
what you would do instead.

The forecast for tomorrow is cloudy in the morning with a chance of light rain near the
coast. In the afternoon the clouds will break up and temperatures will reach eighteen
degrees. Winds from the west at fifteen to twenty kilometres an hour will ease in the
evening, and the night will be clear and cold, with frost possible in the valleys.

Lisbon is a city of hills, trams and tiled walls. Take the old yellow tram up to the castle
in the early morning, before the crowds arrive, and walk back down through the narrow streets
of Alfama. In the evening, find a small restaurant where someone sings fado, order grilled
sardines and a glass of green wine, and stay until the last song.

Tomatoes want sun, warmth and steady water. Plant them deep, up to the first leaves, because
the buried stem grows roots. Water at the base of the plant rather than on the leaves, and do
it in the morning so the soil stays moist through the heat of the day. Pinch out the side
shoots if you grow them on a single stake, and feed them every two weeks once the fruit sets.

When a central bank raises interest rates, borrowing becomes more expensive for households
and firms. People buy fewer houses and cars on credit, companies postpone investment, and
demand in the economy slows. That is the point: slower demand takes pressure off prices. The
difficulty is timing, because the effect arrives a year or more later, and by then the
economy may already be cooling for other reasons.

A fugue begins with a single voice stating a short melody, the subject. A second voice enters
with the same melody a fifth higher while the first continues with a new line against it. A
third and fourth voice follow, and the rest of the piece develops the subject in new keys, in
fragments, upside down, or with the voices crowding in on each other before the end.

Wash your hands with soap and water for at least twenty seconds, especially before eating and
after coughing or sneezing. Most common colds get better on their own within a week. Rest,
drink plenty of fluids, and see a doctor if you have a high fever that lasts more than three
days, if you find it hard to breathe, or if the symptoms get worse instead of better.

The match was decided in the last five minutes. After an hour of cautious play the home team
finally pushed forward, and their young winger beat two defenders on the left before crossing
low into the box. The striker, who had missed an easy chance just before half time, met the
ball first time and sent it into the bottom corner. The crowd stayed on its feet until the
final whistle.

For the soup, soften one chopped onion and two carrots in butter over a low heat for ten
minutes. Add a litre of stock, a handful of red lentils and a bay leaf, and simmer for twenty
minutes until the lentils fall apart. Remove the bay leaf, blend until smooth, season with
salt, pepper and a squeeze of lemon, and serve with warm bread.

The lighthouse keeper had not spoken to anyone in eleven days when the boat appeared on the
horizon. At first he thought it was the supply ship, early for once, but it was too small and
it was moving strangely, turning in slow circles as if nobody held the wheel. He watched it
through the glass for an hour, then put on his coat, took the lantern, and went down to the
little harbour to wait.

Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the
chloroplasts of plant cells, where the green pigment chlorophyll absorbs red and blue light
and reflects green. The sugar feeds the plant and, through it, almost every other living
thing on land; the oxygen it releases made the air we breathe over billions of years.
"""


def corpus_ids(model_dir: str | Path) -> list[int]:
    """`CORPUS` tokenized with `model_dir`'s tokenizer, without BOS: the token stream text
    prompts are cut from. ValueError when the folder has no `tokenizer.json`."""
    from model_runtime.tokenizer import Tokenizer

    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"text prompts need the model's tokenizer: no {path / 'tokenizer.json'}")
    ids = Tokenizer.from_model_dir(path).encode(CORPUS, add_bos=False)
    if not ids:
        raise ValueError(f"{path}: the tokenizer turned the corpus into no tokens")
    return ids
