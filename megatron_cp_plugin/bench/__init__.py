"""Side-by-side benchmarks (run on GPUs; see README)."""
