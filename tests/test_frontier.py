"""The reward-KL frontier (evaluation/frontier.py, rlhf/stats.py): the KL estimate against the exact KL of one-token
responses, best-of-n's selection and its KL formula on known rewards, and a tiny `demo.py --frontier_seeds` run."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data.synthetic import write_task
from data.tokenizer import get_tokenizer
from evaluation.frontier import (
    FrontierPrompts,
    best_of_n,
    frontier_points,
    frontier_table,
    measure,
    sequence_logprobs,
)
from evaluation.samples import sample_summaries
from model.gpt2 import PRESETS, GPT2LMHeadModel
from model.heads import RewardModel
from model.weights import save_hf
from rlhf.stats import best_of_n_index, best_of_n_kl, kl_estimate, mean_and_se

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["POST: my cat ate my homework\n\nTL;DR:", "POST: the landlord kept the deposit\n\nTL;DR:", "TL;DR:"]


def two_policies():
    """Two tiny random GPT-2s (different seeds): a policy and a reference whose next-token distributions differ."""
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(PRESETS["tiny"]).eval()
    torch.manual_seed(1)
    reference = GPT2LMHeadModel(PRESETS["tiny"]).eval()
    return policy, reference


@torch.no_grad()
def next_token_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log pi(. | prompt) (V,) from one plain forward of the prompt (no padding, no cache)."""
    ids = torch.tensor([prompt])
    logits = model(ids, torch.arange(len(prompt))[None], None)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return F.log_softmax(logits[0, -1].double(), -1)


def exact_kls(policy, reference, prompts: list[list[int]]) -> torch.Tensor:
    """KL(pi || pi_ref) (P,) of one-token responses: sum over the vocabulary of p (log p - log q)."""
    out = []
    for p in prompts:
        lp, lq = next_token_logprobs(policy, p), next_token_logprobs(reference, p)
        out.append((lp.exp() * (lp - lq)).sum())
    return torch.stack(out)


# ----------------------------------------------------------------------------------------------------
# The statistics, by hand


def test_mean_and_se_by_hand():
    values = torch.tensor([[1.0, 3.0], [2.0, 6.0]])  # within-prompt sample variances 2 and 8
    mean, se = mean_and_se(values)
    assert mean == 3.0
    assert se == pytest.approx(math.sqrt((2.0 + 8.0) / 2) / 2)  # sqrt(sum_p s_p^2 / G) / P
    mean, se = mean_and_se(torch.tensor([[1.0], [3.0], [5.0]]))  # one value per prompt: over prompts
    assert mean == 3.0 and se == pytest.approx(2.0 / math.sqrt(3))
    assert math.isnan(mean_and_se(torch.tensor([[4.0]]))[1])
    with pytest.raises(ValueError, match="prompts, samples"):
        mean_and_se(torch.zeros(3))


def test_kl_estimate_is_the_mean_log_ratio():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    ref = torch.tensor([[-1.5, -2.0], [-1.0, -2.0]])  # log-ratios 0.5, 0, 0.5, -1
    kl, se = kl_estimate(logp, ref)
    assert kl == pytest.approx(0.0)
    assert se == pytest.approx(math.sqrt((0.125 + 1.125) / 2) / 2)
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(logp, ref[:, :1])


# ----------------------------------------------------------------------------------------------------
# The KL estimate against the exact KL of one-token responses


def test_kl_estimate_matches_the_exact_kl_of_one_token_responses():
    """Tokens drawn from the policy's exact next-token distributions after three prompts (the full 50,257-token
    vocabulary): the estimate is within 1e-3 of the exact sum over the vocabulary, and its standard error covers the
    gap."""
    policy, reference = two_policies()
    tok = get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    exact = float(exact_kls(policy, reference, prompts).mean())
    assert exact > 0.01  # the two policies differ: a KL of 0 would make the check empty
    g = torch.Generator().manual_seed(0)
    logp, logq = [], []
    for p in prompts:
        lp, lq = next_token_logprobs(policy, p), next_token_logprobs(reference, p)
        y = torch.multinomial(lp.exp(), 200_000, replacement=True, generator=g)  # (G,) tokens y ~ pi
        logp.append(lp[y])
        logq.append(lq[y])
    kl, se = kl_estimate(torch.stack(logp), torch.stack(logq))
    assert abs(kl - exact) < 1e-3
    assert abs(kl - exact) <= 3 * se
    assert se < 1e-3 / 2


