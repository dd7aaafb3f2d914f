"""Generated arithmetic word problems:

    words_plugin.py   the plug-in record `PLUGIN`: the task through model.path's tokenizer,
                      generated training problems, held-out problems by length, the warm start
    problems.py       problems with worked solutions, difficulty = number of steps
    prompts.py        `WordsTask`: chat prompts, the boxed-answer reward, one-level hint requests
    hf_warm_start.py  the SFT warm start of a Hugging Face model on word problems (cached)
"""
