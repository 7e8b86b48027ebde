"""Reading a Trainer YAML config: PyYAML's safe loader, refusing a key given twice in one mapping
(plain PyYAML keeps the last value silently)."""

from __future__ import annotations

from typing import Any

import yaml

from nnscaler.errors import ConfigError

__all__ = ["UniqueKeyLoader", "DuplicateKeyError", "read_yaml"]


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping gives the same key twice; the message names the key and both lines (1-based)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that raises DuplicateKeyError on a repeated mapping key."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise DuplicateKeyError(
                    None,
                    None,
                    f"key {key!r} is given twice in one mapping, on line {first} and on line {line}: "
                    "remove one of them (YAML would keep only the last)",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str) -> dict[str, Any]:
    """The mapping in YAML file `path` ({} when empty); ConfigError when missing, invalid, not a
    mapping, or when a key is given twice."""
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except DuplicateKeyError as err:
        raise ConfigError(f"config file {path}: {err.problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of TrainerArgs fields, got {type(data).__name__}"
        )
    return data
