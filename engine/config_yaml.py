"""The YAML loader of config files and of ``--section.key value`` values: PyYAML's SafeLoader, refusing a key given
twice in one mapping and a document that expands past ``MAX_VALUES`` values; ``LiteralLoader``, the same document
with every scalar as the text written (what a string field takes: engine/config.py).

Aliases (``*name``) repeat an anchored node without copying it, so nine lines of nested aliases (the "billion
laughs") describe 9^9 values: PyYAML builds them as shared references, cheaply, but anything that then prints or
walks the value (an error message quoting it: a 39 MB line before) does not end. The document's expanded size is
counted on its node graph (each node once) before anything is constructed.
"""

from __future__ import annotations

import yaml

from engine.errors import ConfigError

# libyaml's parser where PyYAML was built with it (the same documents, ~10x faster than the pure-Python one: the
# parity tests load the config of ~20000 layouts); the constructors stay PyYAML's own.
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# A config file holds a few hundred values (data.paths may list thousands of files); nothing real comes near this.
MAX_VALUES = 100_000


class BoundedLoader(SafeLoader):
    """SafeLoader that refuses a document whose aliases expand it past MAX_VALUES values, or that contains itself."""

    def construct_document(self, node):
        _check_expanded_size(node)
        return super().construct_document(node)


class UniqueKeyLoader(BoundedLoader):
    """BoundedLoader that refuses a mapping key given twice (PyYAML keeps the last one silently)."""


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_expanded_size(root) -> None:
    """The number of values ``root`` stands for with every alias expanded, counted without recursion and each
    node once (post-order over the node graph); ConfigError past MAX_VALUES or on a node that contains itself."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            open_nodes.discard(key)
            if sizes[key] > MAX_VALUES:
                raise ConfigError(
                    f"the document expands to more than {MAX_VALUES} values through its aliases "
                    f"(*name, line {node.start_mark.line + 1}); a config holds a few hundred"
                )
            continue
        if key in sizes:
            continue
        if key in open_nodes:  # reached again below itself: a recursive alias
            raise ConfigError(
                f"the value at line {node.start_mark.line + 1} contains itself through an alias; a config value cannot"
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


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


class LiteralLoader(UniqueKeyLoader):
    """UniqueKeyLoader that gives every scalar YAML would read as a number, a boolean or a date as the text written
    (``0700``, not 448; ``on``, not True), for the config's string fields: a path or a name is the text the user
    typed, not what YAML 1.1 makes of it. Null stays None (no value)."""


for _tag in ("bool", "int", "float", "timestamp"):
    LiteralLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", yaml.constructor.SafeConstructor.construct_yaml_str)
