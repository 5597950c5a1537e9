"""Training: the reference model, data, checkpoints, the training loop and the compare report."""
