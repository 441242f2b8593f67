"""grpo.py: row layout, a frozen reference, world-size and micro-batch invariance over two gloo processes, and a
two-process end-to-end run that changes every parameter and resumes exactly."""

import json
import random
from dataclasses import replace

import pytest
import torch

from data.tldr import collate_sft, pad_prompts, prompt_response_rows
from data.tokenizer import get_tokenizer
from grpo import Config
from model.gpt2 import GPT2LMHeadModel, GPTConfig
from model.sampler import END_ID, SampleOutput
from model.weights import build_policy, freeze
from rlhf.advantages import global_normalize
from rlhf.policy_gradient import AGGREGATIONS
from rlhf.selection import select_top, selection_diagnostics
from rollouts.batches import build_training_batches
from rollouts.models import Models
from rollouts.sampling import RewardSpec
from rollouts.step import train_step
from rollouts.update import micro_batch_loss
from tests.conftest import assert_same_metrics, kill_and_rerun, run_script
from tests.helpers import WORDS, end_biased_policy, prompts_and_rewards, read_metrics, write_sft_rows
from utils.config import parse_config
from utils.optim import build_optimizer, build_scheduler


def test_rows_from_sampler_tensors_equal_collate_sft():
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12]]
    responses = [[1, 2, END_ID], [3], [4, 5]]
    # as the sampler leaves them: one extra column of padding everywhere, masks marking the real tokens
    prompt_ids, prompt_mask = pad_prompts([[0] * 0 + p for p in prompts])
    prompt_ids = torch.cat([torch.full((3, 1), 50256), prompt_ids], 1)
    prompt_mask = torch.cat([torch.zeros(3, 1, dtype=torch.bool), prompt_mask], 1)
    response_ids = torch.full((3, 5), 50256)
    response_mask = torch.zeros(3, 5, dtype=torch.bool)
    for i, r in enumerate(responses):
        response_ids[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = True
    ours = prompt_response_rows(prompt_ids, prompt_mask, response_ids, response_mask)
    ref = collate_sft(prompts, responses)
    assert ours["prompt_len"] == ref["prompt_len"] == 4
    for key in ("input_ids", "attention_mask", "position_ids", "response_ids", "response_mask"):
        assert torch.equal(ours[key], ref[key]), key


def test_step_trains_the_policy_and_leaves_the_frozen_reference_alone():
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32))
    models = Models(policy, freeze(GPT2LMHeadModel(policy.cfg)), None)  # another random model: the KL is not 0
    before_ref = {k: v.clone() for k, v in models.reference.state_dict().items()}
    before_policy = {k: v.clone() for k, v in policy.state_dict().items()}
    cfg = Config(
        rewards="length",
        num_samples=8,
        num_kept=4,
        max_new_tokens=5,
        prompts_per_step=2,
        micro_batch_size=4,
        beta=0.1,
        lr=1e-2,
        warmup_steps=1,
    )
    optimizer = build_optimizer(policy, cfg.lr, 0.0)
    assert all(p.requires_grad for group in optimizer.param_groups for p in group["params"])
    prompts, spec = prompts_and_rewards(cfg)
    r = train_step(models, optimizer, build_scheduler(optimizer, 1, 10), prompts, spec, cfg, step=1)
    assert len(r.batches) == 2 and not any(b.ref_logprobs.requires_grad for b in r.batches)
    assert r.advantages.abs().max() > 0  # the length reward tells the samples apart
    assert all(p.grad is None for p in models.reference.parameters())
    assert all(torch.equal(v, before_ref[k]) for k, v in models.reference.state_dict().items())
    assert all(not torch.equal(v, before_policy[k]) for k, v in policy.state_dict().items())
    assert r.update["train/kl"] > 0 and r.update["train/clip_fraction"] == 0.0  # mu = 1: ratio exactly 1


