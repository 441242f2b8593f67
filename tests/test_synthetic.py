"""The synthetic TL;DR task: layout, determinism, the gold reward worked by hand, label noise, headroom."""

import json
import random
import re
from pathlib import Path

import pytest

from data import synthetic
from data.synthetic import (
    END,
    GOLD_REWARD_MAX,
    format_prompt,
    gold_pairs,
    gold_parts,
    gold_reward,
    make_post,
    prompt_items,
    write_task,
)
from data.tokenizer import END_ID, get_tokenizer

# A hand-made prompt whose key items are sister, car and angry.
PROMPT = format_prompt(
    "relationships",
    "My sister (27F) sold my car",
    "So my sister lives about an hour away from me. A few days ago my sister sold my car while I was "
    "away at work. Now I feel angry every time I think about it. What should I do?",
)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    return write_task(tmp_path_factory.mktemp("synthetic"), seed=0)  # default sizes, noise 0.1


# ----------------------------------------------------------------------------------------------------
# Vocabulary and posts


def test_vocabulary_words_are_single_tokens_and_categories_disjoint():
    tok = get_tokenizer()
    words = [w for vocab in synthetic.CATEGORIES.values() for w in vocab]
    assert len(words) == len(set(words)) == len(synthetic.ALL_ITEMS)
    for word in words:
        assert len(tok.encode_ordinary(" " + word)) == 1, word


def test_prompt_items_recovers_the_drawn_items():
    rng = random.Random(123)
    for _ in range(500):
        post = make_post(rng)
        assert prompt_items(post["prompt"]) == frozenset(post["items"].values())
        assert post["prompt"] == format_prompt(post["subreddit"], post["title"], post["post"])
    assert prompt_items(PROMPT) == {"sister", "car", "angry"}


def test_prompt_items_rejects_a_prompt_in_another_layout():
    with pytest.raises(ValueError):
        prompt_items("Summarize: my sister sold my car.\n\nTL;DR:")


# ----------------------------------------------------------------------------------------------------
# Gold reward, worked by hand: 1 per item named - 1 per wrong item - 0.25 per word over 8 (cap 2)
# + 1 for the end token when at least one item is named, clipped to [-3, 4].


def test_gold_reward_by_hand():
    # 8 words, all 3 items, ended: 3 + 1.
    assert gold_reward(PROMPT, " my sister sold my car, i am angry\n") == 4.0 == GOLD_REWARD_MAX
    # No end token: the model never stopped.
    assert gold_reward(PROMPT, " my sister sold my car, i am angry") == 3.0
    # "brother" is not in the post: 2 right - 1 wrong + 1 ended.
    assert gold_reward(PROMPT, " my brother sold my car, i am angry\n") == 2.0
    # 10 words: 2 over the target, -0.5.
    assert gold_reward(PROMPT, " my sister sold my car and now i am angry\n") == 3.5
    # 17 words: 9 over, penalty 2.25 capped at 2.
    long = " my sister sold my car and i am angry and i do not know what to do\n"
    assert gold_reward(PROMPT, long) == 2.0
    # Naming an item twice counts once; matching ignores case and punctuation.
    assert gold_reward(PROMPT, " Sister, sister, SISTER!\n") == 2.0
    # Text after the first end token was never part of the summary.
    assert gold_reward(PROMPT, " my sister\n car angry") == 2.0
    # No key item: no end bonus. Stopping at once, a generic summary and an empty one all earn 0.
    assert gold_reward(PROMPT, "\n") == gold_reward(PROMPT, " need advice\n") == gold_reward(PROMPT, "") == 0.0
    # An invented item and no right one: -1, ended or not.
    assert gold_reward(PROMPT, " my brother is annoying\n") == gold_reward(PROMPT, " my brother is annoying") == -1.0
    # Clipped below: 4 wrong items, 9 words (1 over), no end token = -4.25 -> -3.
    assert gold_reward(PROMPT, " my brother dog sad mom and lots of words") == -3.0


def test_gold_parts_by_hand():
    assert gold_parts(PROMPT, " my brother sold my car, i am angry\n") == {
        "items_correct": 2.0,
        "items_invented": 1.0,
        "words": 8.0,
        "ended": 1.0,
    }
    assert gold_parts(PROMPT, " Sister, sister\n car dog") == {
        "items_correct": 1.0,
        "items_invented": 0.0,
        "words": 2.0,
        "ended": 1.0,
    }
    assert gold_parts(PROMPT, "") == {"items_correct": 0.0, "items_invented": 0.0, "words": 0.0, "ended": 0.0}


