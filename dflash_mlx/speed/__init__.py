"""Speed: the width policy (what the engine asks each cycle, `port.py`; the rule,
`policy.py`) and the cost table it prices cycles with (`costs.py`). Pure Python over a few
numbers: it imports nothing of MLX or the engine. Measuring a pair's costs on the device is
`dflash_mlx/calibration.py`'s."""
