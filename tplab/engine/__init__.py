"""The serving engine: sequences, sampling, the runner, and the user-facing ``LLM``."""
