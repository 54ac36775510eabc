"""Configuration: YAML files composed with ``defaults:`` lists, strictly validated against the
dataclass schemas that live next to the code they configure, plus ``key.sub=value`` overrides.
Files are read as YAML 1.2 (``config_files``). An override's value is read by the type of its
setting: a str takes the text as typed (YAML 1.1 read ``no`` as False and ``0755`` as 493), an
int a whole number written as a float too (``5e6``), the rest YAML, as a file gives it. A file's
numbers are read by their settings' types too: ``3e-4``, which YAML leaves as text without a
dot, is a float, and ``5e6`` an int where one is due.

A bad config raises ``ConfigError`` with one line naming the key path and the file it came from;
the CLI prints it and exits with code 2. A schema's ``validate()`` checks the form of its values;
its ``check_files()``, if it has one, that the local files they name exist (skipped with
``files=False``: a config written for another machine can still be checked). Every float is a
number, and finite unless its schema names it in ``INFINITE`` (a bound that ``.inf`` turns off).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from embodied.config_files import ConfigError, YAMLLoader, read_yaml
from embodied.logger import write_atomic

COMMAND_LINE = "the command line"


class _Text(str):
    """An override's value as typed on the command line; ``compose`` converts it by the type of
    the setting it is for (``_convert``)."""


def parse_overrides(overrides: list[str]) -> dict:
    """``["a.b=1", "c=[1,2]"]`` -> nested dict of the values' text (``compose`` converts each by
    its setting's type: ``_convert``)."""
    out: dict = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {item!r} on {COMMAND_LINE}: expected key.sub=value")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} on {COMMAND_LINE}: {p} is set twice")
        node[leaf] = expand_home(_Text(value))
    return out


_NULLS = ("", "~", "null", "Null", "NULL")  # (YAML's words for None)


def _yaml(text: str, loader=YAMLLoader) -> Any:
    if text == "":
        return None
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError:
        return text


def _convert(hint: Any, text: str) -> Any:
    """The value of an override's ``text`` for a setting typed ``hint`` (None: not a field): the
    text itself for a str (YAML 1.1 read ``no`` as False and ``0755`` as 493) unless quoted
    (``''``: the empty string), each item's text for a list of str, a whole number written as a
    float (``5e6``) for an int, and YAML's value for the rest, as a file gives it (None for an
    empty text)."""
    hint, optional = _unoptional(hint)
    if optional and text in _NULLS:  # (privileged_keys=null: all of the environment's)
        return None
    if hint is str:
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        return _yaml(text) if quoted else str(text)  # ('' and "no" as in a file)
    if typing.get_origin(hint) in (list, tuple) and typing.get_args(hint)[:1] == (str,):
        return _yaml(text, yaml.BaseLoader)  # (every scalar as its text)
    value = _yaml(text)
    if hint is int and isinstance(value, str):
        return _whole(value)
    return _file_number(hint, value)  # (a file's rules: 5e6, and [6.4e1, 32] item by item)


