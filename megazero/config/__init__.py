"""Configuration: typed sections, YAML loading with dotted overrides, validation."""

from megazero.config.loader import field_docs, load_config, save_config
from megazero.config.schema import Config
from megazero.config.validate import resolve_config, validate_config

__all__ = ["Config", "field_docs", "load_config", "resolve_config", "save_config", "validate_config"]
