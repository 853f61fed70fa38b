"""How long the host takes to trace and lower a run's programs before XLA sees them: the training
step, the evaluation step and the score step of a config, as `moebalance train` prepares them
(ahead.compile_ahead), each lowered alone; or, with --beside, all of them with their compilations
(or loads from the persistent compilation cache) running beside the lowering, as in a run. JAX
keeps what it traced and lowered in the process: run each way in a process of its own. Prints one
JSON object.

    python benchmarks/lowering.py [--beside] [CONFIG] [key=value ...]   (default deepseek4-tiny)
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> None:
    from moebalance import data
    from moebalance.config import load_config
    from moebalance.runtime import enable_compilation_cache
    from moebalance.training import sharding
    from moebalance.training.ahead import compile_ahead, lower
    from moebalance.training.loop import build, probe_set
    from moebalance.training.step import make_eval_step, make_score_step, make_train_step

    enable_compilation_cache()
    beside = argv[:1] == ["--beside"]
    argv = argv[1:] if beside else argv
    cfg = load_config(argv[0] if argv else "deepseek4-tiny", argv[1:])
    mesh = sharding.make_mesh(cfg)
    train_data = data.batches(cfg, "train")
    model, optimizer = build(cfg, mesh, train_data)
    tokens, mask, segment_ids = sharding.global_batch(mesh, *train_data.batch(0))
    probe = probe_set(cfg, mesh)[0]
    steps = {"train": (make_train_step(cfg, model, mesh), model, optimizer, tokens, mask,
                       segment_ids),
             "score": (make_score_step(cfg, model, mesh), model, tokens[0], segment_ids[0]),
             "eval": (make_eval_step(cfg, model, mesh), model, *probe)}
    result = {"config": cfg.model_name, "platform": mesh.devices.flat[0].platform,
              "step_programs": cfg.step_programs}
    if beside:
        start = time.perf_counter()
        with compile_ahead() as ahead:
            for step, *args in steps.values():
                ahead(step, *args)
            result["lowered_beside_compiling_s"] = round(time.perf_counter() - start, 2)
        result["compiled_s"] = round(time.perf_counter() - start, 2)
        print(json.dumps(result))
        return
    result["lowered_s"], result["programs"] = {}, {}
    for name, (step, *args) in steps.items():  # lowered only (jit keeps no lowering: each anew)
        start, programs = time.perf_counter(), []
        lower(step, programs.append, *args)
        result["lowered_s"][name] = round(time.perf_counter() - start, 2)
        result["programs"][name] = len(programs)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
