"""The GRPO objective options (docs/grpo.md, "Objective options"): GSPO's sequence-level ratio, the sampler / trainer
mismatch and its rollout correction, the KL estimators and where the KL goes, dynamic sampling. Each against values
worked by hand or exact expectations on a toy categorical policy, then each end to end in a two-process gloo run of
grpo.py on the embedded task."""

import importlib
import json
import math

import pytest
import torch

from grpo import Config
from rlhf.advantages import informative_groups
from rlhf.policy_gradient import (
    AGGREGATIONS,
    Objective,
    dr_grpo_weights,
    grpo_weights,
    mismatch_stats,
    rollout_correction,
    sequence_clipped_surrogate,
    sequence_kl,
    spread_sequence_loss,
    token_kl,
)
from tests.conftest import run_script
from tests.helpers import end_biased_policy, read_metrics
from utils.config import parse_config


def ragged_mask(lengths, T):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def aggregate(loss, mask, name, max_new_tokens=6):
    w, z = AGGREGATIONS[name](mask, max_new_tokens)
    return (w * loss).sum() / z


# ----------------------------------------------------------------------------------------------------
# 1. Sequence-level importance ratio (GSPO, arXiv 2507.18071)


def test_sequence_ratio_and_its_clipping_by_hand():
    mask = ragged_mask([2, 3], 3)
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.2, -2.4, 0.0], [-1.0, -1.0, -1.3]])  # log-ratios (0.2, 0.4) and (0, 0, 0.3)
    loss, clipped, s = sequence_clipped_surrogate(logp, old, torch.tensor([1.0, -1.0]), mask, 0.2, 0.05)
    assert torch.allclose(s, torch.tensor([math.exp(0.3), math.exp(0.1)]))  # exp of the *mean* log-ratio
    # A = 1: s = 1.35 > 1 + 0.05, clipped to 1.05; A = -1: min(-1.105, -1.05) = -1.105, the unclipped branch
    assert torch.allclose(loss, torch.tensor([-1.05, math.exp(0.1)]))
    assert clipped.tolist() == [True, False]


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_a_sequence_weighs_the_same_whatever_its_length_under_every_aggregation(name):
    """Two responses with the same per-token log-ratio and advantage, 2 and 6 tokens long: the sum over each one's
    tokens of d loss / d logp is the same. Broadcasting the sequence loss to every token instead (the bug class)
    makes the long one weigh 3x under the token-sum aggregations."""
    T = 6
    mask = ragged_mask([2, 6], T)
    logp = torch.full((2, T), -1.0, requires_grad=True)
    old = torch.full((2, T), -1.05)  # ratio exp(0.05) on every token: inside the clip range
    adv = torch.tensor([1.0, 1.0])
    w, _ = AGGREGATIONS[name](mask, T)
    loss, _ = Objective(importance_level="sequence").token_loss(logp, old, old, adv, mask, weights_NT=w)
    (grad,) = torch.autograd.grad(aggregate(loss, mask, name), logp)
    per_sequence = grad.sum(1)
    assert torch.allclose(per_sequence[0], per_sequence[1]), (name, per_sequence)
    loss_N, _, _ = sequence_clipped_surrogate(logp, old, adv, mask, 0.2, 0.2)
    (broadcast,) = torch.autograd.grad(aggregate(loss_N[:, None] * mask, mask, name), logp)
    ratio = broadcast.sum(1)[1] / broadcast.sum(1)[0]
    assert float(ratio) == pytest.approx(1.0 if name == "grpo" else 3.0, rel=1e-5), name


def test_spread_sequence_loss_gives_back_each_sequence_loss():
    mask = ragged_mask([1, 4, 2], 4)
    loss_N = torch.tensor([0.5, -2.0, 3.0])
    for name in AGGREGATIONS:
        w, _ = AGGREGATIONS[name](mask, 4)
        assert torch.allclose((w * spread_sequence_loss(loss_N, w)).sum(1), loss_N), name


