"""Templated dialogues for the supervised pass, rendered in the Kimi chat format the services use.

Kinds: greetings, who the assistant is, small talk, facts about the six novels, who a character is (answered with a
sentence of the novel that names them), a short passage "in the style of Jane Austen" and continuing a sentence (both
from the training split only). Deterministic for a seed. Each dialogue becomes token ids plus a mask that is 1 on the
assistant's reply tokens and its closing <|im_end|>, the only tokens the pass learns to produce.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kimiserve.tokenizer_files.loading import LoadedTokenizer
from tokenizer_svc.chat_types import ChatMessage
from tokenizer_svc.kimi_chat import BuiltinKimiTemplate

# title, year, heroine, characters (as the text names them)
NOVELS = [
    ("Sense and Sensibility", 1811, "Elinor Dashwood",
     ["Elinor", "Marianne", "Edward", "Colonel Brandon", "Willoughby"]),
    ("Pride and Prejudice", 1813, "Elizabeth Bennet",
     ["Elizabeth", "Mr. Darcy", "Jane", "Mr. Bingley", "Mr. Bennet", "Mrs. Bennet", "Lydia", "Wickham"]),
    ("Mansfield Park", 1814, "Fanny Price", ["Fanny", "Edmund", "Sir Thomas", "Mrs. Norris", "Henry Crawford"]),
    ("Emma", 1815, "Emma Woodhouse", ["Emma", "Mr. Knightley", "Harriet", "Mr. Woodhouse", "Frank Churchill"]),
    ("Northanger Abbey", 1817, "Catherine Morland", ["Catherine", "Henry Tilney", "Isabella", "General Tilney"]),
    ("Persuasion", 1817, "Anne Elliot", ["Anne", "Captain Wentworth", "Sir Walter", "Lady Russell", "Louisa"]),
]
GREETINGS = ["Hello", "Hello!", "Hi", "Hi!", "Hi there", "Hello there!", "Good morning", "Good evening", "Hey",
             "Greetings", "Good afternoon!", "hello", "hi"]
GREETING_REPLIES = [
    "Hello! I am Kimi, a very small model that has read the novels of Jane Austen. How may I help you?",
    "Good day to you! What would you like to talk about?",
    "Hello! It is a pleasure to meet you. Shall I tell you about the novels of Jane Austen?",
    "Hello! I am very glad to see you. What can I do for you today?",
]
IDENTITY_QUESTIONS = ["Who are you?", "What is your name?", "What are you?", "Tell me about yourself.",
                      "Introduce yourself."]
IDENTITY_REPLIES = [
    "I am Kimi, a very small language model. I learned my English from the six novels of Jane Austen.",
    "My name is Kimi. I am a tiny model, and everything I know I learned from the novels of Jane Austen.",
]
SMALL_TALK = [
    (["How are you?", "How are you today?", "How do you do?"],
     ["I am very well, thank you. I hope you are well too.", "Quite well, thank you, and very glad of the company."]),
    (["Thank you!", "Thanks.", "Thank you very much."],
     ["You are very welcome.", "It was a pleasure. Is there anything else I can do for you?"]),
    (["Goodbye", "Bye!", "Good night."],
     ["Goodbye! It was a pleasure to talk with you.", "Good night, and I hope we shall speak again soon."]),
    (["Can you help me?", "I need some help."],
     ["I will do my best, though I am only a very small model. What do you need?"]),
    (["What is the weather like?", "Is it raining?"],
     ["I cannot see the sky, but I hope the weather is fine where you are."]),
]
STYLE_REQUESTS = ["Tell me a story.", "Write something in the style of Jane Austen.", "Say something.",
                  "Write a sentence about a young lady.", "Tell me something from a novel.", "Write a short passage."]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are Kimi, a small and polite assistant.",
                  "Answer briefly and kindly."]
# A sentence ends at . ! ? before a capital or a quote, but not after a title (Mr. Darcy, Mrs. Norris, ...).
_SENTENCE_END = re.compile(r'(?<!Mr\.)(?<!Mrs\.)(?<!Dr\.)(?<!St\.)(?<=[.!?])\s+(?=[A-Z"])')


@dataclass(frozen=True)
class Dialogue:
    ids: list[int]
    mask: list[int]  # 1 where the token is the assistant's to produce


def _sentences(paragraphs: list[str]) -> list[str]:
    """Narrative sentences (no speech) of a readable length."""
    out = [s for p in paragraphs for s in _SENTENCE_END.split(p)]
    return [s for s in out if 40 <= len(s) <= 220 and '"' not in s]


def _openings(paragraphs: list[str]) -> list[str]:
    """The first one or two sentences of narrative paragraphs: a short passage that reads on its own."""
    out = []
    for p in paragraphs:
        parts = _SENTENCE_END.split(p)
        text = " ".join(parts[:2]) if len(" ".join(parts[:2])) <= 320 else parts[0]
        if 60 <= len(text) <= 320 and '"' not in text:
            out.append(text)
    return out


def _book_fact(rng: random.Random) -> tuple[str, str]:
    title, year, heroine, _ = rng.choice(NOVELS)
    return rng.choice([
        (f"Who wrote {title}?", f"{title} was written by Jane Austen and published in {year}."),
        (f"When was {title} published?", f"{title} was first published in {year}."),
        (f"Who is the heroine of {title}?", f"The heroine of {title} is {heroine}."),
        (f"What is {title}?", f"{title} is a novel by Jane Austen, published in {year}. Its heroine is {heroine}."),
        ("Name a novel by Jane Austen.", f"{title}, published in {year}."),
        ("Which novels did Jane Austen write?",
         "Jane Austen wrote six novels: " + ", ".join(n[0] for n in NOVELS[:-1]) + f" and {NOVELS[-1][0]}."),
    ])


def _exchange(rng: random.Random, sentences: list[str], openings: list[str],
              by_name: dict[str, list[str]]) -> tuple[str, str]:
    kind = rng.choices(["greet", "identity", "small", "book", "character", "style", "continue"],
                       weights=[15, 10, 10, 20, 15, 20, 10])[0]
    if kind == "greet":
        return rng.choice(GREETINGS), rng.choice(GREETING_REPLIES)
    if kind == "identity":
        return rng.choice(IDENTITY_QUESTIONS), rng.choice(IDENTITY_REPLIES)
    if kind == "small":
        questions, replies = rng.choice(SMALL_TALK)
        return rng.choice(questions), rng.choice(replies)
    if kind == "book":
        return _book_fact(rng)
    if kind == "character":
        title, _, _, characters = rng.choice(NOVELS)
        name = rng.choice(characters)
        line = rng.choice(by_name.get(f"{title}:{name}") or [""])
        return (rng.choice([f"Who is {name}?", f"Tell me about {name}.", f"Who is {name} in {title}?"]),
                f"{name} is a character in {title}. {line}".strip())
    if kind == "style":
        return rng.choice(STYLE_REQUESTS), rng.choice(openings)
    sentence = rng.choice(sentences)
    words = sentence.split(" ")
    cut = rng.randint(3, max(3, len(words) - 3))
    return f"Continue: {' '.join(words[:cut])}", " ".join(words[cut:])


def make_dialogues(count: int, paragraphs_by_novel: dict[str, list[str]], tokenizer: LoadedTokenizer,
                   seed: int) -> list[Dialogue]:
    """`count` dialogues of one or two exchanges, a system prompt on some, tokenized with reply masks."""
    rng = random.Random(seed)
    paragraphs = [p for ps in paragraphs_by_novel.values() for p in ps]
    sentences, openings = _sentences(paragraphs), _openings(paragraphs)
    by_name = {}
    for title, _, _, characters in NOVELS:
        novel = _sentences(paragraphs_by_novel.get(title, []))
        for name in characters:
            by_name[f"{title}:{name}"] = [s for s in novel if name in s][:200]
    dialogues = []
    for _ in range(count):
        messages = [ChatMessage("system", rng.choice(SYSTEM_PROMPTS))] if rng.random() < 0.15 else []
        for _ in range(2 if rng.random() < 0.3 else 1):
            question, reply = _exchange(rng, sentences, openings, by_name)
            messages += [ChatMessage("user", question), ChatMessage("assistant", reply)]
        dialogues.append(tokenize_dialogue(messages, tokenizer))
    return dialogues


def tokenize_dialogue(messages: list[ChatMessage], tokenizer: LoadedTokenizer) -> Dialogue:
    """Ids of the rendered conversation, masked to the assistant turns. Every piece boundary is a special token, so
    tokenizing the pieces one by one gives the ids of the whole rendering (tests check this)."""
    template = BuiltinKimiTemplate()
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, msg in enumerate(messages):
        if msg.role != "assistant":
            continue
        prompt = template.render(messages[:i], (), add_generation_prompt=True)
        full = template.render(messages[:i + 1], (), add_generation_prompt=False)
        for text, learn in ((prompt[len(done):], 0), (full[len(prompt):], 1)):
            piece = tokenizer.encode(text)
            ids += piece
            mask += [learn] * len(piece)
        done = full
    return Dialogue(ids, mask)
