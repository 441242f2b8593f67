"""A verdict's report: its record, small enough to commit (verdict_record.json: what the decisions, the dose's trend,
the tables and the pictures need, without the per-post values of the runs), and the words read from it: the rows'
family-wise decisions (evaluation.matched decide_rows), a dose along beta_rs read as one trend with seeds as blocks
(rlhf.stats.dose_trend) at each row's matched KL and at the common KL, and verdict.md's text. experiments/verdict.py
writes the record after each round of seeds; `python -m evaluation.plots --verdict DIR` and `report` rebuild the
pictures and the tables from it alone, so a new margin or a new statistic on an old grid needs no retraining.
"""

import json
import math
from pathlib import Path

import torch

from evaluation.matched import BEST_OF_N, decide_rows, verdict_table
from rlhf.stats import dose_trend
from utils.logging import read_rows

RECORD = "verdict_record.json"
"""The record's file in the verdict's folder, beside verdict.md."""


def spent(rows: list[dict]) -> list[dict]:
    """At each evaluation of a run's metrics.jsonl rows: its step, the tokens generated and the seconds spent in
    training up to it (summed over the steps before it: perf/tokens_per_second x perf/step_seconds, GRPO's sampled
    tokens; a stage that samples nothing in training, DPO, has none) and eval/gold."""
    tokens = seconds = 0.0
    out = []
    for r in rows:
        step_seconds = r.get("perf/step_seconds", 0.0)
        seconds += step_seconds
        tokens += step_seconds * r.get("perf/tokens_per_second", 0.0) if "reward/mean" in r else 0.0
        if "eval/gold" in r:
            out.append({"step": r["step"], "tokens": tokens, "seconds": seconds, "gold": r["eval/gold"]})
    return out


def arm_options(runs: dict[str, list[Path]]) -> dict[str, dict | None]:
    """Each arm's options that can change a result (evaluation.compare result_options of its first run's
    config.json; None without one): what dose_points compares."""
    from evaluation.compare import IGNORED, result_options

    out = {}
    for arm, dirs in runs.items():
        path = next((d / "config.json" for d in dirs if (d / "config.json").is_file()), None)
        out[arm] = result_options(json.loads(path.read_text()), IGNORED) if path else None
    return out


def dose_points(rows: list[dict], options: dict[str, dict | None]) -> dict[str, list[tuple[float, dict]]]:
    """The verdict's rows along beta_rs: for each arm B that rows compare other arms against (best-of-n aside), the
    rows A - B whose A differs from B only in its selection and beta_rs (`options`, arm_options) with A's selection
    rso (x: its beta_rs) or top (x: 0, the limit beta_rs -> 0), as (x, row) in order of x; B, when it is uniform
    selection, is the limit beta_rs -> infinity. Only arms B with two or more such rows."""
    doses: dict[str, list[tuple[float, dict]]] = {}
    for r in rows:
        a, b = options.get(r["a"]), options.get(r["b"]) if r["b"] != BEST_OF_N else None
        if a is None or b is None or "note" in r or a.get("selection") not in ("rso", "top"):
            continue
        changed = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        if changed <= {"selection", "beta_rs"}:
            doses.setdefault(r["b"], []).append((0.0 if a["selection"] == "top" else float(a["beta_rs"]), r))
    return {b: sorted(points, key=lambda p: p[0]) for b, points in doses.items() if len(points) >= 2}


def dose_trends(points: list[tuple[float, dict]], confidence: float = 0.95) -> dict:
    """One trend over a dose (dose_points' rows of one arm B, in order of beta_rs): each seed's differences A - B on
    the dose's rank (0 for the smallest beta_rs, top's 0 first; ranks need no finite stand-in for beta_rs = 0, which
    log beta_rs would), seeds as blocks (rlhf.stats.dose_trend, with the exact sign-flip p), at each row's own matched
    KL ("matched", its seed_differences) and at the common KL ("common", seed_differences_common, when every row was
    read there). The seeds are the first S every row has; a trend needs two. {"ranks", "arms", "matched", "common"},
    each trend None where it cannot be read (and "why")."""
    rows = [r for _, r in points]
    ranks = list(range(len(rows)))
    out = {"ranks": ranks, "arms": [r["a"] for r in rows], "matched": None, "common": None}
    if not all("seed_differences" in r for r in rows):
        return out | {"why": "rows written before verdict_rows kept each seed's difference"}
    S = min(len(r["seed_differences"]) for r in rows)
    if S < 2:
        return out | {"why": f"{S} seed: a trend over seeds needs two"}
    for name, key in (("matched", "seed_differences"), ("common", "seed_differences_common")):
        if all(key in r for r in rows):
            differences = [[r[key][s] for r in rows] for s in range(S)]
            out[name] = dose_trend(torch.tensor(differences, dtype=torch.float64), ranks, confidence, S <= 20)
    return out