def test_config_rejects_inconsistent_options():
    for argv in (["--selection", "top_bottom", "--num_kept", "3"], ["--num_kept", "65"], ["--temperature", "0"]):
        with pytest.raises(SystemExit):
            parse_config(Config, argv)
    assert parse_config(Config, ["--selection", "all"]).kept == 64


@pytest.mark.slow
def test_global_normalization_and_gradients_do_not_depend_on_world_size_micro_batches_or_prefix_sharing(tmp_path):
    # the reference: one process, one row per sample with its own copy of the prompt; the others pack each prompt
    # once for its samples (grpo --prefix_sharing), FSDP2 gathering and reduce-scattering through the packed forward
    cases = [(1, 8, "unshared"), (2, 4, "shared"), (2, 1, "shared"), (2, 3, "unshared")]
    for nproc in (1, 2):  # one launch per world size runs its cases, each from fresh models
        mine = [f"{micro}:{layout}" for n, micro, layout in cases if n == nproc]
        run_script(["tests/scripts/grpo_dist.py", str(tmp_path), *mine], nproc=nproc)
    results = {(n, micro, layout): torch.load(tmp_path / f"{n}_{micro}_{layout}.pt") for n, micro, layout in cases}
    ref = results[(1, 8, "unshared")]
    values = torch.randn(16, generator=torch.Generator().manual_seed(1))  # the script's vector
    assert torch.allclose(ref["global_norm"], global_normalize(values), atol=1e-6)
    local_only = torch.cat([global_normalize(values[:5]), global_normalize(values[5:])])
    assert not torch.allclose(local_only, ref["global_norm"], atol=1e-2)  # what per-rank normalization gives
    # the selection diagnostics: one process's are those of the whole batch; two processes reduce sums and counts
    pool = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))  # the script's groups: G = 4, top 3 kept
    pool[-1] = 0.25  # the last group tied, on rank 1 alone (ESS and tie share differ from a mean of the ranks' own)
    whole = selection_diagnostics(pool, pool.gather(1, select_top(pool, 3)[0]))
    assert ref["selection"] == {k: float(v) for k, v in whole.items()}
    assert ref["selection"]["tied_fraction"] == 1 / 5
    for key, r in results.items():
        assert torch.allclose(r["global_norm"], ref["global_norm"], atol=1e-6), key
        assert r["selection"].keys() == ref["selection"].keys(), key
        for name, v in ref["selection"].items():
            assert abs(r["selection"][name] - v) < 1e-12, (key, name)
        for loss_type in ("grpo", "bnpo", "dr_grpo"):
            assert abs(r[loss_type]["loss"] - ref[loss_type]["loss"]) < 1e-6, (key, loss_type)
            assert abs(r[loss_type]["kl"] - ref[loss_type]["kl"]) < 1e-6, (key, loss_type)
            for name, g in ref[loss_type]["grads"].items():
                assert torch.allclose(r[loss_type]["grads"][name], g, atol=1e-7, rtol=1e-4), (key, loss_type, name)
    grads = {t: torch.cat([g.flatten() for g in ref[t]["grads"].values()]) for t in ("grpo", "bnpo", "dr_grpo")}
    assert not torch.allclose(grads["grpo"], grads["bnpo"])  # the variants do differ on ragged lengths


# ----------------------------------------------------------------------------------------------------
# End to end


def write_prompt_rows(prompts_path, pref_path, n=48, seed=0):
    """TL;DR-shaped prompt rows and preference pairs made up on the spot."""
    rng, words = random.Random(seed), WORDS
    with open(prompts_path, "w") as f, open(pref_path, "w") as g:
        for _ in range(n):
            post = " ".join(rng.choice(words) for _ in range(rng.randint(10, 40)))
            subreddit, title = rng.choice(words), f"{rng.choice(words)} {rng.choice(words)}"  # drawn in this order
            prompt = f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
            chosen, rejected = (" " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(2))
            f.write(json.dumps({"prompt": prompt, "completion": chosen}) + "\n")
            g.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")


