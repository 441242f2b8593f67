"""Device memory of a GRPO step, estimated from the model's shape and the run's sizes before any weight is loaded,
so that a configuration that cannot fit stops before the first step with one line naming the option to lower,
instead of running out of memory in the middle of a run.

The estimates are upper-bound arithmetic on the tensors each stage keeps alive (no allocator fragmentation, no
framework workspace; `check_memory` keeps a 10% margin for those):

- weights: the policy's fp32 parameters, gradients and two AdamW moments (16 bytes per parameter), and the frozen
  reference and reward model, whose sharded parameters FSDP also keeps in fp32 (mixed precision casts a gathered copy
  to the compute dtype, not the stored shard; 0 on the device with --frozen_cpu_offload), all sharded over the ranks.
  A block-sized FSDP unit gathered while in use is left to the margin.
- generate: the policy gathered whole for the call (utils/fsdp.gathered_params: every parameter in the compute dtype
  on every rank), and the KV cache, keys and values of every layer, 2 * n_layer * n_embd values per cached position.
  Without prefix sharing every sample holds its prompt: gen_prompts * G * (P + new) positions; with it each prompt is
  held once: gen_prompts * (P + G * new). Plus the (rows, vocabulary) fp32 logits the sampler processes per step
  (at most four alive at once: logits, processed, probabilities, the last step's probabilities).
- update: activations per transformer layer, 34 bytes per token and channel at 16-bit precision (Korthikanti et al.,
  arXiv 2205.05198, table 2, with an attention kernel that keeps no (T, T) score matrix), i.e. 17 values per token
  and channel in the compute dtype; with activation checkpointing only each block's input is kept, plus one block's
  activations recomputed in the backward. Tokens are the micro-batch's rows x (P + R), or with prefix sharing its
  prompts x P + rows x R plus each row's copy of its prompt's keys and values (model/gpt2.py's SharedPrefix). Plus
  the response logits and their fp32 gradient. When a step has more than one micro-batch per rank, FSDP2 keeps the
  unsharded fp32 gradient of every trained parameter between micro-batches (no reduce-scatter until the last one).
  Under --deterministic the math attention kernel keeps each layer's (T, T) scores and probabilities per head for
  the backward (two per layer in the compute dtype; one layer's with activation checkpointing).
- score: the reward model gathered whole for the scoring (4 bytes per parameter in fp32, else the compute dtype) and
  its forward of a score micro-batch without gradient: a few (tokens, 4 * n_embd) temporaries of one layer at a
  time, counted as 8 values per token and channel.
- reference: the same for the frozen reference's log-probs of one training micro-batch, plus its fp32 response
  logits (none with LoRA: the reference is the policy with its adapters off).
- --compile: the compiled decode step's copy of the policy's weights (model.sampler.static_weights) and its KV caches
  (model.sampler.DecodeBuffers, one per decode shape) stay allocated from the first generate call to the end of the
  run, beside every stage: counted with the weights, the caches at every prompt-width bucket up to --max_prompt_len's
  for --gen_prompts prompts (a run whose calls also take other numbers of prompts keeps more), and for each bucket
  the memory pool of its recorded decode steps on a GPU (model.sampler.StepGraph: one step's scratch, its four
  (rows, vocabulary) fp32 tensors at most; counted on a CPU too, where no pool exists: the estimate is for the GPU).
"""

from dataclasses import dataclass

import torch

from model.gpt2 import GPTConfig
from model.sampler import PROMPT_BUCKETS, bucket_width
from rollouts.options import keeps_start
from utils.config import ConfigError

GiB = 2**30
MARGIN = 0.9  # share of the free memory the estimate may use


def param_count(cfg: GPTConfig) -> int:
    """Parameters of a GPT-2 (tied head counted once): embeddings, 12 C^2 + 13 C per block, final layer norm."""
    C, L = cfg.n_embd, cfg.n_layer
    return cfg.vocab_size * C + cfg.n_positions * C + L * (12 * C * C + 13 * C) + 2 * C


def kv_cache_bytes(
    cfg: GPTConfig, prompts: int, samples: int, prompt_len: int, new_tokens: int, dtype_bytes: int, prefix_sharing: bool
) -> int:
    """Keys and values of one generate call of `prompts` prompts (prompt_len columns) x `samples` samples."""
    per_position = 2 * cfg.n_layer * cfg.n_embd * dtype_bytes
    if prefix_sharing:
        positions = prompts * prompt_len + prompts * samples * new_tokens
    else:
        positions = prompts * samples * (prompt_len + new_tokens)
    return positions * per_position


def generate_bytes(
    cfg: GPTConfig, prompts: int, samples: int, prompt_len: int, new_tokens: int, dtype_bytes: int, prefix_sharing: bool
) -> int:
    """KV cache plus the sampler's (rows, vocabulary) fp32 tensors of one decode step, four at most."""
    logits = 4 * prompts * samples * cfg.vocab_size * 4
    return kv_cache_bytes(cfg, prompts, samples, prompt_len, new_tokens, dtype_bytes, prefix_sharing) + logits


