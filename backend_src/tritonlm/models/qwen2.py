"""Qwen2: Llama with biased q/k/v projections (o_proj has none) and a sliding window on the layers
its config marks "sliding_attention" (use_sliding_window, from max_window_layers on)."""
from tritonlm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


class Qwen2Model(LlamaModel):
    def attention(self, config, layer_index: int) -> LlamaAttention:
        windowed = config.layer_types[layer_index] == "sliding_attention"
        return LlamaAttention(config, config.sliding_window if windowed else None,
                              qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_class = Qwen2Model
