"""What FSDP does per forward on a one-rank gloo group (the counts do not depend on the world size): frozen models
keep no per-forward records, the LoRA reference (the policy with adapters off) is gathered once for all its
micro-batches, and the sampler asks the host whether every row has finished only every few tokens."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from data.tldr import prompt_response_rows
from model.gpt2 import GPT2LMHeadModel, GPTConfig
from model.heads import RewardModel
from model.lora import AdaptersOff, LoRAConfig, apply_lora
from model.sampler import generate
from model.weights import freeze
from rlhf.losses import preference_loss
from rollouts.batches import MicroBatch
from rollouts.update import batch_logprobs
from training.reference import build_policy_and_reference
from utils.fsdp import forward_order_records, gathered_params, shard_model

CFG = GPTConfig(vocab_size=512, n_positions=64, n_layer=2, n_head=2, n_embd=32)
UNITS = CFG.n_layer + 1  # one FSDP unit per block, plus the root


@pytest.fixture
def all_gathers(monkeypatch):
    """Counts FSDP2's unshards of a unit: on two or more ranks each is one all-gather (one rank skips the collective
    itself, so the count is taken where the gathered parameters are put in place, a private FSDP2 method)."""
    calls = []
    real = _fsdp_param_group.FSDPParamGroup._to_unsharded

    def counting(group):
        if not group.is_unsharded:
            calls.append(1)
        return real(group)

    monkeypatch.setattr(_fsdp_param_group.FSDPParamGroup, "_to_unsharded", counting)
    return calls


def rows(n=4, T=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (n, T), generator=g)
    mask = torch.arange(T)[None] >= torch.randint(0, 3, (n, 1), generator=g)  # (n, T) left padding
    return ids, (mask.long().cumsum(1) - 1).clamp(min=0), mask


def test_frozen_models_keep_no_forward_records(one_rank_group):
    """FSDP2 appends every unit to a forward-order list at each forward and only a backward clears it: a frozen
    reference or reward model would grow it by 2 x units entries per forward for the whole run."""
    torch.manual_seed(0)
    frozen = shard_model(freeze(RewardModel(CFG)))
    trained = shard_model(GPT2LMHeadModel(CFG))
    ids, pos, mask = rows()
    with torch.no_grad():
        for _ in range(5):
            frozen(ids, pos, mask)
            trained(ids, pos, mask)
        with gathered_params(frozen):
            for _ in range(5):
                frozen(ids, pos, mask)
    assert forward_order_records(trained) == 2 * 5 * UNITS  # what a model that trains keeps until its backward
    assert forward_order_records(frozen) == 0


def test_lora_reference_is_gathered_once_for_all_micro_batches(one_rank_group, all_gathers):
    """GRPO's stage 6 keeps the frozen reference's parameters gathered over its micro-batches; with LoRA the reference
    is AdaptersOff(policy), whose own modules hold no FSDP unit, so the policy is the one to gather."""
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(CFG)
    apply_lora(policy, LoRAConfig(lora_rank=4))
    shard_model(policy)
    ids, pos, mask = rows(n=6)
    response_ids = torch.randint(0, CFG.vocab_size, (6, 5))
    real = torch.ones(2, 5, dtype=torch.bool)
    rows_of = [
        prompt_response_rows(ids[i : i + 2], mask[i : i + 2], response_ids[i : i + 2], real) for i in range(0, 6, 2)
    ]  # 3 micro-batches
    batches = [MicroBatch.from_rows(r, torch.zeros(2), torch.zeros(2, 5), torch.arange(2)) for r in rows_of]
    cfg = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0)
    gathered = batch_logprobs(AdaptersOff(policy), batches, cfg, gather=True)
    assert len(all_gathers) == UNITS  # once per unit, not once per unit per micro-batch
    all_gathers.clear()
    per_block = batch_logprobs(AdaptersOff(policy), batches, cfg, gather=False)
    # per block: the blocks once per micro-batch; the root of a model that trains stays gathered after its first
    # forward (it reshards only when its backward or an optimizer step comes), so it is gathered once
    assert len(all_gathers) == 3 * (UNITS - 1) + 1
    for a, b in zip(gathered, per_block, strict=True):
        assert torch.equal(a, b)


def test_sampler_checks_for_finished_rows_every_few_tokens_with_the_same_rows():
    """On a GPU each `bool(done.all())` waits for the device; checking every k tokens lets finished rows step on
    padding a little longer and must not change any row's tokens, mask or log-probs."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CFG).eval()
    with torch.no_grad():  # the final hidden state is a fixed unit vector d and the logit of "\n" (198) is 6 above
        d = torch.ones(CFG.n_embd) / CFG.n_embd**0.5  # the others' (about 0): each token ends a row with p ~ 0.44
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(d)
        model.transformer.wte.weight[198] = 6 * d
    ids, _, mask = rows(n=3)
    calls = []
    model.register_forward_hook(lambda m, a, out: calls.append(1))
    out = {}
    for every in (1, 4):
        calls.clear()
        out[every] = generate(
            model, ids, mask, 4, 40, generator=torch.Generator().manual_seed(1), done_check_every=every
        )
        out[every] = (out[every], len(calls))
    (one, forwards_1), (four, forwards_4) = out[1], out[4]
    assert bool(one.has_end.all()) and one.response_mask.sum(1).max() < 30
    for field in ("response_ids", "response_mask", "logprobs", "has_end"):
        assert torch.equal(getattr(one, field), getattr(four, field)), field
    last = int(one.response_mask.sum(1).max())  # tokens decoded until every row finished
    assert forwards_1 == last  # the prefill and one forward per token after the first, up to the last row's end
    assert forwards_4 == 4 * -(-last // 4)  # decoding runs on to the next multiple of 4 tokens


# ----------------------------------------------------------------------------------------------------
# The same checks on a GPU (pytest -m gpu, bench/gpu_all.sh): what only CUDA shows


@pytest.fixture
def one_gpu_group():
    from utils.dist import cleanup_distributed, setup_distributed

    cleanup_distributed()
    setup_distributed("cuda")
    yield
    cleanup_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sampler_checks_every_8_tokens_by_default_with_the_same_rows():
    from model.sampler import DONE_CHECK_EVERY_GPU

    torch.manual_seed(0)
    model = GPT2LMHeadModel(CFG).cuda().eval()
    with torch.no_grad():
        d = torch.ones(CFG.n_embd, device="cuda") / CFG.n_embd**0.5
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(d)
        model.transformer.wte.weight[198] = 6 * d
    ids, _, mask = (t.cuda() for t in rows(n=3))
    calls = []
    model.register_forward_hook(lambda m, a, out: calls.append(1))
    outs = []
    for every in (1, None):  # None: the GPU default
        calls.clear()
        outs.append(
            (
                generate(
                    model, ids, mask, 4, 40, generator=torch.Generator("cuda").manual_seed(1), done_check_every=every
                ),
                len(calls),
            )
        )
    (one, forwards_1), (default, forwards_default) = outs
    for field in ("response_ids", "response_mask", "logprobs", "has_end"):
        assert torch.equal(getattr(one, field), getattr(default, field)), field
    last = int(one.response_mask.sum(1).max())
    assert forwards_1 == last and forwards_default == min(40, DONE_CHECK_EVERY_GPU * -(-last // DONE_CHECK_EVERY_GPU))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_reward_head_is_fp32_and_frozen_models_keep_no_records(one_gpu_group):
    torch.manual_seed(0)
    model = freeze(RewardModel(CFG))
    with torch.no_grad():
        model.score.weight.mul_(40)
    shard_model(model.cuda(), torch.bfloat16)
    ids, pos, mask = (t.cuda() for t in rows(n=64))
    with torch.no_grad():
        for _ in range(3):
            scores = model(ids, pos, mask)
    assert scores.dtype == torch.float32 and scores.abs().max() > 5
    assert not torch.equal(scores.bfloat16().float(), scores)  # off the bf16 grid
    assert forward_order_records(model) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dpo_reference_dtype_auto_is_fp32_under_dtype_fp32(one_gpu_group, tmp_path):
    """On a GPU --reference_dtype auto under --dtype fp32 keeps the reference in fp32, as the policy: the first loss is
    log 2."""
    import math

    import dpo
    from data.tldr import collate_pairs
    from utils.config import parse_config

    cfg = parse_config(
        dpo.Config, ["--model", "tiny", "--random_init", "true", "--dtype", "fp32", "--out_dir", str(tmp_path / "run")]
    )
    run = SimpleNamespace(say=lambda message: None, device=torch.device("cuda"), dtype=None)
    torch.manual_seed(0)
    policy, reference = build_policy_and_reference(cfg, run)
    assert {p.dtype for p in reference.parameters()} == {torch.float32}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50000, (12,), generator=g).tolist() for _ in range(4)]
    chosen = [torch.randint(0, 50000, (6,), generator=g).tolist() for _ in range(4)]
    rejected = [torch.randint(0, 50000, (5,), generator=g).tolist() for _ in range(4)]
    batch = collate_pairs(prompts, chosen, rejected)
    losses, _ = dpo.pair_losses(policy, reference, batch, preference_loss(cfg), cfg.beta, run.device)
    assert torch.allclose(losses, torch.full_like(losses, math.log(2.0)), rtol=0, atol=1e-6), losses


def test_every_unit_is_sharded_on_a_mesh_of_the_runs_device_type(one_rank_group, monkeypatch):
    """fully_shard's default mesh follows the machine's accelerator, not the process group: on a machine with a GPU a
    gloo (CPU) run would shard onto the GPU. shard_model passes a mesh of the run's device type; with the accelerator
    reported as CUDA (as on a GPU machine), sharding still happens on a cpu mesh (FSDP2's default would fail here)."""
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    torch.manual_seed(0)
    model = shard_model(GPT2LMHeadModel(CFG))
    meshes = {p.device_mesh.device_type for p in model.parameters()}
    assert meshes == {"cpu"}
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_reshard_settings_are_the_ones_shard_model_gave_and_come_back_after_a_gathered_block(one_rank_group):
    from torch.distributed.fsdp import FSDPModule

    from utils.fsdp import reshards_after_forward

    torch.manual_seed(0)
    trained = shard_model(GPT2LMHeadModel(CFG))
    frozen = shard_model(freeze(GPT2LMHeadModel(CFG)))

    def settings(model):
        return [reshards_after_forward(m) for m in model.modules() if isinstance(m, FSDPModule)]

    # blocks come first in modules() order after the root: [root, block 0, block 1]
    assert settings(trained) == [False, True, True]  # a training root stays gathered from forward to backward
    assert settings(frozen) == [True, True, True]
    ids, pos, mask = rows()
    with gathered_params(trained), torch.no_grad():
        assert settings(trained) == [False, False, False]
        trained(ids, pos, mask)
    assert settings(trained) == [False, True, True]
    # what FSDP2 does matches the recorded setting: after a frozen forward every unit is resharded
    with torch.no_grad():
        frozen(ids, pos, mask)
    assert all(
        not m._get_fsdp_state()._fsdp_param_group.is_unsharded  # noqa: SLF001 (FSDP2's own view)
        for m in frozen.modules()
        if isinstance(m, FSDPModule)
    )


def test_dpo_reference_is_gathered_once_per_step(one_rank_group, monkeypatch):
    """DPO's frozen reference is gathered once for all the micro-batches of a step (as GRPO's frozen models are), not
    once per micro-batch; the policy, which trains, is gathered in every micro-batch's forward."""
    import dpo
    from data.tldr import collate_pairs

    unshards = []
    real = _fsdp_param_group.FSDPParamGroup._to_unsharded

    def counting(group):
        if not group.is_unsharded:
            unshards.append(group)
        return real(group)

    monkeypatch.setattr(_fsdp_param_group.FSDPParamGroup, "_to_unsharded", counting)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50257, n_positions=64, n_layer=2, n_head=2, n_embd=16)  # pairs end in GPT-2's end token
    policy = shard_model(GPT2LMHeadModel(cfg))
    reference = shard_model(freeze(GPT2LMHeadModel(cfg)))
    ref_groups = {
        id(m._get_fsdp_state()._fsdp_param_group) for m in reference.modules() if hasattr(m, "_get_fsdp_state")
    }
    g = torch.Generator().manual_seed(0)

    def pairs():
        return [torch.randint(0, 50000, (n,), generator=g).tolist() for n in (7, 5)]

    micro = [collate_pairs(pairs(), pairs(), pairs()) for _ in range(3)]  # 3 micro-batches of 2 pairs
    loss_fn = preference_loss(dpo.Config())
    dpo.accumulate_gradients(policy, reference, micro, 1, 6, loss_fn, 0.1, torch.device("cpu"))
    from_reference = [grp for grp in unshards if id(grp) in ref_groups]
    assert len(from_reference) == UNITS  # once per unit for the whole step
    assert len(unshards) - len(from_reference) >= 3 * CFG.n_layer  # the policy's blocks: every micro-batch's forward