def trend_text(
    against: str, points: list[tuple[float, dict]], trend: dict, key: str = "gold", confidence: float = 0.95
) -> str:
    """verdict.md's lines for one dose: its arms and ranks, and the trend at each KL it was read at."""
    arms = ", ".join(
        f"{a} ({'top: 0' if x == 0 else f'beta_rs {x:g}'}) rank {k}"
        for (x, _), a, k in zip(points, trend["arms"], trend["ranks"], strict=True)
    )
    text = (
        f"Dose along beta_rs against {against} (each A - {against}; {against} itself, beta_rs -> infinity when "
        f"uniform, is what the differences are taken against, not a point of the fit): {arms}. One trend over the "
        "dose, seeds as blocks (rlhf.stats.dose_trend: each seed's least-squares slope on the rank, their mean, t on "
        f"S - 1 df; sign-flip p exact over the seeds), in {key} per rank step:"
    )
    return text + trend_lines(points, trend, confidence)


def order_trend_text(points: list[tuple[int, dict]], trend: dict, key: str = "gold", confidence: float = 0.95) -> str:
    """verdict.md's lines for one of the file's trends (`trends`): its pairs and ranks, and the trend at each KL."""
    pairs = ", ".join(f"{r['a']} - {r['b']} rank {k}" for k, r in points)
    text = (
        f"Trend over the file's order: {pairs}. One trend, seeds as blocks (rlhf.stats.dose_trend: each seed's "
        f"least-squares slope of its differences on the rank, their mean, t on S - 1 df; sign-flip p exact over the "
        f"seeds), in {key} per rank step:"
    )
    return text + trend_lines(points, trend, confidence)


def trend_lines(points: list[tuple[float, dict]], trend: dict, confidence: float) -> str:
    """A trend's lines (dose_trends), at each row's matched KL and at the common KL."""
    if "why" in trend:
        return f" not read, {trend['why']}."
    text = ""
    for name, where in (("matched", "at each row's matched KL"), ("common", "at the common KL")):
        t = trend[name]
        if t is None:
            text += f"\n- {where}: not read (a row was not read there)"
            continue
        kl = f" {points[0][1]['kl_common']:.3f}" if name == "common" else ""
        text += (
            f"\n- {where}{kl}: slope {t['slope']:+.4f} [{t['ci_low']:+.4f}, {t['ci_high']:+.4f}] ({confidence:.0%} t "
            f"interval, {t['seeds']} seeds), p {t['p']:.3g}, sign-flip p {t.get('p_sign_flip', math.nan):.3g}"
        )
    return text


