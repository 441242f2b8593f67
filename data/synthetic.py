"""A synthetic Reddit TL;DR task with a known gold reward, for demonstrating the pipeline on a CPU.

Every post is about three *key items*, one from each of three small vocabularies: a person
("sister"), an object ("car") and a feeling ("angry"). They sit in templated sentences with neutral
filler, in exactly the TL;DR prompt layout:

    SUBREDDIT: r/relationships

    TITLE: My sister sold my car

    POST: So my sister (27F) lives about an hour away from me, and I (24F) visit often. ... A few
    days ago my sister sold my car while I was away at work. ... Now I feel angry every time I think
    about it. What should I do?

    TL;DR:

Every vocabulary word is one GPT-2 token (with its leading space), and no template or filler
sentence contains any vocabulary word, so the key items of a post are exactly the vocabulary words
found in its title and post: `prompt_items` recovers them from the prompt text alone.

Gold reward of a summary (the completion text as generated: " " + words, with a trailing "\\n"
when the model emitted the end token, END_ID = 198), `gold_reward(prompt, summary)`, from the parts
that `gold_parts` returns (and the demo and grpo.py log):

    text      = summary up to its first "\\n" (the rest was generated after the end token)
    correct   = items_correct: distinct key items of the post named in text                     (0..3)
    wrong     = items_invented: distinct vocabulary words named in text that are NOT in the post
    over      = max(0, words - TARGET_WORDS), words = whitespace-separated words in text        (8)
    ended     = 1 if summary contains "\\n" (the model stopped by itself) else 0

    gold = clip(1.0 * correct - 1.0 * wrong - min(0.25 * over, 2.0) + 1.0 * ended * [correct > 0],  -3, 4)

Words are matched case-insensitively as whole words (runs of letters). The end bonus is paid only to
a summary that names at least one key item, so a summary without content (empty, "need advice") can
score at most 0 and brevity and stopping alone cannot beat a policy that names items; a summary that
names none but invents one scores below 0. The best summary names all three items in at most 8 words
and ends with "\\n": gold = GOLD_REWARD_MAX = 4 (`best_summary`). All terms are multiples of 0.25,
so gold rewards compare exactly.

Whether a small model trained from random weights learns to copy the items is measured, not assumed
(docs/results.md): the demo's 2-layer GPT-2 does, but only after a plateau, and only when it sees the same
SFT rows many times. With the 2,000 SFT rows, the demo's 2,400 steps of 32 at lr 6e-3 (38 passes over the rows: it
memorises them, and its copying still improves) name 1.4-2.3 key items per sampled summary, 57-91% of the items it
names right, depending on the seed (the data's summaries name 2.48, 95% right). The policy's likelihood prefers a
post's item to an invented one 99.7% of the time or more (`swap_key_item`); a reward model trained with swap pairs
(`label_pairs`) and a head summed over the summary's tokens prefers it 72-85% of the time.

Data, in the layouts of the Hugging Face datasets (see `write_task`):
- SFT (`trl-lib/tldr`: prompt, completion): good but imperfect summaries (SFT_QUALITY: mostly 2 or all
  3 of the items, 2.48 named on average, sometimes extra filler words, 5% of the named items wrong), so RL has room
  above SFT in checking the items, in length and in the item left out, but little in naming more (docs/results.md).
- preference (`trl-lib/tldr-preference`: prompt, chosen, rejected): two summaries of mixed quality
  (PREF_QUALITY) of the same post; chosen = the higher gold reward, ties skipped, then each pair
  swapped with probability `label_noise` (the analogue of human disagreement; on validation the
  best achievable accuracy against the labels is 1 - realised noise).
- RL prompts (prompt, completion rows, SFT-quality completions).

Everything is pure Python and deterministic from the seed: each split draws from its own
`random.Random` stream, and no post appears twice across all splits (validation is disjoint from
train). Nothing iterates over a set while drawing, so PYTHONHASHSEED does not matter.

Command line:
    python -m data.synthetic --out runs/synthetic --seed 0
"""

import argparse
import functools
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from data.labels import pairs_by_score

# ----------------------------------------------------------------------------------------------------
# Vocabularies: 20 words each, every " word" a single GPT-2 token (tests check this).

