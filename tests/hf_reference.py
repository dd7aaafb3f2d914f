"""Helpers that build tiny random `transformers` reference models for parity tests."""

from __future__ import annotations

import numpy as np
import torch
import transformers

# Tiny configs that turn on the awkward options of each family.
TINY_CONFIGS = {
    "llama_llama3_rope_tied": dict(
        cls="LlamaConfig", vocab_size=97, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8},
        max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama_bias_untied": dict(
        cls="LlamaConfig", vocab_size=97, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "qwen2_qkv_bias": dict(
        cls="Qwen2Config", vocab_size=101, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "qwen3_qk_norm_head_dim": dict(
        cls="Qwen3Config", vocab_size=103, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
}


def make_hf_model(name: str, seed: int = 0):
    """A random `transformers` causal LM with non-trivial norm weights and biases (float32)."""
    kw = dict(TINY_CONFIGS[name])
    cfg_cls = getattr(transformers, kw.pop("cls"))
    cfg = cfg_cls(**kw, eos_token_id=1, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model.float().eval()


def hf_logits(model, tokens: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """Reference float32 logits; with a left-padding mask, positions count valid tokens."""
    ids = torch.from_numpy(np.asarray(tokens, np.int64))
    kw = {}
    if attention_mask is not None:
        m = torch.from_numpy(np.asarray(attention_mask, np.int64))
        kw = dict(attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits.float().numpy()
