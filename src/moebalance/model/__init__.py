"""Model code (Flax NNX): the MoE layer and its token dispatch; the DeepSeek-V4 blocks to come."""