def test_measure_on_one_token_responses_scores_the_sampled_tokens_exactly():
    """The whole measurement (sampling, the policy's and the reference's log-probs of the samples) on one-token
    responses: each sample's log-probs equal the exact next-token distributions' at the sampled token, and the KL
    estimate falls within 4 standard errors of the exact KL."""
    policy, reference = two_policies()
    tok = get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    G = 300
    ids, mask, samples = sample_summaries(policy, prompts, G, 1, generator=torch.Generator().manual_seed(0))
    assert samples.response_ids.shape == (3 * G, 1)
    tokens = samples.response_ids[:, 0].view(3, G)
    exact_p = torch.stack([next_token_logprobs(policy, p) for p in prompts])  # (P, V)
    exact_q = torch.stack([next_token_logprobs(reference, p) for p in prompts])
    want_p, want_q = exact_p.gather(1, tokens), exact_q.gather(1, tokens)  # (P, G)
    got_p = sequence_logprobs(policy, ids, mask, samples, G).view(3, G).double()
    got_q = sequence_logprobs(reference, ids, mask, samples, G).view(3, G).double()
    assert torch.allclose(got_p, want_p, atol=1e-5)
    assert torch.allclose(got_q, want_q, atol=1e-5)
    assert torch.allclose(samples.logprobs.sum(1).view(3, G).double(), want_p, atol=1e-5)  # measure's log pi

    out = measure(policy, reference, FrontierPrompts(prompts, PROMPTS), G, 1, tok, torch.Generator().manual_seed(1))
    exact = float(exact_kls(policy, reference, prompts).mean())
    assert abs(out["kl"] - exact) <= 4 * out["kl_se"]
    assert out["response_length"] == 1.0
    same = measure(policy, policy, FrontierPrompts(prompts, PROMPTS), 8, 4, tok, torch.Generator().manual_seed(1))
    assert same["kl"] == pytest.approx(0.0, abs=1e-5)  # a policy against itself (its log-probs from two paths)


# ----------------------------------------------------------------------------------------------------
# Best-of-n on known rewards


def test_best_of_n_keeps_the_first_n_samples_best_by_the_proxy():
    proxy = torch.tensor([[1.0, 3.0, 2.0, 5.0], [4.0, 4.0, 0.0, 1.0], [0.0, -1.0, 7.0, 7.0]])
    assert best_of_n_index(proxy, 1).tolist() == [0, 0, 0]
    assert best_of_n_index(proxy, 2).tolist() == [1, 0, 0]  # a tie goes to the earlier sample
    assert best_of_n_index(proxy, 4).tolist() == [3, 0, 2]
    with pytest.raises(ValueError, match="1 <= n <= 4"):
        best_of_n_index(proxy, 5)


def test_best_of_n_kl_formula_and_its_exact_value_without_ties():
    """log n - (n-1)/n by hand, and against the exact KL of best-of-n over m equally likely outcomes with distinct
    rewards (the kept one is the i-th best with probability (i/m)^n - ((i-1)/m)^n): equal as m grows, above it for
    small m (an upper bound, Beirami et al. 2024)."""
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert best_of_n_kl(64) == pytest.approx(math.log(64) - 63 / 64)

    def exact(n: int, m: int) -> float:
        i = torch.arange(1, m + 1, dtype=torch.float64)
        p = (i / m) ** n - ((i - 1) / m) ** n
        return float((p * torch.log(p * m)).sum())

    for n in (2, 4, 16, 64):
        assert exact(n, 100_000) == pytest.approx(best_of_n_kl(n), abs=1e-3)
        assert exact(n, 8) < best_of_n_kl(n)
    with pytest.raises(ValueError):
        best_of_n_kl(0)