PEOPLE = (
    "sister", "brother", "mother", "father", "mom", "dad", "wife", "husband", "girlfriend",
    "boyfriend", "friend", "roommate", "boss", "neighbor", "cousin", "uncle", "aunt", "son",
    "daughter", "landlord",
)  # fmt: skip
OBJECTS = (
    "car", "phone", "dog", "cat", "laptop", "bike", "wallet", "ring", "couch", "guitar", "camera",
    "jacket", "truck", "apartment", "computer", "boat", "piano", "necklace", "puppy", "tablet",
)  # fmt: skip
FEELINGS = (
    "angry", "sad", "jealous", "scared", "upset", "worried", "confused", "nervous", "annoyed",
    "lonely", "guilty", "hurt", "ashamed", "furious", "anxious", "stressed", "betrayed",
    "frustrated", "embarrassed", "disappointed",
)  # fmt: skip
FEMALE = frozenset({"sister", "mother", "mom", "wife", "girlfriend", "aunt", "daughter"})
MALE = frozenset({"brother", "father", "dad", "husband", "boyfriend", "uncle", "son"})
CATEGORIES = {"person": PEOPLE, "object": OBJECTS, "feeling": FEELINGS}
ALL_ITEMS = frozenset(PEOPLE + OBJECTS + FEELINGS)

# ----------------------------------------------------------------------------------------------------
# Gold reward constants (formula in the module docstring).

ITEM_REWARD = 1.0
HALLUCINATION_PENALTY = 1.0
TARGET_WORDS = 8
LENGTH_PENALTY = 0.25  # per word beyond TARGET_WORDS
LENGTH_PENALTY_CAP = 2.0
END_BONUS = 1.0
END = "\n"  # the text of END_ID (198)
GOLD_REWARD_MIN = -3.0
GOLD_REWARD_MAX = 4.0  # 3 items named, <= TARGET_WORDS words, ended

FILLER_SENTENCES = (1, 3)  # neutral filler sentences per post, at least and at most

SUBREDDITS = (
    "relationships", "relationship_advice", "tifu", "offmychest", "dating_advice", "legaladvice",
    "AskReddit", "family",
)  # fmt: skip

# ----------------------------------------------------------------------------------------------------
# Post templates. {p} person, {o} object, {f} feeling, {a} an optional age tag like " (27F)" for the
# person and {me} one for the narrator. None of these strings may contain a vocabulary word.

INTROS = (
    "My {p}{a} and I{me} have been close for most of our lives.",
    "So my {p}{a} lives about an hour away from me, and I{me} visit often.",
    "This is about my {p}{a}, who I have always trusted.",
    "Throwaway account because my {p}{a} knows my main one.",
    "I{me} have known my {p}{a} for {years} years now.",
    "A bit of background: my {p}{a} and I share a lot of things.",
)
# (sentence, past-tense verb used in titles and summaries)
EVENTS = (
    ("Last week my {p} borrowed my {o} without asking and gave it back broken.", "broke"),
    ("A few days ago my {p} sold my {o} while I was away at work.", "sold"),
    ("Yesterday I found out that my {p} lost my {o} and lied about it.", "lost"),
    ("My {p} took my {o} on a trip without telling me first.", "took"),
    ("I lent my {o} to my {p} a month ago and still have not gotten it back.", "kept"),
    ("Over the weekend my {p} damaged my {o} and did not even say sorry.", "damaged"),
    ("When I got home on Friday my {p} had ruined my {o}.", "ruined"),
    ("My {p} has been using my {o} every day and never asks first.", "used"),
)
FEELING_SENTENCES = (
    "Honestly I am really {f} about the whole thing.",
    "Now I feel {f} every time I think about it.",
    "I have been {f} ever since and I can not sleep well.",
    "Part of me is {f} and part of me just wants to move on.",
    "I was so {f} that I had to leave the room.",
    "I keep telling myself it is fine but I am {f}.",
)
FILLERS = (
    "I do not want to make a big deal out of nothing.",
    "We usually get along and rarely fight.",
    "Some background: I work full time and I am pretty busy.",
    "I tried to bring it up once but the conversation went nowhere.",
    "Everyone I asked gave me a different answer.",
    "It has been on my mind for days now.",
    "I really do not want to ruin things between us.",
    "For context, something like this has happened twice before.",
    "We live in the same city so I see them a lot.",
    "I am usually a pretty calm person.",
    "Nobody else seems to think this is a problem.",
    "Maybe I am just tired and reading too much into it.",
    "I have not said anything yet.",
    "It is not the first time and probably not the last.",
)
CLOSERS = (
    "Am I overreacting here?",
    "What should I do?",
    "Any advice would be appreciated.",
    "How do I even start this conversation?",
    "Sorry for the long post, I am on mobile.",
    "Thanks for reading.",
)
TITLES = (
    "My {p} {v} my {o}",
    "Feeling {f} after what my {p} did",
    "Need advice about my {p}{a}",
    "My {p}{a} {v} my {o}, not sure how to react",
    "My {p} and my {o}, am I overreacting?",
    "Am I wrong to be {f}?",
    "Not sure how to handle this",
)

