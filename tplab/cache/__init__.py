"""KV cache storage."""
