"""KV cache block accounting: ids, reference counts and a free list over one preallocated pool."""
from collections import deque

from tritonlm.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table)) + self._needs_copy(seq)

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
        return copy

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def share(self, source: Sequence, target: Sequence, num_tokens: int) -> None:
        """Let `target` reuse `source`'s KV for its first `num_tokens` tokens."""
        target.block_table = source.block_table[:self.blocks_for(num_tokens)]
        for block in target.block_table:
            self.ref_counts[block] += 1
        target.num_computed_tokens = min(num_tokens, len(target.block_table) * self.block_size)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody references return to the free list."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