def test_token_and_sequence_level_give_the_same_gradient_at_ratio_one():
    """mu = 1 (old = logp.detach()): both ratios are 1 in value; with the per-sequence mean (--loss_type grpo) the
    gradients are the same, -A_i / |o_i| per token (GSPO paper, section 4.2), the KL term included."""
    g = torch.Generator().manual_seed(0)
    N, T = 5, 6
    mask = ragged_mask([6, 1, 3, 4, 2], T)
    logp = (-torch.rand(N, T, generator=g) * 3).requires_grad_()
    ref = -torch.rand(N, T, generator=g) * 3
    adv = torch.randn(N, generator=g)
    w, z = grpo_weights(mask, T)
    grads, values = {}, {}
    for level in ("token", "sequence"):
        objective = Objective(beta=0.1, importance_level=level)
        loss, _ = objective.token_loss(logp, logp.detach(), ref, adv, mask, weights_NT=w)
        total = (w * loss).sum() / z
        (grads[level],) = torch.autograd.grad(total, logp)
        values[level] = float(total.detach())
    assert torch.allclose(grads["token"], grads["sequence"], atol=1e-7)
    assert values["token"] == pytest.approx(values["sequence"], abs=1e-6)


# ----------------------------------------------------------------------------------------------------
# 2. Sampler / trainer mismatch and its correction


def test_mismatch_stats_by_hand():
    mask = ragged_mask([3, 2], 3)
    train = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -0.5, 9.0]])
    sampler = torch.tensor([[-1.05, -1.8, -3.0], [-1.0, -1.5, 0.0]])  # gaps 0.05, -0.2, 0 | 0, 1.0 | (masked)
    stats = {k: float(v) for k, v in mismatch_stats(train, sampler, mask).items()}
    tokens, outside, gap_sum, gap_max = (stats[k] for k in ("tokens", "outside_band", "abs_log_gap", "max_abs_log_gap"))
    # the band [0.9, 1.1] in log space is [-0.105, 0.095]: -0.2 and 1.0 lie outside
    assert (tokens, outside) == (5.0, 2.0)
    assert gap_sum == pytest.approx(0.05 + 0.2 + 1.0) and gap_max == pytest.approx(1.0)


def test_truncated_and_masked_importance_weights_by_hand():
    mask = ragged_mask([3, 1], 3)
    sampler = torch.zeros(2, 3)
    train = torch.tensor([[0.05, 2.0, -1.0], [1.5, 0.0, 0.0]])  # rho = e^0.05, e^2 = 7.39, e^-1 | e^1.5 = 4.48
    w, beyond = rollout_correction(train, sampler, mask, "tis", 3.0, "token")
    assert torch.allclose(w, torch.tensor([[math.exp(0.05), 3.0, math.exp(-1.0)], [3.0, 1.0, 1.0]]))
    assert beyond.tolist() == [[False, True, False], [True, False, False]]
    w, beyond = rollout_correction(train, sampler, mask, "mis", 3.0, "token")
    assert torch.allclose(w, torch.tensor([[math.exp(0.05), 0.0, math.exp(-1.0)], [0.0, 1.0, 1.0]]))
    # per sequence: the mean log gap, (0.05 + 2 - 1) / 3 = 0.35 (inside the cap) and 1.5 (beyond)
    w, beyond = rollout_correction(train, sampler, mask, "tis", 3.0, "sequence")
    assert w.shape == (2, 1) and torch.allclose(w[:, 0], torch.tensor([math.exp(0.35), 3.0]))
    assert beyond.tolist() == [[False] * 3, [True, False, False]]
    w, _ = rollout_correction(train, sampler, mask, "mis", 3.0, "sequence")
    assert torch.allclose(w[:, 0], torch.tensor([math.exp(0.35), 0.0]))
    w, beyond = rollout_correction(train, sampler, mask, "none", 3.0, "token")
    assert torch.equal(w, torch.ones(2, 3)) and not beyond.any()


def test_the_correction_weights_the_policy_term_only():
    mask = ragged_mask([2], 2)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    adv, c = torch.tensor([2.0]), torch.tensor([[0.5, 0.0]])
    loss, _ = Objective(beta=0.1).token_loss(logp, logp.detach(), ref, adv, mask, correction=c)
    loss.sum().backward()
    kl_grad = 0.1 * (1 - torch.exp(ref - logp.detach()))  # d k3 / d logp = 1 - exp(ref - logp)
    assert torch.allclose(logp.grad, -adv * c + kl_grad)


