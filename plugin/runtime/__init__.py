"""What runs beside training: statistics and the metrics processor, the non-finite guard, torch internals."""
