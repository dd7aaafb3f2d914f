"""The built-in toy task (chain arithmetic mod 10, character level):

    toy_plugin.py  the plug-in record `PLUGIN`: the task, its built-in model (the SFT warm start,
                   or a random initialisation), its training and held-out evaluation problems
    chains.py      problems, prompt formats, reward, `ToyTask`, the toy model's config
    warm_start.py  the SFT warm start of the toy model (shipped in toy_sft/, cached, or trained)
    calibrate.py   the warm start's SFT recipe and the calibration gate before RL
"""
