"""The YAML loader of config files: PyYAML's SafeLoader, refusing a key given twice in one mapping."""
from __future__ import annotations

import yaml

from engine.errors import ConfigError


# libyaml's parser where PyYAML was built with it (the same documents, ~10x faster than the pure-Python one: the
# parity tests load the config of ~20000 layouts); the constructors stay PyYAML's own.
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UniqueKeyLoader(SafeLoader):
    """yaml's SafeLoader that refuses a mapping key given twice (PyYAML keeps the last one silently)."""


def _unique_mapping(loader: SafeLoader, node: yaml.MappingNode) -> dict:
    """Construct a mapping after checking its own keys (not those a ``<<: *anchor`` merge brings in, which may be
    overridden on purpose) for repeats; ConfigError naming the key and both lines."""
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key, line = loader.construct_object(key_node, deep=True), key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"key '{key}' is given twice (lines {seen[key]} and {line}); keep one")
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
