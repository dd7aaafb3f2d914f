"""The real trained LLM (SmolLM2-135M-Instruct, from the `smollm2_dir` fixture) loads with
`models.from_hf` and decodes greedily exactly as transformers does."""

import json

import numpy as np
import pytest
import torch
import transformers

from sage_jax import models
from sage_jax.engine.sampler import sampling

pytestmark = pytest.mark.slow

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
QUESTION = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and "
            "bakes muffins for her friends every day with four. She sells the remainder at the "
            "farmers' market daily for $2 per fresh duck egg. How much in dollars does she make "
            "every day at the farmers' market?")
NEW_TOKENS = 24


def test_smollm2_loads_and_greedy_tokens_equal_transformers(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_hidden_layers"], cfg["hidden_size"]) == (
        ["LlamaForCausalLM"], 30, 576)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": QUESTION}],
                                  add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = ref_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                                 output_logits=True, return_dict_in_generate=True)
    ref = gen.sequences[0, len(ids):].tolist()
    ref_logp = [torch.log_softmax(step[0].double(), -1)[t].item()
                for step, t in zip(gen.logits, ref)]
    del ref_model

    out = sampling.generate(models.from_hf(smollm2_dir), [ids], max_new_tokens=NEW_TOKENS,
                            temperature=0.0, eos_token_id=tok.eos_token_id)
    ours = out.tokens[0, :int(out.lengths[0])].tolist()
    assert len(ref) > 8 and tok.eos_token_id not in ref[:-1]  # a real answer, not an empty one
    assert ours == ref, (tok.decode(ours), tok.decode(ref))
    np.testing.assert_allclose(out.logprobs[0, :len(ours)], ref_logp, atol=2e-3)