# ----------------------------------------------------------------------------------------------------
# Summary templates, keyed by which categories they name (p person, o object, f feeling). Every
# template naming all three fits in TARGET_WORDS words except the last, which runs one over.

SUMMARIES = {
    "pof": (
        "my {p} {v} my {o}, i am {f}",
        "{f} that my {p} {v} my {o}",
        "my {p} {v} my {o}. feeling {f}.",
        "my {p} {v} my {o} and now i am {f}",
    ),
    "po": ("my {p} {v} my {o}", "my {p} {v} my {o} without asking"),
    "pf": ("i am {f} at my {p}", "my {p} made me {f}", "{f} because of my {p}"),
    "of": ("someone {v} my {o} and i am {f}", "{f} about my {o}", "my {o} situation has me {f}"),
    "p": ("problem with my {p}", "my {p} did something bad", "need advice about my {p}"),
    "o": ("something happened to my {o}", "issue with my {o}"),
    "f": ("i feel {f}", "i am so {f} right now", "{f} and need advice"),
    "": ("need advice", "not sure what to do", "am i overreacting?", "someone did something bad"),
}
SUMMARY_PREFIXES = ("long story short,", "so basically", "ok so")
SUMMARY_SUFFIXES = (
    "and i do not know what to do",
    "what should i do?",
    "any advice?",
    "please help",
    "not sure how to handle it",
)


@dataclass(frozen=True)
class SummaryQuality:
    """How good sampled summaries are."""

    p_named: tuple[float, float, float, float]
    """Probability of naming 0, 1, 2 or 3 of the item categories."""
    p_wrong: float
    """Per named category, probability that the word is a wrong (hallucinated) one of that category."""
    p_filler: float
    """Probability of a filler prefix, and independently of a filler suffix."""


SFT_QUALITY = SummaryQuality(p_named=(0.02, 0.08, 0.3, 0.6), p_wrong=0.05, p_filler=0.3)
PREF_QUALITY = SummaryQuality(p_named=(0.15, 0.3, 0.3, 0.25), p_wrong=0.2, p_filler=0.4)

_WORD_RE = re.compile(r"[a-z]+")
_CATEGORY_KEYS = (("person", "p"), ("object", "o"), ("feeling", "f"))


# ----------------------------------------------------------------------------------------------------
# Posts and prompts


def format_prompt(subreddit: str, title: str, post: str) -> str:
    return f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"


def _age_tag(rng: random.Random, person: str = "") -> str:
    # "(27F)": Reddit's age/gender tags, matching the person's gender; left out half of the time.
    gender = "F" if person in FEMALE else "M" if person in MALE else rng.choice("FM")
    return f" ({rng.randint(16, 45)}{gender})" if rng.random() < 0.5 else ""