@pytest.mark.slow
def test_two_process_grpo_trains_every_parameter_and_resumes_exactly_after_sigkill(tmp_path):
    prompts, pref = tmp_path / "prompts.jsonl", tmp_path / "pref.jsonl"
    write_prompt_rows(prompts, pref)
    end_biased_policy(tmp_path / "policy", n_positions=128)
    full_run = tmp_path / "full"

    def args(run):
        return [
            "grpo.py",
            "--model",
            str(tmp_path / "policy"),
            "--reward_model",
            "tiny",
            "--reward_random_init",
            "true",
            "--train_data",
            str(prompts),
            "--val_data",
            str(prompts),
            "--pref_data",
            str(pref),
            "--pref_rows",
            "8",
            "--val_rows",
            "4",
            "--num_samples",
            "8",
            "--num_kept",
            "4",
            "--max_new_tokens",
            "12",
            "--max_prompt_len",
            "64",
            "--prompts_per_step",
            "4",
            "--micro_batch_size",
            "4",
            "--steps",
            "4",
            "--lr",
            "1e-3",
            "--warmup_steps",
            "1",
            "--beta",
            "0.1",
            "--eval_every",
            "2",
            "--save_every",
            "1",
            "--keep_last",
            "2",
            "--table_every",
            "1",
            "--wandb_mode",
            "disabled",
            "--out_dir",
            str(run),
        ]

    run_script(args(full_run), nproc=2)
    full = read_metrics(full_run)
    assert [m["step"] for m in full] == [0, 1, 2, 3, 4]
    assert "eval/reward" in full[0] and "eval/pref_accuracy" in full[-1]
    train = full[1:]
    # the missing-end penalty is the strongest reward signal a random reward model gives: the policy learns to end
    ends = [m["sample/end_fraction"] for m in train]
    assert 0 < ends[0] < 1 and ends[-1] > ends[0] + 0.2, ends
    assert train[-1]["reward/mean"] > train[0]["reward/mean"]
    assert train[0]["train/kl"] == 0.0 and train[-1]["train/kl"] > 0  # the policy moves away from the reference
    assert all(0 < m["rs/acceptance_rate"] <= 1 and m["rs/rounds_max"] >= 1 for m in train)
    assert (full_run / "samples.jsonl").is_file()

    trained = build_policy(str(full_run / "hf")).state_dict()
    initial = build_policy(str(tmp_path / "policy")).state_dict()
    unchanged = [k for k in initial if torch.equal(initial[k], trained[k])]
    assert not unchanged, unchanged

    # SIGKILL torchrun and both workers once a checkpoint of a random step exists (the kill lands mid-step or mid-save),
    # then rerun the same command: samples, selection, rewards, losses and evaluations equal the uninterrupted run's
    # to the last bit, and the sample tables read as one run.
    run = tmp_path / "run"
    kill_at = random.randint(1, 2)
    killed_at = kill_and_rerun(args(run), run, kill_at, nproc=2)
    keys = (
        "train/loss",
        "train/grad_norm",
        "train/kl",
        "reward/raw_mean",
        "reward/mean",
        "rs/acceptance_rate",
        "sample/response_length",
        "eval/reward",
        "eval/pref_accuracy",
    )
    assert_same_metrics(full, read_metrics(run), keys, f"SIGKILL after checkpoint {killed_at} (asked >= {kill_at})")
    tables = [(run_dir / "samples.jsonl").read_text() for run_dir in (full_run, run)]
    assert tables[0] == tables[1]


