"""`key=value` overrides read by the schema's type, and YAML files that YAML cannot read."""

from typing import get_type_hints

import pytest

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
    assert getattr(load_config("deepseek4-smoke", [override]), key) == value


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
    with pytest.raises(ConfigError, match=f"config key `{key}`: has no effect with dataset_type "
                                          "'synthetic'.*set dataset_type=text"):
        load_config("deepseek4-smoke", [override])


def test_a_missing_dataset_path_is_named_before_the_vocabulary():
    """The smoke model's vocab_size (256) is below the default tokenizer_vocab_size (8192), but
    the first thing to fix is the path to the data: both are named, the path first."""
    with pytest.raises(ConfigError, match="`dataset_path`: '/nonexistent/data.jsonl' does not "
                                          "exist.*; then config key `tokenizer_vocab_size`: 8192"):
        load_config("deepseek4-smoke", ["dataset_type=text", "dataset_path=/nonexistent/data.jsonl"])
    with pytest.raises(ConfigError, match="`tokenizer_vocab_size`: 8192 exceeds"):
        load_config("deepseek4-smoke", ["dataset_type=text"])
