"""Strict YAML reading and pydantic validation errors turned into messages that name file and field."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from sim.errors import InputError, did_you_mean

M = TypeVar("M", bound=BaseModel)

#: Most values (scalars, list items, mapping entries) a YAML file may expand to through aliases.
MAX_YAML_VALUES = 1_000_000


def _accepts_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return any(_accepts_bool(a) for a in typing.get_args(annotation))
    return not (isinstance(annotation, type) and issubclass(annotation, int | float))


class StrictModel(BaseModel):
    """Base of every input-file model: unknown keys are errors, numbers must be finite, and
    ``true``/``false`` is not taken for a number (pydantic would read ``nodes: true`` as 1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and not _accepts_bool(field.annotation):
                raise ValueError(f"expected a number or a name, not {str(value).lower()}")
        return value


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in out:
            line = key_node.start_mark.line + 1
            raise InputError(f"duplicate key '{key}' at line {line}", field=str(key))
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_text(path: str | Path, what: str = "file") -> str:
    """The text of ``path``; a missing, unreadable or binary file is an :class:`InputError`."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{what} not found", file=str(path))
    if p.is_dir():
        raise InputError(f"{what} is a directory, expected a file", file=str(path))
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", file=str(path)) from None
    if b"\x00" in raw:
        raise InputError(f"{what} is binary, not text", file=str(path))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 text (byte {exc.start})", file=str(path)) from None


def parse_json(text: str, path: str | Path) -> Any:
    """``text`` (read from ``path``) as JSON; a syntax error or runaway nesting is an :class:`InputError`."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}", file=str(path)
        ) from None
    except RecursionError:
        raise InputError("JSON is nested too deeply", file=str(path)) from None


def load_yaml_mapping(path: str | Path, what: str = "YAML file") -> dict[str, Any]:
    """Parse ``path`` as a YAML mapping; syntax errors, empty files and non-mappings exit 2."""
    text = read_text(path, what)
    if len(text) > MAX_YAML_CHARS:
        raise InputError(
            f"{what} is {len(text) / 2**20:.1f} MiB; hand-written YAML inputs are limited to "
            f"{MAX_YAML_CHARS / 2**20:.0f} MiB (is this the right file?)",
            file=str(path),
        )
    _check_flow_depth(text, what, str(path))
    loader = None
    try:
        loader = _StrictLoader(text)  # the reader refuses control characters here already
        node = loader.get_single_node()
        if node is not None:
            _check_expanded_size(node, str(path))
        data = loader.construct_document(node) if node is not None else None
    except InputError as exc:
        raise exc.with_file(str(path)) from None
    except RecursionError:
        raise InputError(f"{what} is nested too deeply", file=str(path)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"YAML syntax error{where}: {problem}", file=str(path)) from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        raise InputError(f"{what} is empty", file=str(path))
    if not isinstance(data, dict):
        raise InputError(
            f"expected a mapping of keys at the top level, got {type(data).__name__}", file=str(path)
        )
    for key in data:
        if not isinstance(key, str):
            raise InputError(f"keys must be strings, got {key!r}", file=str(path))
    return data


#: Largest YAML input read (characters): PyYAML parses ~0.5 MB/s, and scenario and topology files
#: are a few kB.
MAX_YAML_CHARS = 2 * 2**20

#: Deepest nesting of YAML flow collections (``[...]``, ``{...}``) read: PyYAML's scanner takes time
#: quadratic in this depth, so a file of nested brackets could stall the loader.
MAX_FLOW_DEPTH = 100
_QUOTED_OR_COMMENT = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\']|\'\')*\'|#[^\n]*')


def _check_flow_depth(text: str, what: str, file: str) -> None:
    if text.count("[") + text.count("{") <= MAX_FLOW_DEPTH:
        return
    bare = _QUOTED_OR_COMMENT.sub("", text).encode("utf-8")
    step = np.zeros(256, dtype=np.int8)
    step[ord("[")] = step[ord("{")] = 1
    step[ord("]")] = step[ord("}")] = -1
    depth = np.cumsum(step[np.frombuffer(bare, dtype=np.uint8)], dtype=np.int64)
    if len(depth) and depth.max() > MAX_FLOW_DEPTH:
        raise InputError(
            f"{what} is nested too deeply: [...] / {{...}} more than {MAX_FLOW_DEPTH} levels deep", file=file
        )


