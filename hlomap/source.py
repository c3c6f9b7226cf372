"""Turn a SOURCE argument (`zoo:NAME` or an HLO text file) into a Capture."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from hlomap.hlo.capture import Capture, Role, capture, from_module

ZOO_PREFIX = "zoo:"


class SourceError(ValueError):
    """A SOURCE that names nothing hlomap can read."""


def load_source(spec: str, *, trainable: Iterable[int | str] | None = None, module_index: int = 0) -> Capture:
    """`zoo:NAME` lowers a zoo train step abstractly; anything else is read as HLO text.

    For an HLO file holding several modules (split by `// -----`), `module_index` picks one.
    `trainable` names the trainable entry parameters of a bare dump (indices or HLO names).
    """
    if spec.startswith(ZOO_PREFIX):
        return _load_zoo(spec[len(ZOO_PREFIX):])
    return _load_file(Path(spec), trainable=trainable, module_index=module_index)


def _load_zoo(name: str) -> Capture:
    from hlomap import zoo

    try:
        model = zoo.get(name)
    except KeyError as err:
        raise SourceError(str(err.args[0]) if err.args else f"unknown zoo model {name!r}") from None
    # Carried non-trained state inside params (batch-norm running statistics) is OTHER, not
    # trainable: the optimizer never updates it.
    params_arg = model.arg_names[0]
    roles = {f"{params_arg}/{path}": Role.OTHER for path in model.other_paths()}
    return capture(model.train_step(), *model.abstract_args(), arg_names=model.arg_names, roles=roles or None)


def _load_file(path: Path, *, trainable: Iterable[int | str] | None, module_index: int) -> Capture:
    from hlomap.hlo.parser import parse_all

    if not path.exists():
        raise SourceError(f"{path}: no such file (SOURCE is an HLO text file or zoo:NAME)")
    if path.is_dir():
        raise SourceError(f"{path}: is a directory, expected an HLO text file")
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise SourceError(f"{path}: not a text file ({err.reason} at byte {err.start})") from None
    modules = parse_all(text, filename=str(path))
    if not 0 <= module_index < len(modules):
        raise SourceError(f"{path}: holds {len(modules)} module(s); --module {module_index} is out of range")
    # The source hash identifies the module a plan was made for; hash the module's own text
    # when the file holds several.
    own_text = text if len(modules) == 1 else None
    return from_module(modules[module_index], trainable=trainable, source=str(path), text=own_text)
