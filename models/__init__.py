"""Reference MoE models, named configurations and export helpers."""

from .config import MoEConfig
from .registry import MODEL_CONFIGS, get_config
from .reference import MoEForCausalLM, build_reference

__all__ = ["MoEConfig", "MODEL_CONFIGS", "get_config", "MoEForCausalLM", "build_reference"]
