"""Measuring trained models on held-out data and reporting it: preference accuracy and the per-batch scoring of pairs
(preference.py; eval_preferences.py is its command line), GRPO's evaluation sets and the reward of held-out summaries
(summaries.py), logged samples and the judge's win rate (samples.py), the reward-KL frontier: a policy's reward against
its KL to the reference (measure.py; its options in frontier_declarations.py), best-of-n from the reference
(best_of_n.py), the comparisons at matched KL and the fitted curves (matched.py), and the tables, picture and command
line (frontier.py); a policy's samples labelled by a gold reward model (label_pairs.py), the embedded task's probes
(probes.py), runs side by side (compare.py) and the pictures (plots.py). Imports rollouts/, model/, data/, rlhf/ and
utils/; experiments/, training/ and the scripts import it."""
