"""LoRA (model/lora.py): starts equal to the base, trains only the adapters, the adapters-off reference equals a
frozen copy of the base, merging keeps the function and exports a plain GPT-2; two-process FSDP2 over gloo."""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers

import sft
from model.gpt2 import PRESETS, GPT2LMHeadModel, GPTConfig
from model.lora import (
    AdaptersOff,
    LoRAConfig,
    LoRALinear,
    adapters_disabled,
    apply_lora,
    gpt2_param_count,
    lora_memory_report,
    lora_modules,
    lora_param_count,
    lora_scalings,
    merge_adapters_,
    merged_state_dict,
)
from model.weights import save_hf
from tests.conftest import run_script
from tests.helpers import (
    adapted_weight_names,
    changed_weights,
    pair_run_args,
    read_metrics,
    write_pref_rows,
    write_sft_rows,
)
from utils.config import parse_config
from utils.optim import build_optimizer

CFG = GPTConfig(vocab_size=512, n_positions=64, n_layer=2, n_head=2, n_embd=32)


def batch(B=4, T=10, seed=0):
    """Left-padded rows with GPT-2 positions counting real tokens only."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :3] = False
    mask[2, :1] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return ids, pos, mask


def token_logprobs(model, ids, pos, mask):
    """log p(token t+1 | tokens <= t) at every position (B, T-1)."""
    logits = model(ids, pos, mask)[:, :-1]
    return torch.gather(F.log_softmax(logits.float(), -1), 2, ids[:, 1:, None]).squeeze(-1)


def train_steps(model, n=3, lr=1e-2):
    """A few AdamW steps on the next-token loss: the adapters become non-zero."""
    optimizer = build_optimizer(model, lr, 0.0)
    ids, pos, mask = batch(seed=1)
    for _ in range(n):
        loss = -token_logprobs(model, ids, pos, mask)[mask[:, 1:]].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def lora_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    base = GPT2LMHeadModel(CFG)
    policy = apply_lora(copy.deepcopy(base), LoRAConfig(lora_rank=4, lora_alpha=8.0, **kwargs))
    return base, policy


def test_lora_starts_equal_to_the_base_and_trains_only_the_adapters():
    base, policy = lora_model()
    ids, pos, mask = batch()
    with torch.no_grad():
        assert torch.equal(policy(ids, pos, mask), base(ids, pos, mask))  # B = 0: exactly the base function
    names = {n for n, p in policy.named_parameters() if p.requires_grad}
    targets = [
        f"transformer.h.{i}.{m}"
        for i in range(CFG.n_layer)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert names == {f"{t}.{ab}" for t in targets for ab in ("lora_A", "lora_B")}
    # the state dict is the base's (same names) plus two keys per target
    assert set(policy.state_dict()) == set(base.state_dict()) | names
    optimizer = train_steps(policy)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in policy.named_parameters() if n in names
    }
    after = policy.state_dict()
    for k, v in base.state_dict().items():
        assert torch.equal(after[k], v), k  # the base weights did not move
    for m in lora_modules(policy).values():
        assert m.lora_B.abs().max() > 0  # B left zero and A moved from its initialisation (from the 2nd step)
    assert policy.lm_head.weight is policy.transformer.wte.weight  # still tied


def test_reference_logprobs_with_adapters_off_equal_a_separate_frozen_copy_of_the_base():
    base, policy = lora_model()
    reference = base.requires_grad_(False)  # what dpo.py / grpo.py keep without LoRA: a frozen copy of the start
    train_steps(policy)
    ids, pos, mask = batch(seed=2)
    with torch.no_grad():
        expected = token_logprobs(reference, ids, pos, mask)
        with adapters_disabled(policy):
            off = token_logprobs(policy, ids, pos, mask)
        via_module = token_logprobs(AdaptersOff(policy), ids, pos, mask)
        on = token_logprobs(policy, ids, pos, mask)
    assert torch.equal(off, expected) and torch.equal(via_module, expected)  # bit for bit, not approximately
    assert (on - expected).abs().max() > 1e-3  # the trained policy differs from its reference
    assert all(m.adapter_enabled for m in lora_modules(policy).values())  # switched back on after the block
    assert list(AdaptersOff(policy).parameters()) == []  # no second copy, nothing for an optimizer to find


def test_merge_keeps_the_function_and_the_export_is_a_plain_gpt2_for_transformers(tmp_path):
    _, policy = lora_model(lora_dropout=0.1)
    train_steps(policy)
    policy.eval()  # dropout off
    ids, pos, mask = batch(seed=3)
    with torch.no_grad():
        adapted = policy(ids, pos, mask)
    merged = merged_state_dict(policy.state_dict(), lora_scalings(policy))
    assert not any("lora" in k for k in merged)
    save_hf(merged, CFG, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
    assert (theirs - adapted)[mask].abs().max() < 1e-4

    merge_adapters_(policy)  # in place: the reference refresh of grpo.py
    with torch.no_grad():
        assert (policy(ids, pos, mask) - adapted).abs().max() < 1e-4
        on = token_logprobs(policy, ids, pos, mask)
        with adapters_disabled(policy):
            off = token_logprobs(policy, ids, pos, mask)
    assert torch.equal(on, off)  # B = 0 again: a refreshed reference gives a KL of exactly zero
    assert all(torch.equal(m.lora_B, torch.zeros_like(m.lora_B)) for m in lora_modules(policy).values())


def test_targets_select_projections_and_bad_options_are_refused():
    torch.manual_seed(0)
    model = apply_lora(GPT2LMHeadModel(CFG), LoRAConfig(lora_rank=2, lora_targets="attn.c_proj"))
    assert sorted(lora_modules(model)) == ["transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"]
    model = apply_lora(GPT2LMHeadModel(CFG), LoRAConfig(lora_rank=2, lora_targets="c_proj"))
    assert len(lora_modules(model)) == 2 * CFG.n_layer  # attn.c_proj and mlp.c_proj
    assert isinstance(model.transformer.h[0].mlp.c_proj, LoRALinear)
    for bad in (dict(lora_rank=-1), dict(lora_rank=4, lora_targets="wte"), dict(lora_rank=4, lora_dropout=1.0)):
        with pytest.raises(ValueError):
            LoRAConfig(**bad).validate_lora()
    LoRAConfig(lora_rank=0, lora_targets="nonsense").validate_lora()  # disabled: targets unused


def test_parameter_counts_match_the_model():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CFG)
    assert gpt2_param_count(CFG) == sum(p.numel() for p in model.parameters())  # tied head counted once
    apply_lora(model, LoRAConfig(lora_rank=4, lora_targets="c_attn,c_fc"))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_param_count(CFG, 4, "c_attn,c_fc") == adapters
    report = lora_memory_report(PRESETS["gpt2"], 8)
    assert report["params"] == 124_439_808  # GPT-2 124M
    assert report["adapter_params"] == 12 * 8 * (768 + 3 * 768 + 768 + 768 + 768 + 4 * 768 + 4 * 768 + 768)


@pytest.mark.slow
def test_two_process_fsdp_lora_trains_adapters_only_and_matches_one_process(tmp_path):
    from tests.scripts import lora_dist

    lora_dist.main(str(tmp_path / "1.pt"), str(tmp_path / "hf1"))  # one process: this one, its own one-rank group
    run_script(["tests/scripts/lora_dist.py", str(tmp_path / "2.pt"), str(tmp_path / "hf2")], nproc=2)
    results = {nproc: torch.load(tmp_path / f"{nproc}.pt") for nproc in (1, 2)}
    one, two = results[1], results[2]
    for r in (one, two):
        assert r["ref_equal"] and r["merged_off_equals_on"], r
        assert r["base_unchanged"] and r["adapters_changed"]
        assert r["merge_error"] < 1e-5  # in-place merge of sharded DTensors == merge of the full state dict
    assert abs(one["loss"] - two["loss"]) < 1e-5
    for k, v in one["adapters"].items():
        assert torch.allclose(two["adapters"][k], v, atol=1e-6), k
    # the export of the 2-process run is a plain GPT-2 computing the adapted function
    from model.weights import build_policy

    exported = build_policy(str(tmp_path / "hf2")).eval()
    ids, pos, mask = two["eval_rows"]
    with torch.no_grad():
        assert (exported(ids, pos, mask) - two["logits"])[mask].abs().max() < 1e-4


# ----------------------------------------------------------------------------------------------------
# The stages with --lora_rank


def test_every_option_of_the_lora_stages_is_documented():
    import dataclasses

    import dpo
    import grpo
    import sft
    from utils.config import field_docs

    for cls in (sft.Config, dpo.Config, grpo.Config):
        assert set(field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}, cls.__module__
        assert {"lora_rank", "lora_alpha", "lora_dropout", "lora_targets"} <= set(field_docs(cls))


@pytest.mark.slow
def test_two_process_dpo_with_lora_starts_at_its_reference_and_trains_only_the_adapters(tmp_path):
    import json
    import math

    data = write_pref_rows(tmp_path / "pairs.jsonl")
    torch.manual_seed(0)
    init = tmp_path / "sft"
    start = GPT2LMHeadModel(GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=128))
    save_hf(start.state_dict(), start.cfg, init)
    run = tmp_path / "run"
    run_script(
        [
            "dpo.py",
            "--model",
            str(init),
            "--lora_rank",
            "4",
            "--lora_alpha",
            "8",
            "--lr",
            "1e-2",
            "--eval_every",
            "5",
            *pair_run_args(data, run, 5),
        ],
        nproc=2,
    )
    m = read_metrics(run)
    # the reference is the policy with adapters off, and B = 0 at the start: every pair ties, the loss is log 2
    assert m[0]["val/bt_loss"] == pytest.approx(math.log(2), abs=1e-6) and m[0]["val/n_ties"] == 16
    assert m[1]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert m[5]["val/bt_loss"] < math.log(2) - 0.02 and m[5]["train/reward_margin"] > 0
    # the export is a plain GPT-2 whose adapted projections, and nothing else, moved
    assert changed_weights(init, run / "hf") == adapted_weight_names(start.cfg)
    assert json.loads((run / "checkpoints" / "step_00000005" / "meta.json").read_text())["lora"]["rank"] == 4


@pytest.mark.slow
def test_sft_with_lora_lowers_the_loss_and_exports_merged_weights(tmp_path, capsys):
    data = write_sft_rows(tmp_path / "rows.jsonl", n=16)
    torch.manual_seed(0)
    init = tmp_path / "init"
    start = GPT2LMHeadModel(GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=128))
    save_hf(start.state_dict(), start.cfg, init)
    run = tmp_path / "run"
    sft.main(  # in this process: `python sft.py ...` without the start-up
        parse_config(
            sft.Config,
            [
                "--model",
                str(init),
                "--lora_rank",
                "8",
                "--lora_targets",
                "c_attn,c_fc",
                "--train_data",
                str(data),
                "--val_data",
                "",
                "--steps",
                "4",
                "--batch_size",
                "8",
                "--micro_batch_size",
                "8",
                "--lr",
                "1e-2",
                "--warmup_steps",
                "1",
                "--max_prompt_len",
                "64",
                "--wandb_mode",
                "disabled",
                "--out_dir",
                str(run),
            ],
        )
    )
    assert "LoRA adapters on 4 projections" in capsys.readouterr().out
    m = read_metrics(run)
    assert m[-1]["train/loss"] < m[0]["train/loss"] - 0.05
    assert changed_weights(init, run / "hf") == {
        f"transformer.h.{i}.{n}.weight" for i in range(2) for n in ("attn.c_attn", "mlp.c_fc")
    }


@pytest.mark.slow
def test_ranks_start_identical_then_draw_different_dropout_masks(tmp_path):
    """The common seed builds the same model on every rank; after resume() each rank's global RNG is seeded from
    (seed, rank), so LoRA dropout masks differ between ranks (identical masks would make the ranks' micro-batches
    share their dropout noise); a model built later from run.init_rng is again the same on every rank."""
    out = tmp_path / "rng.pt"
    run_script(["tests/scripts/rank_rng.py", str(out), str(tmp_path / "run")], nproc=2, timeout=120)
    r = torch.load(out)
    assert r["start_equal"] and r["later_equal"]
    assert not r["masks_equal"]
    assert 0.3 < r["kept_fraction"] < 0.7  # dropout 0.5 did drop about half