def test_token_loss_is_its_three_terms_by_hand():
    """Objective.token_loss = policy term + KL term - entropy term on response tokens, 0 elsewhere, each term worked
    by hand on one response: ratio e^0.1 (inside the clip range), k3 with log r = ref - logp, H given."""
    mask = ragged_mask([2], 3)
    logp = torch.tensor([[-1.0, -2.0, float("-inf")]])
    old, ref = torch.tensor([[-1.1, -2.1, 0.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
    entropy = torch.tensor([[2.0, 3.0, 7.0]])
    objective = Objective(eps_low=0.2, eps_high=0.2, beta=0.1, entropy_coef=0.01)
    loss, stats = objective.token_loss(logp, old, ref, torch.tensor([2.0]), mask, entropy_NT=entropy)
    rho = math.exp(0.1)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]  # exp(ref - logp) - (ref - logp) - 1
    want = [-2.0 * rho + 0.1 * k3[0] - 0.01 * 2.0, -2.0 * rho + 0.1 * k3[1] - 0.01 * 3.0, 0.0]
    assert torch.allclose(loss, torch.tensor([want]))
    assert torch.allclose(stats["kl"], torch.tensor([[k3[0], k3[1], 0.0]]))
    assert torch.allclose(stats["ratio_deviation"], torch.tensor([[rho - 1, rho - 1, 0.0]]))
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        Objective(kl_estimator="k4")
    with pytest.raises(ValueError, match="unknown importance level 'row'"):
        Objective(importance_level="row")


# ----------------------------------------------------------------------------------------------------
# 3. KL estimators and where the KL goes (arXiv 2512.21852)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -0.5]), torch.tensor([-2.0, -0.5])  # logp - ref = 1, 0
    assert torch.allclose(token_kl(logp, ref, "k1"), torch.tensor([1.0, 0.0]))
    assert torch.allclose(token_kl(logp, ref, "k2"), torch.tensor([0.5, 0.0]))
    assert torch.allclose(token_kl(logp, ref, "k3"), torch.tensor([math.exp(-1.0) + 1.0 - 1.0, 0.0]))
    mask = ragged_mask([2, 1], 2)
    two = torch.stack([logp, logp]), torch.stack([ref, ref])
    assert torch.allclose(sequence_kl(*two, mask, "k1"), torch.tensor([1.0, 1.0]))  # the masked token leaves out
    with pytest.raises(ValueError, match="k4"):
        token_kl(logp, ref, "k4")


def toy_policy():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(7, generator=g, dtype=torch.float64).requires_grad_()
    ref = torch.randn(7, generator=g, dtype=torch.float64).log_softmax(0)
    return theta, ref


def expected_gradient(term) -> torch.Tensor:
    """E_{y ~ pi_old}[grad term(y)] exactly, on the toy categorical policy pi = softmax(theta), pi_old = pi
    (detached): sum_y pi_old(y) grad term(logp(y), old(y), ref(y))."""
    theta, ref = toy_policy()
    logp = theta.log_softmax(0)
    old = logp.detach()
    (grad,) = torch.autograd.grad((old.exp() * term(logp, old, ref)).sum(), theta)
    return grad


def true_gradients():
    theta, ref = toy_policy()
    logp = theta.log_softmax(0)
    (reverse,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)  # grad KL(pi || pi_ref)
    theta, ref = toy_policy()
    logp = theta.log_softmax(0)
    (forward,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)  # grad KL(pi_ref || pi)
    return reverse, forward


def test_expected_gradient_of_each_estimator_on_a_toy_categorical_policy():
    """The expectations the options table in docs/grpo.md states, exactly (sums over the 7 outcomes)."""
    reverse, forward = true_gradients()
    assert not torch.allclose(reverse, forward, atol=1e-3)  # the toy can tell them apart

    def in_loss(name, ratio=False):
        return expected_gradient(lambda lp, old, ref: (torch.exp(lp - old) if ratio else 1.0) * token_kl(lp, ref, name))

    assert torch.allclose(
        in_loss("k1"), torch.zeros(7, dtype=torch.float64), atol=1e-12
    )  # k1 in the loss: no pull at all
    assert torch.allclose(in_loss("k2"), reverse, atol=1e-12)  # k2 in the loss: unbiased on-policy
    assert torch.allclose(in_loss("k3"), forward, atol=1e-12)  # k3 in the loss: the forward KL's gradient
    assert torch.allclose(in_loss("k3", ratio=True), reverse, atol=1e-12)  # --kl_ratio: corrected
    assert torch.allclose(in_loss("k1", ratio=True), reverse, atol=1e-12)
    # in the reward: a detached penalty through the policy gradient, -(r - beta k1) grad logp with r = 0, beta = 1
    in_reward = expected_gradient(lambda lp, old, ref: token_kl(old, ref, "k1") * lp)
    assert torch.allclose(in_reward, reverse, atol=1e-12)


def test_kl_ratio_term_in_the_loss_matches_the_estimator():
    """Objective.token_loss with kl_ratio: beta * rho * k, rho = exp(logp - old) with old detached."""
    mask = ragged_mask([2], 2)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old, ref = torch.tensor([[-1.1, -2.0]]), torch.tensor([[-1.5, -1.0]])
    objective = Objective(beta=0.5, kl_estimator="k2", kl_ratio=True)
    loss, stats = objective.token_loss(logp, old, ref, torch.tensor([0.0]), mask)
    k2 = 0.5 * (logp.detach() - ref) ** 2
    assert torch.allclose(loss.detach(), 0.5 * torch.exp(logp.detach() - old) * k2)
    assert torch.allclose(stats["kl"], k2)


# ----------------------------------------------------------------------------------------------------
# 4. Dynamic sampling (DAPO, arXiv 2503.14476)


def test_groups_with_near_zero_spread_are_dropped():
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5 + 1e-6], [0.0, 1.0, 0.0, 1.0]])
    assert informative_groups(r, 1e-3).tolist() == [False, False, True]  # the near-tie goes too
    assert informative_groups(r, 0.0).tolist() == [True, True, True]
    assert informative_groups(r, 0.6).tolist() == [False, False, False]  # std of the last: 0.577


