"""Data plumbing: the GPT-2 tokenizer (offline), TL;DR loading, tokenization, collation and sharding, and the rule that
turns a labeller's scores into preference pairs (labels.py).

CPU-only and deterministic given a seed; rank and world size come in as arguments, so nothing here
touches torch.distributed. Import the submodules directly (`from data.tldr import ...`); this file
imports nothing so that `import data` stays cheap.
"""
