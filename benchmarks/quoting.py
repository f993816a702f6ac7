"""The quoting workload: chat requests whose answers reuse their prompt's phrases (edit, copy,
summarize a given text), the case prompt-lookup speculative decoding is for. Standalone data
for `benchmarks/bench_speculative.py`.

Each request is one user message: a task from `TASKS` and a paragraph of the built-in English
corpus (`tooling.goodput.text_prompts.CORPUS`, written for this repository), cycled so that
request i pairs task i mod len(TASKS) with paragraph i mod (paragraphs). Answers are greedy and
end at the model's end of sequence or `max_tokens`, so every target (pdserve with and without
speculation, llama.cpp) produces the same text from the same weights, up to numerics.
"""

from __future__ import annotations

from tooling.goodput.text_prompts import CORPUS

TASKS = (
    "Rewrite the following text, correcting any mistakes, and return the whole text:",
    "Copy the following text exactly:",
    "Summarize the following text in a few sentences, reusing its own words:",
    "Edit the following text so that it is written in the first person, keeping everything "
    "else as it is:",
)


def paragraphs() -> list[str]:
    """The corpus's paragraphs, each on one line."""
    return [" ".join(p.split()) for p in CORPUS.split("\n\n") if p.strip()]


def quoting_messages(n: int) -> list[list[dict[str, str]]]:
    """`n` one-message chats (OpenAI message dicts), task and paragraph cycled."""
    paras = paragraphs()
    return [
        [{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{paras[i % len(paras)]}"}]
        for i in range(n)
    ]
