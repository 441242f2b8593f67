"""GPT-2 written from scratch as plain nn.Modules.

Layer names follow the Hugging Face GPT-2 checkpoint (`transformer.h.0.attn.c_attn`, ...) so loading and
exporting are loops over names with a transpose for the Conv1D layers (see model/weights.py).

Two things differ from a textbook GPT-2 and both matter for RLHF:
- Position ids are explicit. GPT-2 has absolute position embeddings, so a left-padded prompt must start at
  position 0 at its first *real* token; deriving positions from column indices would shift every prompt by
  its padding and change the logits.
- A KV cache (`KVCache`) for incremental decoding. The sampler (model/sampler.py) prefills each prompt once
  and decodes one token per step, reading keys and values from the cache.
- Prefix sharing (GRPO samples many responses per prompt). `SharedPrefix` packs B prompts and the n responses
  that follow them into one row of tokens, each prompt once: the prompt tokens attend among themselves and each
  response to its own prompt plus its own earlier tokens, so every real token gets exactly the hidden state it
  gets in the prompt + response row of the unshared layout, and gradients flow into the shared prompt
  computation from all of its responses (autograd sums them, as over K separate copies). `SharedKVCache` keeps
  the prompt's keys and values once per prompt for decoding and each sample's own response part beside them.

Logits are computed only where the caller asks (`logits_slice`): with the 50,257-word vocabulary the head is
most of the FLOPs of a small model, and the losses need logits at response positions only.
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    layer_norm_epsilon: float = 1e-5

    def to_dict(self) -> dict:
        return asdict(self)


# Sizes of the released checkpoints, plus tiny configs for tests and the CPU demo.
PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, n_positions=512),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, n_positions=512),
}


# Devices whose shared-prefix decode attention runs one_softmax_decode_attention (few kernels); elsewhere
# shared_prefix_decode_attention (fp32 merge of the two parts; a CPU's golden numbers are recorded with it).
ONE_SOFTMAX_DEVICES = ("cuda",)


class KVCache:
    """Keys and values of every layer for incremental decoding.

    k, v: (n_layer, B, n_head, max_len, head_dim), allocated at the first write with the dtype the model
    computes in (bf16 under mixed precision). `valid` (B, max_len) marks which cached positions hold real
    tokens (False for left padding and for positions not yet written) and is the key mask of every step.
    `length` is the number of positions written so far; all rows advance together.

    `write_at` (set by the caller, for a compiled decode step): a (T,) long tensor of the positions the next T
    tokens are written to. Every position is then a key, the ones not written yet masked by `valid`: no shape
    and no Python number in the step changes from one token to the next. None: positions `length` .. `length`+T-1
    and keys up to there (the eager path). `visible` (with write_at; a recorded step sets it): the keys are
    positions 0 .. visible-1 only (None: all max_len), so a step early in a response reads less of the cache.
    """

    def __init__(self, cfg: GPTConfig, batch_size: int, max_len: int, device):
        self.shape = (cfg.n_layer, batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.valid = torch.zeros(batch_size, max_len, device=device, dtype=torch.bool)
        self.length = 0
        self.max_len = max_len
        self.write_at: torch.Tensor | None = None
        self.visible: int | None = None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values (B, nh, T, hs) after the cached ones; return all of them (B, nh, L, hs)."""
        if self.k is None or self.k.dtype != k.dtype:
            self.k = torch.zeros(self.shape, device=k.device, dtype=k.dtype)
            self.v = torch.zeros(self.shape, device=v.device, dtype=v.dtype)
        if self.write_at is not None:
            self.k[layer].index_copy_(2, self.write_at, k)
            self.v[layer].index_copy_(2, self.write_at, v)
            return self.k[layer, :, :, : self.visible], self.v[layer, :, :, : self.visible]
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked to write up to {end}")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def attention_mask(self, attention_mask: torch.Tensor | None, T: int) -> torch.Tensor:
        """Mark the T new positions valid (attention_mask (B, T), or all of them) and return the attention mask of
        their queries over every cached key: (B, 1, 1, L) for one new token (it is the last key, so causality
        asks nothing more; a view, no op), else build_attention_mask's (B, 1, T, L)."""
        if self.write_at is not None:
            self.valid.index_fill_(1, self.write_at, True)
            return self.valid[:, None, None, : self.visible]
        end = self.length + T
        self.valid[:, self.length : end] = attention_mask if attention_mask is not None else True
        if T == 1 and attention_mask is None:
            return self.valid[:, None, None, :end]
        return build_attention_mask(self.valid[:, :end], T)

    def advance(self, T: int) -> None:
        """T positions written (the eager path's count; a compiled step moves `write_at` instead)."""
        if self.write_at is None:
            self.length += T

    def reset(self) -> "KVCache":
        """Empty again, for another prefill into the same tensors (a compiled decode's buffers keep their addresses
        from one generate call to the next): nothing written, nothing valid."""
        self.valid.zero_()
        self.length, self.write_at, self.visible = 0, None, None
        return self

    def repeat_interleave_into(self, out: "KVCache", n: int) -> "KVCache":
        """repeat_interleave(n) written into `out`'s tensors (allocated by an earlier repeat_interleave)."""
        rows = torch.arange(self.shape[1], device=self.valid.device).repeat_interleave(n)
        torch.index_select(self.k, 1, rows, out=out.k)
        torch.index_select(self.v, 1, rows, out=out.v)
        torch.index_select(self.valid, 0, rows, out=out.valid)
        out.length, out.max_len, out.write_at, out.visible = self.length, self.max_len, self.write_at, None
        return out

    def repeat_interleave(self, n: int) -> "KVCache":
        """Copy every row n times (row i -> rows i*n .. i*n+n-1): one prefill serves a group of n samples."""
        out = object.__new__(KVCache)
        out.shape = (self.shape[0], self.shape[1] * n, *self.shape[2:])
        out.k = None if self.k is None else self.k.repeat_interleave(n, dim=1)
        out.v = None if self.v is None else self.v.repeat_interleave(n, dim=1)
        out.valid = self.valid.repeat_interleave(n, dim=0)
        out.length, out.max_len, out.write_at, out.visible = self.length, self.max_len, self.write_at, None
        return out


