"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts, prefix sharing.

A sequence's K/V live in ``block_table`` blocks of ``block_size`` token slots each;
token p sits in slot ``block_table[p // block_size] * block_size + p % block_size``.
Blocks are handed out when needed and returned when the sequence finishes, so a
sequence holds memory for the tokens it has, not for the longest it might become.

With prefix caching, every *full* block is keyed by a chained hash of its token ids
(the hash of the block before it, and its own tokens), so two sequences with the
same prefix find the same blocks and share them by reference count. A sequence keeps
the hashes of its full blocks (``seq.block_hashes``), extended by one as each block fills.
A block is registered when it is allocated (or filled), before the step that writes its K/V runs:
the scheduler never frees a prompt halfway through its prefill, and after a step that raised the
engine starts an empty block manager (``Scheduler.abort_all``).

A sequence here is anything with ``seq_id``, ``token_ids``, ``block_table``, ``block_hashes``,
``num_cached_tokens`` and ``len(seq)``, its number of tokens (``tplab.engine.sequence.Sequence``).
"""
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None                  # set once the block is full (prefix caching)
    token_ids: tuple[int, ...] = field(default=())


def chain_hash(prev_hash: int | None, token_ids) -> int:
    """Key of a full block: depends on every token before it, not only its own."""
    return hash((prev_hash, tuple(token_ids)))


class BlockManager:
    """Which KV blocks each sequence holds, with prefix sharing by reference count.

    Contract of ``Parts.block_manager`` (the scheduler and ``llm.stats()`` use exactly this):
    - ``__init__(num_blocks, block_size, enable_prefix_caching=False)``;
    - ``can_allocate(seq) -> int | None``: None when the free blocks cannot hold ``seq``'s tokens (its
      cached prefix aside), else how many of its leading full blocks are cached already;
    - ``allocate(seq, num_cached_blocks)``: a block for every token of ``seq`` in ``seq.block_table``, the
      first ``num_cached_blocks`` shared from the cache, and ``seq.num_cached_tokens`` the tokens they hold;
    - ``can_append(seq) -> bool``, ``may_append(seq)``: room for, and a block for, ``seq``'s newest token
      (with prefix caching ``may_append`` also registers the block that token fills);
    - ``free(seq)``: give its blocks back (a shared one when its last user goes), empty ``seq.block_table``
      and set ``seq.num_cached_tokens`` to 0;
    - counters ``num_blocks``, ``num_used_blocks``, ``prefix_cache_hit_blocks``, ``peak_blocks_used``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # freed blocks go to the back
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_hit_blocks = 0
        self.peak_blocks_used = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, seq, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _hash_full_blocks(self, seq) -> list[int]:
        """``seq.block_hashes``, extended to cover every full block of ``seq``: each new one chains on the last."""
        for i in range(len(seq.block_hashes), len(seq) // self.block_size):
            seq.block_hashes.append(chain_hash(seq.block_hashes[-1] if i else None, self._block_tokens(seq, i)))
        return seq.block_hashes

    def _cached_prefix(self, seq) -> list[int]:
        """Block ids already holding this sequence's leading full blocks (never its last token:
        that one is always recomputed, to get the logits for the next token)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i, h in enumerate(self._hash_full_blocks(seq)[:(len(seq) - 1) // self.block_size]):
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
                break                                            # not cached, or a hash collision
            hits.append(block_id)
        return hits

    def can_allocate(self, seq) -> int | None:
        """How many of ``seq``'s leading blocks are cached already, when there is room for the rest
        (pass it to ``allocate``); None when there is not."""
        hits = self._cached_prefix(seq)
        revived = sum(self.blocks[b].ref_count == 0 for b in hits)  # shared from the free list
        enough = len(self.free_block_ids) >= self.blocks_needed(len(seq)) - len(hits) + revived
        return len(hits) if enough else None

    def allocate(self, seq, num_cached_blocks: int = 0) -> None:
        """Blocks for every token of ``seq`` (its prompt, or prompt + output after a preemption); its
        first ``num_cached_blocks`` are the cached ones ``can_allocate`` found."""
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        hashes = self._hash_full_blocks(seq) if self.enable_prefix_caching else []
        hits = [self.hash_to_block_id[h] for h in hashes[:num_cached_blocks]]
        for block_id in hits:
            if self.blocks[block_id].ref_count == 0:
                self.free_block_ids.remove(block_id)
            self.blocks[block_id].ref_count += 1
        seq.block_table = list(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        self.prefix_cache_hit_blocks += len(hits)
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free_block())
        for i in range(len(hits), len(hashes)):
            self._register(seq.block_table[i], hashes[i], self._block_tokens(seq, i))

    def can_append(self, seq) -> bool:
        """Room for the K/V of ``seq``'s newest token (position ``len(seq) - 1``)."""
        needs_block = len(seq.block_table) < self.blocks_needed(len(seq))   # the token starts a new block
        return len(self.free_block_ids) >= int(needs_block)

    def may_append(self, seq) -> None:
        """Give ``seq`` a new block if its newest token starts one; register a block it fills."""
        if len(seq.block_table) < self.blocks_needed(len(seq)):
            seq.block_table.append(self._take_free_block())
        if self.enable_prefix_caching and len(seq) % self.block_size == 0:
            i = len(seq) // self.block_size - 1
            self._register(seq.block_table[i], self._hash_full_blocks(seq)[i], self._block_tokens(seq, i))

    def free(self, seq) -> None:
        """Return ``seq``'s blocks; a block goes back to the free list when no sequence uses it."""
        for block_id in reversed(seq.block_table):  # tail first into the free list: reused before the prefix,
                                                    # the part a later prompt is likeliest to share
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)   # keeps its hash: a later prompt may still hit it
        seq.block_table, seq.num_cached_tokens = [], 0

    def _take_free_block(self) -> int:
        block = self.blocks[self.free_block_ids.popleft()]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]      # its old contents are about to be overwritten
        block.ref_count, block.hash, block.token_ids = 1, None, ()
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_used_blocks)
        return block.block_id

    def _register(self, block_id: int, h: int, token_ids) -> None:
        block = self.blocks[block_id]
        block.hash, block.token_ids = h, tuple(token_ids)
        self.hash_to_block_id[h] = block_id
