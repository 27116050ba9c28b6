"""flowtt_jax tests: run with ``python -m pytest tests`` from the repository root."""
