"""CUDA graphs for decode steps, captured per batch-size bucket as vLLM captures them: a step of
only decodes replays the graph of the smallest bucket that holds it, so its hundreds of kernel
launches cost one. The graphs read persistent buffers, which each step fills from numpy: token
ids, positions, the cache rows the new K/V go to, the block rows of every sequence (padded to
max_model_len) and the context lengths the paged decode kernel reads. Rows past the step's are
padding: they write to and attend over a scratch block no sequence owns.

On CPU with the C++ kernels a step size is recorded as an op program (engine/op_programs.py) the
first time it runs, and replayed after: the same buffers, no Python per op. CPU sizes are exact
up to 8, then multiples of 8 (program_buckets). The programs' intermediate tensors lie in
one arena that all of them share (they never run at once), as large as the largest program's
(SmolLM2: ~310 KB a row); sizes whose program would need more than PROGRAM_MEMORY run eagerly.
Otherwise a step runs the buffers eagerly (how the tests check the buffers and the padding, with
the Triton decode kernel under Triton's CPU interpreter).
"""
import logging

import numpy as np
import torch

from tritonlm.engine.step_inputs import pad_tables
from tritonlm.engine.step_plan import ScheduledChunk
from tritonlm.engine.op_programs import ProgramRecorder, RecordingRefused
from tritonlm.layers.attention_metadata import AttentionMetadata, DecodeRows, write_locations