def test_gold_pairs_by_hand():
    best = " my sister sold my car, i am angry\n"  # gold 4
    two = " my sister sold my car\n"  # 2 items + end: 3
    wrong = " my brother is annoying\n"  # -1
    # In order: best pairs with the next that differs (two), then wrong with the one left that differs (two again).
    assert gold_pairs(PROMPT, [best, two, wrong, two]) == [(best, two), (two, wrong)]
    # Ties carry no preference; what did not end or says nothing is never paired.
    assert gold_pairs(PROMPT, [best, best, best]) == []
    assert gold_pairs(PROMPT, [best, " my sister sold my car", "\n", " \n", wrong]) == [(best, wrong)]
    # The worse one may come first; at most len // 2 disjoint pairs.
    assert gold_pairs(PROMPT, [wrong, best, two, best]) == [(best, wrong), (best, two)]


def test_label_pairs_by_hand():
    best, two, wrong = " my sister sold my car, i am angry\n", " my sister sold my car\n", " my brother is annoying\n"
    plain = synthetic.label_pairs(PROMPT, [best, two, wrong, two], 0.0, random.Random(0))
    assert [(r["chosen"], r["rejected"], r["swap"]) for r in plain] == [
        (best[:-1], two[:-1], False),
        (two[:-1], wrong[:-1], False),
    ]
    # every pair flipped at noise ~1; swap pairs follow their pair, never flipped, for each summary naming a key item
    rows = synthetic.label_pairs(PROMPT, [best, two, wrong, two], 0.999999, random.Random(0), random.Random(0))
    assert [r["swap"] for r in rows] == [False, True, True, False, True]  # "wrong" names no key item: no swap pair
    assert (rows[0]["chosen"], rows[0]["rejected"]) == (two[:-1], best[:-1])
    for pair, swap in ((rows[0], rows[1]), (rows[0], rows[2]), (rows[3], rows[4])):
        original = swap["chosen"]
        assert original in (pair["chosen"], pair["rejected"]) and swap["prompt"] == PROMPT
        assert sum(a != b for a, b in zip(original.split(), swap["rejected"].split(), strict=True)) == 1
        assert gold_reward(PROMPT, swap["rejected"] + "\n") <= gold_reward(PROMPT, original + "\n") - 2
    assert {rows[1]["chosen"], rows[2]["chosen"]} == {best[:-1], two[:-1]}


def test_no_summary_without_a_key_item_beats_the_sft_data(task):
    """Whatever a summary without a key item does (stop at once, stay short, pad with filler), it scores at most 0;
    the task's SFT summaries score well above that. (tests/test_learning.py checks the same against the demo's
    trained SFT policy.)"""
    stats = synthetic.task_stats(task)
    rng = random.Random(3)
    posts = [make_post(rng) for _ in range(50)]
    generic = ["", "\n", " need advice\n", " not sure what to do\n", " am i overreacting?\n", " please help"]
    generic += [" " + t + END for t in synthetic.SUMMARIES[""]]
    best_without_items = max(gold_reward(p["prompt"], g) for p in posts for g in generic)
    assert best_without_items == 0.0
    assert best_without_items < stats["sft_validation_gold"] - 1.0


def test_best_summary_reaches_the_maximum():
    rng = random.Random(7)
    for _ in range(200):
        post = make_post(rng)
        assert gold_reward(post["prompt"], " " + synthetic.best_summary(post) + END) == GOLD_REWARD_MAX


def test_mean_gold_reward():
    summaries = [" my sister sold my car, i am angry\n", " my brother\n"]
    assert synthetic.mean_gold_reward([PROMPT, PROMPT], summaries) == (4.0 - 1.0) / 2
    with pytest.raises(ValueError):
        synthetic.mean_gold_reward([PROMPT], summaries)


# ----------------------------------------------------------------------------------------------------
# Files


def test_same_seed_same_bytes_different_seed_differs(tmp_path):
    sizes = dict(n_sft_train=50, n_sft_val=20, n_pref_train=50, n_pref_val=20, n_prompts=30)
    a = write_task(tmp_path / "a", seed=3, **sizes)
    b = write_task(tmp_path / "b", seed=3, **sizes)
    c = write_task(tmp_path / "c", seed=4, **sizes)
    assert a.keys() == b.keys() == c.keys()
    for key in a:
        assert a[key].read_bytes() == b[key].read_bytes(), key
        assert a[key].read_bytes() != c[key].read_bytes(), key


