"""A scalar reward head composed with the GPT-2 body."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.gpt2 import GPT2, GPTConfig, SharedPrefix, init_gpt2_weights


def last_real_index(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Column of the last True in each row (B,). cumsum reaches its maximum first at the last real token,
    whatever padding sits on either side."""
    return attention_mask_BT.long().cumsum(-1).argmax(-1)


class RewardModel(nn.Module):
    """r(x, y): the GPT-2 body's hidden state at the last real token, projected to a scalar.

    `gain` and `bias` are fitted after training so that rewards of SFT samples have mean 0 and std 1
    (reward_model.py); `normalized(r) = gain * r + bias`. They are buffers so they travel with checkpoints.
    The head is `score` without a bias, as in transformers' GPT2ForSequenceClassification, so the exported
    folder loads there.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = GPT2(cfg)
        self.score = nn.Linear(cfg.n_embd, 1, bias=False)
        self.register_buffer("gain", torch.ones(()))
        self.register_buffer("bias", torch.zeros(()))
        init_gpt2_weights(self, cfg.n_layer)

    def forward(self, input_ids, position_ids, attention_mask) -> torch.Tensor:
        """Raw rewards (B,) read at each row's last real token; for a packed row (attention_mask a SharedPrefix), one
        reward per response (n,), read at its last real token."""
        h = self.transformer(input_ids, position_ids, attention_mask)  # (B, T, C)
        if isinstance(attention_mask, SharedPrefix):
            h_last = h[0, attention_mask.last_real_index()]  # (n, C)
        else:
            last = last_real_index(attention_mask)  # (B,)
            h_last = h[torch.arange(h.shape[0], device=h.device), last]  # (B, C)
        # The head in fp32 even under bf16 mixed precision: a bf16 output lands on bf16 steps (0.0625 apart near
        # |r| = 10), and the scores feed RSO's r == r_max ties, the advantages and the gain/bias fit
        r = F.linear(h_last.float(), self.score.weight.float())  # (B, 1) fp32
        return r.squeeze(-1).clone()  # (B,), a new tensor, not a view (FSDP2 warns about returning views)

    def normalize(self, rewards: torch.Tensor) -> torch.Tensor:
        return self.gain * rewards + self.bias
