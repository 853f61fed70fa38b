"""Training: the train step, the loop and its hooks, the bias calibration, evaluation,
checkpoints, sharding over the mesh, and the memory planner."""
