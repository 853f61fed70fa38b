"""Checkpoint interop for DeepSeek-V4: Hugging Face transformers' and DeepSeek's own layouts.

    load(path)                  -> (Config, DeepSeekV4), from any of the three layouts
    save(model, config, path)   -> what transformers' DeepseekV4ForCausalLM.from_pretrained loads

`names` holds the layouts and the renaming between them, `config` the config.json styles,
`checkpoint` our parameters under DeepSeek's names, dequantisation and the files.
"""

from moebalance.hf.checkpoint import deepseek_tensors, dequantize, load, save
from moebalance.hf.config import config_from_hf, config_to_hf
from moebalance.hf.names import LAYOUTS, detect_layout

__all__ = ["LAYOUTS", "config_from_hf", "config_to_hf", "deepseek_tensors", "dequantize",
           "detect_layout", "load", "save"]