def test_rows_without_response_tokens_add_nothing_to_the_normaliser():
    """The filler rows that keep ranks in step after dynamic sampling: weight 0, no count in Z."""
    mask = ragged_mask([3, 0, 2], 4)
    for weigh, z in ((grpo_weights, 2.0), (dr_grpo_weights, 2.0 * 4)):
        w, got = weigh(mask, 4)
        assert float(got) == z and (w[1] == 0).all()


def test_config_names_the_offending_option(capsys):
    for argv, fragment in (
        (["--kl_ratio", "true", "--kl_in", "reward"], "--kl_ratio weights the loss's KL term: it needs --kl_in loss"),
        (["--rollout_correction_cap", "0"], "--rollout_correction_cap must be > 0, got 0.0"),
        (["--min_group_std", "-0.1"], "--min_group_std must be >= 0, got -0.1"),
        (["--min_group_std", "0.1", "--num_kept", "1", "--advantage", "dr_grpo"], "it needs at least 2 kept samples"),
        (["--importance_level", "segment"], "--importance_level: invalid choice: 'segment'"),
    ):
        with pytest.raises(SystemExit):
            parse_config(Config, argv)
        assert fragment in capsys.readouterr().err, argv


def test_each_option_group_checks_its_own_fields_and_binds_the_objective_from_its_options():
    """rollouts/options.py's groups, each alone: SamplingConfig, SelectionConfig and ObjectiveConfig name their own
    offending option; ObjectiveConfig.objective() reads every field of rlhf.policy_gradient.Objective from the option of
    that name that declares objective=True (beta 0 with the KL in the reward)."""
    import dataclasses

    from rlhf.policy_gradient import Objective
    from rollouts.options import ObjectiveConfig, SamplingConfig, SelectionConfig
    from utils.config import ConfigError, declared

    with pytest.raises(ConfigError, match="--gen_prompts must be positive, got 0"):
        SamplingConfig(gen_prompts=0).validate_sampling()

    @dataclasses.dataclass
    class Selection(SamplingConfig, SelectionConfig):
        pass

    with pytest.raises(ConfigError, match="--num_kept 9 exceeds --num_samples 8"):
        Selection(num_samples=8, num_kept=9).validate_selection()
    assert Selection(num_samples=8, selection="all").kept == 8
    with pytest.raises(ConfigError, match="--policy_epochs must be positive, got 0"):
        ObjectiveConfig(policy_epochs=0).validate_objective()
    values = {"eps_low": 0.1, "eps_high": 0.3, "importance_level": "sequence", "rollout_correction": "tis"}
    values |= {"rollout_correction_cap": 2.5, "beta": 0.07, "kl_estimator": "k2", "kl_ratio": True}
    values |= {"entropy_coef": -0.01}
    assert {f.name for f in dataclasses.fields(Objective)} == set(values)  # a new Objective field is seen here
    assert set(declared(ObjectiveConfig, "objective")) == set(values)  # and must be declared on its option
    assert ObjectiveConfig(**values).objective() == Objective(**values)
    assert ObjectiveConfig(**values, kl_in="reward").objective() == Objective(**values | {"beta": 0.0})


