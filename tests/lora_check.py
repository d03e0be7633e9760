"""Random PEFT LoRA adapters on tiny transformers models, and their reference: greedy tokens of
the `peft` library's merged model in transformers."""
import json
import shutil
from pathlib import Path

import torch
from transformers import (GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM,
                          OPTConfig, OPTForCausalLM)

from family_check import TINY_LLAMA, random_prompts, reference_greedy, save_tiny


def save_adapter(model, out: Path, seed: int, b_scale: float = 20, **lora) -> Path:
    """A random (not zero-initialised) adapter over `model` (a transformers model, changed);
    PEFT's random B times `b_scale`."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():  # on a tiny random model PEFT's random init changes little: scale it
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft_model.save_pretrained(out)
    return out


def merged_greedy(model, adapter_dir: Path, prompts, new_tokens: int):
    """Greedy tokens of `model` (a transformers model, changed) with the adapter merged in."""
    from peft import PeftModel
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    return [reference_greedy(merged, p, new_tokens) for p in prompts]


def register(model_dir: Path, adapters: dict[str, Path]) -> None:
    """Copy adapters into a converted model version and list them in its multi_lora.json (by
    hand, as an operator would without tritonlm-convert --add-lora)."""
    version = next(p for p in model_dir.iterdir() if p.name.isdigit())
    for name, path in adapters.items():
        shutil.copytree(path, version / "adapters" / name, dirs_exist_ok=True)
    (version / "multi_lora.json").write_text(
        json.dumps({name: f"adapters/{name}" for name in adapters}))


NEW_TOKENS = 16
FAMILIES = {
    "llama": (LlamaForCausalLM, lambda v: LlamaConfig(**TINY_LLAMA, vocab_size=v),
              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
              ["q_proj", "v_proj"]),
    "gpt_neox": (GPTNeoXForCausalLM, lambda v: GPTNeoXConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        initializer_range=0.15, max_position_embeddings=256, vocab_size=v),
        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], ["query_key_value"]),
    "opt": (OPTForCausalLM, lambda v: OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=64, max_position_embeddings=256, vocab_size=v, init_std=0.15),
        ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], ["k_proj", "fc1"]),
}


def build(tmp_path, tokenizer, family: str, prompts=None):
    """A converted tiny model of `family` with two adapters: "all" (every linear layer, rank 8)
    and "some" (a few modules, rank 4, rsLoRA); the prompts (random ones unless given) and
    their greedy references by adapter name (None: the base model)."""
    from tritonlm_convert.convert import convert
    model_class, config, all_modules, some_modules = FAMILIES[family]
    base = tmp_path / "hf"
    save_tiny(base, model_class, config(len(tokenizer)), tokenizer)
    model_dir = convert(str(base), tmp_path / "repo", dtype="float32")
    adapters = {
        "all": save_adapter(model_class.from_pretrained(base), tmp_path / "all", 1, r=8,
                            lora_alpha=16, target_modules=all_modules),
        "some": save_adapter(model_class.from_pretrained(base), tmp_path / "some", 2, r=4,
                             lora_alpha=8, use_rslora=True, target_modules=some_modules),
    }
    register(model_dir, adapters)
    prompts = prompts or random_prompts(3, len(tokenizer), seed=3)
    references = {name: merged_greedy(model_class.from_pretrained(base), path, prompts,
                                      NEW_TOKENS)
                  for name, path in adapters.items()}
    references[None] = [reference_greedy(model_class.from_pretrained(base).eval(), p, NEW_TOKENS)
                        for p in prompts]
    return model_dir, prompts, references