def _unoptional(hint: Any) -> tuple[Any, bool]:
    """(the type inside ``X | None``, True) for an optional setting's hint, else (hint, False)."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional and len(args) == 2:
        return next(a for a in args if a is not type(None)), True
    return hint, optional


# a float in exponent form with no dot (3e-4, 5e6): YAML 1.2 and Python read it as a number,
# PyYAML (YAML 1.1) as text
_EXPONENT_FORM = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+")


def _file_number(hint: Any, value: Any) -> Any:
    """A file's ``value`` read by the type of its setting (``hint``), as an override's is: a float
    in exponent form that YAML 1.1 left as text (``3e-4``) as a float, and a whole float (``5e6``,
    ``5.0e6``) for an int as an int; a list of numbers item by item."""
    hint, _ = _unoptional(hint)
    if typing.get_origin(hint) in (list, tuple) and isinstance(value, list):
        items = typing.get_args(hint)[:1]
        return [_file_number(items[0], v) for v in value] if items else value
    text = isinstance(value, str) and _EXPONENT_FORM.fullmatch(value) is not None
    if hint is float and text:
        return float(value)
    if hint is int and (text or isinstance(value, float)):
        return _whole(value)
    return value


def _whole(value: str | float) -> Any:
    """``value`` (text or a float, for an int setting) as an int where it is a whole number that
    fits 64 bits (``5e6``: 5000000), else as a float, or as it was where it is not a number."""
    try:
        number = Decimal(str(value))
    except InvalidOperation:
        return value
    if not number.is_finite():
        return value
    if number.adjusted() > 18:
        return float(number)
    return int(number) if number == number.to_integral_value() else float(number)


def _hints(section) -> dict:
    """Field name -> type of the dataclass behind an OmegaConf section ({} for a plain dict)."""
    kind = OmegaConf.get_type(section) if isinstance(section, DictConfig) else None
    return typing.get_type_hints(kind) if dataclasses.is_dataclass(kind) else {}


def _typed(cfg, data: dict, name: str, prefix: str = "") -> dict:
    """``data`` (one source's mapping) with each command-line text converted by the type of its
    setting in ``cfg`` (``_convert``). A mapping given for a list is a ConfigError, as is a list
    given for a mapping (OmegaConf's merge raises a bare TypeError for both)."""
    hints = _hints(cfg)
    out = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, _Text):
            value = expand_home(_convert(hints.get(key), value))
        else:
            value = _file_number(hints.get(key), value)
        _refuse_marks(path, hints.get(key), value, name)
        node = cfg.get(key) if isinstance(cfg, DictConfig) and key in cfg else None
        if isinstance(node, ListConfig) and isinstance(value, dict):
            whole = f"{path}={OmegaConf.to_container(node)}".replace(" ", "")
            how = f"is set whole, as in {whole}, not by item" if name == COMMAND_LINE else ""
            raise ConfigError(f"{path}: a list {how or 'was given a mapping'} (in {name})")
        if isinstance(node, DictConfig) and isinstance(value, list):
            raise ConfigError(f"{path}: a mapping of keys, got a list (in {name})")
        if isinstance(value, dict):
            value = _typed(node, value, name, path + ".")
        out[key] = value
    return out


def _refuse_marks(path: str, hint: Any, value: Any, name: str) -> None:
    """A ConfigError for what OmegaConf would take silently: ``???`` (its mark of a value not
    set: the setting kept its earlier value) and a number other than 0 or 1 for a bool (``2``
    was true)."""
    if value == "???":
        raise ConfigError(f"{path}: ??? marks a value not set; give one (in {name})")
    number = type(value) is float or (type(value) is int and value not in (0, 1))
    if _unoptional(hint)[0] is bool and number:
        raise ConfigError(f"{path}: true or false, got {value} (in {name})")


def _leaf_paths(d: dict, prefix: str = "") -> list[str]:
    paths = []
    for k, v in d.items():
        p = f"{prefix}{k}"
        paths += _leaf_paths(v, p + ".") if isinstance(v, dict) and v else [p]
    return paths


def _setter(key: str, sources: list[tuple[str, dict]]) -> str | None:
    """The last source that set ``key`` or one of its parents/children; None if none did."""
    for name, data in reversed(sources):
        for p in _leaf_paths(data):
            if p == key or p.startswith(key + ".") or key.startswith(p + "."):
                return name
    return None


def source_of(key: str, sources: list[tuple[str, dict]]) -> str:
    """The last source that set ``key`` or one of its parents/children; for a key left at its
    default, the config file (where it would be set)."""
    files = [name for name, _ in sources if name != COMMAND_LINE]
    return _setter(key, sources) or (files[-1] if files else COMMAND_LINE)


def validate_tree(obj: Any, path: str, sources, files: bool = True) -> None:
    """Call ``validate()`` (and, with ``files``, ``check_files()``) on every dataclass in the
    tree, its numbers checked first, prefixing errors with their key path (``path``: where the
    tree sits, e.g. ``env.``); sections first, so that a parent's checks across sections see
    valid sections."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        validate_tree(getattr(obj, f.name), f"{path}{f.name}.", sources, files)
    _check_numbers(obj, path, sources)
    checks = [getattr(obj, "validate", None)]
    if files:
        checks.append(getattr(obj, "check_files", None))
    for check in filter(None, checks):
        try:
            check()
        except ValueError as e:
            raise _check_error(obj, path, str(e), sources) from None


_KEY = re.compile(r"[A-Za-z_][\w.\[\]]*")  # (what a validate() message starts with: "key: why")


def _check_error(obj: Any, path: str, message: str, sources) -> ConfigError:
    """A section's ``validate()`` error as one line: ``path.key: why (in source)``. A message
    that starts with no key (``d_model (256) must be divisible by heads (3)``) is the section's,
    from the sources that set the fields it names."""
    field_name, sep, why = message.partition(":")
    if sep and _KEY.fullmatch(field_name):
        key = f"{path}{field_name}"
        return ConfigError(f"{key}: {why.strip()} (in {source_of(key, sources)})")
    named = [f.name for f in dataclasses.fields(obj) if re.search(rf"\b{f.name}\b", message)]
    setters = {f"{path}{n}": _setter(f"{path}{n}", sources) for n in named}
    setters = {key: name for key, name in setters.items() if name}
    if len(set(setters.values())) > 1:
        where = ", ".join(f"{key} in {name}" for key, name in setters.items())
    else:
        where = "in " + (next(iter(setters.values()), None) or source_of(path[:-1], sources))
    return ConfigError(f"{path[:-1] or 'config'}: {message} ({where})")


def _check_numbers(obj: Any, path: str, sources) -> None:
    """No NaN in a dataclass's floats, those in its dict and list values included, and no
    infinity but in the fields its ``INFINITE`` names: a learning rate of .inf or a NaN timeout
    would fail far from its cause."""
    infinite = getattr(obj, "INFINITE", ())
    for f in dataclasses.fields(obj):
        field_key = f"{path}{f.name}"
        bound = f.name in infinite  # (the field itself, a float that .inf turns off)
        for key, number in _floats(getattr(obj, f.name), field_key):
            if math.isfinite(number) or (math.isinf(number) and bound and key == field_key):
                continue
            why = "not a number" if math.isnan(number) else "must be finite"
            where = source_of(key.split("[")[0], sources)
            raise ConfigError(f"{key}: {why}, got {number} (in {where})")


def _floats(value: Any, key: str) -> list[tuple[str, float]]:
    """(key path, number) for ``value`` if it is a float, and for the floats in it if it is a
    dict or a list (``resources.GPU``, ``hidden_sizes[1]``)."""
    if isinstance(value, float):
        return [(key, value)]
    if isinstance(value, dict):
        return [pair for k, v in value.items() for pair in _floats(v, f"{key}.{k}")]
    if isinstance(value, (list, tuple)):
        return [pair for i, v in enumerate(value) for pair in _floats(v, f"{key}[{i}]")]
    return []


def _base(schema: type, chosen: dict[str, tuple[Any, str]]):
    """The structured config to merge into. A schema may declare ``CHOICES = {field: registry}``
    (registry: name -> dataclass): the last ``field.name`` given in the sources (``chosen``:
    field -> (that name, its source), from ``_settled``) picks the dataclass that validates that
    field (e.g. ``policy.name: vla`` -> ``VLAConfig``)."""
    cfg = OmegaConf.structured(schema)
    keys = getattr(schema, "CHOICE_KEYS", {})  # field -> the key that names the choice
    for field_name, (name, where) in chosen.items():
        registry = schema.CHOICES[field_name]
        if not isinstance(name, str) or name not in registry:
            key = keys.get(field_name, "name")
            raise ConfigError(
                f"{field_name}.{key}: unknown {field_name} {name!r}; "
                f"known: {sorted(registry)} (in {where})"
            )
        if OmegaConf.get_type(cfg[field_name]) is registry[name]:
            continue  # (the schema's own default of that kind: its values, SFT's rgb say)
        cfg[field_name] = OmegaConf.structured(registry[name])
    return cfg


def _value_for_section(cfg, data: dict, prefix: str = "") -> tuple[str, Any] | None:
    """(key path, value) where ``data`` gives a plain value for a section of ``cfg`` (OmegaConf's
    merge error does not say where)."""
    for key, value in data.items():
        node = cfg.get(key) if isinstance(key, str) and key in cfg else None
        if not isinstance(node, DictConfig):
            continue
        if not isinstance(value, dict):
            return f"{prefix}{key}", value
        found = _value_for_section(node, value, f"{prefix}{key}.")
        if found:
            return found
    return None


def _settled(schema: type, sources: list[tuple[str, dict]]):
    """``sources`` as ``compose`` merges them, and each choice field's last choice (field ->
    (name, source name), for ``_base``): a choice field's section given whole on the command
    line (``algorithm={name: ppo}``) read as YAML, as in a file, so that its choice counts; and
    where a later source changes a choice, each earlier source's settings of that field that only
    its own choice has left behind (``algorithm.name=ppo`` over a GRPO file drops ``group_size``
    and keeps ``learning_rate``; a key neither choice has stays, to be refused)."""
    choices = getattr(schema, "CHOICES", {})
    keys = getattr(schema, "CHOICE_KEYS", {})
    sources = [(name, _sections_read(data, choices)) for name, data in sources]
    base = OmegaConf.structured(schema)
    chosen: dict[str, tuple[Any, str]] = {}
    for field_name, registry in choices.items():
        key = keys.get(field_name, "name")
        current = OmegaConf.get_type(base[field_name])
        in_effect = []  # the dataclass each source's settings of the field were written for
        for source, data in sources:
            node = data.get(field_name)
            if isinstance(node, dict) and key in node:
                chosen[field_name] = (node[key], source)
                if isinstance(node[key], str) and node[key] in registry:
                    current = registry[node[key]]
            in_effect.append(current)
        final = _field_names(current)
        sources = [
            (name, _without(data, field_name, _field_names(kind) - final))
            for (name, data), kind in zip(sources, in_effect)
        ]
    return sources, chosen


def _sections_read(data: dict, choices: dict) -> dict:
    """``data`` with each choice field's command-line text that YAML reads as a mapping read."""
    out = dict(data)
    for field_name in choices:
        node = out.get(field_name)
        if isinstance(node, _Text) and isinstance(_yaml(node), dict):
            out[field_name] = _yaml(node)
    return out


