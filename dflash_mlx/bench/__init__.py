"""`dflash-mlx bench`: the benchmark runs, their prompts and results."""
