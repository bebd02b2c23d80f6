"""The chat session behind `dflash-mlx chat` and its settings."""
