"""Single-file, atomic checkpoints: a numpy .npz of named arrays plus a JSON header.

Pytrees (parameters, optimizer state, PRNG keys) are flattened to arrays named by their key path,
and restored into a template built from the same config, so a checkpoint never needs pickle and a
mismatch (another network size, another optimizer) fails loudly, naming the array. Writes go to a
temporary file in the same directory that is then renamed over the target: a crash mid-write
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np

_META = "__meta__"
FORMAT_VERSION = 1

C = TypeVar("C")


def save(path: str | os.PathLike[str], arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Writes `arrays` and the JSON-serialisable `meta` to `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if _META in arrays:
        raise ValueError(f"array name {_META!r} is reserved")
    header = json.dumps({"format_version": FORMAT_VERSION, **meta}, sort_keys=True)
    payload = {**arrays, _META: np.frombuffer(header.encode(), np.uint8)}
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Reads a checkpoint written by `save`: (arrays, meta). A file that is not one raises
    ValueError naming it."""
    try:
        with np.load(Path(path), allow_pickle=False) as data:
            if not hasattr(data, "files") or _META not in data.files:
                raise ValueError("no checkpoint metadata")
            arrays = {name: data[name] for name in data.files}
        meta = json.loads(arrays.pop(_META).tobytes().decode())
    except (ValueError, TypeError, OSError, EOFError):  # pickled, not an .npz (a .npy: TypeError), not our metadata
        raise ValueError(f"{path}: not a checkpoint written by hlomap (an .npz of named arrays)") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format_version')} is not "
                         f"{FORMAT_VERSION}")
    return arrays, meta


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def flatten(prefix: str, tree: Any) -> dict[str, np.ndarray]:
    """Names every leaf of `tree` `prefix + keystr(path)`, as host numpy copies (typed PRNG keys
    as their raw key data)."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        value = jax.random.key_data(leaf) if _is_key(leaf) else leaf
        out[prefix + jax.tree_util.keystr(path)] = np.array(value, copy=True)
    return out


def unflatten(prefix: str, template: Any, arrays: dict[str, np.ndarray]) -> Any:
    """Rebuilds a pytree shaped like `template` from arrays named by `flatten(prefix, ...)`."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, like in paths:
        name = prefix + jax.tree_util.keystr(path)
        if name not in arrays:
            raise KeyError(f"checkpoint has no array {name!r}")
        value = arrays[name]
        if _is_key(like):
            leaves.append(jax.random.wrap_key_data(value, impl=jax.random.key_impl(like)))
            continue
        if value.shape != np.shape(like) or value.dtype != np.asarray(like).dtype:
            raise ValueError(f"checkpoint array {name!r} is {value.dtype}{list(value.shape)}, "
                             f"expected {np.asarray(like).dtype}{list(np.shape(like))}")
        # A copy, not a view: donated update functions may later write into this buffer.
        leaves.append(jax.numpy.array(value, copy=True))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def subset(prefix: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays under `prefix`, with the prefix stripped."""
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def config_to_json(config: Any) -> dict[str, Any]:
    """A frozen config dataclass as JSON-ready data (enums by value, tuples as lists)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        out[field.name] = value.value if isinstance(value, enum.Enum) else (
            list(value) if isinstance(value, tuple) else value)
    return out


def config_from_json(cls: type[C], data: dict[str, Any]) -> C:
    """Inverse of `config_to_json`, using each field's default to recover enums and tuples."""
    kwargs: dict[str, Any] = {}
    names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - set(names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown config fields {sorted(unknown)}")
    for name, value in data.items():
        default = names[name].default
        if isinstance(default, enum.Enum):
            value = type(default)(value)
        elif isinstance(default, tuple):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)
