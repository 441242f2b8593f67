"""What GRPO's step runs on and calls for its stages 2 and 3: the three models (models.py), a rank's prompts
(prompts.py), responses sampled from the policy and scored by the reward sources (sampling.py). They run models under
FSDP, so they live neither in model/ (no distributed code) nor in rlhf/ (pure math); grpo.py, the benchmark, the tests
and evaluation/summaries.py import them."""
