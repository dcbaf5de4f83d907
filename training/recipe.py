"""Training recipes: one YAML file → nested dataclasses, validated before anything runs.

An unknown key or a value of the wrong type is an error that names the key (``train.lr``),
so a typo never silently trains with a default. Command-line overrides use the same dotted
names (``--train.lr 5e-4``) or, when unambiguous, the bare field name (``--lr 5e-4``);
their values are parsed as YAML scalars and checked like the file.
"""
from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import one_line
from .recipe_checks import check_values
from .recipe_sections import CHOICES, Recipe, RecipeError


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint)


def _yaml_float(value: Any, hint: Any) -> Any:
    """PyYAML reads ``1e-3`` (no dot) as a string; for a float field that is a float."""
    if isinstance(value, str) and _type_ok(1.5, hint) and not _type_ok(value, hint):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def build(cls: type, data: dict, prefix: str = "") -> Any:
    """Dataclass ``cls`` from a (nested) dict; unknown keys and wrong types name the key."""
    if not isinstance(data, dict):
        raise RecipeError(f"Recipe section {prefix.rstrip('.') or '<root>'} must be a mapping, got {data!r}.")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RecipeError(f"Unknown recipe key {prefix}{unknown[0]!s}; known keys in "
                          f"{prefix.rstrip('.') or 'the recipe root'}: {sorted(known)}.")
    values = {}
    for name, value in data.items():
        hint, key = hints[name], prefix + name
        if is_dataclass(hint):
            values[name] = build(hint, value or {}, key + ".")
            continue
        value = _yaml_float(value, hint)
        if not _type_ok(value, hint):
            raise RecipeError(f"Recipe key {key} must be {_type_name(hint)}, got {type(value).__name__} {value!r}.")
        if hint is float and value is not None:
            value = float(value)
        if key in CHOICES and value not in CHOICES[key]:
            raise RecipeError(f"Recipe key {key} must be one of {list(CHOICES[key])}, got {value!r}.")
        values[name] = value
    return cls(**values)


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        keys += _leaf_keys(hint, prefix + f.name + ".") if is_dataclass(hint) else [prefix + f.name]
    return keys


def _leaf_hint(key: str) -> Any:
    cls: Any = Recipe
    for part in key.split("."):
        cls = typing.get_type_hints(cls)[part]
    return cls


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["--train.lr", "5e-4", "--epochs=2"]`` → [(dotted key, value parsed as YAML)], bare
    field names resolved to their one dotted key."""
    leaves = _leaf_keys(Recipe)
    pairs, items = [], list(overrides)
    while items:
        item = items.pop(0)
        if not item.startswith("--"):
            raise RecipeError(f"Override {item!r} must look like --key value or --key=value.")
        key, _, value = item[2:].partition("=")
        if not _:
            if not items:
                raise RecipeError(f"Override --{key} has no value.")
            value = items.pop(0)
        key = key.replace("-", "_")
        if key not in leaves:
            matches = [leaf for leaf in leaves if leaf.rsplit(".", 1)[-1] == key]
            if len(matches) != 1:
                raise RecipeError(f"Unknown recipe key {key} in override --{key}"
                                  + (f" (ambiguous: {matches})" if matches else f"; known keys: {leaves}."))
            key = matches[0]
        parsed = yaml.safe_load(value)
        if isinstance(parsed, (bool, int, float)) and _leaf_hint(key) is str:
            parsed = value  # YAML 1.1 reads "no"/"off" as False; a str field means the text
        pairs.append((key, parsed))
    return pairs


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``["--train.lr", "5e-4", "--epochs=2"]`` → nested dict updates (values parsed as YAML)."""
    for key, value in parse_overrides(overrides):
        node = data
        *parents, last = key.split(".")
        for depth, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                section = ".".join(parents[:depth + 1])
                raise RecipeError(f"Recipe section {section} must be a mapping, got {node!r}; override --{key} "
                                  "cannot set a key in it.")
        node[last] = value
    return data


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (None = all defaults), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"Recipe {path} not found; the shipped recipes are in recipes/*.yaml.")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError:
            raise RecipeError(f"Recipe {path} is not a text file (not UTF-8): pass a YAML recipe such as "
                              "recipes/medusa-smollm2.yaml.") from None
        except yaml.YAMLError as err:
            raise RecipeError(f"Recipe {path} is not valid YAML: {one_line(str(err))}") from None
        except OSError as err:
            raise RecipeError(f"Recipe {path} cannot be read ({err.strerror or err}).") from None
        if not isinstance(data, dict):
            raise RecipeError(f"Recipe {path} holds a YAML {type(data).__name__} at the top level; a recipe is a "
                              "mapping of sections (name:, base:, heads:, data:, train:...), as in recipes/*.yaml.")
    data = apply_overrides(data, overrides or [])
    try:
        recipe = build(Recipe, data)
        check_values(recipe)
    except RecipeError as err:
        if path is None:
            raise
        overridden = {key for key, _ in parse_overrides(overrides or [])}
        raise RecipeError(locate(str(err), path, key_lines(path.read_text(encoding="utf-8")), overridden)) from None
    return recipe


def key_lines(text: str) -> dict[str, int]:
    """Each dotted key written in a YAML recipe (``heads.extra.prefix_heads``) → its line, 1-based."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = prefix + str(key.value)
                lines[name] = key.start_mark.line + 1
                walk(value, name + ".")

    walk(root, "")
    return lines


def locate(message: str, path: Path, lines: dict[str, int], overridden: set[str]) -> str:
    """A recipe error naming the key it is about, prefixed with the recipe file and the key's
    line there, so the fix is one look away (unchanged when the value came from an override)."""
    import re

    found = re.search(r"[Rr]ecipe (?:keys?|section) ([A-Za-z_][\w.+-]*\w)", message)
    if found is None:
        return message
    key = found.group(1)
    while key and key not in lines:
        key = key.rpartition(".")[0]
    if not key or any(key == o or o.startswith(key + ".") or key.startswith(o + ".") for o in overridden):
        return message
    return f"{path}, line {lines[key]}: {message}"
