"""`tritonlm-convert --quantize awq`: the scales fold into the layers without changing what
transformers computes, the repository serves transformers' tokens with the weights it holds, and
on held-out text AWQ's perplexity stays closer to the float model's than round-to-nearest's."""
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM

from family_check import random_prompts, reference_greedy, save_tiny
from test_quantize import dequantized_weights, rank_file
from tritonlm import LLM, SamplingParams
from tritonlm.engine.llm_engine import LLMEngine
from tritonlm.quality import perplexity
from tritonlm_convert.awq import FOLDS, _foldable, fold_scales
from tritonlm_convert.convert import convert
from tritonlm_convert.errors import ConversionError

DATA = Path(__file__).parent / "data"
CALIBRATION = (DATA / "botchan_chapters_3_11.txt").read_text()[:24000]
HELD_OUT = (DATA / "botchan_chapters_1_2.txt").read_text()[:12000]
GROUP_SIZE = 32
LAYERS = dict(num_hidden_layers=2, max_position_embeddings=512)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                  num_key_value_heads=4, **LAYERS)),
    "qwen2-gqa": (Qwen2ForCausalLM, Qwen2Config, dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                      num_key_value_heads=2, **LAYERS)),
    "opt": (OPTForCausalLM, OPTConfig, dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64,
                                            **LAYERS)),
}


def with_outlier_channels(model, channels=(3, 17, 40), factor=12.0):
    """A few input channels of every norm made large, as trained LLMs' activations have them."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("layernorm") or name.endswith("layer_norm"):
                module.weight[list(channels)] *= factor
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_folded_scales_leave_transformers_outputs_unchanged(family, smollm2_tokenizer):
    model_class, config_class, settings = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=1000, **settings)).eval()
    ids = torch.tensor([random_prompts(1, 1000, seed=1)[0] * 2])
    with torch.no_grad():
        before = model(ids).logits
        layers = model.model.decoder.layers if family == "opt" else model.model.layers
        folded = 0
        for layer in layers:
            modules = dict(layer.named_modules())
            linears = {m for m in modules.values() if isinstance(m, torch.nn.Linear)}
            for fold in FOLDS[model.config.model_type]:
                if _foldable(modules, fold, linears):
                    width = modules[fold.linears[0]].in_features
                    fold_scales(modules[fold.previous], [modules[p] for p in fold.linears],
                                torch.rand(width) * 4 + 0.25)
                    folded += 1
        after = model(ids).logits
    assert folded == len(layers) * (3 if family == "opt" else 4 if family == "llama" else 3)  # GQA: no v -> o
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def outlier_llama(tmp_path_factory, smollm2_tokenizer):
    directory = tmp_path_factory.mktemp("awq")
    config = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=128, intermediate_size=256,
                         num_attention_heads=4, num_key_value_heads=4, initializer_range=0.1,
                         tie_word_embeddings=False, **LAYERS)
    torch.manual_seed(0)
    model = with_outlier_channels(LlamaForCausalLM(config).eval())
    model.save_pretrained(directory / "hf")
    smollm2_tokenizer.save_pretrained(directory / "hf")
    (directory / "calibration.txt").write_text(CALIBRATION)
    return directory


def _converted(directory: Path, name: str, **options) -> Path:
    return convert(str(directory / "hf"), directory / name, dtype="float32", float_head=bool(options),
                   **options)


def test_awq_repository_serves_transformers_with_its_weights(outlier_llama, smollm2_tokenizer):
    model_dir = _converted(outlier_llama, "awq", quantize="awq", group_size=GROUP_SIZE,
                           calibration=outlier_llama / "calibration.txt")
    assert 'string_value: "awq-int4"' in (model_dir / "config.pbtxt").read_text()
    stored = rank_file(model_dir)
    reference = LlamaForCausalLM.from_pretrained(outlier_llama / "hf", dtype=torch.float32).eval()
    original = {name: t.clone() for name, t in reference.state_dict().items()}
    weights = {**{n: t for n, t in stored.items() if ".quantized." not in n}, **dequantized_weights(stored)}
    reference.load_state_dict(weights)
    norms = [n for n in weights if "layernorm" in n]
    assert norms and all(not torch.equal(weights[n], original[n]) for n in norms)  # the scales folded in
    prompts = random_prompts(4, len(smollm2_tokenizer), seed=3)
    with LLM(str(model_dir), quantized_activations="float") as llm:  # the dequantized math
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == reference_greedy(reference, prompt, 12)


def test_awq_beats_round_to_nearest_on_held_out_text(outlier_llama):
    def held_out_perplexity(model_dir):
        engine = LLMEngine(model_dir, num_kv_blocks=64)
        return perplexity(engine, engine.tokenizer.encode(HELD_OUT), 256)

    float_ppl = held_out_perplexity(_converted(outlier_llama, "float"))
    rtn = held_out_perplexity(_converted(outlier_llama, "rtn", quantize="int4", group_size=GROUP_SIZE))
    awq = held_out_perplexity(_converted(outlier_llama, "awq-ppl", quantize="awq", group_size=GROUP_SIZE,
                                         calibration=outlier_llama / "calibration.txt"))
    # seeded: AWQ's gap is about half of round-to-nearest's here (SmolLM2's: README's table)
    assert abs(awq - float_ppl) < 0.75 * abs(rtn - float_ppl), (float_ppl, rtn, awq)


@pytest.mark.parametrize("options, message", [
    (dict(quantize="awq"), "--quantize awq needs --calibration"),
    (dict(quantize="awq", calibration="calibration.txt", family="gpt_neox"), "AWQ folds its scales into"),
])
def test_awq_refusals_are_clear(tmp_path, smollm2_tokenizer, options, message):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    family = options.pop("family", "llama")
    if family == "gpt_neox":
        config = GPTNeoXConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, **LAYERS)
        save_tiny(tmp_path / "hf", GPTNeoXForCausalLM, config, smollm2_tokenizer)
    else:
        config = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
                             num_attention_heads=4, **LAYERS)
        save_tiny(tmp_path / "hf", LlamaForCausalLM, config, smollm2_tokenizer)
    if "calibration" in options:
        (tmp_path / "calibration.txt").write_text(CALIBRATION[:2000])
        options["calibration"] = tmp_path / "calibration.txt"
    with pytest.raises(ConversionError, match=message):
        convert(str(tmp_path / "hf"), tmp_path / "out", **options)