def make_post(rng: random.Random) -> dict:
    """One post: subreddit, title, post, items {person, object, feeling}, verb, prompt."""
    items = {name: rng.choice(vocab) for name, vocab in CATEGORIES.items()}
    event, verb = rng.choice(EVENTS)
    slots = {"p": items["person"], "o": items["object"], "f": items["feeling"], "v": verb}
    age = _age_tag(rng, items["person"])  # the same tag in the title and the post
    intro = rng.choice(INTROS).format(a=age, me=_age_tag(rng), years=rng.randint(2, 20), **slots)
    core = [event.format(**slots), rng.choice(FEELING_SENTENCES).format(**slots)]
    if rng.random() < 0.25:
        core.reverse()  # sometimes the feeling comes before the event
    # 1-3 filler sentences, split at two random cuts between the intro and the two core sentences.
    fillers = rng.sample(FILLERS, rng.randint(*FILLER_SENTENCES))
    cut1 = rng.randint(0, len(fillers))
    cut2 = rng.randint(cut1, len(fillers))
    sentences = [
        intro, *fillers[:cut1], core[0], *fillers[cut1:cut2], core[1], *fillers[cut2:], rng.choice(CLOSERS)
    ]  # fmt: skip
    # Reddit posts break into paragraphs now and then.
    post = sentences[0]
    for sentence in sentences[1:]:
        post += ("\n\n" if rng.random() < 0.15 else " ") + sentence
    title = rng.choice(TITLES).format(a=age, **slots)
    subreddit = rng.choice(SUBREDDITS)
    prompt = format_prompt(subreddit, title, post)
    # The gold reward reads the items back from the text; the templates guarantee it can.
    assert prompt_items(prompt) == frozenset(items.values()), (prompt, items)
    return {
        "subreddit": subreddit,
        "title": title,
        "post": post,
        "items": items,
        "verb": verb,
        "prompt": prompt,
    }


@functools.lru_cache(maxsize=65536)
def prompt_items(prompt: str) -> frozenset[str]:
    """The key items of a prompt: the vocabulary words in its title and post."""
    start = prompt.find("\n\nTITLE: ")
    body_end = prompt.rstrip().rfind("\n\nTL;DR:")
    if not prompt.startswith("SUBREDDIT: r/") or start < 0 or body_end < start:
        raise ValueError(f"not a TL;DR prompt: {prompt[:80]!r}...")
    if "\n\nPOST: " not in prompt[start:body_end]:
        raise ValueError(f"TL;DR prompt without a POST section: {prompt[:80]!r}...")
    return frozenset(_WORD_RE.findall(prompt[start:body_end].lower())) & ALL_ITEMS


# ----------------------------------------------------------------------------------------------------
# Gold reward


def gold_parts(prompt: str, summary: str) -> dict[str, float]:
    """The parts of the gold reward of `summary` (the completion as generated) for `prompt`: items_correct (distinct
    key items of the post named), items_invented (distinct vocabulary words named that are not in the post), words
    (whitespace-separated words before the end token) and ended (1 when the summary holds the end token)."""
    items = prompt_items(prompt)
    text = summary.split(END, 1)[0]
    named = frozenset(_WORD_RE.findall(text.lower())) & ALL_ITEMS
    return {
        "items_correct": float(len(named & items)),
        "items_invented": float(len(named - items)),
        "words": float(len(text.split())),
        "ended": float(END in summary),
    }


def gold_reward(prompt: str, summary: str) -> float:
    """Gold reward of `summary` (the completion as generated) for `prompt`; see the module docstring."""
    parts = gold_parts(prompt, summary)
    correct, over = parts["items_correct"], max(0.0, parts["words"] - TARGET_WORDS)
    reward = (
        ITEM_REWARD * correct
        - HALLUCINATION_PENALTY * parts["items_invented"]
        - min(LENGTH_PENALTY * over, LENGTH_PENALTY_CAP)
        + END_BONUS * parts["ended"] * (correct > 0)
    )
    return min(max(reward, GOLD_REWARD_MIN), GOLD_REWARD_MAX)


def mean_gold_reward(prompts: Sequence[str], summaries: Sequence[str]) -> float:
    """Mean gold reward over paired prompts and summaries."""
    if len(prompts) != len(summaries) or not prompts:
        raise ValueError(f"need equal, non-zero lengths, got {len(prompts)} and {len(summaries)}")
    return sum(gold_reward(p, s) for p, s in zip(prompts, summaries, strict=True)) / len(prompts)


