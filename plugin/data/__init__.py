"""Data: rollout and prompt files, batches of whole groups, online sampling's dataset, reward functions."""