def attention_scores_bytes(
    cfg: GPTConfig, rows: int, prompts: int, prompt_len: int, response_len: int, dtype_bytes: int, prefix_sharing: bool
) -> int:
    """One layer's (queries, keys) attention scores and probabilities of every head, as the math kernel keeps them for
    the backward (--deterministic). With prefix sharing each prompt attends to itself once and each response to its
    prompt and itself."""
    if prefix_sharing:
        pairs = prompts * prompt_len * prompt_len + rows * response_len * (prompt_len + response_len)
    else:
        pairs = rows * (prompt_len + response_len) ** 2
    return 2 * cfg.n_head * pairs * dtype_bytes


def update_bytes(
    cfg: GPTConfig,
    rows: int,
    prompts: int,
    prompt_len: int,
    response_len: int,
    dtype_bytes: int,
    prefix_sharing: bool,
    checkpointing: bool,
    math_attention: bool = False,
) -> int:
    """Activations and response logits of one training micro-batch of `rows` sequences from `prompts` prompts;
    `math_attention`: the (T, T) scores the math kernel keeps (--deterministic)."""
    C, L = cfg.n_embd, cfg.n_layer
    tokens = prompts * prompt_len + rows * response_len if prefix_sharing else rows * (prompt_len + response_len)
    per_layer = 17 * tokens * C * dtype_bytes
    if prefix_sharing:  # every row's copy of its prompt's keys and values, saved for the attention's backward
        per_layer += 2 * rows * prompt_len * C * dtype_bytes
    if math_attention:
        per_layer += attention_scores_bytes(cfg, rows, prompts, prompt_len, response_len, dtype_bytes, prefix_sharing)
    activations = L * tokens * C * dtype_bytes + per_layer if checkpointing else L * per_layer
    logits = rows * response_len * cfg.vocab_size * (dtype_bytes + 4)  # logits and their fp32 gradient
    return activations + logits


def score_bytes(
    cfg: GPTConfig, rows: int, prompts: int, prompt_len: int, response_len: int, dtype_bytes: int, prefix_sharing: bool
) -> int:
    """The reward model's forward of one score micro-batch (no gradient)."""
    tokens = prompts * prompt_len + rows * response_len if prefix_sharing else rows * (prompt_len + response_len)
    return 8 * tokens * cfg.n_embd * dtype_bytes


def weight_bytes(
    policy: GPTConfig,
    reward_model: GPTConfig | None,
    world: int,
    lora: bool,
    frozen_offload: bool = False,
    start_copy: bool = False,
) -> int:
    """Policy (fp32 weights, gradients, AdamW moments; with LoRA the frozen base alone, the adapters are small),
    reference (none with LoRA: the policy with adapters off), reward model and, with `start_copy`, the frozen copy of
    the starting policy (rollouts.options.keeps_start) (fp32 shards, as FSDP keeps them; on the host with
    `frozen_offload`), sharded over `world` ranks."""
    n = param_count(policy)
    total = n * (4 if lora else 16)
    if not frozen_offload:
        total += (0 if lora else n * 4) + (param_count(reward_model) * 4 if reward_model is not None else 0)
        total += n * 4 if start_copy else 0
    return total // world


def no_sync_grad_bytes(policy: GPTConfig, micro_batches: int, lora: bool) -> int:
    """The unsharded fp32 gradients FSDP2 accumulates between the micro-batches of one optimizer step (none with a
    single micro-batch, whose backward reduce-scatters at once; LoRA's adapters are small)."""
    return 0 if micro_batches <= 1 or lora else param_count(policy) * 4


@dataclass
class StepMemory:
    """Estimated bytes of each stage of one GRPO step on one rank; the step needs weights + the largest stage."""

    weights: int
    generate: int
    score: int
    reference: int
    update: int

    @property
    def peak(self) -> int:
        return self.weights + max(self.generate, self.score, self.reference, self.update)


