"""Jobs: what a command runs around the library (`train_job` for `python -m sage_jax.train`,
`eval_job` for `python -m sage_jax.evaluate`, `toy_job` the toy task's default job, `report` its
summary)."""
