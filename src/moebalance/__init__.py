"""moebalance: DeepSeek-V4-style Mixture-of-Experts training with first-class load balancing.

Axis glossary, used in every shape comment and docstring of the package:

    B  batch (sequences)            S  sequence (tokens per sequence)
    T  tokens (any flattened leading shape, T = B*S when it comes from a batch)
    D  model width                  F  expert hidden width
    E  routed experts               K  experts chosen per token (top-k)
    G  expert groups                L  layers
    V  vocabulary                   C  per-expert capacity (capacity-factor dispatch only)

Modules:
    routing    scores, top-k selection with a selection-only bias, hash routing and hash tables
    balancing  expert counts, bias-update rules, Quantile Balancing, balance losses, z-loss
    metrics    per-layer load statistics (variance, MaxVio, CV, dead experts, entropy)
    model.moe  the MoE layer (Flax NNX): router, routed and shared SwiGLU experts, dispatch
    simulate   a model-free balancer simulation (drifting, skewed router logits)
"""

__version__ = "0.1.0"