def step_memory(
    cfg, policy: GPTConfig, reward_model: GPTConfig | None, world: int, dtype_bytes: int, **override
) -> StepMemory:
    """StepMemory of grpo.Config `cfg` (its sizes, with `override` replacing any of gen_prompts, micro_batch_size,
    score_micro_batch_size) at the longest prompt (--max_prompt_len) and response (--max_new_tokens)."""
    sizes = {
        "gen_prompts": cfg.gen_prompts,
        "micro_batch_size": cfg.micro_batch_size,
        "score_micro_batch_size": cfg.score_micro_batch_size,
    } | override
    P, R, G, K, shared = cfg.max_prompt_len, cfg.max_new_tokens, cfg.num_samples, cfg.kept, cfg.prefix_sharing
    micro, score_micro = sizes["micro_batch_size"], sizes["score_micro_batch_size"]
    lora, math_attention = cfg.lora_enabled, cfg.deterministic
    start_copy = keeps_start(cfg)  # a frozen copy of the starting policy (rollouts.models)
    # a micro-batch of consecutive rows spans at most ceil(rows / group) + 1 prompts
    train_prompts = min(micro, -(-micro // K) + 1)
    score_prompts = min(score_micro, -(-score_micro // G) + 1)
    micro_batches = -(-(-(-cfg.prompts_per_step // world) * K) // micro)  # per rank: ceil(ceil(B / world) * K / micro)
    gathered_policy = param_count(policy) * dtype_bytes
    forward_scores = (
        attention_scores_bytes(policy, micro, train_prompts, P, R, dtype_bytes, shared) if math_attention else 0
    )
    reference = (
        0
        if lora
        else (
            gathered_policy
            + score_bytes(policy, micro, train_prompts, P, R, dtype_bytes, shared)
            + forward_scores
            + micro * R * policy.vocab_size * 4
        )
    )
    score = 0
    if reward_model is not None:
        score = param_count(reward_model) * dtype_bytes + score_bytes(
            reward_model, score_micro, score_prompts, P, R, dtype_bytes, shared
        )
        if math_attention:
            score += attention_scores_bytes(reward_model, score_micro, score_prompts, P, R, dtype_bytes, shared)
    compiled = 0
    if cfg.compile:
        widths = [b for b in PROMPT_BUCKETS if b < bucket_width(P, policy.n_positions - R)]
        widths.append(bucket_width(P, policy.n_positions - R))
        rows = sizes["gen_prompts"] * G
        compiled = gathered_policy + sum(
            kv_cache_bytes(policy, sizes["gen_prompts"], G, w, R, dtype_bytes, shared)
            + 4 * rows * policy.vocab_size * 4
            for w in widths
        )
    return StepMemory(
        weights=weight_bytes(policy, reward_model, world, lora, cfg.frozen_cpu_offload, start_copy) + compiled,
        generate=gathered_policy + generate_bytes(policy, sizes["gen_prompts"], G, P, R, dtype_bytes, shared),
        score=score,
        reference=reference,
        update=(
            update_bytes(
                policy, micro, train_prompts, P, R, dtype_bytes, shared, cfg.activation_checkpointing, math_attention
            )
            + no_sync_grad_bytes(policy, micro_batches, lora)
        ),
    )


def size(n_bytes: int) -> str:
    return f"{n_bytes / GiB:.1f} GiB" if n_bytes >= GiB else f"{n_bytes / 2**20:.0f} MiB"


def largest_fitting(fits, start: int) -> int:
    """The largest value v <= start with fits(v), halving from start; 0 when even 1 does not fit."""
    v = start
    while v >= 1 and not fits(v):
        v //= 2
    return v


def check_memory(
    cfg, policy: GPTConfig, reward_model: GPTConfig | None, world: int, dtype_bytes: int, free_bytes: int, where: str
) -> StepMemory:
    """Stop (ConfigError, one line) when the step's estimate exceeds MARGIN of `free_bytes`, naming for each stage
    that does not fit beside the weights the option to lower and the largest value that fits: --gen_prompts for
    generation, --score_micro_batch_size for scoring, --micro_batch_size for the update (or
    --activation_checkpointing). Returns the estimate."""
    budget = int(free_bytes * MARGIN)
    est = step_memory(cfg, policy, reward_model, world, dtype_bytes)
    if est.peak <= budget:
        return est
    free = f"{size(free_bytes)} is free on {where}"
    if est.weights >= budget:
        raise ConfigError(
            f"the models' weights and optimizer state need about {size(est.weights)} per rank but "
            f"{free}: use more ranks, --lora_rank or --frozen_cpu_offload true"
        )
    stages = {
        "gen_prompts": (("generate",), "KV cache and logits of one generate call"),
        "score_micro_batch_size": (("score",), "one reward-model micro-batch"),
        "micro_batch_size": (
            ("reference", "update"),
            "one training micro-batch: its activations, or the reference's log-probs",
        ),
    }
    problems = []
    for option, (names, what) in stages.items():

        def need(e: StepMemory, names: tuple[str, ...] = names) -> int:
            return max(getattr(e, n) for n in names)

        if est.weights + need(est) <= budget:
            continue
        value = getattr(cfg, option)

        def fits(v: int, option: str = option, need=need) -> bool:
            return (
                est.weights + need(step_memory(cfg, policy, reward_model, world, dtype_bytes, **{option: v})) <= budget
            )

        best = largest_fitting(fits, value)
        hint = f"lower --{option} to {best}" if best else f"--{option} 1 does not fit either"
        if option == "micro_batch_size" and not cfg.activation_checkpointing:
            hint += " or set --activation_checkpointing true"
        problems.append(f"--{option} {value} needs about {size(need(est))} ({what}): {hint}")
    sharing = "" if cfg.prefix_sharing else " (or set --prefix_sharing true)"
    raise ConfigError(
        f"not enough device memory, {size(est.weights)} of weights and {free}{sharing}; " + "; ".join(problems)
    )


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device; None elsewhere (a CPU run is not checked)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free
