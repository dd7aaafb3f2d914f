"""Tasks: training and evaluation data, and the prompt formats of each task."""
