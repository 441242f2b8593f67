"""Best-of-n from a verdict's reference on its posts (experiments/verdict.py's runs are compared with it at matched KL):
`reference_best_of_n` draws it, `kept_best_of_n` keeps it in the verdict's folder with the inputs it was drawn from
(BEST_OF_N), and with --reuse takes it from there while they are the same."""

import hashlib
import json
import time
from pathlib import Path

from experiments.verdict import Measurement
from utils.rundir import write_text_atomic


def reference_best_of_n(
    measured: Measurement, posts: int, best_of: int, pool: int, reading: tuple[str, int], *, seed: int, device="cpu"
) -> list[dict]:
    """Best-of-n from the reference on the first `posts` posts (read as the arms read them: `reading`, split and
    prompt length), ranked by the proxy, scored by the gold: one pool of `pool` samples per post, every n up to
    `best_of` (evaluation.best_of_n.best_of_n); its samples from the stream (seed, "best-of-n")."""
    from data.tokenizer import get_tokenizer
    from evaluation.best_of_n import best_of_n
    from evaluation.measure import load_frontier_prompts
    from model.weights import build_policy, build_reward_model
    from rlhf.rewards import load_function
    from utils.dist import stream

    t0, tok, (split, max_prompt_len) = time.time(), get_tokenizer(), reading
    prompts = load_frontier_prompts(str(measured.data), split, posts, tok, max_prompt_len, measured.max_new_tokens)
    gold_model = build_reward_model(str(measured.gold_model)).to(device).eval() if measured.gold_model else None
    curve = best_of_n(
        build_policy(str(measured.reference)).to(device).eval(),
        prompts,
        build_reward_model(str(measured.proxy)).to(device).eval(),
        tok,
        stream(seed, 0, 0, "best-of-n", device=device),
        measured.max_new_tokens,
        n_max=best_of,
        gold_fn=load_function(measured.gold_fn, "--frontier_gold_fn") if measured.gold_fn else None,
        pool=pool,
        gold_model=gold_model,
    )
    print(f"best-of-n from {measured.reference}, n up to {best_of}: {time.time() - t0:.0f} s", flush=True)
    return curve


BEST_OF_N = "best_of_n.json"
"""What kept_best_of_n writes in the verdict's folder: best-of-n's curve and the inputs it was drawn from."""


def model_fingerprint(name_or_path: str | Path) -> dict:
    """A model by its folder and, for each file in it (weights, config.json, a reward model's normalisation), its size
    and modification time in nanoseconds: a model retrained or exported again at the same path has new files. Not a
    digest of the safetensors header: it holds only names, dtypes, shapes and offsets, the same for a model retrained
    at the same size; not a digest of the weights either: the gold model's would be gigabytes read at every start. A
    name that is no folder (a hub model) is its name alone."""
    folder = Path(name_or_path)
    files = sorted(f for f in folder.iterdir() if f.is_file()) if folder.is_dir() else []
    return {"path": str(name_or_path), "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}


def posts_fingerprint(source: str | Path) -> dict:
    """The posts: a file by the sha256 of its bytes alone, not its path (the embedded task writes its posts again at
    every start and in each verdict's folder, the same rows, so their modification time and place change when they do
    not: a verdict on the same posts may start from another's best_of_n.json copied into its folder); a posts file is
    megabytes, read in milliseconds. A folder or a dataset's name is its name alone."""
    path = Path(source)
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()} if path.is_file() else {"path": str(source)}


def best_of_n_inputs(
    measured: Measurement, posts: int, best_of: int, pool: int, reading: tuple[str, int], *, seed: int, device: str
) -> dict:
    """Everything reference_best_of_n's curve depends on, as JSON reads it back: the three models (or the gold
    function's name), the posts and how they are read, the pool, n, the summaries' length (at temperature 1, which
    evaluation.best_of_n.best_of_n fixes), the seed of its stream and the device it samples on (CPU and CUDA draw
    other samples from the same seed)."""
    split, max_prompt_len = reading
    gold = model_fingerprint(measured.gold_model) if measured.gold_model else {"function": measured.gold_fn}
    return {
        "reference": model_fingerprint(measured.reference),
        "proxy": model_fingerprint(measured.proxy),
        "gold": gold,
        "posts": posts_fingerprint(measured.data) | {"split": split, "count": posts, "max_prompt_len": max_prompt_len},
        "pool": pool,
        "best_of": best_of,
        "max_new_tokens": measured.max_new_tokens,
        "seed": seed,
        "device": str(device),
    }


def kept_best_of_n(
    measured: Measurement,
    posts: int,
    best_of: int,
    pool: int,
    reading: tuple[str, int],
    folder: Path,
    *,
    seed: int,
    device="cpu",
    reuse: bool,
) -> list[dict]:
    """reference_best_of_n's curve, written with its inputs (best_of_n_inputs) to `folder`/BEST_OF_N at once (a run
    killed while writing leaves the old record or none); with `reuse`, the curve written there when its inputs are
    these, instead of drawing it again (on real TL;DR: 400 posts x 256 samples generated and scored by two models)."""
    inputs = best_of_n_inputs(measured, posts, best_of, pool, reading, seed=seed, device=device)
    path = folder / BEST_OF_N
    if reuse:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = {}
        if record.get("inputs") == inputs:
            print(f"reusing best-of-n: {path} (drawn from the same models, posts and options)", flush=True)
            return record["best_of_n"]
    curve = reference_best_of_n(measured, posts, best_of, pool, reading, seed=seed, device=device)
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"inputs": inputs, "best_of_n": curve}) + "\n")
    return curve
