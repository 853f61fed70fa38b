import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moebalance.config import ConfigError, load_config
from moebalance.training import sharding

HERE = Path(__file__).parent
MESHES = [
    (("ici_data_parallelism=2", "ici_fsdp_parallelism=4"), [2, 4, 1]),
    (("ici_data_parallelism=2", "ici_expert_parallelism=4"), [2, 1, 4]),
    (("ici_fsdp_parallelism=1", "ici_expert_parallelism=-1"), [1, 1, 8]),
    # the step as programs per model segment, each compiled before the next is traced
    (("ici_data_parallelism=2", "ici_expert_parallelism=4", "step_programs=segments"), [2, 1, 4])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """The 1-device reference run, then one run on 8 devices for each of MESHES: one process
    with 8 CPU devices (the reference on the first), one compilation of JAX and the model code."""
    out = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    specs = ["1", *(f"8:{','.join(mesh)}" for mesh, _ in MESHES)]
    subprocess.run([sys.executable, str(HERE / "scripts" / "multidevice_run.py"), str(out),
                    *specs], env=env, check=True)
    return [dict(np.load(out / f"{i}.npz")) for i in range(len(specs))]


@pytest.mark.parametrize("mesh,shape", MESHES)
def test_one_device_equals_eight(runs, mesh, shape):
    """3 training steps of 2 micro-batches on 8 devices (expert parallelism where the `expert`
    axis is > 1; the last as a chain of programs) against 1 device: counts exactly, every float to
    1e-5; the steps after the first compile nothing (the state a step returns is taken by the
    same program next time); a chain compiled ahead, none of its programs at the first step."""
    one, eight = runs[0], runs[1 + MESHES.index((mesh, shape))]
    assert int(one["devices"]) == 1 and int(eight["devices"]) == 8
    if "step_programs=segments" in mesh:
        assert eight["step_compiled_in_the_first_step"] == 0
        # but AdamW's program once more at the second step: it was compiled for the state as
        # placed, and the state it returns has the layouts XLA chose (docs/distributed.md)
        assert eight["compiles_after_the_first_step"] == 1
    else:
        assert eight["compiles_after_the_first_step"] == 0
    assert list(one["mesh"]) == [1, 1, 1] and list(eight["mesh"]) == shape
    data, fsdp, expert = shape
    assert ("fsdp" in str(eight["embed_spec"])) == (fsdp > 1)  # parameters really are split
    assert ("expert" in str(eight["expert_spec"])) == (expert > 1)  # and so are the experts
    np.testing.assert_array_equal(eight["counts"], one["counts"])  # exact, every step and block
    for key in ("loss", "grad_norm", "bias", "embed", "logits", "router_logits"):
        np.testing.assert_allclose(eight[key], one[key], rtol=1e-5, atol=1e-5, err_msg=key)


def test_mesh_shape_and_errors():
    cfg = load_config("deepseek4-smoke", {"ici_data_parallelism": 2})
    assert sharding.mesh_shape(cfg, 8) == (2, 4, 1)
    expert = load_config("deepseek4-smoke", {"ici_fsdp_parallelism": 1,
                                             "ici_expert_parallelism": -1})
    assert sharding.mesh_shape(expert, 8) == (1, 1, 8)
    with pytest.raises(ConfigError, match="`num_experts` / `ici_expert_parallelism`: 8 experts "
                                          "do not split over 16"):
        sharding.mesh_shape(expert, 16)
    with pytest.raises(ConfigError, match="do not divide the 7 devices"):
        sharding.mesh_shape(cfg, 7)
    both = load_config("deepseek4-smoke", {"ici_data_parallelism": -1})
    with pytest.raises(ConfigError, match="at most one"):
        sharding.mesh_shape(both, 8)
    fixed = load_config("deepseek4-smoke", {"ici_data_parallelism": 2, "ici_fsdp_parallelism": 2})
    with pytest.raises(ConfigError, match="must equal the 8 devices"):
        sharding.mesh_shape(fixed, 8)


def test_param_spec_splits_largest_divisible_axis_not_the_layer_axis():
    assert sharding.param_spec(("embed",), (256, 64), 4) == P("fsdp", None)
    assert sharding.param_spec(("w",), (6, 64), 4) == P(None, "fsdp")
    assert sharding.param_spec(("w",), (6, 5), 4) == P()
    assert sharding.param_spec(("segments", 1, "units", "w"), (64, 8, 32), 8) == P(None, None, "fsdp")
    assert sharding.param_spec(("w",), (64, 8), 1) == P()
    assert sharding.param_spec(("segments", 0, "units", "ffn", "w1"), (2, 8, 64, 32), 1, 4) == P(
        None, "expert", None, None)
