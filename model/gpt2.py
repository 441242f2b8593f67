"""GPT-2 written from scratch as plain nn.Modules.

Layer names follow the Hugging Face GPT-2 checkpoint (`transformer.h.0.attn.c_attn`, ...) so loading and
exporting are loops over names with a transpose for the Conv1D layers (see model/weights.py).

Two things differ from a textbook GPT-2 and both matter for RLHF:
- Position ids are explicit. GPT-2 has absolute position embeddings, so a left-padded prompt must start at
  position 0 at its first *real* token; deriving positions from column indices would shift every prompt by
  its padding and change the logits.
- A KV cache (`KVCache`) for incremental decoding. The sampler (model/sampler.py) prefills each prompt once
  and decodes one token per step, reading keys and values from the cache.

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


class KVCache:
    """Keys and values of every layer for incremental decoding.

    k, v: (n_layer, B, n_head, max_len, head_dim), allocated at the first write with the dtype the model
    computes in (bf16 under mixed precision). `valid` (B, max_len) marks which cached positions hold real
    tokens (False for left padding and for positions not yet written) and is the key mask of every step.
    `length` is the number of positions written so far; all rows advance together.
    """

    def __init__(self, cfg: GPTConfig, batch_size: int, max_len: int, device):
        self.shape = (cfg.n_layer, batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.valid = torch.zeros(batch_size, max_len, device=device, dtype=torch.bool)
        self.length = 0
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values (B, nh, T, hs) after the cached ones; return all of them (B, nh, L, hs)."""
        if self.k is None:
            self.k = torch.zeros(self.shape, device=k.device, dtype=k.dtype)
            self.v = torch.zeros(self.shape, device=v.device, dtype=v.dtype)
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked to write up to {end}")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def repeat_interleave(self, n: int) -> "KVCache":
        """Copy every row n times (row i -> rows i*n .. i*n+n-1): one prefill serves a group of n samples."""
        out = object.__new__(KVCache)
        out.shape = (self.shape[0], self.shape[1] * n, *self.shape[2:])
        out.k = None if self.k is None else self.k.repeat_interleave(n, dim=1)
        out.v = None if self.v is None else self.v.repeat_interleave(n, dim=1)
        out.valid = self.valid.repeat_interleave(n, dim=0)
        out.length, out.max_len = self.length, self.max_len
        return out


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

    def forward(self, x, attn_mask, kv_cache: KVCache | None = None):
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
        # Set by utils/fsdp.py: recompute this block's activations in the backward pass.
        self.activation_checkpointing = False

    def _forward(self, x, attn_mask, kv_cache):
        x = x + self.attn(self.ln_1(x), attn_mask, kv_cache)
        return x + self.mlp(self.ln_2(x))

    def forward(self, x, attn_mask, kv_cache: KVCache | None = None):
        if self.activation_checkpointing and self.training and kv_cache is None:
            return torch.utils.checkpoint.checkpoint(self._forward, x, attn_mask, None, use_reentrant=False)
        return self._forward(x, attn_mask, kv_cache)


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
        no row has padding. With a cache, the T new tokens are appended after the `kv_cache.length` cached ones."""
        B, T = input_ids.shape
        if kv_cache is not None:
            end = kv_cache.length + T
            kv_cache.valid[:, kv_cache.length : end] = (
                attention_mask if attention_mask is not None else True
            )
            mask = build_attention_mask(kv_cache.valid[:, :end], T)
        else:
            mask = None if attention_mask is None else build_attention_mask(attention_mask, T)
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, C)
        for block in self.h:
            x = block(x, mask, kv_cache)
        if kv_cache is not None:
            kv_cache.length += T
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
        self, input_ids, position_ids, attention_mask=None, kv_cache=None, logits_slice: slice | torch.Tensor | None = None,
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
