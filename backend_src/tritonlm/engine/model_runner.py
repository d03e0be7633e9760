"""Owns the model, the KV cache and every tensor: turns a StepPlan into sampled tokens."""
import dataclasses
import logging
import time
from pathlib import Path

import torch

from tritonlm.config import EngineConfig
from tritonlm.distributed import parallel_state
from tritonlm.distributed.ranks import RankGroup
from tritonlm.engine.attention_setup import CacheSlots, flash_usable, paged_kernels
from tritonlm.engine.auto_dtype import resolve_dtype, resolve_int8_activations
from tritonlm.engine.decode_graphs import DecodeGraphs, batch_buckets, program_buckets
from tritonlm.engine.decode_run import (CUDA_DECODE_RUN, decode_run, greedy_run,
                                        sampled_tokens, verification_plan)
from tritonlm.engine.kv_cache_sizing import (GIB, measured_cuda_budget, most_blocks_in_use,
                                             profile_steps)
from tritonlm.engine.lora_registry import read_registry
from tritonlm.engine.lora_slots import LoRASlots
from tritonlm.engine.prompt_logprobs import prompt_logprobs
from tritonlm.engine.sampling_inputs import SamplingInputs
from tritonlm.engine.step_inputs import StepInputBuilder
from tritonlm.engine.step_plan import SampledToken, StepPlan, StepResult
from tritonlm.layers import cpu_kernels
from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionSpec
from tritonlm.layers.kv_cache import KVCache
from tritonlm.layers.quantization import QuantizedWeight
from tritonlm.layers.sampler import argmax_tokens, sample
from tritonlm.layers.shortlist_head import SHORTLIST, shortlist_head
from tritonlm.layers.token_counts import TokenCounts
from tritonlm.models.loader import load_model

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel `rank`: one GPU per rank unless an index is given."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    return torch.device("cuda", rank) if device.type == "cuda" and device.index is None else device


