"""The training scripts' pieces that run models or collectives, outside GRPO's step (rollouts/): the preference pairs
the reward model and DPO train and validate on (pairs.py: PairConfig, load_pairs; PairConfig extends utils/config.py's
DataConfig, so it cannot live in data/, which imports nothing of utils/), a policy trained against a frozen reference
(reference.py: DPO's policy and reference, the reference's log-probs of a step's micro-batches), the reward model's
normalisation over samples of the SFT policy (reward_normalization.py), and the next-token loss of an SFT micro-batch
(nll.py). Above evaluation/ (pairs.py builds the validation EvalSet, reference.py scores with its pair_logprobs) and
rollouts/ (reward_normalization.py samples with its sample_responses); nothing in a package imports it. Importers:
sft.py (nll.py); dpo.py (pairs.py, reference.py); reward_model.py (pairs.py, reward_normalization.py); the tests."""
