"""A small, fixed English corpus, and the byte-level BPE tokenizer of the random test models.

Runs wherever a random model is built (tests, `pdserve make-model`, benchmark set-up); torch-free,
so tokenizer tests need no model.

The tokenizer of a random model must come out identical on every machine, so nothing here reads
files that vary between machines: the corpus is the prose below (written for this project) plus
synthetic text generated from it with a seeded `random.Random`. The synthetic part recombines the
prose's words (a word-bigram chain) and mixes in pseudo-words built from syllables, so that BPE
has enough distinct material to reach vocabularies of several thousand tokens.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PROSE = """\
The lighthouse on the northern cape was built in 1871 from granite cut in the valley below.
For more than a century a keeper climbed its 114 steps every evening, trimmed the wick, wound
the clockwork that turned the lens, and wrote the weather into a thick leather book. The book
is still there: wind from the west, force six; visibility poor; two ships passed before midnight.

Most of the town lived from the sea. Fishermen left the harbour before dawn and came back in the
afternoon, their boats low in the water, gulls circling above the nets. In the market square the
catch was sold by weight, and the prices were chalked on a board: cod, haddock, mackerel, crab.
On Saturdays a baker from the next village brought bread, and the queue reached the church door.

Weather on the coast changes quickly. A clear morning can turn grey by noon, and a storm that
starts far out over the ocean may arrive within hours. Warm air rises, cools, and its water
condenses into clouds; when the droplets grow heavy enough they fall as rain. The temperature
that morning was 12°C, and the barometer had been falling since Tuesday, which the old keeper
would have read as a warning.

Trains reached the town in 1903. The line followed the river through the hills, crossed it twice
on iron bridges, and ended at a small station with a clock, a bench and a ticket office that sold
tickets to the capital for three shillings. Children ran to watch the evening train arrive; the
engine hissed, the doors opened, and for a few minutes the platform was full of voices.

A good recipe is a small program. Take 200 grams of flour, a pinch of salt, two eggs and a cup of
milk. Mix the flour and salt, make a well in the middle, break the eggs into it and whisk, adding
the milk slowly until the batter is smooth. Let it rest for half an hour. Heat a pan, add a little
butter, pour in a thin layer of batter and tilt the pan so that it spreads. After a minute, turn
it over. The first pancake is always a test; the second is usually better.

In the café by the harbour the owner, a woman named Zoë, served coffee for €2.50 and kept a shelf
of old books for anyone who wanted to read. Her résumé, she liked to say, was short: fisherman's
daughter, sailor, teacher, cook. She thought it naïve to believe that anything stayed the same for
long — the town, the sea, the people — and yet she opened at seven o'clock every single day.

Scientists measure the world in order to understand it. They count, weigh and compare; they write
down what they expect before they look, so that they cannot fool themselves afterwards. A single
measurement proves little, but a thousand careful ones, repeated by different people in different
places, can show a pattern that nobody would have guessed. Mistakes are part of the work: a result
that cannot be reproduced is not yet a result.

The river rises in the mountains, where snow lies until June. In spring the melt water fills the
valley with noise, and the mill wheels that once ground corn would turn day and night. Farther
down, the water slows, widens and grows brown with silt; herons stand in the shallows, and in the
evening swallows hunt insects just above the surface. Near the sea the river meets the tide twice
a day, and the salt water pushes a few miles inland before it turns back.

Computers follow instructions exactly, which is both their strength and their weakness. A program
that adds two numbers will add them a billion times without error, but it will also repeat a
mistake a billion times if the instruction is wrong. Good engineers therefore test their work:
they feed it small examples whose answers they already know, check the edges where things tend
to break, and keep those checks so that the next change does not quietly undo the last one.

"Where are you going?" asked the boy. "North," said the traveller, "to the cape, and then along the
cliffs until the path ends." "And after that?" "After that, I shall see." He smiled, lifted his
pack, and walked on; the boy watched until he was only a small dark shape against the hills.

Music travelled with the sailors: songs for hauling ropes, songs for long nights, songs about
home. Some of them crossed the ocean and came back changed, with new words and a faster rhythm.
In the winter the town held a concert in the school hall, with a fiddle, an accordion and a choir
of twenty voices, and the tickets — one penny each — were sold out every year.

