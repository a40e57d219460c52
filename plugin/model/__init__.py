"""The model: the GRPO policy class, its parallelize function, the frozen reference, the optimizer container."""