def _field_names(kind: type) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else set()


def _without(data: dict, field_name: str, dropped: set[str]) -> dict:
    """``data`` without the keys ``dropped`` in its section ``field_name``."""
    node = data.get(field_name)
    if not dropped or not isinstance(node, dict):
        return data
    return {**data, field_name: {k: v for k, v in node.items() if k not in dropped}}


def compose(schema: type, sources: list[tuple[str, dict]]):
    """Merge (source name, mapping) pairs in order into an instance of ``schema`` (ConfigError on
    a bad key or value), without running the ``validate()`` methods."""
    sources, chosen = _settled(schema, sources)
    cfg = _base(schema, chosen)
    for name, data in sources:
        try:
            cfg = OmegaConf.merge(cfg, _typed(cfg, data, name))
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None)
            msg = str(e).splitlines()[0]
            misplaced = None if key else _value_for_section(cfg, data)
            if misplaced:
                key, value = misplaced
                msg = f"expected a section of keys (a mapping), got {value!r}"
            key = key or "?"
            if "not in" in msg:
                owner = msg.split("not in")[-1].strip()
                msg = f"unknown key (not a field of {owner})"
            raise ConfigError(f"{key}: {msg} (in {name})") from None
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(
            f"{key}: {str(e).splitlines()[0]} (in {source_of(key, sources)})"
        ) from None


