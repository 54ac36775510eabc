"""Reading a config's YAML files: YAML 1.2's booleans, integers and floats (no dates), a key
given twice in one mapping refused, and each file's ``defaults:`` chain before it."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import yaml


class ConfigError(Exception):
    """A config that cannot be used; ``str()`` is a single line for the user."""


class YAMLLoader(yaml.SafeLoader):
    """YAML's safe loader with YAML 1.2's booleans, integers and floats, and no dates. PyYAML's
    YAML 1.1 read yes/no/on/off as booleans (``runner: {name: no}`` named a run "False"), a
    leading zero as octal (``seed: 010`` ran seed 8, as ``seed: 008`` did), ``1:30`` as 90 and
    ``2024-05-01`` as a date. A bool setting still takes yes/no/on/off (OmegaConf converts the
    text); an int setting reads ``0o17`` and ``0x1f`` as YAML 1.2 does; a float needs its dot
    (``3e-4`` stays text: ``_file_number`` reads it by its setting's type)."""

    def construct_yaml_int(self, node) -> int:
        text = self.construct_scalar(node)
        return int(text, 0 if text.lstrip("+-")[:2] in ("0o", "0x") else 10)


_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_YAML_1_1 = (_BOOL, _INT, _FLOAT, "tag:yaml.org,2002:timestamp")
YAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML_1_1]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YAMLLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
YAMLLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
YAMLLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?"  # (3e-4: text, as before)
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)
YAMLLoader.add_constructor(_INT, YAMLLoader.construct_yaml_int)


class _UniqueKeyLoader(YAMLLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the
    last silently: a second ``runner:`` block dropped the first)."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # (``<<:`` merges keys on purpose)
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # (the safe loader refuses it)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r}, first at line {lines[key]}",
                    key_node.start_mark,
                )
            lines[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(path: Path, chain: tuple[Path, ...]) -> list[tuple[str, dict]]:
    """(source name, mapping) for ``path`` and, first, everything its ``defaults:`` list names."""
    if not path.is_file():
        where = f" (listed in defaults of {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {path}{where}")
    if path.resolve() in [p.resolve() for p in chain]:
        raise ConfigError(f"{path}: defaults form a cycle through {' -> '.join(map(str, chain))}")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:  # nothing but comments and blank lines: a run of all defaults is a mistake
        raise ConfigError(f"{path}: config file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    defaults = data.pop("defaults", []) or []
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"{path}: 'defaults' must be a list of file paths relative to this file")
    sources: list[tuple[str, dict]] = []
    for d in defaults:
        sources += read_yaml((path.parent / d), chain + (path,))
    return sources + [(str(path), data)]
