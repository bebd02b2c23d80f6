"""`dflash-mlx train`: training a DFlash draft for a target."""