def test_files_match_the_tldr_layouts(task):
    expected = {
        "sft_train": ("sft/train.jsonl", ["prompt", "completion"]),
        "sft_validation": ("sft/validation.jsonl", ["prompt", "completion"]),
        "preference_train": ("preference/train.jsonl", ["prompt", "chosen", "rejected"]),
        "preference_validation": ("preference/validation.jsonl", ["prompt", "chosen", "rejected"]),
        "prompts_train": ("prompts/train.jsonl", ["prompt", "completion"]),
    }
    sizes = {"sft_train": 2000, "sft_validation": 200, "preference_train": 2000,
             "preference_validation": 400, "prompts_train": 2000}  # fmt: skip
    assert task.keys() == expected.keys()
    for key, (relative, columns) in expected.items():
        assert task[key].as_posix().endswith(relative)
        rows = read_jsonl(task[key])
        assert len(rows) == sizes[key]
        for row in rows:
            assert list(row) == columns
            prompt = row["prompt"]
            assert prompt.startswith("SUBREDDIT: r/") and prompt.endswith("\n\nTL;DR:")
            assert prompt.index("\n\nTITLE: ") < prompt.index("\n\nPOST: ")
            for column in columns[1:]:
                # " " + summary, no end token: the loaders append END_ID.
                assert row[column].startswith(" ") and row[column].strip() == row[column][1:]
                assert "\n" not in row[column]


def test_files_load_with_the_tldr_loader(task):
    from data.tldr import PREF_COLUMNS, SFT_COLUMNS, load_rows

    root = task["sft_train"].parents[1]
    assert load_rows(str(root / "sft"), "validation", SFT_COLUMNS) == read_jsonl(task["sft_validation"])
    assert len(load_rows(str(root / "preference"), "train", PREF_COLUMNS)) == 2000


def test_validation_posts_are_disjoint_from_train(task):
    train = {r["prompt"] for key in ("sft_train", "preference_train", "prompts_train") for r in read_jsonl(task[key])}
    for key in ("sft_validation", "preference_validation"):
        assert not train & {r["prompt"] for r in read_jsonl(task[key])}, key


def test_token_lengths(task):
    tok = get_tokenizer()
    for key, path in task.items():
        rows = read_jsonl(path)
        prompt_lens = [len(ids) for ids in tok.encode_ordinary_batch([r["prompt"] for r in rows])]
        assert max(prompt_lens) < 200, key
        responses = [r[c] for r in rows for c in ("completion", "chosen", "rejected") if c in r]
        # + END_ID, which the loaders append.
        response_lens = [len(ids) + 1 for ids in tok.encode_ordinary_batch(responses)]
        assert max(response_lens) < 24, key
    assert tok.encode_ordinary(END) == [END_ID]


# ----------------------------------------------------------------------------------------------------
# Labels and headroom


def test_realised_label_noise_is_near_the_configured_rate(task):
    stats = synthetic.task_stats(task)
    assert abs(stats["preference_train_label_noise"] - 0.1) < 0.05
    assert abs(stats["preference_validation_label_noise"] - 0.1) < 0.05
    # The label carries signal: chosen is better on average by a wide margin.
    assert stats["preference_train_chosen_gold"] > stats["preference_train_rejected_gold"] + 0.5


def test_without_noise_chosen_always_beats_rejected(tmp_path):
    paths = write_task(tmp_path, seed=1, n_sft_train=10, n_sft_val=10, n_pref_train=500, n_pref_val=10,
                       n_prompts=10, label_noise=0.0)  # fmt: skip
    for row in read_jsonl(paths["preference_train"]):
        assert gold_reward(row["prompt"], row["chosen"] + END) > gold_reward(row["prompt"], row["rejected"] + END)


def test_sft_completions_are_good_but_leave_room_for_rl(task):
    stats = synthetic.task_stats(task)
    for split in ("train", "validation"):
        # Far better than a summary without content (at most 0), clearly below the best achievable (4.0).
        assert 1.5 < stats[f"sft_{split}_gold"] < GOLD_REWARD_MAX - 1.0
    rows = read_jsonl(task["sft_train"])
    n_items = [len(prompt_items(r["prompt"]) & set(re.findall(r"[a-z]+", r["completion"]))) for r in rows]
    # Most summaries name two or three items (there is little room for RL to gain by naming more), but only about
    # half name all three right: the rest leave one out or name a wrong one.
    assert sum(n >= 2 for n in n_items) / len(rows) > 0.8
    assert 0.4 < sum(n == 3 for n in n_items) / len(rows) < 0.65


