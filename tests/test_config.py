"""`key=value` overrides read by the schema's type, and YAML files that YAML cannot read."""

import dataclasses
import json
import re
from pathlib import Path
from typing import get_type_hints

import pytest
import yaml

from moebalance import config
from moebalance.config import Config, ConfigError, load_config, parse_override


@pytest.mark.parametrize("override, key, value", [
    ("dataset_glob=*.txt", "dataset_glob", "*.txt"),  # YAML: "while scanning an alias"
    ("dataset_glob='*.json*'", "dataset_glob", "*.json*"),  # one pair of quotes dropped
    ("tokenizer_path=", "tokenizer_path", ""),
    ("dtype=bfloat16", "dtype", "bfloat16"),
    ("dataset_path=[]", "dataset_path", []),
    ("compress_ratios=0,4,4,0", "compress_ratios", [0, 4, 4, 0]),
    ("compress_ratios=[0, 4, 128, 0]", "compress_ratios", [0, 4, 128, 0]),
    ("norm_topk_prob=null", "norm_topk_prob", None),
    ("norm_topk_prob=true", "norm_topk_prob", True),
    ("learning_rate=1e-3", "learning_rate", 1e-3),
    ("num_experts=16", "num_experts", 16),
])
def test_overrides_are_read_by_the_key_type(override, key, value):
    text = ["dataset_type=text", "vocab_size=8192"]  # where the data keys take effect
    assert getattr(load_config("deepseek4-smoke", [*text, override]), key) == value


@pytest.mark.parametrize("override, key, value", [
    ("tokenizer_path=/data/tok: v2.json", "tokenizer_path", "/data/tok: v2.json"),
    ("dataset_path=/some/dir", "dataset_path", ["/some/dir"]),
    ("dataset_path=/a,/b/*.jsonl", "dataset_path", ["/a", "/b/*.jsonl"]),
    ("dataset_path=[/a, '/b c']", "dataset_path", ["/a", "/b c"]),
    ("dataset_path=['/a,b', /c]", "dataset_path", ["/a,b", "/c"]),  # YAML's quoting holds
    ("dataset_path=[*.txt, b]", "dataset_path", ["*.txt", "b"]),  # not YAML: items as written
    ("dataset_path=123", "dataset_path", ["123"]),  # a path, not a number
])
def test_path_overrides_are_read_as_written(override, key, value):
    """Paths that exist nowhere, read alone (parse_override, as load_config does): a synthetic
    config refuses them (they would have no effect), a text config names the first missing one."""
    assert parse_override(key, override.partition("=")[2], get_type_hints(Config)[key]) == value


@pytest.mark.parametrize("override, message", [
    ("num_experts=[1", "config key `num_experts`: cannot read '\\[1'"),
    ("seed=*x", "config key `seed`: cannot read"),
    ("compress_ratios=a,b", "config key `compress_ratios`: expected a list of int"),
    ("num_experts=1.5", "config key `num_experts`: expected int"),
    ("dataset_glb=*.txt", "unknown config key `dataset_glb`; did you mean dataset_glob"),
    ("num_experts", "override 'num_experts' must look like key=value"),
])
def test_unreadable_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("deepseek4-smoke", [override])


def test_a_yaml_file_yaml_cannot_read_names_the_file_and_the_fix(tmp_path):
    path = tmp_path / "mine.yml"
    path.write_text("dataset_glob: *.txt\n")
    with pytest.raises(ConfigError, match="mine.yml is not valid YAML .*dataset_glob: '\\*.txt'"):
        load_config(path)
    path.write_text("compress_ratios: [0, x]\n")
    with pytest.raises(ConfigError, match="expected a list of int"):
        load_config(path)


@pytest.mark.parametrize("override", ["dataset_path=empty.jsonl", "tokenizer_path=tok.json"])
def test_a_key_without_effect_is_refused_naming_both_keys(override):
    """deepseek4-smoke trains on synthetic tokens: a path to data or a tokenizer would be
    ignored (and recorded in config.yaml as if used)."""
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=f"^config key `{key}`: has no effect with dataset_type="
                                          f"synthetic .*; leave {key} out, or set "
                                          "dataset_type=text$"):
        load_config("deepseek4-smoke", [override])


def test_a_missing_dataset_path_is_named_before_the_vocabulary():
    """The smoke model's vocab_size (256) is below the default tokenizer_vocab_size (8192), but
    the first thing to fix is the path to the data: both are named, the path first."""
    with pytest.raises(ConfigError, match="`dataset_path`: '/nonexistent/data.jsonl' does not "
                                          "exist.*; then config key `tokenizer_vocab_size`: 8192"):
        load_config("deepseek4-smoke", ["dataset_type=text", "dataset_path=/nonexistent/data.jsonl"])
    with pytest.raises(ConfigError, match="`tokenizer_vocab_size`: 8192 exceeds"):
        load_config("deepseek4-smoke", ["dataset_type=text"])


SHIPPED = Path(config.__file__).parent / "configs"
BENCHMARKS = Path(__file__).parent.parent / "benchmarks" / "configs"
# A config in which every declared `Needs` holds, and for each key a need names, values to try
# against it (those its test refuses are the switch off).
SWITCHED_ON = {"dataset_type": "text", "vocab_size": 8192, "tokenizer_path": "",
               "routed_bias": True, "load_balance_loss_weight": 0.001, "mtp_num_layers": 1,
               "capacity_factor": 1.25, "first_num_hash_layers": 2, "hash_table": "random",
               "rope_factor": 16.0}
TRIED = {"dataset_type": ["synthetic", "tokens", "text"], "tokenizer_path": ["tok.json", ""],
         "routed_bias": [False, True], "load_balance_loss_weight": [0.0, 0.001],
         "mtp_num_layers": [0, 1], "capacity_factor": [-1.0, 0.0, 1.25],
         "first_num_hash_layers": [0, 2], "hash_table": ["zeros", "balanced", "random"],
         "rope_factor": [1.0, 16.0]}