# ----------------------------------------------------------------------------------------------------
# Each option end to end: two gloo processes, grpo.py on the embedded task's prompts and gold reward


OPTIONS = {  # four runs for the six options, CPU being scarce; each case asserts what its options log
    # caps far from 1 either way: in fp32 the sampler's and the trainer's log-probs agree to ~1e-6, so the share of
    # tokens past a cap of exactly 1 would be rounding noise. 1000: nothing masked (GSPO's clipping still acts);
    # 0.5: every token's ratio (~1) is past the cap, so TIS weighs every policy term by 0.5
    "sequence_ratio_mis": [
        "--importance_level",
        "sequence",
        "--eps_low",
        "3e-4",
        "--eps_high",
        "4e-4",
        "--policy_epochs",
        "2",
        "--rollout_correction",
        "mis",
        "--rollout_correction_cap",
        "1000",
    ],
    "tis_kl_ratio": [
        "--rollout_correction",
        "tis",
        "--rollout_correction_cap",
        "0.5",
        "--kl_estimator",
        "k2",
        "--kl_ratio",
        "true",
    ],
    "kl_in_reward": ["--kl_in", "reward", "--kl_estimator", "k1"],
    "dynamic_sampling": ["--min_group_std", "0.1"],
}


def ends(prompt, response):
    """1 for a response that ended by itself: a reward the end-biased policy's samples differ in (the embedded
    task's gold reward pays nothing to summaries without content, which a random policy never writes)."""
    return float(response.endswith("\n"))


@pytest.fixture(scope="module")
def embedded_task(tmp_path_factory):
    from data.synthetic import write_task

    folder = tmp_path_factory.mktemp("embedded")
    files = write_task(folder / "task", seed=0, n_sft_train=4, n_sft_val=4, n_pref_train=4, n_pref_val=4, n_prompts=32)
    end_biased_policy(folder / "policy", n_positions=256)  # ends about half the time: the gold reward varies
    return files["prompts_train"], folder / "policy"


@pytest.fixture(scope="module")
def option_runs(embedded_task, tmp_path_factory):
    """Every case of OPTIONS run by grpo.py on two gloo processes, one after the other in one launch
    (tests/scripts/runs.py: a launch costs seconds of start-up; each case is a run of its own, in its own folder,
    seeded at its start as a fresh process is). Returns the folder that holds each case's run (and, for a case that
    raised, its traceback) and the launch's failure ("" when every case ran)."""
    prompts, policy = embedded_task
    base = tmp_path_factory.mktemp("options")
    cases = {
        option: [
            "--model",
            str(policy),
            "--rewards",
            "tests.test_grpo_options:ends",
            "--train_data",
            str(prompts),
            "--val_data",
            "",
            "--pref_data",
            "",
            "--num_samples",
            "8",
            "--num_kept",
            "4",
            "--max_new_tokens",
            "8",
            "--max_prompt_len",
            "128",
            "--prompts_per_step",
            "4",
            "--micro_batch_size",
            "4",
            "--steps",
            "3",
            "--lr",
            "1e-3",
            "--warmup_steps",
            "1",
            "--beta",
            "0.1",
            "--eval_every",
            "-1",
            "--table_every",
            "0",
            "--save_every",
            "0",
            "--seed",
            "0",
            "--wandb_mode",
            "disabled",
            "--out_dir",
            str(base / option),
            *OPTIONS[option],
        ]
        for option in sorted(OPTIONS)
    }
    (base / "cases.json").write_text(json.dumps(cases))
    try:
        run_script(["tests/scripts/runs.py", "grpo.py", str(base / "cases.json")], nproc=2)
    except AssertionError as e:  # each test names its own case's failure
        return base, str(e)
    return base, ""