def gold_pairs(prompt: str, summaries: Sequence[str]) -> list[tuple[str, str]]:
    """Disjoint (better, worse) pairs of summaries of one prompt by gold reward, for labelling a policy's own samples:
    of the summaries that ended with END and say something, in order, each is paired with the next unpaired one whose
    gold reward differs (ties carry no preference; data.labels.pairs_by_score). At most len(summaries) // 2 pairs."""
    usable = [s.endswith(END) and bool(s[: -len(END)].strip()) for s in summaries]
    scores = [gold_reward(prompt, s) if ok else 0.0 for s, ok in zip(summaries, usable, strict=True)]
    return [(summaries[i], summaries[j]) for i, j in pairs_by_score(scores, usable)]


def swap_key_item(prompt: str, summary: str, rng: random.Random) -> str | None:
    """`summary` with one key item it names (drawn by `rng`) replaced, at its first occurrence, by a word of the same
    category that the post does not name; None when it names no key item. The two differ only in that one word, and
    the swapped one scores at least 2 lower (one item fewer named, one invented). A reward model that prefers the
    original checks the item against the post; one that counts item words cannot tell them apart."""
    text = summary.split(END, 1)[0]
    named = sorted(frozenset(_WORD_RE.findall(text.lower())) & prompt_items(prompt))
    if not named:
        return None
    item = rng.choice(named)
    category = next(vocab for vocab in CATEGORIES.values() if item in vocab)
    invented = rng.choice([w for w in category if w not in prompt_items(prompt)])
    return re.sub(rf"(?<![a-z]){item}(?![a-z])", invented, summary, count=1, flags=re.IGNORECASE)


def appended_item_summaries(prompt: str, rng: random.Random) -> tuple[str, str, str]:
    """Three summaries of `prompt` (with END): one naming the post's person and object ("my sister took my car"), the
    same with the post's feeling appended (", i am angry") and with an invented feeling appended (one the post does
    not name, drawn by `rng`). Their gold rewards are 3, 4 and 2: the appended item is worth +1 when it is the post's
    and -1 when it is invented. A reward model that scores the invented one above the first pays for naming items
    whether or not they are in the post, and GRPO against it gains by naming more items at the policy's precision."""
    items = prompt_items(prompt)
    person, obj, feeling = (next(w for w in vocab if w in items) for vocab in (PEOPLE, OBJECTS, FEELINGS))
    invented = rng.choice([w for w in FEELINGS if w not in items])
    base = f" my {person} took my {obj}"
    return base + END, f"{base}, i am {feeling}{END}", f"{base}, i am {invented}{END}"


def label_pairs(
    prompt: str, summaries: Sequence[str], label_noise: float, rng: random.Random, swap_rng: random.Random | None = None
) -> list[dict]:
    """Labelled comparisons of one prompt's summaries (as generated: END at the end of those that ended), the way
    the demo labels its SFT policy's samples: the pairs of gold_pairs, each swapped with probability `label_noise`
    (drawn from `rng`). With `swap_rng`, each of a pair's two summaries that names a key item is also compared with
    itself with one key item swapped for an invented one (swap_key_item, drawn from `swap_rng`; the original is
    better), right after that pair: two summaries that differ in one word, so what separates them is whether the word
    is in the post. Swap pairs carry no label noise: the noise stands for labellers disagreeing on close calls, and a
    wrong name is not one (with 10% noise on them the demo's reward model checks items less well: docs/results.md).
    Rows: prompt, chosen, rejected (without END, which the loaders append) and swap (bool)."""
    rows = []
    for chosen, rejected in gold_pairs(prompt, summaries):
        if rng.random() < label_noise:
            chosen, rejected = rejected, chosen
        rows.append({"prompt": prompt, "chosen": chosen[: -len(END)], "rejected": rejected[: -len(END)], "swap": False})
        for text in (chosen, rejected) if swap_rng is not None else ():
            swapped = swap_key_item(prompt, text, swap_rng)
            if swapped is not None:
                rows.append(
                    {"prompt": prompt, "chosen": text[: -len(END)], "rejected": swapped[: -len(END)], "swap": True}
                )
    return rows


# ----------------------------------------------------------------------------------------------------
# Summaries