def _moot_cases():
    """(key, need, switch-off value) for every field with a declared need, every value of TRIED
    that its need refuses."""
    cases = []
    for field in dataclasses.fields(Config):
        for need in field.metadata["needs"]:
            off = [v for v in TRIED[need.on] if not need.holds(v)]
            assert off and need.holds(SWITCHED_ON[need.on]), (field.name, need.on)
            cases += [(field.name, need, value) for value in off]
    return cases


def _preset(monkeypatch, tmp_path, values) -> str:
    """A preset (in a preset directory of the test's) holding `values`; its name."""
    monkeypatch.setattr(config, "PRESET_DIR", tmp_path / "presets")
    (tmp_path / "presets").mkdir(exist_ok=True)
    base = yaml.safe_load((SHIPPED / "deepseek4-smoke.yml").read_text())
    (tmp_path / "presets" / "p.yml").write_text(yaml.safe_dump({**base, **values}))
    return "p"


def test_every_key_with_a_need_is_refused_when_the_user_gives_it_moot(monkeypatch, tmp_path):
    """Each dependent key, given by the user with its switch off: refused, naming the key and
    the switch, with a fix that works; the same key from a preset, or with its switch on, is
    taken."""
    cases = _moot_cases()
    assert {"dataset_path", "tokenizer_path", "routed_bias_update_rate",
            "routed_bias_freeze_step"} <= {key for key, *_ in cases}
    defaults = config.defaults()
    for key, need, off in cases:
        switched = {**SWITCHED_ON, need.on: off}
        if off == "tokens":
            switched["dataset_path"] = ["train.bin"]
        given = f"{key}={json.dumps(defaults[key])}"
        with pytest.raises(ConfigError, match=f"^config key `{key}`: has no effect with "
                                              f"{need.on}=.*; leave {key} out, or set "
                                              f"{need.on}={re.escape(need.fix)}$"):
            load_config(_preset(monkeypatch, tmp_path, switched), [given])
        mine = tmp_path / "mine.yml"  # the user's own YAML file counts as given too
        mine.write_text(yaml.safe_dump({**switched, key: defaults[key]}))
        with pytest.raises(ConfigError, match=f"config key `{key}`: has no effect"):
            load_config(mine)  # (with the switches: the file gives them too, and may moot them)
        fixed = load_config(_preset(monkeypatch, tmp_path, switched),
                            [given, f"{need.on}={need.fix}"])
        assert need.holds(getattr(fixed, need.on))
        assert load_config(_preset(monkeypatch, tmp_path, {**switched, key: defaults[key]}))
        assert load_config(_preset(monkeypatch, tmp_path, SWITCHED_ON), [given])


@pytest.mark.parametrize("path", sorted([*SHIPPED.glob("*.yml"), *BENCHMARKS.glob("*.yml")]))
def test_the_shipped_configs_give_no_key_without_effect(tmp_path, path):
    """Each preset and benchmark config, loaded as a user's own file: none of its keys is moot."""
    copy = tmp_path / path.name
    copy.write_text(path.read_text())
    assert load_config(copy) == load_config(path)


def test_a_runs_config_yaml_loads_whatever_it_holds(tmp_path):
    """A run's config.yaml records every key the trainer knew (Run A's: the bias off, its rate
    0; an older run's lacks the keys added since): the record of a config, not keys chosen one by
    one, so it loads as it is (`train RUN/config.yaml --resume`); the same keys in a file of the
    user's are the user's."""
    cfg = dataclasses.replace(load_config("deepseek4-smoke"), routed_bias=False,
                              routed_bias_update_rate=0.0, routed_bias_calibration_batches=4)
    values = dataclasses.asdict(cfg)
    del values["eval_batches"]  # an older run's
    for name in ("config.yaml", "mine.yaml"):
        (tmp_path / name).write_text(yaml.safe_dump(values))
    assert load_config(tmp_path / "config.yaml") == cfg
    with pytest.raises(ConfigError, match="`routed_bias_update_rate`: has no effect"):
        load_config(tmp_path / "mine.yaml")


def test_the_study_refuses_only_what_is_moot_in_every_arm():
    """The study's own switches (all balancing off, then each arm's) are not the user's; a key
    the user gives for every arm is refused only when no arm takes it, one of the user's own arm
    when that arm does not."""
    from moebalance.study import ARMS, Arm, arm_configs

    arms = [Arm("none", ARMS["none"]), Arm("loss-free", ARMS["loss-free"])]
    assert arm_configs("deepseek4-smoke", ["routed_bias_freeze_step=3"], arms)[1] \
        .routed_bias_freeze_step == 3
    with pytest.raises(ConfigError, match="`sequence_loss_mode`: has no effect with "
                                          "load_balance_loss_weight=0.0"):
        arm_configs("deepseek4-smoke", ["sequence_loss_mode=maxtext"], arms)
    with pytest.raises(ConfigError, match="`routed_bias_freeze_step`: has no effect with "
                                          "routed_bias=false"):
        arm_configs("deepseek4-smoke", [], [Arm("mine", ("routed_bias_freeze_step=3",))])


def test_a_config_path_that_is_no_file_says_why(tmp_path):
    (tmp_path / "dir.yml").mkdir()
    with pytest.raises(ConfigError, match="config file '.*dir.yml' is a directory, not a file; "
                                          "give a YAML file or a preset \\(deepseek4-flash"):
        load_config(tmp_path / "dir.yml")
    with pytest.raises(ConfigError, match="config file '.*none.yml' does not exist"):
        load_config(tmp_path / "none.yml")
