"""Rollout engines: sample responses and their log-probs from the current policy."""