def test_cli_writes_and_reports(tmp_path, capsys):
    synthetic.main(["--out", str(tmp_path), "--seed", "2", "--n-sft-train", "20", "--n-sft-val", "10",
                    "--n-pref-train", "40", "--n-pref-val", "10", "--n-prompts", "5"])  # fmt: skip
    out = capsys.readouterr().out
    assert str(tmp_path / "preference" / "train.jsonl") in out
    assert "sft_train_gold" in out and "preference_train_label_noise" in out
    assert len(read_jsonl(tmp_path / "prompts" / "train.jsonl")) == 5


def test_appended_item_summaries_differ_by_one_item_worth_plus_or_minus_one():
    rng = random.Random(0)
    base, right, invented = synthetic.appended_item_summaries(PROMPT, rng)
    assert [gold_reward(PROMPT, s) for s in (base, right, invented)] == [3.0, 4.0, 2.0]
    assert right.startswith(base[:-1]) and invented.startswith(base[:-1]) and right != invented
    assert synthetic.gold_parts(PROMPT, invented)["items_invented"] == 1.0
    for seed in range(20):  # twenty random posts: the same three gold rewards
        post = synthetic.make_post(random.Random(seed))
        summaries = synthetic.appended_item_summaries(post["prompt"], rng)
        assert [gold_reward(post["prompt"], s) for s in summaries] == [3.0, 4.0, 2.0]


def test_demo_appended_item_gains_give_the_gold_reward_its_plus_and_minus_one(tmp_path):
    """evaluation.probes.appended_item_gains (the probe of whether the reward model pays for invented items) against
    the gold reward read back from the token ids of the batches it scores: exactly +1 for the post's item, -1 for an
    invented one; a scorer that counts response tokens gains the same for both."""
    import torch

    from evaluation.probes import appended_item_gains

    tok = get_tokenizer()
    rows = [{"prompt": make_post(random.Random(i))["prompt"], "completion": " x"} for i in range(40)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def gold_scores(batch):
        P, ids, mask = batch["prompt_len"], batch["input_ids"], batch["attention_mask"]
        texts = [
            (tok.decode(r[:P][m[:P]].tolist()), tok.decode(r[P:][m[P:]].tolist()))
            for r, m in zip(ids, mask, strict=True)
        ]
        return torch.tensor([gold_reward(prompt, response) for prompt, response in texts])

    assert appended_item_gains(gold_scores, path, 40, seed=0) == {"append_correct": 1.0, "append_invented": -1.0}
    lengths = appended_item_gains(lambda b: b["response_mask"].sum(-1).float(), path, 33, seed=0)
    assert lengths["append_correct"] == lengths["append_invented"] == 4.0  # ",", " i", " am", " <feeling>"


def test_swap_key_item_invents_one_item_in_place_of_a_named_one():
    rng = random.Random(0)
    swapped = synthetic.swap_key_item(PROMPT, " my sister sold my car, i am angry\n", rng)
    before, after = " my sister sold my car, i am angry\n".split(), swapped.split()
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert len(before) == len(after) and len(changed) == 1 and swapped.endswith("\n")
    old, new = (w.strip(",") for w in changed[0])
    assert old in synthetic.prompt_items(PROMPT) and new in synthetic.ALL_ITEMS - synthetic.prompt_items(PROMPT)
    assert any(old in vocab and new in vocab for vocab in synthetic.CATEGORIES.values())  # the same category
    parts = synthetic.gold_parts(PROMPT, swapped)
    assert (parts["items_correct"], parts["items_invented"]) == (2.0, 1.0)
    assert gold_reward(PROMPT, swapped) == gold_reward(PROMPT, " my sister sold my car, i am angry\n") - 2.0
    # the only key item named: the end bonus goes too; a word merely containing an item is left alone
    assert gold_reward(PROMPT, synthetic.swap_key_item(PROMPT, " my sister\n", rng)) == -1.0
    assert synthetic.swap_key_item(PROMPT, " sisterly car stuff\n", random.Random(1)).startswith(" sisterly ")
    assert synthetic.swap_key_item(PROMPT, " need advice\n", rng) is None
