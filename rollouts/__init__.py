"""GRPO's step (step.py: train_step, stages 2-7 of grpo.py's loop) and what it runs on and calls around its math: the
three models and the checks that they hold the lengths and fit the device (models.py, memory.py), GRPO's option
groups (rewards, sampling, selection, objective, batch sizes) and the frozen models' offload (options.py), a rank's
prompts (prompts.py), responses sampled from the policy and scored by the reward sources (sampling.py), the training
micro-batches (batches.py), the policy update (update.py), the step's result and global metrics (metrics.py). They
run models or collectives, so they live neither in model/ (no distributed code) nor in rlhf/ (pure math). Importers:
grpo.py; dpo.py (the frozen models' offload: options.py); evaluation/label_pairs.py, evaluation/measure.py,
evaluation/preference.py, evaluation/probes.py, evaluation/samples.py and evaluation/summaries.py (sampling and
scoring: sampling.py; GRPO's prompts: prompts.py); evaluation/compare.py (the options' declarations: options.py);
training/reward_normalization.py (sample_responses); the benchmark (bench/) and the tests."""