class SharedPrefix:
    """Layout of a packed row (1, B*P + n*R) of tokens: B left-padded prompts (B, P), then n right-padded responses
    (n, R), response i following prompt group[i]. Passed to the model in place of the attention mask.

    Attention: prompt tokens as in a padded prompt batch (causal, real keys only); response tokens of row i over
    the real tokens of prompt group[i] then causally over their own response. A padding query also sees itself
    (no empty softmax); its output is garbage nobody reads. A plain class, not a dataclass: FSDP2 rebuilds the
    dataclasses among a module's inputs when it casts them, which would rebuild the masks at every block.
    """

    def __init__(self, prompt_mask: torch.Tensor, response_mask: torch.Tensor, group: torch.Tensor):
        self.prompt_mask = prompt_mask  # (B, P) bool, True on real tokens (left padding)
        self.response_mask = response_mask  # (n, R) bool, True on real tokens (right padding)
        self.group = group  # (n,) long, the prompt of each response
        B, P = prompt_mask.shape
        n, R = response_mask.shape
        self.prompt_attn = build_attention_mask(prompt_mask, P)  # (B, 1, P, P)
        own_RR = build_attention_mask(response_mask, R)  # (n, 1, R, R)
        prompt_nRP = prompt_mask[group][:, None, None, :].expand(n, 1, R, P)
        self.response_attn = torch.cat([prompt_nRP, own_RR], dim=-1)  # (n, 1, R, P+R)
        self.prompt_tokens = B * P
        self.response_cols = torch.arange(R, device=prompt_mask.device)

    def response_index(self, col: torch.Tensor) -> torch.Tensor:
        """Packed position of response column col (n, k) of each row."""
        R = self.response_mask.shape[1]
        return self.prompt_tokens + torch.arange(self.group.shape[0], device=col.device)[:, None] * R + col

    def prompt_last_index(self) -> torch.Tensor:
        """Packed position (n,) of the last prompt column of each response's prompt (real: prompts are left-padded)."""
        P = self.prompt_mask.shape[1]
        return self.group * P + P - 1

    def logits_index(self) -> torch.Tensor:
        """Packed positions (n, R) whose next-token logits predict response columns 0 .. R-1: the prompt's last
        token, then the response's own columns 0 .. R-2."""
        n, R = self.response_mask.shape
        own = self.response_index(self.response_cols[None, : R - 1].expand(n, -1))  # (n, R-1)
        return torch.cat([self.prompt_last_index()[:, None], own], dim=1)  # (n, R)

    def last_real_index(self) -> torch.Tensor:
        """Packed position (n,) of each prompt + response row's last real token (the prompt's last token for an
        empty response), where a reward model reads its score."""
        length = self.response_mask.sum(-1)  # (n,) right padding: real tokens are columns 0 .. length-1
        own = self.response_index((length - 1).clamp(min=0)[:, None]).squeeze(1)
        return torch.where(length > 0, own, self.prompt_last_index())

    @staticmethod
    def pack(
        prompt_ids, prompt_mask, response_ids, response_mask, group
    ) -> tuple[torch.Tensor, torch.Tensor, "SharedPrefix"]:
        """(input_ids (1, T), position_ids (1, T), layout) with T = B*P + n*R. Positions count real tokens from 0:
        a response continues at its prompt's real length; padding gets position 0 (masked everywhere)."""
        prompt_pos = (prompt_mask.long().cumsum(-1) - 1) * prompt_mask  # (B, P)
        start = prompt_mask.sum(-1)[group]  # (n,) real prompt tokens before each response
        response_pos = (start[:, None] + response_mask.long().cumsum(-1) - 1) * response_mask  # (n, R)
        input_ids = torch.cat([prompt_ids.reshape(-1), response_ids.reshape(-1)])[None]
        position_ids = torch.cat([prompt_pos.reshape(-1), response_pos.reshape(-1)])[None]
        return input_ids, position_ids, SharedPrefix(prompt_mask, response_mask, group)


