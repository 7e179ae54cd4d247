"""config.json read completely: both spellings of the RoPE settings, and every key that would change the math either
implemented or refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig, UnsupportedModel
from modeling.kernels.packing import choose_ops, pack_weights
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE, KVCache, pages_for_slots, slot_pages
from modeling.model.decoder import TORCH_OPS, DecoderModel

transformers = pytest.importorskip("transformers")

BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def test_rope_theta_is_read_from_transformers_5s_rope_parameters() -> None:
    saved = transformers.LlamaConfig(
        **{k: v for k, v in BASE.items() if k != "model_type"}, rope_theta=500000.0
    ).to_dict()
    assert "rope_parameters" in saved and "rope_theta" not in saved  # the spelling transformers 5 writes
    assert ModelConfig.from_hf(saved).rope_theta == 500000.0


@pytest.mark.parametrize(
    "spelling",
    [
        {"rope_theta": 250000.0},
        {"rope_theta": 250000.0, "rope_scaling": None},
        {"rope_parameters": {"rope_theta": 250000.0, "rope_type": "default"}},
        {"rope_theta": 250000.0, "rope_parameters": {"rope_theta": 250000.0, "rope_type": "default"}},
        {"rope_theta": 250000.0, "rope_scaling": {"type": "default"}},
    ],
)
def test_both_spellings_of_the_rope_settings_are_read(spelling: dict[str, Any]) -> None:
    assert ModelConfig.from_hf({**BASE, **spelling}).rope_theta == 250000.0


def test_without_any_rope_setting_the_base_is_ten_thousand() -> None:
    assert ModelConfig.from_hf(BASE).rope_theta == 10000.0


@pytest.mark.parametrize(
    ("spelling", "named"),
    [
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}},
            "rope_parameters lacks 'low_freq_factor', which rope_type 'llama3' needs",
        ),
        (
            {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "longrope", "factor": 8.0}},
            "rope_scaling.rope_type 'longrope'",
        ),
        ({"rope_scaling": {"type": "linear"}}, "rope_scaling lacks 'factor'"),
        ({"rope_parameters": {"rope_type": "yarn-ish", "rope_theta": 1.0}}, "'yarn-ish'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}, "'factor'"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "low_freq_factor": 1.0}},
            "'low_freq_factor', which rope_type 'linear' does not take",
        ),
        ({"rope_scaling": "linear"}, "rope_scaling 'linear' is not an object"),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}}, "disagree"),
        (
            {
                "rope_parameters": {"rope_type": "linear", "factor": 2.0},
                "rope_scaling": {"type": "linear", "factor": 4.0},
            },
            "different RoPE scalings",
        ),
    ],
)
def test_rope_settings_it_does_not_implement_are_refused_by_name(spelling: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named.replace(".", r"\.").replace("(", r"\(")):
        ModelConfig.from_hf({**BASE, **spelling})


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"sliding_window": 64}, "key 'sliding_window' is not known to this server for model_type 'llama'"),
        (
            {"model_type": "mistral", "layer_types": ["sliding_attention", "full_attention"]},
            "'layer_types' is not known to this server for model_type 'mistral'",
        ),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "layer_types": ["sliding_attention", "local"]},
            "layer_types",
        ),
        ({"rope_interleaved": True}, "rope_interleaved"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "gemma3_text", "hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"final_logit_softcapping": 30.0}, "'final_logit_softcapping' is not known"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"qk_layernorm": True}, "'qk_layernorm' is not known"),
        (
            {"model_type": "mistral", "attention_bias": True},
            "'attention_bias' is not known to this server for model_type 'mistral'",
        ),
        ({"model_type": "gemma3"}, "model_type 'gemma3' is Gemma 3 with its vision tower"),
        ({"model_type": "phi3"}, "model_type 'phi3' is not one of"),
    ],
)
def test_keys_that_would_change_the_math_are_refused_by_name(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        ModelConfig.from_hf({**BASE, **extra})


@pytest.mark.parametrize(
    "make",
    [
        transformers.LlamaConfig,
        transformers.MistralConfig,
        transformers.Qwen2Config,
        transformers.Qwen3Config,
        transformers.Gemma3TextConfig,
    ],
)
def test_configs_saved_by_the_installed_transformers_are_read(make: Any) -> None:
    fields = {k: v for k, v in BASE.items() if k != "model_type"}
    window = {"sliding_window": None} if make is transformers.MistralConfig else {}
    config = ModelConfig.from_hf(make(**fields, **window, rope_theta=123456.0).to_dict())
    assert (config.rope_theta, config.num_layers, config.num_kv_heads) == (123456.0, 2, 2)


def test_the_default_models_config_is_read(default_model_dir: Path) -> None:
    assert ModelConfig.from_folder(default_model_dir).rope_theta == 100000.0


@pytest.mark.parametrize("native", [False, True])
def test_a_model_saved_with_a_large_rope_base_gives_transformers_logits(tmp_path: Path, native: bool) -> None:
    torch.manual_seed(0)
    fields = {k: v for k, v in BASE.items() if k != "model_type"}
    reference = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**fields, rope_theta=500000.0, tie_word_embeddings=True)
    )
    reference.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_theta"] == 500000.0
    config = ModelConfig.from_folder(tmp_path)
    ours = DecoderModel(config, ops=choose_ops(config, torch.float32, torch.device("cpu")) if native else TORCH_OPS)
    ours.load_weights(tmp_path)
    ours.set_rope_cache(128)
    if native:
        assert pack_weights(ours).startswith("native")
    tokens = [(17 * i + 3) % 97 for i in range(60)]  # long enough for the base to matter
    with torch.inference_mode():
        batch = ours.plan([SeqSpan(slot_pages(0, 128), 0, tokens, len(tokens))], DEFAULT_PAGE_SIZE)
        logits = ours.logits(
            ours(
                batch, KVCache(config, pages_for_slots(1, 128), DEFAULT_PAGE_SIZE, torch.float32, torch.device("cpu"))
            )[batch.logit_rows]
        )
        expected = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