def test_summary_evaluation_gives_every_rank_as_many_prompts_and_padding_counts_for_nothing(tmp_path):
    """3 validation prompts over 2 ranks: each rank generates and scores 2 (the evaluation ends in all-reduces, so a
    rank with fewer prompts would desynchronise them), rank 1's second being a padding copy that no mean counts."""
    from evaluation.summaries import evaluate_summaries, load_eval_sets
    from rollouts.prompts import PromptSet

    data = write_sft_rows(tmp_path / "rows.jsonl", n=5)
    cfg = parse_config(
        Config,
        [
            "--val_data",
            str(data),
            "--val_rows",
            "3",
            "--pref_data",
            "",
            "--rewards",
            "length",
            "--max_new_tokens",
            "6",
            "--max_prompt_len",
            "64",
            "--out_dir",
            str(tmp_path / "run"),
        ],
    )
    tok = get_tokenizer()
    sets = [load_eval_sets(cfg, tok, cfg.sources(), rank, 2, torch.device("cpu"))[0] for rank in (0, 1)]
    assert [v.ids.shape[0] for v in sets] == [2, 2]
    assert [v.counted.tolist() for v in sets] == [[True, True], [True, False]]
    assert sets[0].rows + sets[1].rows[:1] == [0, 1, 2]  # every row once
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=128))
    spec = RewardSpec(cfg.sources(), cfg.normalize_reward_fns, tok)
    v = sets[1]
    alone = PromptSet(v.ids[:1], v.mask[:1], v.texts[:1], v.rows[:1], v.applies[:1], v.where)  # row 2 only
    out = evaluate_summaries(policy, None, spec, v, cfg, 0)
    assert out == evaluate_summaries(policy, None, spec, alone, cfg, 0)
    v.counted = None  # counting the padding copy too would move the means
    assert evaluate_summaries(policy, None, spec, v, cfg, 0) != out


@pytest.mark.parametrize("shared", [True, False])
def test_micro_batch_loss_compiles_as_one_graph_without_host_reads(shared):
    """The update's micro-batch (the policy forward, the chunked log-prob pass, the loss's terms and its sums) reads
    nothing back to the host: torch.compile(fullgraph=True) raises at a graph break, which a data-dependent read
    (.item(), bool(), a boolean index, nonzero) makes. Dynamo's capture alone (backend "eager", no code generation, so
    the test takes seconds); the compiled call gives the eager loss, sums and gradients."""
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16, n_positions=32))
    G, R = 3, 5
    prompt_ids, prompt_mask = pad_prompts([[5, 6, 7], [8, 9]], pad_id=0)
    lengths = torch.tensor([5, 2, 3, 1, 4, 5])
    response_mask = torch.arange(R)[None] < lengths[:, None]
    samples = SampleOutput(torch.randint(0, 64, (6, R)), response_mask, -torch.rand(6, R) * response_mask, lengths < R)
    cfg = Config(
        max_new_tokens=R,
        micro_batch_size=6,
        policy_epochs=2,
        rollout_correction="tis",
        entropy_coef=0.01,
        importance_level="sequence",
        top_k=20,
        temperature=0.9,
    )
    (batch,) = build_training_batches(prompt_ids, prompt_mask, samples, torch.arange(6), torch.randn(6), G, 6, shared)
    batch = replace(batch, ref_logprobs=-torch.rand(6, R), old_logprobs=-torch.rand(6, R))
    w, _ = AGGREGATIONS[cfg.loss_type](batch.response_mask, R)
    results = []
    for fn in (micro_batch_loss, torch.compile(micro_batch_loss, fullgraph=True, backend="eager")):
        policy.zero_grad(set_to_none=True)
        loss, sums, maxima = fn(policy, batch, w, cfg.objective(), cfg, True)
        loss.backward()
        results.append((loss.detach(), sums, maxima, [p.grad.clone() for p in policy.parameters()]))
    (eager_loss, eager_sums, eager_max, eager_grads), (loss, sums, maxima, grads) = results
    assert eager_loss != 0 and torch.equal(loss, eager_loss)
    assert sums.keys() == eager_sums.keys() and all(torch.equal(sums[k], eager_sums[k]) for k in sums)
    assert torch.equal(maxima["mismatch_gap_max"], eager_max["mismatch_gap_max"])
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))
