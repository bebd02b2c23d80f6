"""The models: the DFlash draft (and DFlash 2's conv and selector), its config, the target
adapter, loading checkpoints, the draft registry, the model catalogue and tiny test models."""
