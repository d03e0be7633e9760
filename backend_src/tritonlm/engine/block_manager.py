"""KV cache block accounting: ids, reference counts and a free list over one preallocated pool,
with prefix caching: full blocks are hashed along the prefix chain, and freed blocks keep their
content until reused, least recently freed first."""
from collections import OrderedDict

from tritonlm.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # Insertion order is eviction order: freed blocks go to the end.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.enable_prefix_caching = enable_prefix_caching
        self.block_hashes: dict[int, int] = {}  # block -> hash of its prefix chain
        self.cached_blocks: dict[int, int] = {}  # hash -> block holding that content

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return (max(0, needed - len(seq.block_table)) + self._needs_copy(seq)
                + self._missing_cross_blocks(seq))

    def _missing_cross_blocks(self, seq: Sequence) -> int:
        if seq.encoder_token_ids is None:
            return 0
        return self.blocks_for(len(seq.encoder_token_ids)) - len(seq.cross_block_table)

    def _needs_copy(self, seq: Sequence) -> bool:
        """The block that receives the next token is shared: write to a private copy."""
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= len(self.free_blocks)

    def grow(self, seq: Sequence, num_new_tokens: int) -> tuple[int, int] | None:
        """Give `seq` blocks for its next `num_new_tokens` KV entries; returns (source, copy)
        when a shared block had to be copied first (copy on write)."""
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > len(self.free_blocks):
            raise RuntimeError(f"{missing} blocks needed, {len(self.free_blocks)} free")
        copy = None
        if self._needs_copy(seq):
            index = seq.num_computed_tokens // self.block_size
            shared = seq.block_table[index]
            self.ref_counts[shared] -= 1
            seq.block_table[index] = self._take()
            copy = (shared, seq.block_table[index])
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._take())
        seq.cross_block_table += [self._take() for _ in range(self._missing_cross_blocks(seq))]
        return copy

    def _take(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        self._forget(block)
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        content = self.block_hashes.pop(block, None)
        if content is not None and self.cached_blocks.get(content) == block:
            del self.cached_blocks[content]

    def reset_prefix_cache(self) -> None:
        """Evict every cached block nobody references (vLLM's reset_prefix_cache)."""
        for block in self.free_blocks:
            self._forget(block)

    def reuse_cached_prefix(self, seq: Sequence) -> int | None:
        """For a sequence holding no blocks, take the cached blocks of its longest cached prefix
        of full blocks (at least one token is left to compute); returns the tokens reused, or
        None when nothing was looked up."""
        if not self.enable_prefix_caching or seq.block_table:
            return None
        for index in range((seq.num_tokens - 1) // self.block_size):
            content = self._chain_hash(seq, index)
            block = self.cached_blocks.get(content)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.num_cached_blocks += 1
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def pending_block_hashes(self, seq: Sequence) -> list[int]:
        """Content hashes of `seq`'s full blocks of tokens it has not computed yet: blocks the
        prefix cache will hold once its prefill gets there."""
        if not self.enable_prefix_caching:
            return []
        return [self._chain_hash(seq, index) for index in
                range(seq.num_computed_tokens // self.block_size, seq.num_tokens // self.block_size)]

    def next_block_hash(self, seq: Sequence) -> int | None:
        """The content hash of the first full block `seq` would compute itself after its reused
        prefix, if a later lookup could still find it cached."""
        index = len(seq.block_table)
        if not self.enable_prefix_caching or index >= (seq.num_tokens - 1) // self.block_size:
            return None
        return self._chain_hash(seq, index)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Make `seq`'s newly computed full blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        # NOTE: only full blocks are hashed; a partial block is still being written.
        for index in range(seq.num_cached_blocks, seq.num_computed_tokens // self.block_size):
            content = self._chain_hash(seq, index)
            block = seq.block_table[index]
            seq.num_cached_blocks += 1
            self.block_hashes[block] = content
            self.cached_blocks.setdefault(content, block)

    def _chain_hash(self, seq: Sequence, index: int) -> int:
        hashes = seq.content_hashes
        while len(hashes) <= index:
            start = len(hashes) * self.block_size
            # an adapter computes other KV from the same tokens: its chains are its own
            previous = hashes[-1] if hashes else ("lora", seq.lora_id) if seq.lora_id else None
            hashes.append(hash((previous, tuple(seq.token_ids[start:start + self.block_size]))))
        return hashes[index]

    def share(self, source: Sequence, target: Sequence, num_tokens: int) -> None:
        """Let `target` reuse `source`'s KV for its first `num_tokens` tokens."""
        target.block_table = source.block_table[:self.blocks_for(num_tokens)]
        full_blocks = num_tokens // self.block_size
        target.num_cached_blocks = min(source.num_cached_blocks, full_blocks)
        target.content_hashes = source.content_hashes[:full_blocks]
        target.cross_block_table = list(source.cross_block_table)
        target.encoder_computed = source.encoder_computed
        for block in target.block_table + target.cross_block_table:
            self.ref_counts[block] += 1
        target.num_computed_tokens = min(num_tokens, len(target.block_table) * self.block_size)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody references return to the free list."""
        # The deepest blocks of a prefix are freed first, so they are evicted first.
        for block in reversed(seq.cross_block_table + seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.cross_block_table = []
        seq.encoder_computed = False
