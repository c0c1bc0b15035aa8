# Exercise: slot_mapping (reference solution)


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """Token p lives in block ``block_table[p // block_size]``, at offset ``p % block_size`` in it."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
