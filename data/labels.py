"""The rule that turns a labeller's scores of one prompt's summaries into preference pairs: the embedded task's gold
function (data.synthetic.gold_pairs) and a gold reward model (evaluation/label_pairs.py) both label through it."""

from collections.abc import Sequence


def pairs_by_score(scores: Sequence[float], usable: Sequence[bool]) -> list[tuple[int, int]]:
    """Disjoint (chosen, rejected) index pairs of one prompt's summaries by their labeller's scores: of the usable
    summaries, in order, each is paired with the next unpaired one whose score differs, the higher score chosen.
    Equal scores carry no preference, so a summary is never paired with one that ties it; once every summary left
    ties the first one left, no more pairs. At most len(scores) // 2 pairs; an unusable summary's score is not read.

    Example: scores [1, 1, 0, 2] all usable -> [(0, 2), (3, 1)]: 0 skips its tie 1 and pairs with 2; then 1 with 3."""
    if len(scores) != len(usable):
        raise ValueError(f"pairs_by_score: {len(scores)} scores, {len(usable)} usable flags")
    left = [i for i, ok in enumerate(usable) if ok]
    pairs = []
    while left:
        a, rest = left[0], left[1:]
        b = next((j for j in rest if scores[j] != scores[a]), None)
        if b is None:
            break  # every summary left ties a
        left = [j for j in rest if j != b]
        pairs.append((a, b) if scores[a] > scores[b] else (b, a))
    return pairs
