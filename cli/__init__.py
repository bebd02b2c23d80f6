"""dflash-mlx command line: typer wiring in main.py, all rich rendering in ui.py."""