Words travel too. The Japanese say ありがとう for thank you, the Greeks say ευχαριστώ, and in
Russian it is спасибо. A map of the world shows countries and rivers; a map of languages would
show borders that move, overlap and fade. Even a small town has its own words: the fishermen had
eleven names for different kinds of wave, and the bakers had four for different kinds of crust.
"""

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
CORPUS_SEED = 0  # the tokenizer does not depend on the model seed: same vocab for every seed

# Syllables for pseudo-words: common English onsets and rimes, so the words look pronounceable.
_ONSET_TEXT = (
    "b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr qu r s sh sk sl sm sn sp st str"
    " sw t th tr v w wh y z"
)
_RIME_TEXT = (
    "a e i o u ay ee ie oa oo ar er ir or ur an en in on un al el il ol ack eck ick ock uck ash"
    " esh ish osh ing ang ong ent ant est ust ame ine ope"
)
_ONSETS = _ONSET_TEXT.split()
_RIMES = _RIME_TEXT.split()


def _pseudo_word(rng: random.Random) -> str:
    n = rng.choice((1, 2, 2, 2, 3, 3, 4))
    return "".join(rng.choice(_ONSETS) + rng.choice(_RIMES) for _ in range(n))


def synthetic_text(num_words: int, seed: int = 0) -> str:
    """`num_words` words of deterministic pseudo-prose built from `PROSE`.

    A word-bigram chain over the prose keeps the statistics English-like; about one word in
    six is a pseudo-word (drawn, Zipf-like, from a pool that grows as text is generated) or a
    number, which gives BPE fresh merges to learn. Same arguments, same text, on any machine.
    """
    rng = random.Random(seed)
    words = PROSE.split()
    following: dict[str, list[str]] = {}
    for prev, nxt in itertools.pairwise(words):
        following.setdefault(prev, []).append(nxt)
    pool: list[str] = []
    out: list[str] = []
    word = rng.choice(words)
    for i in range(num_words):
        r = rng.random()
        if r < 0.12:
            # Zipf-like reuse: early pool entries come back often, so BPE sees them repeated.
            if not pool or rng.random() < 0.3:
                pool.append(_pseudo_word(rng))
            out.append(pool[int(len(pool) * rng.random() ** 3)])
        elif r < 0.15:
            out.append(str(rng.randrange(10 ** rng.randrange(1, 6))))
        else:
            successors = following.get(word)
            word = rng.choice(successors) if successors else rng.choice(words)
            out.append(word)
        if i % 40 == 39:
            out.append("\n")
    return " ".join(out)


def training_corpus(num_synthetic_words: int, seed: int = 0) -> list[str]:
    """The tokenizer training input: the prose paragraphs, then the synthetic text in lines."""
    paragraphs = [p for p in PROSE.split("\n\n") if p.strip()]
    return paragraphs + synthetic_text(num_synthetic_words, seed).split(" \n ")


def train_tokenizer(vocab_size: int, corpus_words: int) -> Tokenizer:
    """Train the byte-level BPE (specials `<s>`, `</s>`, `<pad>` = ids 0, 1, 2).

    Deterministic: the corpus is fixed and the trainer breaks ties by pair, so the same arguments
    give the same `tokenizer.json` everywhere (for one `tokenizers` version). The post-processor
    prepends `<s>`, as Llama tokenizers do, so HF's `AutoTokenizer(text)` gives the same ids as
    `pdserve`'s `Tokenizer.encode(text, add_bos=True)`.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(corpus_words, CORPUS_SEED), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[BOS_ID]} $A",
        pair=f"{SPECIAL_TOKENS[BOS_ID]} $A {SPECIAL_TOKENS[BOS_ID]} $B",
        special_tokens=[(SPECIAL_TOKENS[BOS_ID], BOS_ID)],
    )
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name), i)
    return tok


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
"""The chat template written into every model folder (HF `chat_template` syntax): BOS, then
each message as ``<|role|>\ncontent</s>\n``, then ``<|assistant|>\n`` to prompt a reply."""


def write_tokenizer_files(out_dir: str | Path, tok: Tokenizer, model_max_length: int) -> None:
    """Write `tokenizer.json` and a `tokenizer_config.json` that HF `AutoTokenizer` loads
    (with `CHAT_TEMPLATE` as its `chat_template`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