class TableReward(torch.nn.Module):
    """A stand-in reward model for best_of_n: the raw score of a response is a fixed value per response token id
    (looked up in `table`), summed; gain 1 and bias 0."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table
        self.gain, self.bias = torch.tensor(1.0), torch.tensor(0.0)

    def forward(self, input_ids, position_ids, mask, prompt_len=None):
        return self.table[input_ids[:, -1]]  # one-token responses: the last column is the response token

    def normalize(self, raw):
        return self.gain * raw + self.bias


def test_best_of_n_curve_on_known_rewards():
    """One-token samples from the policy, a proxy that scores each token by a known table and a gold reward of the
    text: for every n the kept sample is the proxy's best among the first n, the curve's proxy is its mean, and gold
    follows the same rows."""
    policy, _ = two_policies()
    tok = get_tokenizer()
    prompts = FrontierPrompts([tok.encode(p) for p in PROMPTS], PROMPTS)
    table = torch.randn(50257, generator=torch.Generator().manual_seed(3))
    gold = lambda prompt, text: float(len(text))  # noqa: E731  (a known function of the text)
    curve = best_of_n(policy, prompts, TableReward(table), tok, torch.Generator().manual_seed(5), 1, 8, gold)
    assert [p["n"] for p in curve] == [1, 2, 4, 8]
    assert [p["kl"] for p in curve] == [best_of_n_kl(n) for n in (1, 2, 4, 8)]
    _, _, samples = sample_summaries(policy, prompts.prompts, 8, 1, generator=torch.Generator().manual_seed(5))
    scores = table[samples.response_ids[:, 0]].view(3, 8).double()
    texts = [tok.decode([t]) for t in samples.response_ids[:, 0].tolist()]
    golds = torch.tensor([len(t if t != "<|endoftext|>" else "\n") for t in texts], dtype=torch.float64).view(3, 8)
    for point in curve:
        n = point["n"]
        kept = scores[:, :n].argmax(1)
        assert point["proxy"] == pytest.approx(float(scores[:, :n].max(1).values.mean()))
        assert point["gold"] == pytest.approx(float(golds.gather(1, kept[:, None]).mean()))
    assert curve[-1]["proxy"] >= curve[0]["proxy"]


# ----------------------------------------------------------------------------------------------------
# A tiny frontier run: demo.py --frontier_seeds on random tiny models


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    """A demo folder holding what --reuse reads: a random tiny SFT policy, random reward model, labelled pairs."""
    out = tmp_path_factory.mktemp("frontier") / "demo"
    paths = write_task(out / "data", seed=0)
    torch.manual_seed(0)
    save_hf(GPT2LMHeadModel(PRESETS["tiny"]).state_dict(), PRESETS["tiny"], out / "sft" / "hf")
    save_hf(RewardModel(PRESETS["tiny"], "sum").state_dict(), PRESETS["tiny"], out / "rm" / "hf", reward_pooling="sum")
    (out / "data" / "policy_pairs").mkdir(parents=True)
    shutil.copy(paths["preference_train"], out / "data" / "policy_pairs" / "train.jsonl")
    shutil.copy(paths["preference_validation"], out / "data" / "policy_pairs" / "validation.jsonl")
    return out


@pytest.mark.slow  # four processes: the demo, GRPO twice, DPO
def test_a_tiny_frontier_run(tiny_demo, tmp_path):
    cmd = [sys.executable, "demo.py", "--out", str(tiny_demo), "--reuse", "--assets", str(tmp_path)]
    cmd += ["--frontier_seeds", "1", "--frontier_dpo_betas", "0.1", "--frontier_grpo_betas", "0.4"]
    cmd += ["--frontier_dpo_steps", "2", "--grpo_steps", "2", "--frontier_prompts", "4", "--frontier_samples", "2"]
    cmd += ["--frontier_best_of", "4", "--frontier_grpo_samples", "8", "--frontier_eval_rows", "8"]
    cmd += ["--wandb_mode", "disabled"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "frontier.png").stat().st_size > 0
    record = json.loads((tiny_demo / "frontier" / "frontier.json").read_text())
    assert [p["n"] for p in record["best_of_n"]] == [1, 2, 4]
    assert set(record["methods"]) == {"GRPO rso 8->8, beta 0.4", "GRPO uniform 8->8, beta 0.4", "DPO beta 0.1"}
    for name, seeds in record["methods"].items():
        points = seeds[0]
        # every evaluation: before the first step, then GRPO's every --eval_every, DPO's every third of its steps (1)
        assert [p["step"] for p in points] == ([0, 1, 2] if name.startswith("DPO") else [0, 2]), name
        assert points[0]["kl"] == pytest.approx(0.0, abs=1e-5), name  # the policy is its reference at step 0
        for p in points:
            assert {"kl", "kl_se", "gold", "gold_se", "proxy", "proxy_raw", "win_rate"} <= set(p), name
    grpo = frontier_points(tiny_demo / "frontier" / "grpo_rso_beta0.4" / "seed0")
    assert grpo == record["methods"]["GRPO rso 8->8, beta 0.4"][0]
    text = (tiny_demo / "frontier" / "frontier.md").read_text()
    assert text.strip() == frontier_table(record["best_of_n"], record["methods"]).strip()
    assert "| DPO beta 0.1 | 1 |" in text and "best-of-4" in text
    # the picture and its table as TensorBoard events beside the runs (their own event files are in their folders)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tiny_demo / "frontier"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert [i.encoded_image_string for i in events.Images("frontier")] == [(tmp_path / "frontier.png").read_bytes()]
    (table,) = events.Tensors("frontier/table")
    assert "DPO beta 0.1 | 1 |" in table.tensor_proto.string_val[0].decode()


def test_compare_draws_evaluation_metrics_against_eval_kl_by_default(tmp_path, monkeypatch):
    """A run that logged eval/kl (--frontier_prompts) is drawn against it, not against the per-step train/kl."""
    from evaluation import compare
    from utils.logging import Logger

    log = Logger(tmp_path / "run", {"seed": 0}, "test", "run", "disabled", enabled=True)
    for step in (1, 2, 3):
        row = {"train/kl": 0.5 * step}
        if step != 2:
            row |= {"eval/kl": 0.1 * step, "eval/kl_se": 0.01, "eval/gold": 2.0 + step}
        log.log(row, step=step)
    log.finish()
    drawn = {}
    monkeypatch.setattr(compare, "plot", lambda groups, metrics, out, x, smooth: drawn.update(metrics=metrics, x=x))
    text = compare.main([str(tmp_path / "run"), "--out", str(tmp_path / "c.png"), "--tensorboard", "false"])  # no PNG
    assert drawn == {"metrics": ["eval/gold", "train/kl"], "x": "eval/kl"}
    assert "eval/gold (final)" in text
    groups = compare.group_runs([compare.load_run(tmp_path / "run")])
    fig = compare.figure(groups, ["eval/gold"], x="eval/kl")
    path = fig.axes[1].lines[0]
    assert list(path.get_xdata()) == pytest.approx([0.1, 0.3]) and list(path.get_ydata()) == [3.0, 5.0]


def test_the_command_line_draws_runs_without_a_gold_reward(tiny_demo, tmp_path, capsys):
    """python -m evaluation.frontier on two seeds of a run that logged the frontier, on prompts with reference
    summaries and no gold reward: best-of-n from the reference, proxy and win rate in the table; a run that did not
    measure the frontier is one line naming it."""
    from evaluation import frontier
    from evaluation.compare import CompareError
    from utils.logging import Logger

    runs = []
    for seed in (0, 1):
        log = Logger(tmp_path / f"seed{seed}", {"seed": seed, "beta": 0.1}, "test", "run", "disabled", enabled=True)
        for step in (0, 5):
            values = {"kl": 0.1 * step, "proxy": 0.2 * step + seed, "proxy_raw": 0.0, "win_rate_sampled": 0.5}
            log.log({f"eval/{k}": v for k, v in values.items()} | {f"eval/{k}_se": 0.01 for k in values}, step=step)
        log.finish()
        runs.append(str(tmp_path / f"seed{seed}"))
    data = str(tiny_demo / "data" / "sft" / "validation.jsonl")
    common = ["--reference", str(tiny_demo / "sft" / "hf"), "--reward_model", str(tiny_demo / "rm" / "hf")]
    common += ["--data", data, "--prompts", "3", "--best_of", "2", "--max_new_tokens", "6", "--max_prompt_len", "192"]
    text = frontier.main([*runs, *common, "--out", str(tmp_path / "f.png")])
    assert text.splitlines()[0] == "| policy | seeds | kl | proxy | win_rate |"
    assert "| best-of-2 (reference) | | 0.193 |" in text
    assert "| all runs | 2 | 0.500 ± 0.000 (se 0.010) | 1.500 ± 0.707 (se 0.010) | 0.500 ± 0.000 (se 0.010) |" in text
    assert (tmp_path / "f.png").stat().st_size > 0 and (tmp_path / "f.json").is_file()
    Logger(tmp_path / "plain", {"seed": 0}, "test", "run", "disabled", enabled=True).finish()
    with pytest.raises(CompareError, match="plain: no eval/kl in its metrics.jsonl"):
        frontier.main([str(tmp_path / "plain"), *common, "--out", ""])


def test_metric_names_are_the_ones_evaluate_logs(tmp_path):
    # the stages check --best_metric against Frontier.metric_names before their first step, without evaluating
    from types import SimpleNamespace

    from evaluation.frontier import Frontier, FrontierConfig

    paths = write_task(tmp_path / "data", seed=0)
    policy, reference = two_policies()
    torch.manual_seed(0)
    reward_model = RewardModel(PRESETS["tiny"]).eval()
    cfg = SimpleNamespace(**vars(FrontierConfig(frontier_prompts=2, frontier_samples=2)), seed=0)
    run = SimpleNamespace(dtype=None, device=torch.device("cpu"))
    for rm, gold in ((None, None), (reward_model, None), (reward_model, lambda prompt, response: 1.0)):
        for source in (paths["sft_validation"], paths["preference_validation"]):  # with and without references
            frontier = Frontier(cfg, str(source), "", get_tokenizer(), 64, 4, run, reward_model=rm, gold_fn=gold)
            assert set(frontier.evaluate(policy, reference, 0)) == frontier.metric_names()


def test_frontier_points_read_a_torn_last_line_and_a_missing_standard_error(tmp_path):
    # a kill mid-write leaves a torn last line; a standard error of one prompt and one sample is NaN, which the logger
    # does not write (utils.logging keeps finite values only): the points read it as NaN
    rows = [{"step": 0, "eval/kl": 0.0, "eval/gold": 0.5}, {"step": 1, "eval/kl": 0.1, "eval/kl_se": 0.01}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "eval/k'
    (tmp_path / "metrics.jsonl").write_text(text)
    points = frontier_points(tmp_path)
    assert [p["step"] for p in points] == [0, 1]
    assert points[0]["kl"] == 0.0 and math.isnan(points[0]["kl_se"]) and math.isnan(points[0]["gold_se"])
    assert points[1]["kl_se"] == 0.01 and "gold" not in points[1]


def test_the_command_line_checks_each_models_kind_in_one_line(tiny_demo, tmp_path):
    # a reward model as --reference, a policy as --reward_model: one line naming the option, exit 2, no traceback
    run = tmp_path / "run"
    run.mkdir()
    sft, rm = str(tiny_demo / "sft" / "hf"), str(tiny_demo / "rm" / "hf")
    data = str(tiny_demo / "data" / "sft" / "validation.jsonl")
    for reference, reward_model, option in ((rm, rm, "--reference"), (sft, sft, "--reward_model")):
        cmd = [sys.executable, "-m", "evaluation.frontier", str(run), "--reference", reference]
        cmd += ["--reward_model", reward_model, "--data", data, "--out", str(tmp_path / "f.png")]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {option} "), done.stderr[
            -2000:
        ]