class ModelRunner:
    """Runs steps on this rank. Rank 0 (the driver) sends each plan to the other ranks first and
    samples after; the others run the model forward only. A draft model's runner (`draft`) only
    gives greedy tokens (greedy_tokens), through its head's shortlist where one runs."""

    def __init__(self, config: EngineConfig, hf_config, weights_dir: Path,
                 ranks: RankGroup | None = None, draft: bool = False):
        tp = parallel_state.current()
        self.config = config
        self.ranks = ranks
        self.is_driver = tp.rank == 0
        self.draft = draft
        self.device = resolve_device(config.device, tp.rank)
        self.dtype = DTYPES[resolve_dtype(config.dtype, self.device, hf_config)]
        self.block_size = config.block_size
        self.free_at_start = (torch.cuda.mem_get_info(self.device)[0]
                              if self.device.type == "cuda" else None)
        self.model = load_model(weights_dir, hf_config, self.dtype, self.device,
                                config.max_model_len, tp.rank)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.adapters = read_registry(weights_dir.parent, config.max_lora_rank)
        self.lora = self._lora_slots(hf_config) if self.adapters else None
        quantized = [m for m in self.model.modules() if isinstance(m, QuantizedWeight)]
        # settled (and logged) only for a model that has quantized weights or a shortlist
        int8_inputs = (resolve_int8_activations(config.quantized_activations, self.device)
                       if quantized or draft else False)
        for weight in quantized:
            weight.int8_inputs = int8_inputs
        shortlist = (shortlist_head(self.model, self.dtype, int8_inputs)
                     if draft and self.device.type == "cpu" else None)
        if shortlist is not None:
            logger.info("greedy head: the best %d tokens of a 4-bit copy, rescored on the float "
                        "head", SHORTLIST)
        self.greedy_head = shortlist or self._argmax_head
        # the model's own prepack packs its head: not for a head the shortlist stands in for
        for module in self.model.modules():
            if hasattr(module, "prepack_for_cpu") and not (shortlist and module is self.model):
                module.prepack_for_cpu(config.max_num_seqs)
        self.use_flash = flash_usable(self.attention_layers, self.device, self.dtype,
                                      self.block_size, config.kv_cache_dtype)
        self.cache_slots = CacheSlots(self.attention_layers, self.block_size, self.dtype,
                                      config.kv_cache_dtype == "int8", self.use_flash, self.device)
        kernels = paged_kernels(self.attention_layers, self.device, self.use_flash,
                                config.kv_cache_dtype)
        self.inputs = StepInputBuilder(
            self.block_size, _attention_specs([a for a in self.attention_layers if a.causal]),
            _attention_specs([a for a in self.attention_layers if not a.causal]),
            self.use_flash, self.device, kernels.decode is not None, kernels.prefill is not None)
        for layer in self.attention_layers:
            layer.kernels = kernels
        self.token_counts = TokenCounts(hf_config.vocab_size, self.device)
        self.sampling_inputs = SamplingInputs(self.token_counts, config.watermark_gamma,
                                              config.watermark_delta, self.device)
        self.encoder_decoder = bool(getattr(hf_config, "is_encoder_decoder", False))
        self.decode_graphs = None
        self.num_blocks = self._size_kv_cache()
        if self._decode_graphs_usable():
            self._allocate_kv_cache(self.num_blocks + 1)  # the last: the padding rows' scratch
            self.decode_graphs = self._decode_graphs(self.num_blocks)
            if self.device.type == "cuda":
                start, free = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
                self.decode_graphs.capture()
                logger.info("CUDA graphs of %d decode batch sizes captured in %.1f s, %.2f GiB",
                            len(self.decode_graphs.graphs), time.perf_counter() - start,
                            (free - torch.cuda.mem_get_info(self.device)[0]) / GIB)
        else:
            self._allocate_kv_cache(self.num_blocks)
        # Decode runs go through the decode graphs' buffers (inputs from the device).
        run = config.num_scheduler_steps or (CUDA_DECODE_RUN if self.device.type == "cuda" else 1)
        self.max_decode_run = run if self.decode_graphs is not None else 1

    def _lora_slots(self, hf_config) -> LoRASlots:
        if getattr(hf_config, "is_encoder_decoder", False):
            raise ValueError("LoRA adapters are served for decoder-only models")
        max_rank = self.config.max_lora_rank or max(a.max_rank for a in self.adapters)
        return LoRASlots(self.model, self.adapters, self.config.max_loras, max_rank, self.device)

    def _decode_graphs(self, scratch_block: int) -> DecodeGraphs:
        record = self._records_programs()
        return DecodeGraphs(
            self.model, self.attention_layers[0].num_kv_heads, self.block_size,
            self.config.max_model_len, (program_buckets if record else batch_buckets)(
                self.config.max_num_seqs), scratch_block,
            [spec.sliding_window for spec in self.inputs.window_specs], self.device,
            cpu_kernels.load().OpProgram if record else None)

    def _decode_graphs_usable(self) -> bool:
        """CUDA graphs and CPU op programs need the fixed shapes of the paged decode kernel (not
        flash-attn's varlen metadata), one rank (no collectives inside a graph) and a
        decoder-only model; CPU programs also need the C++ decode kernel (all tensor work in
        dispatcher ops, which a program records)."""
        return (not self.config.enforce_eager
                and self.attention_layers[0].kernels.decode is not None
                and parallel_state.current().world_size == 1 and not self.encoder_decoder
                and (self.device.type == "cuda" or self._records_programs()))

    def _records_programs(self) -> bool:
        return self.device.type == "cpu" and self.attention_layers[0].kernels.decode is getattr(
            cpu_kernels.load(), "decode_attention", None)

    def _size_kv_cache(self) -> int:
        """KV blocks: num_kv_blocks, or as many as the memory for them holds, at most what the
        running sequences can hold at once (the same on every rank)."""
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        config = self.config
        lookahead = config.speculative_tokens if config.speculative else 0
        most = most_blocks_in_use(config.max_num_seqs, config.max_model_len, self.block_size,
                                  lookahead, self.encoder_decoder)
        per_block = self.cache_slots.bytes_per_block()
        if self.device.type != "cuda":
            budget, source = config.kv_cache_memory, f"kv_cache_memory {config.kv_cache_memory}"
        elif self.draft:  # the target's cache took the GPU memory left: the most it may need
            budget, source = most * per_block, "a draft's sequences"
        else:
            budget, source = self._profile_cuda_budget(), "the GPU memory left"
        if budget < per_block:
            raise ValueError(f"{source} holds no {per_block}-byte KV block")
        num_blocks = min(budget // per_block, most)
        if parallel_state.current().connected:  # ranks measure their own GPUs
            count = torch.tensor([num_blocks], device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
            num_blocks = int(count.item())
        bound = (f"the most {config.max_num_seqs} running sequences can hold" if num_blocks == most
                 else source)
        logger.info("KV cache: %d blocks of %d tokens, %.3f GiB (%s)", num_blocks, self.block_size,
                    num_blocks * per_block / GIB, bound)
        return num_blocks

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self._use_kv_cache(self.cache_slots.allocate(num_blocks))

    def _use_kv_cache(self, cache: KVCache | None) -> None:
        self.kv_cache = cache
        self.cache_slots.attach(cache)

    @torch.inference_mode()
    def run_profile_steps(self) -> int:
        """Run the largest steps the scheduler can plan (kv_cache_sizing.profile_steps) on a
        temporary cache of just their blocks; the cache in use before (if any) is back after.
        Every rank runs them (their collectives pair up); only the driver samples. Returns the
        temporary cache's block count."""
        config = self.config
        steps, num_blocks = profile_steps(config.max_num_batched_tokens, config.max_model_len,
                                          config.max_num_seqs, self.block_size,
                                          self.encoder_decoder)
        previous, graphs = getattr(self, "kv_cache", None), self.decode_graphs
        self.decode_graphs = None  # they read the cache in use, not this one
        self._allocate_kv_cache(num_blocks)
        try:
            for plan in steps:
                hidden, sample_index = self._forward(plan)
                if self.is_driver:
                    self._sample(plan, hidden, sample_index, [0] * len(plan.chunks))
                    prompt_logprobs(self.model, plan.chunks, hidden)
        finally:
            self.token_counts.release([c.seq_id for plan in steps for c in plan.chunks])
            self._use_kv_cache(previous)
            self.decode_graphs = graphs
        return num_blocks

    def _profile_cuda_budget(self) -> int:
        return measured_cuda_budget(
            self.device, self.free_at_start, self.config.gpu_memory_utilization,
            lambda: self.run_profile_steps() * self.cache_slots.bytes_per_block(),
            self._decode_graph_bytes if self._decode_graphs_usable() else lambda: 0)

    def _decode_graph_bytes(self) -> int:
        """What the decode graphs will hold for good (their buffers and memory pool, and the
        driver's memory for the graphs themselves), measured by capturing them once over a
        one-block cache: all their rows are padding, which reads and writes only that block."""
        self._allocate_kv_cache(1)
        torch.cuda.synchronize(self.device)
        free = torch.cuda.mem_get_info(self.device)[0]
        graphs = self._decode_graphs(scratch_block=0)
        graphs.capture()
        torch.cuda.empty_cache()  # the eager warm-ups' blocks
        held = free - torch.cuda.mem_get_info(self.device)[0]
        del graphs  # its graphs' pool goes back with them
        self._use_kv_cache(None)
        torch.cuda.empty_cache()
        return max(0, held)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step (or a decode run); the sampled tokens of the chunks that sample and the
        prompt logprobs of those that ask (on the driver; other ranks return an empty result)."""
        if plan.num_steps > 1:
            self._forward_setup(plan)
            return StepResult(sampled_tokens(plan.chunks, decode_run(
                self.decode_graphs, self.model, self.sampling_inputs, plan.chunks,
                plan.num_steps)))
        plan, positions = verification_plan(plan)
        if self.ranks is None:
            hidden, sample_index = self._forward(plan)
        else:
            self.ranks.broadcast_plan(plan)
            try:
                hidden, sample_index = self._forward(plan)
            except Exception as exc:  # the ranks' collectives are out of step: nothing can go on
                raise self.ranks.failure("a tensor-parallel step failed", exc) from exc
        if not self.is_driver:
            return StepResult()
        return StepResult(self._sample(plan, hidden, sample_index, positions),
                          prompt_logprobs(self.model, plan.chunks, hidden))

    @torch.inference_mode()
    def greedy_tokens(self, plan: StepPlan) -> list[list[int]]:
        """A draft model's step or decode run, every chunk sampling greedily with no logprobs,
        penalties or constraints (a single step's chunks may end in draft rows): per step, each
        chunk's argmax after its last token. No sampling tensors are built for it."""
        if plan.num_steps > 1:
            self._forward_setup(plan)
            return greedy_run(self.decode_graphs, self.greedy_head, plan.chunks,
                              plan.num_steps).tolist()
        plan, positions = verification_plan(plan)
        hidden, sample_index = self._forward(plan)
        ends = [i for i, after in enumerate(positions[1:] + [0]) if after == 0]
        return [self.greedy_head(hidden[sample_index[ends]]).tolist()]

    def _argmax_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return argmax_tokens(self.model.compute_logits(hidden))

    def _forward_setup(self, plan: StepPlan) -> None:
        if self.is_driver:
            self.token_counts.release(plan.finished_seq_ids)
            self.token_counts.record(plan.chunks)
        if plan.block_copies:  # copy on write of shared blocks, before this step writes them
            source, target = (torch.tensor(i, device=self.device) for i in zip(*plan.block_copies))
            self.kv_cache.copy_blocks(source, target)

    def _forward(self, plan: StepPlan):
        self._forward_setup(plan)
        graphs = self.decode_graphs
        decodes = graphs is not None and graphs.covers(plan.chunks)
        # CPU programs run adapter steps too, from tensors kept per program size; CUDA graphs
        # were captured without adapters
        programs = decodes and self.device.type == "cpu"
        uses_lora = self.lora is not None and self.lora.prepare(
            plan.chunks, graphs.bucket(len(plan.chunks)) if programs else None)
        if decodes and (programs or not uses_lora):
            sampling = [i for i, c in enumerate(plan.chunks) if c.sampling is not None]
            return (graphs.run(plan.chunks, lora=uses_lora),
                    torch.tensor(sampling, dtype=torch.int64, device=self.device))
        inputs = self.inputs.build(plan.chunks)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta), inputs.sample_index

    def _sample(self, plan: StepPlan, hidden: torch.Tensor, sample_index: torch.Tensor,
                positions: list[int]) -> list[dict[int, SampledToken]]:
        sampling = [(c, p) for c, p in zip(plan.chunks, positions) if c.sampling is not None]
        if not sampling:
            return [{}]
        rows, positions = zip(*sampling)
        logits = self.model.compute_logits(hidden[sample_index])
        out = sample(logits, self.sampling_inputs.build(rows, logits.shape[-1]))
        return sampled_tokens(rows, [out], list(positions))


def _attention_specs(layers: list[PagedAttention]) -> list[AttentionSpec]:
    """The distinct specs of `layers`; they may differ only in their sliding window."""
    specs = list(dict.fromkeys(
        AttentionSpec(layer.num_kv_heads, layer.sliding_window, layer.position_bias is not None,
                      layer.causal) for layer in layers))
    if len({dataclasses.replace(spec, sliding_window=None) for spec in specs}) > 1:
        raise ValueError(f"attention layers differ in kv heads or position bias: {specs}")
    return specs
