"""Small random checkpoints made with transformers (tests, the demo's preset, benchmarks)."""
