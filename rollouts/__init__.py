"""What GRPO's step runs on and calls around its math: the three models and the checks that they hold the lengths and
fit the device (models.py, memory.py), a rank's prompts (prompts.py), responses sampled from the policy and scored by
the reward sources (sampling.py), the training micro-batches (batches.py) and the step's result and global metrics
(metrics.py). They run models or collectives, so they live neither in model/ (no distributed code) nor in rlhf/ (pure
math); grpo.py, the benchmark, the tests and evaluation/summaries.py import them."""