def _check_expanded_size(root: yaml.Node, file: str) -> None:
    """Refuse a document whose aliases expand to more than :data:`MAX_YAML_VALUES` values
    ("billion laughs"): sizes are counted once per node, bottom-up, without recursion."""
    size: dict[int, int] = {}
    open_nodes: set[int] = set()  # nodes whose children are being counted: the current path
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if not children_done and id(node) in size:
            continue
        if isinstance(node, yaml.ScalarNode):
            size[id(node)] = 1
            continue
        kids = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        if children_done:
            open_nodes.discard(id(node))
            total = 1 + sum(size[id(k)] for k in kids)
            if total > MAX_YAML_VALUES:
                raise InputError(
                    f"the document expands to more than {MAX_YAML_VALUES:,} values through YAML aliases "
                    f"(line {node.start_mark.line + 1}); write the values out",
                    file=file,
                )
            size[id(node)] = total
            continue
        if id(node) in open_nodes:
            raise InputError(f"recursive YAML alias at line {node.start_mark.line + 1}", file=file)
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)


def _sub_model(annotation: Any, through_lists: bool = False) -> type[BaseModel] | None:
    """The BaseModel class inside ``annotation`` (unwrapping Optional / Union, and ``list[...]``
    when ``through_lists``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated) or (through_lists and origin is list):
        for arg in typing.get_args(annotation):
            found = _sub_model(arg, through_lists)
            if found is not None:
                return found
    return None


def _model_at(cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """Walk ``loc`` (field names; list indices are stepped over) from ``cls`` to the model that
    holds the last element."""
    current: type[BaseModel] | None = cls
    for part in loc:
        if isinstance(part, int):
            continue  # an item of a list field: _sub_model already unwrapped list[Model]
        if current is None or part not in current.model_fields:
            return current if current is not None and part == loc[-1] else None
        current = _sub_model(current.model_fields[part].annotation, through_lists=True)
    return current


_FIELD_TAG = re.compile(r"^\[([A-Za-z_][\w.]*)\] (.*)$", re.S)


def field_error(field: str, message: str) -> ValueError:
    """A ValueError for a model validator that names ``field`` (shown as ``section.field``)."""
    return ValueError(f"[{field}] {message}")


def _loc_path(loc: tuple) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]
    return ".".join(parts)


def validation_to_input_error(exc: ValidationError, cls: type[BaseModel], file: str | None) -> InputError:
    """Turn the first few pydantic errors into one :class:`InputError` that names every field."""
    messages = []
    first_field = None
    for err in exc.errors(include_url=False)[:5]:
        loc = tuple(err["loc"])
        path = _loc_path(loc) or "(top level)"
        first_field = first_field or path
        if err["type"] == "extra_forbidden":
            parent = _model_at(cls, loc[:-1]) if len(loc) > 1 else cls
            allowed = sorted(parent.model_fields) if parent is not None else []
            key = str(loc[-1])
            hint = did_you_mean(key, allowed)
            if ":" in key:  # '{node:1}' is one key in YAML; '{node: 1}' is a key and a value
                hint += f" (YAML needs a space after ':' - write '{key.replace(':', ': ', 1)}')"
            messages.append(f"{path}: unknown key{hint}; allowed keys: {', '.join(allowed)}")
        elif err["type"] == "missing":
            messages.append(f"{path}: required field is missing")
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            tagged = _FIELD_TAG.match(msg)
            if tagged:  # a cross-field check that names its field: "[top_k] ..."
                path = ".".join(p for p in (_loc_path(loc), tagged.group(1)) if p)
                msg = tagged.group(2)
                first_field = first_field or path
            got = err.get("input")
            shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
            messages.append(f"{path}: {msg}{shown}")
    extra = len(exc.errors()) - len(messages)
    text = "; ".join(messages) + (f"; and {extra} more error(s)" if extra > 0 else "")
    return InputError(text, file=file)


def validate_model(cls: type[M], data: dict[str, Any], file: str | None) -> M:
    """``cls.model_validate(data)`` with errors as :class:`InputError`."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_to_input_error(exc, cls, file) from None
