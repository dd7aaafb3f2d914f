"""Dimensions of the paper's models, for compile-only checks and memory estimates without
their checkpoints (`PRESETS[name]` is a Hugging Face config.json dict)."""

from __future__ import annotations

# Dimensions typed in from the public Hugging Face config.json files of these checkpoints
# (nothing can be downloaded here). The qwen3-4b and llama3.2-3b values are identical to the
# copies in ../shared/data/tokenizers/*/config.json; qwen2.5-7b is Qwen/Qwen2.5-7B-Instruct's,
# qwen2.5-0.5b Qwen/Qwen2.5-0.5B-Instruct's and qwen2.5-1.5b Qwen/Qwen2.5-1.5B-Instruct's (below).
PRESETS = {
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "max_position_embeddings": 32768, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-4b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 5000000, "tie_word_embeddings": True,
        "max_position_embeddings": 262144, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645},
    "llama3.2-3b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
}
# Qwen/Qwen2.5-0.5B-Instruct: the 7B's family, smaller, embeddings tied (the free-Colab recipe).
PRESETS["qwen2.5-0.5b"] = dict(
    PRESETS["qwen2.5-7b"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
# Qwen/Qwen2.5-1.5B-Instruct: the same family, embeddings tied (the free-Colab LoRA recipe).
PRESETS["qwen2.5-1.5b"] = dict(
    PRESETS["qwen2.5-7b"], vocab_size=151936, hidden_size=1536, intermediate_size=8960,
    num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