@pytest.mark.slow
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_option_runs_end_to_end_in_two_processes(option, option_runs):
    base, failure = option_runs
    errors = sorted(base.glob(f"{option}.error.*"))
    assert not errors, "\n".join(e.read_text() for e in errors)
    assert (base / option / "summary.json").is_file(), f"{option} did not run to its end:\n{failure}"
    steps = read_metrics(base / option)
    assert [m["step"] for m in steps] == [1, 2, 3]
    trained = [m for m in steps if m["train/skipped"] == 0]
    assert trained, steps
    for m in trained:  # fp32 on the CPU: the sampler's KV-cache path and the training forward agree closely
        assert 0 <= m["train/mismatch/outside_band_fraction"] < 0.01
        assert 0 <= m["train/mismatch/mean_abs_log_gap"] <= m["train/mismatch/max_abs_log_gap"] < 1e-3
    if option == "sequence_ratio_mis":  # the second epoch's sequence ratios leave GSPO's narrow range
        assert any(m["train/epoch_2/clip_fraction"] > 0 for m in trained)
    if option == "sequence_ratio_mis":  # cap 1000: no sequence masked
        assert all(m["train/rollout_correction_fraction"] == 0 for m in trained)
    if option == "tis_kl_ratio":  # cap 0.5: every token's weight truncated
        assert all(m["train/rollout_correction_fraction"] == 1 for m in trained)
    if option == "tis_kl_ratio":
        assert steps[0]["train/kl"] == 0 and steps[-1]["train/kl"] > 0  # k2 >= 0, 0 before the first update
    if option == "kl_in_reward":  # the policy == the reference at step 1 (k1 = 0), apart after the first update
        assert steps[0]["reward/kl_penalty_mean"] == 0 and steps[-1]["reward/kl_penalty_mean"] != 0
    if option == "dynamic_sampling":  # some groups tie (all kept samples ended, or none), some do not
        dropped = [m["sample/dropped_group_fraction"] for m in steps]
        # an odd number of the 4 groups dropped: the two ranks kept different numbers of micro-batches (one group
        # each), so one of them ran filler micro-batches to stay in step with the other's collectives. Which groups
        # tie depends on the prompts drawn from the embedded task (the posts and the task's SFT summaries share one
        # stream): seeds 0, 1 and 3 give an odd number in 3 steps, seed 2 does not.
        assert any(d in (0.25, 0.75) for d in dropped), dropped


def test_top_selection_and_pool_statistics_run_in_grpos_step_from_the_command_line():
    """--selection top --advantage pool_normalized, parsed as grpo.py parses them, through one step of train_step (the
    function grpo.py's main() calls) and its logged metrics, in one process: the kept samples are each prompt's 4 best
    of 8, their advantages are the pool's z-scores whitened over the batch, and the selection diagnostics say so."""
    from grpo import Config
    from model.gpt2 import GPT2LMHeadModel, GPTConfig
    from model.weights import freeze
    from rlhf.advantages import global_normalize, pool_normalize
    from rollouts.metrics import step_metrics
    from rollouts.models import Models
    from rollouts.step import train_step
    from tests.helpers import prompts_and_rewards
    from utils.optim import build_optimizer, build_scheduler

    argv = ["--selection", "top", "--advantage", "pool_normalized", "--rewards", "length", "--num_samples", "8"]
    argv += ["--num_kept", "4", "--max_new_tokens", "5", "--prompts_per_step", "2", "--micro_batch_size", "4"]
    cfg = parse_config(Config, argv + ["--beta", "0.1", "--lr", "1e-2", "--warmup_steps", "1"])
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32))
    models = Models(policy, freeze(GPT2LMHeadModel(policy.cfg)), None)
    optimizer = build_optimizer(policy, cfg.lr, 0.0)
    prompts, spec = prompts_and_rewards(cfg)
    r = train_step(models, optimizer, build_scheduler(optimizer, 1, 10), prompts, spec, cfg, step=1)
    pool = r.scores.total.view(2, 8)
    assert (r.rewards_BK.min(1).values >= pool.sort(1, descending=True).values[:, 3]).all()  # the 4 best kept
    want = global_normalize(pool_normalize(r.rewards_BK, pool_BG=pool).flatten())
    assert torch.allclose(r.advantages, want, atol=1e-6) and r.advantages.abs().max() > 0
    metrics = step_metrics(r, spec, cfg, per_row_sources=False)
    assert metrics["rs/acceptance_rate"] == 0.5 and metrics["rs/rounds_mean"] == metrics["rs/rounds_max"] == 1
    assert metrics["rs/kept_mean_shift"] > 0 and metrics["rs/kept_std_ratio"] < 1  # the top band of each pool
    assert metrics["train/grad_norm"] > 0


