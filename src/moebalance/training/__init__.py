"""Training: the train step, data, checkpoints and the loop."""
