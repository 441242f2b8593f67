"""Batched sampling on the KV-cache path of model/gpt2.py.

Prompts arrive left-padded with a boolean mask; position ids count real tokens only, so a padded prompt is
computed exactly as it would be alone (GPT-2's positions are absolute). Each prompt is prefilled once for its
`num_samples` samples: 64 samples of one prompt cost one prefill, not 64. With `prefix_sharing` (the default) its
keys and values are also stored once (model/gpt2.py's SharedKVCache) and every decode step reads them once per
prompt, not once per sample: the cache holds B*P + N*max_new_tokens positions instead of N*(P + max_new_tokens).
Without it they are copied to every sample (KVCache.repeat_interleave), the reference the tests compare against.

The token distribution is processed in a fixed order: logits in fp32, divided by the temperature, then top-k,
then top-p (nucleus) masking (rlhf/logprobs.py's `process_logits`). `processed_logprobs` here (and rlhf/logprobs.py's
chunked pass, which grpo.py's update uses) applies exactly the same processing to training-time logits, so the
log-probs of a GRPO ratio and KL describe the distribution the tokens were drawn from.

Decoding stops per row at the first end token ("\\n", id 198) or EOS (50256); later positions are padding.
The project samples through rollouts.sampling.sample_responses, which under FSDP gathers the parameters once for all
its calls (`utils.fsdp.gathered_params`).

Host work per token. On a GPU a small model's decode step is bound by the host dispatching its ops, not by the GPU,
so the loop dispatches few: positions, masks and constants are built once per call, the stop test and the masks
once after the loop, and the only host sync is the done check (every DONE_CHECK_EVERY_GPU tokens on a GPU);
`python -m bench.decode_profile` counts the ops per token (docs/benchmarks.md). With `compile=True` (--compile) the
decode runs on static shapes: on a GPU each step and its draw are recorded once as a CUDA graph and replayed
(StepGraph: one launch per token instead of some hundreds), on a CPU the step runs under torch.compile
(compiled_decode_step). On a GPU the head's weight is padded to aligned rows (padded_head_weight) and the
shared-prefix attention takes its few-kernel form (model.gpt2.one_softmax_decode_attention), eager or not.
"""

import contextlib
import functools
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from model.gpt2 import KVCache, SharedKVCache
from rlhf.logprobs import process_logits  # the one definition of the processing, shared with the update

END_ID, EOS_ID, PAD_ID = 198, 50256, 50256  # GPT-2's "\n", <|endoftext|>, and the id used for padding
DONE_CHECK_EVERY_GPU = 8  # decoded tokens between host checks that every row has finished, on a GPU (generate)
COMPILE_BUCKETS = 4  # head sizes a compiled decode step uses as rows finish: N, N/2, N/4, N/8 (head_bucket)
PROMPT_BUCKETS = (64, 128, 256, 384, 512, 768, 1024)  # prompt widths a compiled decode pads to (bucket_width)
OWN_KEYS_BUCKET = 8  # a recorded step reads its rows' own keys up to the next multiple of this (StepGraph per length)


@dataclass
class SampleOutput:
    response_ids: torch.Tensor  # (N, R) long; PAD_ID after the first end token
    response_mask: torch.Tensor  # (N, R) bool; True up to and including the first end token
    logprobs: torch.Tensor  # (N, R) fp32 log-prob of each token under the processed distribution; 0 where masked
    has_end: torch.Tensor  # (N,) bool; False when max_new_tokens ran out first