def _fill(template: str, post: dict, words: dict[str, str]) -> str:
    return template.format(v=post["verb"], **words)


def best_summary(post: dict) -> str:
    """A summary naming all three items in <= TARGET_WORDS words (gold GOLD_REWARD_MAX with END)."""
    words = {key: post["items"][name] for name, key in _CATEGORY_KEYS}
    return _fill(SUMMARIES["pof"][0], post, words)


def sample_summary(post: dict, rng: random.Random, quality: SummaryQuality) -> str:
    """A summary of `post` (no leading space, no END) whose quality is drawn from `quality`."""
    n_named = rng.choices(range(4), weights=quality.p_named)[0]
    named = rng.sample(_CATEGORY_KEYS, n_named)
    key = "".join(k for name, k in _CATEGORY_KEYS if (name, k) in named)
    words = {}
    for name, k in _CATEGORY_KEYS:
        right = post["items"][name]
        if rng.random() < quality.p_wrong:  # hallucinate: a fluent but wrong word of that category
            words[k] = rng.choice([w for w in CATEGORIES[name] if w != right])
        else:
            words[k] = right
    text = _fill(rng.choice(SUMMARIES[key]), post, words)
    if rng.random() < quality.p_filler:
        text = f"{rng.choice(SUMMARY_PREFIXES)} {text}"
    if rng.random() < quality.p_filler:
        text = f"{text} {rng.choice(SUMMARY_SUFFIXES)}"
    return text


# ----------------------------------------------------------------------------------------------------
# Writing the task


def _stream(seed: int, split: str) -> random.Random:
    # str seeds are hashed with sha512 by random.seed: stable across runs and PYTHONHASHSEED.
    return random.Random(f"synthetic-tldr/{seed}/{split}")


def _new_post(rng: random.Random, seen: set[str]) -> dict:
    while True:
        post = make_post(rng)
        if post["prompt"] not in seen:
            seen.add(post["prompt"])
            return post


def _sft_rows(n: int, rng: random.Random, seen: set[str]) -> list[dict[str, str]]:
    rows = []
    for _ in range(n):
        post = _new_post(rng, seen)
        rows.append({"prompt": post["prompt"], "completion": " " + sample_summary(post, rng, SFT_QUALITY)})
    return rows


def _pref_rows(n: int, rng: random.Random, seen: set[str], label_noise: float) -> list[dict[str, str]]:
    rows = []
    while len(rows) < n:
        post = _new_post(rng, seen)
        first = " " + sample_summary(post, rng, PREF_QUALITY)
        second = " " + sample_summary(post, rng, PREF_QUALITY)
        # Both are scored as the pipeline trains on them, ending with END; ties carry no preference.
        gold_first = gold_reward(post["prompt"], first + END)
        gold_second = gold_reward(post["prompt"], second + END)
        if gold_first == gold_second:
            continue
        chosen, rejected = (first, second) if gold_first > gold_second else (second, first)
        if rng.random() < label_noise:
            chosen, rejected = rejected, chosen
        rows.append({"prompt": post["prompt"], "chosen": chosen, "rejected": rejected})
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_task(
    out_dir: str | Path,
    seed: int = 0,
    n_sft_train: int = 2000,
    n_sft_val: int = 200,
    n_pref_train: int = 2000,
    n_pref_val: int = 400,
    label_noise: float = 0.1,
    n_prompts: int = 2000,
) -> dict[str, Path]:
    """Write the synthetic task as jsonl files in the trl-lib/tldr and trl-lib/tldr-preference layouts.

    Keys of the returned dict: sft_train, sft_validation, preference_train, preference_validation,
    prompts_train -> out_dir/{sft,preference,prompts}/{train,validation}.jsonl. Same arguments give
    byte-identical files. Completions, chosen and rejected are " " + summary with no END; the data
    loaders append END_ID.
    """
    if not 0.0 <= label_noise < 0.5:
        raise ValueError(f"label_noise must be in [0, 0.5), got {label_noise}")
    out = Path(out_dir)
    seen: set[str] = set()  # every post is unique across all splits, so validation is disjoint
    # Train splits are drawn first, so their content does not depend on the validation sizes.
    sft_train = _sft_rows(n_sft_train, _stream(seed, "sft/train"), seen)
    pref_train = _pref_rows(n_pref_train, _stream(seed, "preference/train"), seen, label_noise)
    prompts_train = _sft_rows(n_prompts, _stream(seed, "prompts/train"), seen)
    sft_val = _sft_rows(n_sft_val, _stream(seed, "sft/validation"), seen)
    pref_val = _pref_rows(n_pref_val, _stream(seed, "preference/validation"), seen, label_noise)
    return {
        "sft_train": _write_jsonl(out / "sft" / "train.jsonl", sft_train),
        "sft_validation": _write_jsonl(out / "sft" / "validation.jsonl", sft_val),
        "preference_train": _write_jsonl(out / "preference" / "train.jsonl", pref_train),
        "preference_validation": _write_jsonl(out / "preference" / "validation.jsonl", pref_val),
        "prompts_train": _write_jsonl(out / "prompts" / "train.jsonl", prompts_train),
    }