def load_config(
    schema: type, path: str | Path, overrides: list[str] | None = None, *, files: bool = True
):
    """Compose ``path`` (and its defaults) with ``overrides`` into an instance of ``schema``,
    validated (``files``: the local files it names too). Returns ``(config, sources)`` where
    sources lists (file, mapping) in merge order."""
    sources = read_yaml(Path(path), ())
    if overrides:
        sources.append((COMMAND_LINE, parse_overrides(overrides)))
    sources = [(name, expand_home(data)) for name, data in sources]  # (the files': a path)
    obj = compose(schema, sources)
    validate_tree(obj, "", sources, files)
    return obj, sources


def expand_home(node: Any) -> Any:
    """``node`` with each string that starts with ``~/`` expanded to the home directory: a path
    (``runner.output_dir=~/runs`` is not a shell assignment, so the shell leaves the ~ alone)."""
    if isinstance(node, dict):
        return {key: expand_home(value) for key, value in node.items()}
    if isinstance(node, list):
        return [expand_home(value) for value in node]
    if isinstance(node, str) and node.startswith("~/"):
        return os.path.expanduser(node)
    return node


def to_dict(cfg) -> dict:
    """A dataclass config as plain containers (for saving the resolved config)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def save_config(cfg, path: str | Path) -> None:
    write_atomic(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))


def check_folder_name(key: str, name: str) -> None:
    """``name`` (the value of ``key``) names a folder inside ``output_dir``: relative, not empty
    and without ``..`` (``a/b`` is a folder in a folder). An absolute name or ``..`` would write
    outside it, and an empty one or ``.`` into it, among other runs."""
    parts = Path(name).parts  # (none for "" and ".")
    if not parts or not name.strip() or Path(name).is_absolute() or ".." in parts:
        raise ValueError(
            f"{key}: a folder inside output_dir (relative, without '..'), got {name!r}"
        )