def processed_logprobs(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """log p(target) (B, T) in fp32 under the same processing the sampler used. The plain whole-tensor form;
    grpo.py's reference and update use rlhf/logprobs.py, the same numbers in chunks with the entropy beside them
    (tests/test_logprobs.py checks the two agree)."""
    logp = process_logits(logits_BTV, temperature, top_k, top_p).log_softmax(-1)
    return torch.gather(logp, -1, targets_BT.unsqueeze(-1)).squeeze(-1)


def sample_tokens(
    probs: torch.Tensor,
    generator: torch.Generator | None = None,
    block: int = 256,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of probabilities (N, V) (any non-negative mass: a row need not sum to 1), by inverting the
    CDF with one float64 uniform per row (drawn from `generator`, or `uniforms` (N, 1) float64 in [0, 1) when given).

    The same distribution as torch.multinomial at a fraction of its cost on CPU (multinomial draws V
    exponentials per row). Two levels keep it exact without a float64 copy of the whole (N, V) array: pick a
    block of `block` tokens from the float64 CDF of the block sums, then a token from the CDF inside that
    block. Tokens of probability 0 (outside top-k / top-p) are never drawn. Written with few ops (it runs once per
    decoded token), and reading `probs` where it lies (views, no (N, V) copy): the block CDF starts with a 0 column,
    so the mass below the chosen block is one gather, and the chosen block is one gather of its columns, those past
    V (the short last block) read as 0."""
    N, V = probs.shape
    nb = -(-V // block)  # blocks, the last one short when block does not divide V
    full = V // block * block
    parts = [probs.new_zeros(N, 1), probs[:, :full].unflatten(1, (-1, block)).sum(-1)]
    if full < V:
        parts.append(probs[:, full:].sum(-1, keepdim=True))  # the short last block, summed over its own tokens
    cdf = torch.cat(parts, dim=1).cumsum(-1, dtype=torch.float64)  # (N, nb + 1): cdf[:, b] = mass before block b
    if uniforms is None:
        uniforms = torch.rand(N, 1, generator=generator, device=probs.device, dtype=torch.float64)
    u = uniforms * cdf[:, -1:]
    b = (torch.searchsorted(cdf, u, right=True) - 1).clamp_(max=nb - 1)  # (N, 1) the block whose CDF first exceeds u
    below = cdf.gather(-1, b)  # (N, 1)
    cols = b * block + torch.arange(block, device=probs.device)  # (N, block) the chosen block's columns
    inside = probs.gather(1, cols.clamp(max=V - 1)).masked_fill_(cols >= V, 0.0)  # (N, block)
    inner_cdf = inside.cumsum(-1, dtype=torch.float64)  # (N, block)
    rest = torch.minimum(u - below, inner_cdf[:, -1:] * (1 - 1e-12))  # rounding must not step past the block
    j = torch.searchsorted(inner_cdf, rest, right=True)
    return (b * block + j).squeeze(-1)


def decode_step(
    model,
    cache,
    tok: torch.Tensor,
    pos: torch.Tensor,
    rows: torch.Tensor | None,
    temperature: float,
    top_k: int,
    top_p: float,
    head_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feed one token per row (tok (N,), positions pos (N, 1)) through the model with its KV cache and return the
    processed probabilities (n, V) of the next token of `rows` (n,) (None: every row): the head, the softmax and the
    draw, most of a decode step's cost with a 50,257-word vocabulary, run on those rows only. The softmax is one
    exp per logit, which the draw reads as it is (a log-softmax would need a second exp for the draw). The unit
    that generate(compile=True) compiles on a CPU and records as a CUDA graph (with the draw) on a GPU.
    head_weight: the head's weight with its rows padded (padded_head_weight), in place of the model's."""
    V = model.cfg.vocab_size

    def head(h, w):  # h (N, 1, C) -> logits (n, 1, V)
        h = h if rows is None else h[rows]
        return F.linear(h, w) if head_weight is None else F.linear(h, head_weight)[..., :V]

    logits = model(tok[:, None], pos, None, kv_cache=cache, head=head)[:, -1]  # (n, V)
    return process_logits(logits, temperature, top_k, top_p).softmax(-1)


def draw(probs: torch.Tensor, uniforms: torch.Tensor | None, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens (n,) drawn from probabilities (n, V) with one uniform per row (n, 1) (temperature 0: the most
    likely), and their log-probabilities (n,) (a drawn token's probability is never 0)."""
    drawn = probs.argmax(-1) if temperature == 0 else sample_tokens(probs, uniforms=uniforms)
    return drawn, probs.gather(-1, drawn[:, None]).squeeze(-1).log()


HEAD_ROWS_MULTIPLE = 64  # a GPU's head pads the vocabulary to a multiple of this (50,257 -> 50,304 rows)
PADDED_HEAD_DEVICES = ("cuda",)  # where padded_head_weight pads (elsewhere the products take any row count alike)


def padded_head_weight(model) -> torch.Tensor | None:
    """On a GPU, the head's weight (V, C) with zero rows appended up to a multiple of HEAD_ROWS_MULTIPLE, kept for the
    model's life and refilled at each call; None elsewhere or when V is a multiple already. With V = 50,257 (odd)
    cuBLAS runs the head's product with an unaligned kernel at about an eighth of the speed of an aligned one (0.84
    ms of a 5.4 ms decode step of 1,024 rows on an H100, docs/benchmarks.md); the padded rows' logits are cut off
    before anything reads them."""
    w = model.lm_head.weight
    V, C = w.shape
    if w.device.type not in PADDED_HEAD_DEVICES or V % HEAD_ROWS_MULTIPLE == 0:
        return None
    kept = _DECODE_WEIGHTS.setdefault(model, {})
    padded = kept.get(PADDED_HEAD)
    rows = -(-V // HEAD_ROWS_MULTIPLE) * HEAD_ROWS_MULTIPLE
    if padded is None or padded.shape != (rows, C) or padded.dtype != w.dtype or padded.device != w.device:
        padded = kept[PADDED_HEAD] = torch.zeros(rows, C, dtype=w.dtype, device=w.device)
    padded[:V].copy_(w)
    return padded


@functools.cache
def compiled_decode_step(device_type: str):
    """decode_step under torch.compile (inductor), built once per process and device type, so every generate call
    of a run reuses its graphs: generate(compile=True) off a GPU (on a GPU the step is recorded as a CUDA graph
    instead: StepGraph). Shapes are static inside a step (the caches are preallocated, write positions are tensors,
    finished rows leave the head in COMPILE_BUCKETS) and change only from one generate call to the next (prompt
    width, rows)."""
    return torch.compile(decode_step)


def bucket_width(P: int, limit: int) -> int:
    """The prompt width a compiled decode pads a batch of width P to: the smallest of PROMPT_BUCKETS that holds it,
    at most `limit` (the widest prompt the model's positions leave room for, itself at least P)."""
    return min([b for b in PROMPT_BUCKETS if b >= P] + [limit])


class DecodeBuffers:
    """What only a compiled decode needs, kept from one generate call to the next: the KV caches (the prefill's, and
    the one the samples decode into), the write position, the positions fed and the head's rows, for one shape
    (B prompts of bucketed width P, G samples each, max_new tokens, layout). generate(compile=True) takes them from
    decode_buffers, so every call of a run with that shape reads and writes the same tensors: a compiled step's
    graph (and, on a GPU, its CUDA graph, which reads its inputs in place) is captured once per shape, not once
    per call. Stale values from the last call are never read: the prefill cache's mask is cleared, and a compiled
    step masks every response position past the one it writes."""

    def __init__(self, cfg, B: int, P: int, G: int, max_new: int, prefix_sharing: bool, device):
        N = B * G
        self.prefill = KVCache(cfg, B, P if prefix_sharing else P + max_new, device)
        self.decode = None  # the samples' cache, built at the first call from the prefill's tensors
        self.write_at = torch.zeros(1, dtype=torch.long, device=device)
        self.pos_now = torch.zeros(N, 1, dtype=torch.long, device=device)
        self.head_rows = torch.arange(N, device=device)
        # what only StepGraphs read: the tokens fed, the uniforms of the draw, each head bucket's rows
        self.tok = torch.zeros(N, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(N, 1, dtype=torch.float64, device=device)
        self.bucket_rows: dict[int, torch.Tensor] = {}
        self.graphs: dict[tuple, StepGraph] = {}  # (sampling options, head bucket, keys visible) -> its recorded step
        self.pool = None  # the memory pool the graphs share (they replay one at a time; step_graph)
        self.inputs: tuple = ()  # what the graphs were recorded over (check_graph_inputs)
        self.recorded = 0  # StepGraphs recorded with these buffers

    def decode_cache(self, G: int, max_new: int, prefix_sharing: bool):
        """The cache the samples decode into, filled from the prefill just run (same tensors as the last call's,
        unless the prefill's dtype changed)."""
        fresh = self.decode is None
        if prefix_sharing:
            if fresh or self.decode.prompt_k._base is not self.prefill.k:
                self.decode = SharedKVCache(self.prefill, G, max_new)
            return self.decode.reset()
        if G == 1:
            self.decode = self.prefill
            return self.decode
        if fresh or self.decode.k.dtype != self.prefill.k.dtype:
            self.decode = self.prefill.repeat_interleave(G)
            return self.decode
        return self.prefill.repeat_interleave_into(self.decode, G)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a compiled step reads in place (their addresses: CUDA graphs' static inputs)."""
        return [self.write_at, self.pos_now, *cache_tensors(self.decode)]

    def check_graph_inputs(self, model, head_weight) -> None:
        """Drop the recorded StepGraphs when the tensors they were recorded over moved: the weights (another model of
        this shape, or its copy reallocated) or the caches. (The sampling options, which a graph also holds as
        constants, are in each graph's key: a run's greedy evaluations and its sampling keep their graphs side by
        side.) Called once per generate call, inside static_weights."""
        params = list(model.parameters())
        if any(isinstance(p, DTensor) for p in params):
            raise ValueError(
                "generate(compile=True) on a GPU records the decode step with the parameters gathered: call it through "
                "rollouts.sampling.sample_responses (utils.fsdp.gathered_params), not on a sharded model"
            )
        tensors = [*params, *cache_tensors(self.decode), self.prefill.k, self.prefill.v]
        if head_weight is not None:
            tensors.append(head_weight)
        inputs = (id(model), *(t.data_ptr() for t in tensors))
        if inputs != self.inputs:
            # a fresh pool too: once its graphs are gone a pool cannot take another recording (the CUDA allocator
            # asserts it is in use; seen on an H100 when a second model of the same shape came to these buffers)
            self.graphs.clear()
            self.pool = None
            self.inputs = inputs

    def step_graph(self, model, cache, head_rows, temperature: float, top_k: int, top_p: float, head_weight):
        """Feed self.tok (at cache.write_at, positions self.pos_now) and draw the next token of `head_rows` (a head
        bucket, `rows` padded) with self.uniforms: one replay of the StepGraph of these sampling options, this head
        bucket and the keys the cache makes visible (cache.visible), recorded at its first use. Returns the graph's
        outputs (drawn (n,), log-probs (n,)), refilled at every replay. The graphs share one memory pool: they replay
        one at a time and their outputs are read before the next replay, so one graph's scratch may be another's."""
        n = len(head_rows)
        idx = self.bucket_rows.get(n)
        if idx is None:
            idx = self.bucket_rows[n] = torch.empty(n, dtype=torch.long, device=self.tok.device)
        idx.copy_(head_rows)
        key = (temperature, top_k, top_p, n, cache.visible)
        graph = self.graphs.get(key)
        if graph is None:

            def step():
                probs = decode_step(model, cache, self.tok, self.pos_now, idx, temperature, top_k, top_p, head_weight)
                return draw(probs, self.uniforms.index_select(0, idx), temperature)

            if self.pool is None and self.tok.device.type == "cuda":
                self.pool = torch.cuda.graph_pool_handle()
            graph = self.graphs[key] = StepGraph(step, self.tok.device, self.pool)
            self.recorded += 1
        return graph.replay()


class StepGraph:
    """A decode step recorded once and replayed. `fn` () -> tuple of tensors reads and writes only tensors that keep
    their addresses from one replay to the next (DecodeBuffers, static_weights), with no host sync and no random
    draw. On a GPU a CUDA graph: fn runs twice on a side stream (cuBLAS and the allocator warmed up outside the
    recording; running it again rewrites the same cache positions with the same values), then is recorded once;
    replay() launches the whole step, a few hundred kernels, at the cost of one launch, and returns the same output
    tensors every time, refilled. Elsewhere the same contract emulated (tests/test_sampler.py): replay() runs fn again
    and copies its results into the outputs of the first run."""

    def __init__(self, fn, device: torch.device, pool=None):
        self.fn, self.graph = fn, None
        if device.type != "cuda":
            self.outputs = fn()
            return
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn()

    def replay(self) -> tuple[torch.Tensor, ...]:
        if self.graph is not None:
            self.graph.replay()
        else:
            for out, new in zip(self.outputs, self.fn(), strict=True):
                out.copy_(new)
        return self.outputs


_DECODE_BUFFERS: dict[tuple, DecodeBuffers] = {}


def decode_buffers(model, B: int, P: int, G: int, max_new: int, prefix_sharing: bool, device) -> DecodeBuffers:
    """The DecodeBuffers of this model shape and decode shape, made at the first generate call that needs them and
    kept for the process (a run decodes a few shapes: its prompt-width buckets, its batch sizes)."""
    cfg = model.cfg
    key = (cfg.n_layer, cfg.n_head, cfg.n_embd, B, P, G, max_new, prefix_sharing, str(device))
    if key not in _DECODE_BUFFERS:
        _DECODE_BUFFERS[key] = DecodeBuffers(cfg, B, P, G, max_new, prefix_sharing, device)
    return _DECODE_BUFFERS[key]


_DECODE_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PADDED_HEAD = "<padded head>"  # padded_head_weight's entry among a model's kept weights (no parameter's name)


@contextlib.contextmanager
def static_weights(model):
    """Within the block, `model` computes with a copy of its parameters kept for the model's life: the same
    nn.Parameter objects at the same addresses in every generate call, filled with the parameters' present values at
    entry. A compiled decode step reads its weights in place like its buffers (on a GPU a CUDA graph records their
    addresses), and the parameters themselves move between calls: under FSDP2 each gather (utils.fsdp.gathered_params)
    allocates them anew, so reading them directly would record the step's CUDA graphs again at every call. Costs one
    copy of the weights in memory and one copy per call. Every module's forward hooks are off within the block: the
    parameters are gathered already (utils.fsdp.gathered_params), and FSDP2's unit hooks would otherwise run their
    stream waits and forward-order records at every step, inside a recorded CUDA graph too. A model whose parameters
    are still sharded (DTensor) is left as it is, hooks included: its forward gathers them itself."""
    named = dict(model.named_parameters())  # tied parameters once
    if any(isinstance(p, DTensor) for p in named.values()):
        yield
        return
    kept = _DECODE_WEIGHTS.setdefault(model, {})
    name_of = {id(p): name for name, p in named.items()}
    for name, p in named.items():
        k = kept.get(name)
        if k is None or k.shape != p.shape or k.dtype != p.dtype or k.device != p.device:
            k = kept[name] = torch.nn.Parameter(torch.empty_like(p), requires_grad=False)
        k.copy_(p)
    slots = [(m, attr, p) for m in model.modules() for attr, p in m._parameters.items() if p is not None]
    hooks = [(m, m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    for m, attr, p in slots:
        m._parameters[attr] = kept[name_of[id(p)]]
    for m, _, _ in hooks:  # FSDP's unit hooks (stream waits, forward-order records) have nothing to do here
        m._forward_pre_hooks, m._forward_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        for m, attr, p in slots:
            m._parameters[attr] = p
        for m, pre, post in hooks:
            m._forward_pre_hooks, m._forward_hooks = pre, post


def head_bucket(n: int, N: int) -> int:
    """Rows the compiled head runs for n unfinished rows of N: the smallest of N, N/2, N/4, N/8 (rounded up) that
    holds them, so finishing rows change the head's shape at most COMPILE_BUCKETS times per call, not at every check."""
    return min(size for size in (-(-N // 2**k) for k in range(COMPILE_BUCKETS)) if size >= n)


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    stop_ids: tuple[int, ...] = (END_ID, EOS_ID),
    done_check_every: int | None = None,
    prefix_sharing: bool = True,
    compile: bool = False,
    cuda_graphs: bool | None = None,
) -> SampleOutput:
    """Sample `num_samples` responses for each of B left-padded prompts (B, P); `prefix_sharing`: one copy of each
    prompt's keys and values for its samples (see the module docstring).

    Returns N = B * num_samples rows grouped by prompt: rows b*G .. b*G+G-1 belong to prompt b.

    done_check_every: decoded tokens between checks that every row has finished. The check copies a flag to the
    host, which on a GPU waits for every queued kernel, so the Python loop can no longer run ahead of the device;
    None: every token on CPU (free there), every DONE_CHECK_EVERY_GPU tokens on a GPU. Each check also drops the
    finished rows from the head; rows that finished since keep going through it until the next one. Either way it
    changes the work done, never a row's tokens, mask or log-probs (the generator draws for every row at every
    step). It is the loop's only host sync: the stop test and the masks are computed once, after the loop.

    compile: decode on static shapes, each step reading and writing the DecodeBuffers of its shape and the model's
    weights from static_weights (FSDP's hooks off: the parameters are gathered already): on a GPU each step and the
    draw after it are recorded once as a CUDA graph (StepGraph) and replayed, on a CPU the step runs through
    compiled_decode_step (inductor; the draw stays eager). The same tokens and log-probs up to rounding
    (tests/test_sampler.py); the head runs on padded buckets of rows, the prompts are left-padded to a bucket
    width (bucket_width), so a run records or compiles each shape once.
    cuda_graphs: with compile, record StepGraphs (None: on a GPU); True on a CPU emulates their contract (tests)."""
    if done_check_every is None:
        done_check_every = DONE_CHECK_EVERY_GPU if prompt_ids.device.type == "cuda" else 1
    B, P = prompt_ids.shape
    G, device = num_samples, prompt_ids.device
    graphed = compile and (device.type == "cuda" if cuda_graphs is None else cuda_graphs)
    if P + max_new_tokens > model.cfg.n_positions:
        raise ValueError(
            f"prompt width {P} + {max_new_tokens} new tokens exceeds the model's {model.cfg.n_positions} positions"
        )
    if compile:  # a bucketed width: the padding columns (copies of column 0) are masked out
        width = bucket_width(P, model.cfg.n_positions - max_new_tokens)
        prompt_ids = torch.cat([prompt_ids[:, :1].expand(B, width - P), prompt_ids], dim=1)  # (B, width)
        prompt_mask = torch.cat([prompt_mask.new_zeros(B, width - P), prompt_mask], dim=1)
        P = width
        buffers = decode_buffers(model, B, P, G, max_new_tokens, prefix_sharing, device)
    prompt_pos = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P) positions of real tokens from 0

    # 1. prefill each prompt once; its cache is then shared by its G samples, or copied to each of them
    if compile:
        cache = buffers.prefill.reset()
    else:
        cache = KVCache(model.cfg, B, P if prefix_sharing else P + max_new_tokens, device)
    logits = model(prompt_ids, prompt_pos, prompt_mask, kv_cache=cache, logits_slice=slice(-1, None))[:, -1]  # (B, V)
    if compile:
        cache = buffers.decode_cache(G, max_new_tokens, prefix_sharing)
    elif prefix_sharing:
        cache = SharedKVCache(cache, G, max_new_tokens)
    elif G > 1:
        cache = cache.repeat_interleave(G)
    probs = process_logits(logits, temperature, top_k, top_p).softmax(-1).repeat_interleave(G, dim=0)  # (N, V)
    N = B * G
    # positions of the response tokens, built once: token t of a row sits at its prompt's real length + t (N, R)
    positions = prompt_mask.sum(-1).repeat_interleave(G)[:, None] + torch.arange(max_new_tokens, device=device)
    step = decode_step
    head_weight = padded_head_weight(model)  # a GPU's head on aligned rows; None on a CPU
    if compile:
        step = compiled_decode_step(device.type)
        first = 0 if prefix_sharing else P  # the cache position of response token 0
        cache.write_at = buffers.write_at.fill_(first)
        pos_now = buffers.pos_now

    # 2. decode one token per step for every row. Finished rows keep stepping through the body on their last token
    #    (every row advances together in the cache), but the head, the softmax and the draw run only on `rows`: the
    #    rows unfinished at the last check (all rows until one finishes). Every row's uniform is drawn at every step,
    #    so a row's tokens do not depend on which other rows are still running. Tokens and log-probs are recorded
    #    raw; what follows a row's first stop token is masked after the loop. Token 0 is drawn from the prefill's
    #    probabilities; each step t then feeds token t and draws token t + 1 (graphed: both in one CUDA graph).
    raw_tokens = torch.full((N, max_new_tokens), PAD_ID, dtype=torch.long, device=device)
    raw_logprobs = torch.zeros(N, max_new_tokens, dtype=torch.float32, device=device)
    stop = torch.tensor(stop_ids, device=device, dtype=torch.long)

    def uniforms():  # one float64 uniform per row, every row, at every token
        return None if temperature == 0 else torch.rand(N, 1, generator=generator, device=device, dtype=torch.float64)

    rows = None  # None: every row (always so at t = 0, which sets `tok`); else the (n,) rows the head runs
    # compiled: the head always takes a row index, padded to a bucket, its length dynamic: one graph for every bucket
    head_rows = None if not compile else buffers.head_rows
    with static_weights(model) if compile else contextlib.nullcontext():
        if graphed:
            buffers.check_graph_inputs(model, head_weight)
        drawn, drawn_logp = draw(probs, uniforms(), temperature)  # (N,) token 0 of every row
        for t in range(max_new_tokens):
            if rows is None:
                tok = drawn if not graphed else buffers.tok.copy_(drawn)
                raw_logprobs[:, t] = drawn_logp
            else:
                tok.index_copy_(0, rows, drawn)  # rows outside `rows` finished: their token is never read
                raw_logprobs[:, t].index_copy_(0, rows, drawn_logp)
            raw_tokens[:, t] = tok
            if t == max_new_tokens - 1:
                break
            if (t + 1) % done_check_every == 0:  # a host sync on a GPU, hence only every done_check_every tokens
                unfinished = (~torch.isin(raw_tokens[:, : t + 1], stop).any(1)).nonzero().squeeze(1)
                if len(unfinished) == 0:
                    break
                rows = None if len(unfinished) == N else unfinished
                if rows is not None and compile:  # padded to a bucket (repeating the last row), so few head shapes
                    head_rows = torch.cat([rows, rows[-1:].expand(head_bucket(len(rows), N) - len(rows))])
                elif rows is not None:
                    head_rows = rows
            # finished rows are fed a token they drew (ignored), not PAD_ID, which may lie outside a small vocabulary
            pos = positions[:, t : t + 1]
            if compile:
                cache.write_at.fill_(first + t)
                pos = pos_now.copy_(pos)
            u = uniforms()
            n = N if rows is None else len(rows)
            if graphed:  # one replay: the body on every row, the head and the draw on the bucket of `rows`
                if u is not None:
                    buffers.uniforms.copy_(u)
                cache.visible = first + min(max_new_tokens, -(-(t + 1) // OWN_KEYS_BUCKET) * OWN_KEYS_BUCKET)
                drawn, drawn_logp = buffers.step_graph(model, cache, head_rows, temperature, top_k, top_p, head_weight)
                drawn, drawn_logp = drawn[:n], drawn_logp[:n]
                continue
            if compile:
                torch._dynamo.maybe_mark_dynamic(head_rows, 0)
            probs = step(model, cache, tok, pos, head_rows, temperature, top_k, top_p, head_weight)  # (n or bucket, V)
            drawn, drawn_logp = draw(probs[:n], u if u is None or rows is None else u[rows], temperature)

    # 3. a row ends at its first stop token: it is kept, everything after it is padding
    stopped = torch.isin(raw_tokens, stop)  # (N, R)
    mask = (stopped.cumsum(-1) - stopped.long()) == 0  # no stop token before this position
    tokens = raw_tokens.masked_fill(~mask, PAD_ID)
    return SampleOutput(tokens, mask, raw_logprobs.masked_fill(~mask, 0.0), (stopped & mask).any(-1))


def cache_tensors(cache) -> list[torch.Tensor]:
    """The tensors a decode step writes in place (for CUDA graphs' static addresses)."""
    if isinstance(cache, SharedKVCache):
        return [cache.kv]
    return [cache.k, cache.v, cache.valid]
