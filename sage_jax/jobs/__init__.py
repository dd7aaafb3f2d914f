"""Jobs: what a command runs around the library (`toy_job`, the toy task's default job that
`python -m sage_jax.train` runs, and `report` its summary; `eval_job` for
`python -m sage_jax.evaluate`)."""