def verdict_record(
    curve: list[dict],
    methods: dict[str, list[list[dict]]],
    rows: list[dict],
    runs: dict[str, list[Path]],
    *,
    rounds: int,
    primary: list[tuple[str, str]] | None,
    margin: float,
    trends: list[list[tuple[str, str]]] = (),
    key: str = "gold",
    confidence: float = 0.95,
    tables: str = "",
) -> dict:
    """The record of a verdict (RECORD): best-of-n's points and each arm's evaluations per seed (step, mean KL, mean
    gold and their errors: everything but the per-post values), each arm's compute at every evaluation (spent, from
    its runs' metrics), its options (arm_options: what dose_points compares), the rows undecided (verdict_rows: per
    pair its difference, se and df with seeds, and per seed the matched KL, the mean difference over posts and its
    variance over posts, at the common KL too), the primary pairs, the margin, the file's trends (each an ordered
    list of pairs), the round of seeds it was written after
    (`rounds` in all) and the tables that need the runs (the frontier's, the selection's diagnostics) as text."""

    def strip(points: list[dict]) -> list[dict]:
        return [{k: v for k, v in p.items() if k != "posts"} for p in points]

    posts = len(curve[0]["posts"][key]) if curve and "posts" in curve[0] else None
    config = next((d / "config.json" for dirs in runs.values() for d in dirs if (d / "config.json").is_file()), None)
    return {
        "key": key,
        "confidence": confidence,
        "margin": margin,
        "primary": [list(p) for p in primary] if primary is not None else None,
        "trends": [[list(p) for p in trend] for trend in trends],
        "round": min((len(seeds) for seeds in methods.values()), default=0),
        "rounds": rounds,
        "posts": posts,
        "samples": json.loads(config.read_text()).get("frontier_samples") if config else None,
        "best_of_n": strip(curve),
        "methods": {arm: [strip(points) for points in seeds] for arm, seeds in methods.items()},
        "compute": {arm: [spent(list(read_rows(d / "metrics.jsonl"))) for d in dirs] for arm, dirs in runs.items()},
        "options": arm_options(runs),
        "rows": [{k: v for k, v in r.items() if k != "distinguishable"} for r in rows],
        "tables": tables,
    }


def write_record(folder: Path, record: dict) -> Path:
    path = Path(folder) / RECORD
    path.write_text(json.dumps(record, indent=None, separators=(",", ":")) + "\n")
    return path


def read_record(folder: Path) -> dict:
    """The record in a verdict folder; FileNotFoundError naming it when absent."""
    path = Path(folder) / RECORD
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; demo.py --verdict and verdict.py write it after each seed round")
    return json.loads(path.read_text())


def decided_rows(record: dict) -> list[dict]:
    """The record's rows with their family-wise decisions (decide_rows) under its primary pairs and margin."""
    return decide_rows(record["rows"], record["primary"], record["margin"], record["confidence"])


def report(record: dict) -> tuple[str, list[dict]]:
    """verdict.md's text and the decided rows, from the record alone: whether the table is interim (written after a
    round of seeds before the last: a look at accumulating data, not a result) or final; the rows' table
    (verdict_table); which rows form each family; each dose's trend (dose_points, dose_trends); the tables that
    needed the runs."""
    rows, key, confidence = decided_rows(record), record["key"], record["confidence"]
    done, rounds = record["round"], record["rounds"]
    if done >= rounds:
        status = f"Final: after the last round of seeds, every arm's {rounds} seed{'s' if rounds > 1 else ''}."
    else:
        status = (
            f"Interim: after round {done} of {rounds} of seeds, a look at accumulating data; the decisions are read "
            f"from the final table, written after round {rounds}."
        )
    primary = "the file's primary pairs, adjusted among themselves; the other pairs as an exploratory family"
    families = (
        f"Decisions at {1 - confidence:.0%} family-wise (Holm within each family): the verdict's pairs form one "
        f"family ({primary if record['primary'] is not None else 'all of them'}); each arm against best-of-n forms "
        f'another. "different": adjusted p < {1 - confidence:g}; "equal": the {1 - 2 * (1 - confidence):.0%} '
        f'interval inside ±{record["margin"]:g} (two one-sided tests, each row its own claim); "undecided": neither. '
        "Each row is read at its own matched KL; pairs between arms also at the common KL, the smallest final KL "
        "every arm of the pairs reaches."
    )
    text = f"{status}\n\n{verdict_table(rows, key, confidence)}\n\n{families}"
    for against, points in dose_points(rows, record["options"]).items():
        text += "\n\n" + trend_text(against, points, dose_trends(points, confidence), key, confidence)
    for trend in record.get("trends", []):
        points = [(k, r) for k, (a, b) in enumerate(trend) for r in rows if (r["a"], r["b"]) == (a, b)]
        if len(points) == len(trend):  # every pair read (a verdict cut short may lack an arm)
            text += "\n\n" + order_trend_text(points, dose_trends(points, confidence), key, confidence)
    return text + (f"\n\n{record['tables']}" if record["tables"] else ""), rows