class SharedKVCache:
    """Decoding cache with each prompt's keys and values stored once for its G samples.

    prompt_k, prompt_v: (n_layer, B, n_head, P, head_dim) from a prefill of the B prompts; prompt_valid (B, P).
    kv: (n_layer, 2, B, n_head, G, max_new, head_dim), the samples' own keys (kv[:, 0]) and values (kv[:, 1]),
    written one step at a time (all rows advance together, finished rows included, so every written response
    position is a key). Rows are grouped by prompt (B, G) behind the head axis, the layout both parts of the
    attention read (shared_prefix_decode_attention), and keys and values sit side by side so one copy writes both.
    Memory: B*P prompt positions plus B*G*max_new response positions, against B*G*(P + max_new) for
    KVCache.repeat_interleave. `write_at`, `visible`: as KVCache's (a compiled or recorded decode step; visible
    counts response positions).
    """

    def __init__(self, prompt: "KVCache", group: int, max_new: int):
        n_layer, B, nh, _, hs = prompt.shape
        P = prompt.length
        self.prompt_k, self.prompt_v = prompt.k[:, :, :, :P], prompt.v[:, :, :, :P]
        self.prompt_valid = prompt.valid[:, :P]
        self.prompt_hidden = ~self.prompt_valid[:, None, None, :]  # (B, 1, 1, P) once per call, not per layer
        self.group = group
        self.kv = torch.zeros((n_layer, 2, B, nh, group, max_new, hs), device=prompt.k.device, dtype=prompt.k.dtype)
        self.length = 0  # response positions written
        self.max_len = max_new
        self.write_at: torch.Tensor | None = None
        self.visible: int | None = None
        self.work: dict[str, torch.Tensor] = {}  # the attention's output buffers, reused by every layer and step
        self.hidden: torch.Tensor | None = None  # one_softmax_decode_attention's key mask of the step (layer 0's)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.prompt_k, self.prompt_v, self.kv))

    def reset(self) -> "SharedKVCache":
        """Ready for the samples of a new prefill of the same prompt cache, in the same tensors (a compiled decode's
        buffers): the prompt mask read anew in place, no response position written (those left from the last call
        are keys no query sees: a compiled step masks every position past write_at)."""
        torch.logical_not(self.prompt_valid[:, None, None, :], out=self.prompt_hidden)
        self.length, self.write_at, self.visible, self.hidden = 0, None, None, None
        return self

    def advance(self, T: int) -> None:
        if self.write_at is None:
            self.length += T

    def buffer(self, name: str, shape: tuple, dtype=torch.float32) -> torch.Tensor:
        """A work tensor of this shape, kept across layers and steps in eager decoding (no allocation per layer);
        a fresh one in a compiled step, where it costs nothing and a graph should not write into its inputs."""
        if self.write_at is not None:
            return torch.empty(shape, device=self.kv.device, dtype=dtype)
        buf = self.work.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self.work[name] = torch.empty(shape, device=self.kv.device, dtype=dtype)
        return buf

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """Write this step's keys/values and return the attention output (N, T, C) of its queries over their
        prompt's real tokens and their own response so far (causal within the T new). qkv: (N, T, 3C), the
        c_attn output of N = B*G rows grouped by prompt."""
        N, T, _ = qkv.shape
        _, _, B, nh, G, max_new, hs = self.kv.shape
        qkv = qkv.view(B, G, T, 3, nh, hs)
        q = qkv[:, :, :, 0].permute(0, 3, 1, 2, 4)  # (B, nh, G, T, hs), a view
        new_kv = qkv[:, :, :, 1:].permute(3, 0, 4, 1, 2, 5)  # (2, B, nh, G, T, hs), a view
        one_softmax = q.device.type in ONE_SOFTMAX_DEVICES
        masks = not one_softmax or layer == 0 or self.hidden is None  # one_softmax: layer 0 builds the step's mask
        if self.write_at is not None:
            self.kv[layer].index_copy_(4, self.write_at, new_kv)
            L = self.visible or max_new
            own_kv = self.kv[layer, :, :, :, :, :L]  # every position a key; those not written yet are masked below
            own_hidden = torch.arange(L, device=q.device) > self.write_at[:, None] if masks else None  # (T, L)
        else:
            end = self.length + T
            if end > self.max_len:
                raise ValueError(f"shared KV cache holds {self.max_len} response positions, asked to write up to {end}")
            self.kv[layer, :, :, :, :, self.length : end] = new_kv
            own_kv = self.kv[layer, :, :, :, :, :end]  # (2, B, nh, G, L, hs)
            own_hidden = None
            if T > 1:
                key_pos, query_pos = torch.arange(end, device=q.device), torch.arange(self.length, end, device=q.device)
                own_hidden = key_pos[None, :] > query_pos[:, None]  # (T, L) later tokens
        if one_softmax:
            if masks:  # the keys each query may not see, built once per step
                self.hidden = decode_key_mask(self.prompt_hidden, own_hidden, T, own_kv.shape[-2])
            y = q.new_empty(B, G, T, nh, hs)  # (N, T, C) once viewed
            one_softmax_decode_attention(
                q,
                self.prompt_k[layer],
                self.prompt_v[layer],
                own_kv[0],
                own_kv[1],
                self.hidden,
                out=y.permute(0, 3, 1, 2, 4),
            )
            return y.view(N, T, nh * hs)
        args = (q, self.prompt_k[layer], self.prompt_v[layer], self.prompt_hidden, own_kv[0], own_kv[1], own_hidden)
        if self.write_at is not None:  # compiled: no out= into a strided view (a graph break), the copy is fused
            y = shared_prefix_decode_attention(*args).permute(0, 2, 3, 1, 4)  # (B, G, T, nh, hs)
            return _cast(y.reshape(N, T, nh * hs), qkv.dtype)
        y = self.buffer("y", (B, G, T, nh, hs), dtype=torch.float32)  # (N, T, C) once viewed
        shared_prefix_decode_attention(*args, out=y.permute(0, 3, 1, 2, 4), buffer=self.buffer)
        return _cast(y.view(N, T, nh * hs), qkv.dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """t in dtype, without dispatching an op when it already is (a decode step runs this thousands of times)."""
    return t if t.dtype == dtype else t.to(dtype)


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b, rounded to a's dtype first (the cache dtype) when out is fp32 and a is not."""
    if a.dtype == out.dtype:
        torch.matmul(a, b, out=out)
    else:
        out.copy_(a @ b)


def shared_prefix_decode_attention(
    q,
    prompt_k,
    prompt_v,
    prompt_hidden,
    own_k,
    own_v,
    own_hidden,
    out=None,
    buffer=None,
) -> torch.Tensor:
    """out = softmax(q K^T / sqrt(hs)) V over the keys [prompt part, own part], without copying the prompt part per
    row.

    q: (B, nh, G, T, hs), the queries of B*G rows grouped by prompt; prompt_k/v: (B, nh, P, hs) with prompt_hidden
    (B, 1, 1, P) True on padding; own_k/v: (B, nh, G, L, hs), each row's own keys, with own_hidden (T, L) True on the
    keys a query may not see (None: it sees all). Returns the output (B, nh, G, T, hs) in fp32, written into `out`
    when given. buffer(name, shape): where the work tensors come from (SharedKVCache.buffer; None allocates).
    The two parts are computed apart and merged by their log-sum-exps: out = (e^{lse_p} o_p + e^{lse_o} o_o) /
    (e^{lse_p} + e^{lse_o}). The prompt part reads each prompt's keys once for its G*T queries (one matmul per
    prompt): the decode step is memory-bound and this is the read that sharing saves. Matmuls run in the cache's
    dtype (no fp32 copy of the cache), softmax and merge in fp32. SDPA does not return its log-sum-exp, hence the
    explicit form (see docs/benchmarks.md). Few ops by construction (a decode step of a small model is bound by
    the host dispatching them, docs/benchmarks.md): both parts write their log-sum-exps and outputs into one
    stacked tensor each, so one subtraction, exponential, product and sum merge them; the masks come built; the
    query is copied once into the grouped layout, scaled on the way when 1/sqrt(hs) is a power of two (hs = 64 in
    every GPT-2), which scales every score exactly as scaling the scores would."""
    B, nh, G, T, hs = q.shape
    buffer = buffer or (lambda name, shape, dtype=torch.float32: torch.empty(shape, device=q.device, dtype=dtype))
    scale = 1.0 / math.sqrt(hs)
    exact_prescale = math.frexp(scale)[0] == 0.5  # a power of two
    q_g = buffer("q", (B, nh, G, T, hs), q.dtype)
    if exact_prescale:
        torch.mul(q, scale, out=q_g)
    else:
        q_g.copy_(q)
    lse = buffer("lse", (2, B, nh, G, T, 1))  # [prompt part, own part]
    o = buffer("o", (2, B, nh, G, T, hs))
    # prompt part: one (G*T, hs) x (hs, P) product per prompt and head
    s_p = _cast(q_g.view(B, nh, G * T, hs) @ prompt_k.transpose(-1, -2))  # (B, nh, G*T, P)
    if not exact_prescale:
        s_p = s_p * scale
    s_p = s_p.masked_fill_(prompt_hidden, float("-inf"))
    lse_p = lse[0].view(B, nh, G * T, 1)
    torch.logsumexp(s_p, -1, keepdim=True, out=lse_p)  # every prompt has a real token
    _matmul_into(o[0].view(B, nh, G * T, hs), _cast(s_p.sub_(lse_p).exp_(), prompt_v.dtype), prompt_v)
    # own part: one (T, hs) x (hs, L) product per row and head
    s_o = _cast(q_g @ own_k.transpose(-1, -2))  # (B, nh, G, T, L)
    if not exact_prescale:
        s_o = s_o * scale
    if own_hidden is not None:
        s_o = s_o.masked_fill_(own_hidden, float("-inf"))
    torch.logsumexp(s_o, -1, keepdim=True, out=lse[1])  # a query always sees itself
    _matmul_into(o[1], _cast(s_o.sub_(lse[1]).exp_(), own_v.dtype), own_v)
    # merge
    weight = (lse - torch.logaddexp(lse[0], lse[1])).exp_()  # (2, B, nh, G, T, 1)
    return torch.sum(weight * o, 0, out=out)


def decode_key_mask(prompt_hidden: torch.Tensor, own_hidden: torch.Tensor | None, T: int, L: int) -> torch.Tensor:
    """(B, 1, 1, T, P + L) bool, True on the keys a decode query may not see: the prompt's padding (prompt_hidden
    (B, 1, 1, P)), then the own keys own_hidden (T, L) hides (None: none)."""
    B, P = prompt_hidden.shape[0], prompt_hidden.shape[-1]
    own = own_hidden if own_hidden is not None else prompt_hidden.new_zeros(T, L)
    return torch.cat([prompt_hidden[:, :, :, None, :].expand(B, 1, 1, T, P), own.expand(B, 1, 1, T, L)], dim=-1)


def one_softmax_decode_attention(q, prompt_k, prompt_v, own_k, own_v, hidden, out=None) -> torch.Tensor:
    """shared_prefix_decode_attention's result in few kernels, for a GPU: the scores of both parts side by side in
    one tensor, one softmax over them, two products and one sum, about 9 kernels per layer against about 45 (a
    decode step on a GPU is some hundreds of kernels, bound by their count and their passes over fp32 scores).

    q (B, nh, G, T, hs); prompt_k/v (B, nh, P, hs), read once per prompt for its G*T queries; own_k/v
    (B, nh, G, L, hs); hidden (B, 1, 1, T, P + L) from decode_key_mask. Returns (B, nh, G, T, hs) in q's dtype,
    written into `out` when given. Scores, probabilities and the two parts' sum are in q's dtype (bf16 on a GPU: the
    softmax accumulates in fp32 inside), where the lse merge keeps fp32: the same rounding as the bf16 products
    themselves, not bit for bit the merge's. tests/test_sampler.py checks both against plain attention."""
    B, nh, G, T, hs = q.shape
    P = prompt_k.shape[2]
    scale = 1.0 / math.sqrt(hs)
    exact_prescale = math.frexp(scale)[0] == 0.5  # a power of two: scaling q scales every score exactly
    q_s = torch.mul(q, scale if exact_prescale else 1.0, out=q.new_empty(B, nh, G, T, hs))
    s = torch.cat(
        [(q_s.view(B, nh, G * T, hs) @ prompt_k.transpose(-1, -2)).view(B, nh, G, T, P), q_s @ own_k.transpose(-1, -2)],
        dim=-1,
    )  # (B, nh, G, T, P + L)
    if not exact_prescale:
        s = s.mul_(scale)
    p = s.masked_fill_(hidden, float("-inf")).softmax(-1)  # a query always sees itself: no empty row
    y_prompt = (p[..., :P].reshape(B, nh, G * T, P) @ prompt_v).view(B, nh, G, T, hs)  # a view: rows P + L apart
    return torch.add(y_prompt, p[..., P:] @ own_v, out=out)


def build_attention_mask(key_valid_BL: torch.Tensor, q_len: int) -> torch.Tensor:
    """Boolean mask (B, 1, T, L) for T queries that sit at the last T of L key positions.

    Query i (absolute position L-T+i) sees key j if j <= L-T+i (causal) and key j is a real token. A query
    always sees itself, so rows belonging to padding never have an empty softmax (which would give NaN);
    their outputs are garbage that no loss reads.
    """
    B, L = key_valid_BL.shape
    q_pos = torch.arange(L - q_len, L, device=key_valid_BL.device)  # (T,)
    k_pos = torch.arange(L, device=key_valid_BL.device)  # (L,)
    causal_TL = k_pos[None, :] <= q_pos[:, None]
    self_TL = k_pos[None, :] == q_pos[:, None]
    mask_BTL = (causal_TL[None] & key_valid_BL[:, None, :]) | self_TL[None]
    return mask_BTL[:, None]  # (B, 1, T, L)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.layer_idx = layer_idx
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x, attn_mask, kv_cache: KVCache | SharedKVCache | None = None):
        if isinstance(attn_mask, SharedPrefix):
            return self.c_proj(self._shared_prefix(x[0], attn_mask))[None]  # (1, T, C)
        if isinstance(kv_cache, SharedKVCache):  # decoding over prompts stored once per group
            return self.c_proj(kv_cache.attend(self.layer_idx, self.c_attn(x)))  # (N, T, C)
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, nh, L, hs)
        if attn_mask is None:  # no padding anywhere: the fused causal kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)

    def _shared_prefix(self, x_TC: torch.Tensor, layout: SharedPrefix) -> torch.Tensor:
        """Attention of a packed row x (B*P + n*R, C), before the output projection. Two SDPA calls with explicit
        masks: the prompts among themselves, and the responses over [their prompt's keys, their own keys]. The
        prompt keys are gathered per response (n*P keys per layer, as many as the unshared rows hold; the gather's
        backward sums their gradients into the one prompt computation). index_select, not k_p[group]: the same sums,
        but on a CPU its backward (index_add) is much cheaper than advanced indexing's (index_put with accumulate)
        (docs/benchmarks.md)."""
        C, nh = x_TC.shape[1], self.n_head
        B, P = layout.prompt_mask.shape
        n, R = layout.response_mask.shape
        qkv_p, qkv_r = self.c_attn(x_TC).split([B * P, n * R])  # (B*P, 3C), (n*R, 3C)
        q_p, k_p, v_p = (t.reshape(B, P, nh, C // nh).transpose(1, 2) for t in qkv_p.split(C, dim=1))  # (B, nh, P, hs)
        q_r, k_r, v_r = (t.reshape(n, R, nh, C // nh).transpose(1, 2) for t in qkv_r.split(C, dim=1))  # (n, nh, R, hs)
        y_p = F.scaled_dot_product_attention(q_p, k_p, v_p, attn_mask=layout.prompt_attn)  # (B, nh, P, hs)
        k_all = torch.cat([k_p.index_select(0, layout.group), k_r], dim=2)  # (n, nh, P+R, hs)
        v_all = torch.cat([v_p.index_select(0, layout.group), v_r], dim=2)  # (n, nh, P+R, hs)
        y_r = F.scaled_dot_product_attention(q_r, k_all, v_all, attn_mask=layout.response_attn)  # (n, nh, R, hs)
        return torch.cat([y_p.transpose(1, 2).reshape(B * P, C), y_r.transpose(1, 2).reshape(n * R, C)])  # (T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        # GPT-2's "gelu_new" is the tanh approximation.
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    fsdp_unit = True  # utils/fsdp.py shards each block as a unit of its own (the model imports nothing of FSDP)

    def __init__(self, cfg: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)
        # Set by utils/fsdp.py: recompute this block's activations in the backward pass; `_forward` compiled, for the
        # forward without a KV cache (training, scoring, reference passes; decoding keeps its own compiled step).
        self.activation_checkpointing = False
        self.compiled_forward = None

    def _forward(self, x, attn_mask, kv_cache):
        x = x + self.attn(self.ln_1(x), attn_mask, kv_cache)
        return x + self.mlp(self.ln_2(x))

    def forward(self, x, attn_mask, kv_cache: KVCache | None = None):
        fn = self._forward if kv_cache is not None or self.compiled_forward is None else self.compiled_forward
        if self.activation_checkpointing and self.training and kv_cache is None:
            return torch.utils.checkpoint.checkpoint(fn, x, attn_mask, None, use_reentrant=False)
        return fn(x, attn_mask, kv_cache)


class GPT2(nn.Module):
    """The GPT-2 body: embeddings, blocks and final layer norm. Returns hidden states (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, input_ids, position_ids, attention_mask=None, kv_cache: KVCache | None = None):
        """input_ids, position_ids: (B, T) long. attention_mask: (B, T) bool, True on real tokens, or None when
        no row has padding, or a SharedPrefix for a packed row (1, T). With a cache, the T new tokens are appended
        after the `kv_cache.length` cached ones."""
        B, T = input_ids.shape
        if isinstance(attention_mask, SharedPrefix) or isinstance(kv_cache, SharedKVCache):
            mask = attention_mask  # the layout, or None: the shared cache knows which keys each row sees
        elif kv_cache is not None:
            mask = kv_cache.attention_mask(attention_mask, T)
        else:
            mask = None if attention_mask is None else build_attention_mask(attention_mask, T)
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, C)
        for block in self.h:
            x = block(x, mask, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.ln_f(x)


def init_gpt2_weights(module: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation: N(0, 0.02) for weights, zero biases, and residual projections scaled by
    1/sqrt(2 * n_layer) (GPT-2 paper, section 2.3)."""
    for name, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj") else 0.02
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 body plus the language-model head, tied to the token embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = GPT2(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        init_gpt2_weights(self, cfg.n_layer)

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask=None,
        kv_cache=None,
        logits_slice: slice | torch.Tensor | None = None,
        head=None,
    ):
        """Returns logits (B, T', V) for the positions in `logits_slice`: a slice of columns, a (B, T') long tensor
        of column indices per row, or None for all positions. With `head`, returns head(hidden (B, T', C), head
        weight (V, C)) instead: a function that needs less than the logits (rlhf/logprobs.py's fused log-probs)
        applies the head itself, here, where FSDP has the tied weight gathered."""
        h = self.transformer(input_ids, position_ids, attention_mask, kv_cache)  # (B, T, C)
        if isinstance(logits_slice, torch.Tensor):
            h = h.gather(1, logits_slice[..., None].expand(-1, -1, h.shape[-1]))  # (B, T', C)
        elif logits_slice is not None:
            h = h[:, logits_slice]
        if head is not None:
            return head(h, self.lm_head.weight)
        return self.lm_head(h)  # (B, T', V)
