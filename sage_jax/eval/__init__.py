"""The evaluation library (benchmarks avg@k / pass@k)."""
