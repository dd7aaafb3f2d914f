"""Generated arithmetic word problems: the task, its problems and the SFT warm start."""