logger = logging.getLogger(__name__)
# The most the CPU op programs' shared arena of intermediate tensors may take.
PROGRAM_MEMORY = 256 << 20


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then multiples of 8 (vLLM's), up to max_num_seqs."""
    sizes = {b for b in (1, 2, 4) if b < max_num_seqs} | set(range(8, max_num_seqs, 8))
    return sorted(sizes | {max_num_seqs})


def program_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes recorded as CPU op programs: each up to 8, then multiples of 8. A padding
    row costs a CPU compute, not just a launch, but little beside a recording: a size's first
    step, recorded, takes 30-60 ms more than its replays (SmolLM2, 256 random requests on 2 AMX
    Xeon cores: every size recorded, 135 of them, 13.9-15.5 s of an 89-99 s run; in multiples
    of 8, 25 recorded in 2.4 s, the run 85 s; of 4, 42 in 4.0 s, 83 s)."""
    return sorted(set(batch_buckets(max_num_seqs)) | set(range(1, min(8, max_num_seqs) + 1)))


class DecodeGraphs:
    def __init__(self, model, num_kv_heads: int, block_size: int, max_model_len: int,
                 buckets: list[int], scratch_block: int, windows: list[int | None],
                 device: torch.device, op_program: type | None = None):
        """`op_program`: the C++ OpProgram class, to record each size on first use (CPU)."""
        self.model = model
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.scratch_block = scratch_block
        self.windows = windows  # the other layers' sliding windows: they share the metadata
        self.buckets = buckets
        self.op_program = op_program
        self.arena: torch.Tensor | None = None  # the op programs' intermediate tensors
        self.eager_from: int | None = None  # sizes from this one need more than PROGRAM_MEMORY
        rows = self.buckets[-1]

        def buffer(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.int64, device=device)
        self.input_ids = buffer(rows)
        self.positions = buffer(rows)
        self.write_rows = buffer(rows * num_kv_heads)
        self.blocks = buffer(rows, num_kv_heads, self.max_blocks)
        self.context_lens = buffer(rows, fill=1)
        self.token_index = torch.arange(rows, device=device)
        # by (bucket, whether LoRA adapters are on: CPU programs only), CUDA graphs or OpPrograms
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}

    def covers(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a step is one these graphs run: decodes only, no more than the largest bucket,
        contexts within max_model_len."""
        return (0 < len(chunks) <= self.buckets[-1]
                and all(len(c.token_ids) == 1 and c.encoder_token_ids is None
                        and len(c.block_table) <= self.max_blocks for c in chunks))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool; each runs eagerly once first
        (lazy initialisation, kernel compilation). All rows are padding: only the scratch block
        is written. (In inference mode, as steps run: no autograd records in the graphs.)"""
        self._fill([], self.buckets[-1])
        pool = None
        for bucket in reversed(self.buckets):
            self._forward(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket, False] = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket, False] = graph

    def run(self, chunks: list[ScheduledChunk], step: int = 0,
            input_ids: torch.Tensor | None = None, lora: bool = False) -> torch.Tensor:
        """The hidden states [len(chunks), hidden] of a step `covers` accepts; `step` > 0: the
        step that many after the chunks' in a decode run, its input ids on the device; `lora`:
        the step's adapters are set in the layers' batch, in buffers kept for this size (CPU
        programs)."""
        bucket = self.bucket(len(chunks))
        self._fill(chunks, bucket, step, input_ids)
        key = (bucket, lora)
        if key in self.graphs:
            self.graphs[key].replay()
            return self.outputs[key][:len(chunks)]
        if self.op_program is not None and (self.eager_from is None or bucket < self.eager_from):
            return self._record(key)[:len(chunks)]
        return self._forward(bucket)[:len(chunks)]

    def bucket(self, rows: int) -> int:
        """The size a step of `rows` decodes runs as: the smallest bucket that holds it."""
        return next(b for b in self.buckets if b >= rows)

    def _record(self, key: tuple[int, bool]) -> torch.Tensor:
        """This step, run and recorded as the bucket's op program; a step the recording refuses
        (its ops are written again by the eager run) turns recording off."""
        bucket = key[0]
        program = self.op_program()
        try:
            with ProgramRecorder(program) as recorder:
                out = self._forward(bucket)
        except RecordingRefused as e:
            logger.warning("CPU decode steps run eagerly: the model's step cannot be recorded "
                           "(%s)", e)
            self.op_program = None
            return self._forward(bucket)
        needed = program.adopt_results(list(recorder.result_storages))
        if needed > PROGRAM_MEMORY:  # its results stay the allocator's; this size eager from now on
            self.eager_from = bucket  # only sizes below eager_from are recorded
            return out
        if self.arena is None or self.arena.numel() < needed:
            grown = 0 if self.arena is None else min(2 * self.arena.numel(), PROGRAM_MEMORY)
            self.arena = torch.empty(max(needed, grown), dtype=torch.uint8)
            for other in self.graphs.values():  # what they hold now is never read again
                other.place_results(self.arena, with_contents=False)
        program.place_results(self.arena, with_contents=True)  # out among them
        self.graphs[key], self.outputs[key] = program, out
        return out

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(
            write_rows=self.write_rows[:bucket * self.num_kv_heads],
            seq_lens=self.context_lens[:bucket],
            decode=[DecodeRows(self.token_index[:bucket], self.blocks[:bucket],
                               context_lens=self.context_lens[:bucket])])
        meta.by_window = dict.fromkeys(self.windows, meta)
        return self.model(self.input_ids[:bucket], self.positions[:bucket], meta)

    def _fill(self, chunks: list[ScheduledChunk], bucket: int, step: int = 0,
              input_ids: torch.Tensor | None = None) -> None:
        """The step's rows, then padding up to the bucket, into the buffers; `input_ids`, when
        given, replace the chunks' tokens (copied on the device, in stream order)."""
        count = len(chunks)
        positions = np.zeros(bucket, dtype=np.int64)
        positions[:count] = [c.start_pos + step for c in chunks]
        if input_ids is None:
            token_ids = np.zeros(bucket, dtype=np.int64)
            token_ids[:count] = [c.token_ids[0] for c in chunks]
            self.input_ids[:bucket].copy_(torch.from_numpy(token_ids), non_blocking=True)
        else:  # padding rows keep the ids of the run's first step
            self.input_ids[:count].copy_(input_ids)
        # Only the tables' width: the kernel reads no block past a row's context, so what lies
        # beyond (an earlier step's) is never read (32 rows of 128-token contexts: 16 of 512).
        width = max([len(c.block_table) for c in chunks], default=1) or 1
        tables = pad_tables([c.block_table for c in chunks] + [[]] * (bucket - count), width,
                            self.scratch_block)
        filling = [
            (self.positions, positions),
            (self.context_lens, positions + 1),
            (self.write_rows, write_locations(tables, np.ones(bucket, dtype=np.int64), positions,
                                              self.block_size, self.num_kv_heads, False))]
        if step == 0:  # a run's later steps read the same blocks
            heads = np.arange(self.num_kv_heads)
            filling.append((self.blocks[:, :, :width], tables[:, None, :] * self.num_kv_heads
                            + heads[None, :, None]))
        for buffer, array in filling:
            buffer[:len(array)].copy_(torch.from_numpy(array), non_blocking=True)
