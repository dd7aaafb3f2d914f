"""The built-in toy task (chain arithmetic mod 10, character level), as a plug-in:

    task.py        problems, prompt formats, reward, `ToyTask`, the toy model's config
    warm_start.py  the SFT warm start of the toy model (shipped in toy_sft/, cached, or trained)
    calibrate.py   the warm start's SFT recipe and the calibration gate before RL

`from sage_jax.tasks import toy` gives the names of task.py.
"""

from sage_jax.tasks.toy.task import (
    BASE, OPERANDS, LABELS, MAX_STEPS, ANSWER_TAG, QUESTION_TAG, HINT_TAG, SOLUTION_TAG,
    REQUEST_TAG, STEP_SEP, apply_op, ToyProblem, solution_text, random_problem, hint_steps,
    hint_lengths, reference_hints, hint_payload, continuation, toy_reward, ToyTask, ToySpec,
    SFT_SPEC, RL_SPEC, EVAL_PROBLEMS, EVAL_SEED, make_problems, to_example, make_examples,
    eval_problems, SFTMix, sft_pair, sft_draw,
    sft_examples, toy_model_config,
)

__all__ = [
    "BASE", "OPERANDS", "LABELS", "MAX_STEPS", "ANSWER_TAG", "QUESTION_TAG", "HINT_TAG",
    "SOLUTION_TAG", "REQUEST_TAG", "STEP_SEP", "apply_op", "ToyProblem", "solution_text",
    "random_problem", "hint_steps", "hint_lengths", "reference_hints", "hint_payload",
    "continuation", "toy_reward", "ToyTask", "ToySpec", "SFT_SPEC", "RL_SPEC", "EVAL_PROBLEMS",
    "EVAL_SEED", "make_problems", "to_example", "make_examples", "eval_problems", "SFTMix",
    "sft_pair", "sft_draw", "sft_examples", "toy_model_config",
]
