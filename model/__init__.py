from model.gpt2 import GPT2, PRESETS, Block, GPT2LMHeadModel, GPTConfig, KVCache
from model.heads import POOLINGS, RewardModel, last_real_index
from model.weights import ModelLoadError, build_policy, build_reward_model, save_hf

__all__ = [
    "PRESETS",
    "GPT2",
    "Block",
    "GPT2LMHeadModel",
    "GPTConfig",
    "KVCache",
    "POOLINGS",
    "RewardModel",
    "last_real_index",
    "ModelLoadError",
    "build_policy",
    "build_reward_model",
    "save_hf",
]
