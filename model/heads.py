"""A scalar reward head composed with the GPT-2 body."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.gpt2 import GPT2, GPTConfig, SharedPrefix, init_gpt2_weights


def last_real_index(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Column of the last True in each row (B,). cumsum reaches its maximum first at the last real token,
    whatever padding sits on either side."""
    return attention_mask_BT.long().cumsum(-1).argmax(-1)


POOLINGS = ("last", "sum")


class RewardModel(nn.Module):
    """r(x, y): a scalar from the GPT-2 body's hidden states, by `pooling`:

    - "last": the hidden state at the last real token (the response's end token) projected to a scalar, as in
      transformers' GPT2ForSequenceClassification, so the exported folder loads there and scores the same.
    - "sum": the same projection at every response token, summed over the response (a per-token reward; 0 for an
      empty response). Each token's score can check that token against the prompt (a copied name against an
      invented one), which a single read at the end has to do for all of them at once (docs/results.md).
      The export loads in transformers too, but there the class reads the last token only: score it here.

    `gain` and `bias` are fitted after training so that rewards of SFT samples have mean 0 and std 1
    (reward_model.py); `normalized(r) = gain * r + bias`. They are buffers so they travel with checkpoints.
    The head is `score` without a bias, as in transformers' GPT2ForSequenceClassification.
    """

    def __init__(self, cfg: GPTConfig, pooling: str = "last"):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"reward pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.cfg = cfg
        self.pooling = pooling
        self.transformer = GPT2(cfg)
        self.score = nn.Linear(cfg.n_embd, 1, bias=False)
        self.register_buffer("gain", torch.ones(()))
        self.register_buffer("bias", torch.zeros(()))
        init_gpt2_weights(self, cfg.n_layer)

    def forward(self, input_ids, position_ids, attention_mask, prompt_len: int | None = None) -> torch.Tensor:
        """Raw rewards (B,), one per row; for a packed row (attention_mask a SharedPrefix), one per response (n,).
        `prompt_len`: with "sum" pooling and padded rows, the column where the responses start (collate_sft's
        layout: prompts left-padded in columns 0 .. P-1, responses right-padded after them)."""
        h = self.transformer(input_ids, position_ids, attention_mask)  # (B, T, C)
        # The head in fp32 even under bf16 mixed precision: a bf16 output lands on bf16 steps (0.0625 apart near
        # |r| = 10), and the scores feed RSO's r == r_max ties, the advantages and the gain/bias fit
        w = self.score.weight.float()  # (1, C)
        if self.pooling == "sum":
            if isinstance(attention_mask, SharedPrefix):
                n, R = attention_mask.response_mask.shape
                index = attention_mask.response_index(attention_mask.response_cols[None].expand(n, R))  # (n, R)
                per_token, mask = F.linear(h[0, index].float(), w).squeeze(-1), attention_mask.response_mask  # (n, R)
            else:
                if prompt_len is None:
                    raise ValueError("a reward model with pooling 'sum' needs prompt_len for padded rows")
                per_token = F.linear(h[:, prompt_len:].float(), w).squeeze(-1)  # (B, R)
                mask = attention_mask[:, prompt_len:]
            return per_token.masked_fill(~mask, 0.0).sum(-1)  # (B,); padding columns hold garbage, not read
        if isinstance(attention_mask, SharedPrefix):
            h_last = h[0, attention_mask.last_real_index()]  # (n, C)
        else:
            last = last_real_index(attention_mask)  # (B,)
            h_last = h[torch.arange(h.shape[0], device=h.device), last]  # (B, C)
        r = F.linear(h_last.float(), w)  # (B, 1) fp32
        return r.squeeze(-1).clone()  # (B,), a new tensor, not a view (FSDP2 warns about returning views)

    def normalize(self, rewards: torch.Tensor) -> torch.Tensor:
        return self.gain * rewards + self.bias