def test_pool_statistics_need_a_pool_and_the_kl_in_the_loss(capsys):
    from grpo import Config

    for argv, message in (
        (["--kl_in", "reward"], "--kl_in reward takes the KL from the kept samples' rewards only"),
        (["--num_samples", "1", "--num_kept", "1"], "it needs --num_samples >= 2, got 1"),
    ):
        with pytest.raises(SystemExit):
            parse_config(Config, ["--advantage", "pool_normalized", *argv])
        assert message in capsys.readouterr().err
    assert parse_config(Config, ["--advantage", "pool_normalized", "--num_kept", "1"]).kept == 1


# ----------------------------------------------------------------------------------------------------
# Registries: each choice of the algorithm is a registered name, and the option that picks one lists the registry


REGISTRIES = {
    "selection": ("rlhf.selection", "SELECTIONS"),
    "advantage": ("rlhf.advantages", "ADVANTAGES"),
    "loss_type": ("rlhf.policy_gradient", "AGGREGATIONS"),
    "kl_estimator": ("rlhf.policy_gradient", "KL_ESTIMATORS"),
    "rollout_correction": ("rlhf.policy_gradient", "ROLLOUT_CORRECTIONS"),
}


@pytest.mark.parametrize("option", sorted(REGISTRIES))
def test_each_choice_option_takes_and_lists_every_registered_name(option, capsys):
    """--help and the generated docs list each registered name with its phrase; every name parses; any other is one
    line naming the option."""
    from utils.config import build_parser, options_markdown

    module, name = REGISTRIES[option]
    registry = getattr(importlib.import_module(module), name)
    action = next(a for a in build_parser(Config)._actions if a.dest == option)
    assert action.choices == list(registry) and len(registry) >= 3
    table = options_markdown(Config)
    for name in registry:
        assert f"{name}: {registry.help[name]}" in action.help and f"{name}: {registry.help[name]}" in table
        assert getattr(parse_config(Config, [f"--{option}", name, "--num_kept", "2"]), option) == name
    with pytest.raises(SystemExit):
        parse_config(Config, [f"--{option}", "nonesuch"])
    assert f"--{option}: invalid choice: 'nonesuch'" in capsys.readouterr().err


def test_a_registered_estimator_is_an_option_value_with_no_other_edit():
    """The proof of the registry: a function under the decorator is selectable by --advantage, listed by --help, and
    reached by rlhf.advantages.advantages; a name registered twice or looked up unregistered is a ValueError."""
    from rlhf.advantages import ADVANTAGES, advantages
    from utils.config import build_parser

    @ADVANTAGES.register("test_sign", help="the sign of r", min_kept=3)
    def sign(rewards_BK, reduce_sum=None):
        return rewards_BK.sign().float()

    try:
        help_text = next(a.help for a in build_parser(Config)._actions if a.dest == "advantage")
        assert "test_sign: the sign of r" in help_text
        assert parse_config(Config, ["--advantage", "test_sign", "--num_kept", "4"]).advantage == "test_sign"
        assert advantages(torch.tensor([[-2.0, 0.0, 3.0]]), "test_sign", False).tolist() == [-1.0, 0.0, 1.0]
        with pytest.raises(SystemExit):  # its declared min_kept is checked against --num_kept
            parse_config(Config, ["--advantage", "test_sign", "--num_kept", "2"])
        with pytest.raises(ValueError, match="advantage estimator 'test_sign' is registered twice"):
            ADVANTAGES.register("test_sign", help="again")(sign)
    finally:
        del ADVANTAGES["test_sign"], ADVANTAGES.help["test_sign"], ADVANTAGES.facts["test_sign"]
    with pytest.raises(ValueError, match="unknown advantage estimator 'test_sign'; expected one of grpo, dr_grpo"):
        advantages(torch.zeros(1, 2), "test_sign", False)