def test_judge_and_frontier_reward_models_keep_no_forward_records(one_rank_group, tmp_path):
    """--judge's reward model (evaluation/samples.py Judge) and --frontier_reward_model's (evaluation/frontier.py
    Frontier) are frozen before they are sharded, so shard_model gives them the hook that empties FSDP2's per-forward
    records: after any number of forwards they hold none (sharded before freezing, each forward adds 2 x units)."""
    from data.synthetic import write_task
    from data.tokenizer import get_tokenizer
    from evaluation.frontier_declarations import FrontierConfig
    from evaluation.measure import Frontier
    from evaluation.samples import Judge, JudgeConfig
    from model.gpt2 import PRESETS
    from model.weights import save_hf

    paths = write_task(tmp_path / "data", seed=0)
    torch.manual_seed(0)
    folder = tmp_path / "rm" / "hf"
    save_hf(RewardModel(PRESETS["tiny"]).state_dict(), PRESETS["tiny"], folder)
    tok = get_tokenizer()
    cpu = torch.device("cpu")
    judge = Judge(JudgeConfig(judge=str(folder), summary_data=str(paths["sft_validation"]), summary_rows=2), tok, 64,
                  None, cpu, 2, seed=0)  # fmt: skip
    frontier_cfg = SimpleNamespace(
        **vars(FrontierConfig(frontier_prompts=2, frontier_reward_model=str(folder))), seed=0
    )
    run = SimpleNamespace(dtype=None, device=cpu)
    frontier = Frontier(frontier_cfg, str(paths["sft_validation"]), "", tok, 64, 8, run)
    units = PRESETS["tiny"].n_layer + 1
    ids = torch.randint(0, 50000, (2, 12), generator=torch.Generator().manual_seed(0))
    pos, mask = torch.arange(12).expand(2, 12), torch.ones(2, 12, dtype=torch.bool)
    for model in (judge.model, frontier.reward_model):
        assert sum(1 for m in model.modules() if hasattr(m, "_get_fsdp_state")) == units
        with torch.no_grad():
            for _ in range(5):
                model(ids, pos, mask)
        assert forward_order_records(model) == 0
