"""Scoring: per-token log-probs and entropy (plain, vocab-sharded, chunked, vocab-blocked, fused) and the GRPO loss."""