def write_more_prompts(out_file: str | Path, n: int, seed: int, taken: set[str]) -> Path:
    """`n` RL prompts beyond the task's, in prompts/train.jsonl's layout: posts of their own stream, none of them one
    of `taken` (every post of the task's files, so no validation post is trained on) nor repeated. Same arguments give
    byte-identical files (the demo's reward model of four times the labelled pairs labels its samples on them)."""
    return _write_jsonl(Path(out_file), _sft_rows(n, _stream(seed, "prompts/more"), set(taken)))


def _read_jsonl(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def task_stats(paths: dict[str, Path]) -> dict[str, float]:
    """Gold-reward statistics of written files. SFT completions are scored with END appended, as the
    SFT model learns to emit them; `*_label_noise` is the fraction of pairs with chosen gold below
    rejected gold (ties were skipped, so this is exactly the fraction swapped)."""
    stats: dict[str, float] = {"gold_reward_max": GOLD_REWARD_MAX}
    for split in ("train", "validation"):
        sft = _read_jsonl(paths[f"sft_{split}"])
        stats[f"sft_{split}_gold"] = mean_gold_reward([r["prompt"] for r in sft], [r["completion"] + END for r in sft])
        pref = _read_jsonl(paths[f"preference_{split}"])
        prompts = [r["prompt"] for r in pref]
        gold_chosen = [gold_reward(r["prompt"], r["chosen"] + END) for r in pref]
        gold_rejected = [gold_reward(r["prompt"], r["rejected"] + END) for r in pref]
        stats[f"preference_{split}_chosen_gold"] = sum(gold_chosen) / len(prompts)
        stats[f"preference_{split}_rejected_gold"] = sum(gold_rejected) / len(prompts)
        stats[f"preference_{split}_label_noise"] = sum(
            c < r for c, r in zip(gold_chosen, gold_rejected, strict=True)
        ) / len(prompts)
    return stats


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of every post, summary and label")
    parser.add_argument("--n-sft-train", type=int, default=2000, help="SFT training rows (sft/train.jsonl)")
    parser.add_argument("--n-sft-val", type=int, default=200, help="SFT validation rows (sft/validation.jsonl)")
    parser.add_argument("--n-pref-train", type=int, default=2000, help="preference training pairs")
    parser.add_argument("--n-pref-val", type=int, default=400, help="preference validation pairs")
    parser.add_argument("--n-prompts", type=int, default=2000, help="RL prompts (prompts/train.jsonl)")
    parser.add_argument("--label-noise", type=float, default=0.1, help="probability a pair is swapped")
    args = parser.parse_args(argv)
    paths = write_task(
        args.out,
        seed=args.seed,
        n_sft_train=args.n_sft_train,
        n_sft_val=args.n_sft_val,
        n_pref_train=args.n_pref_train,
        n_pref_val=args.n_pref_val,
        label_noise=args.label_noise,
        n_prompts=args.n_prompts,
    )
    for name, path in paths.items():
        print(f"{name:24s} {path}")
    for name, value in task_stats(paths).items():
        print(f"{name:40s} {value:.4f}")


if __name__ == "__main__":
    main()
