"""Draft and target quantization (`dflash-mlx quantize`).

Not implemented yet: quantized drafts already load (`load_draft` restores a `quantization`
entry of `config.json`), and quantized targets load through mlx-lm; the writer and the CLI
come with the quantization issue.
"""
