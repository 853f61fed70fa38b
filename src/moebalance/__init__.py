"""moebalance: DeepSeek-V4-style Mixture-of-Experts training with first-class load balancing.

Axis glossary, used in every shape comment and docstring of the package:

    B  batch (sequences)            S  sequence (tokens per sequence)
    T  tokens (any flattened leading shape, T = B*S when it comes from a batch)
    D  model width                  F  expert hidden width
    E  routed experts               K  experts chosen per token (top-k)
    G  expert groups                L  layers
    V  vocabulary                   C  per-expert capacity (capacity-factor dispatch only)

Modules, from the ground up:
    config       the typed config schema and its presets
    routing      scores, top-k selection with a selection-only bias, hash routing and hash tables
    balancing    expert counts, bias-update rules, Quantile Balancing, balance losses, z-loss
    metrics      per-layer load statistics (variance, MaxVio, CV, dead experts, entropy)
    simulate     a model-free balancer simulation (drifting, skewed router logits)
    rundir       the run directory: its files, read and written only here
    data         corpus, tokenizer, token files, packed rows and seeded batches
    model        DeepSeek-V4: attention, hyper-connections, the MoE layer (model.moe), MTP
    hf           Hugging Face checkpoints, both ways
    training     the train step, the loop and its hooks, calibration, eval, sharding, the planner
    report       finished runs -> the A/B table, plots and HTML page
    experiment   the A/B experiment;  generate  sampling;  cli  the moebalance command
"""

__version__ = "0.1.0"
