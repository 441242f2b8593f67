"""Evaluation of trained models on held-out data (preference accuracy); imports model, data, rlhf and utils."""
