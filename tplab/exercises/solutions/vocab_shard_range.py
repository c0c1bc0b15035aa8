# Exercise: vocab_shard_range (reference solution)


def vocab_shard_range(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """Pad the vocab up to a multiple of tp; rank r holds the r-th equal slice, cut at the real vocab."""
    per_rank = -(-vocab_size // tp)                      # ceil(vocab_size / tp) rows each, padding included
    start = rank * per_rank
    return start, max(start, min(start + per_rank, vocab_size))
