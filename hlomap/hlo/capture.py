"""Capture a JAX train step as an HLO Module, with the role and pytree path of every entry parameter.

How roles are decided (first rule that applies wins; `roles=` overrides everything):

1. `roles=` given by the caller: a mapping from an argument name (or index, or a path prefix such
   as "opt_state/0/mu") to a `Role`, or a function `(path, leaf) -> Role | None`. The longest
   matching prefix wins; leaves it does not cover fall through to the rules below.
2. A leaf inside an optax optimizer state (any node on its path is an instance of a class
   defined in an `optax` module, e.g. `ScaleByAdamState`) is OPTIMIZER_STATE, except integer
   leaves (step counters), which are OTHER.
3. By argument name: `params`, `parameters`, `weights`, `variables`, `model` -> TRAINABLE for
   floating-point leaves; `batch`, `inputs`, `data`, `x`, `y`, `images`, `labels`, `tokens`,
   `targets`, `examples` -> DATA; `opt_state`, `optimizer_state` -> OPTIMIZER_STATE.
4. Otherwise: a scalar leaf is OTHER; a floating-point array in the first argument is TRAINABLE;
   anything else is DATA.

Entry parameter i of the lowered module is leaf i of `jax.tree.flatten(args)`: the step is
lowered with `keep_unused=True`, so XLA drops no argument and the correspondence is exact.
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import logging
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from hlomap.hlo.fingerprint import ModuleSignature, module_signature, structure_fingerprint
from hlomap.hlo.ir import ArrayShape, Instruction, Module

log = logging.getLogger(__name__)


class Role(enum.Enum):
    TRAINABLE = "trainable"
    OPTIMIZER_STATE = "optimizer_state"
    DATA = "data"
    OTHER = "other"
    UNKNOWN = "unknown"  # a bare HLO dump whose caller named no roles


class Phase(enum.Enum):
    """Where an instruction sits in a train step, read off JAX's metadata."""

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"  # optimizer update and anything after the gradient
    UNKNOWN = "unknown"


TRAINABLE_ARG_NAMES = frozenset({"params", "parameters", "weights", "variables", "model"})
DATA_ARG_NAMES = frozenset(
    {"batch", "inputs", "data", "x", "y", "images", "labels", "tokens", "targets", "examples"}
)
OPTIMIZER_ARG_NAMES = frozenset({"opt_state", "optimizer_state", "optim_state"})

RoleOverride = Union[Mapping[Union[str, int], Role], Callable[[str, Any], Union[Role, None]]]


@dataclass(frozen=True)
class EntryParameter:
    """One entry parameter of the module and where it came from."""

    index: int
    name: str  # the HLO parameter instruction's name
    path: str  # pytree path in the step's arguments, e.g. "params/layers_0/attn/query/kernel"
    shape: ArrayShape
    role: Role

    @property
    def dtype(self) -> str:
        return self.shape.dtype

    @property
    def byte_size(self) -> int:
        return self.shape.byte_size


# Debug information records where the step was traced from (file paths, line numbers, the call
# stack), so the same step lowered from another script, checkout or install prints differently.
_DEBUG_SECTIONS = frozenset({"FileNames", "FunctionNames", "FileLocations", "StackFrames"})
_METADATA = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def module_fingerprint(text: str) -> str:
    """sha256 of an HLO module's text without its debug sections and `metadata={...}`: what a
    saved plan records to recognize the module it was made for."""
    kept: list[str] = []
    in_section = False
    for line in text.splitlines():
        if line in _DEBUG_SECTIONS:
            in_section = True
        elif in_section:
            in_section = bool(line.strip())
        else:
            kept.append(_METADATA.sub("", line))
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


@dataclass(frozen=True, eq=False)
class Capture:
    """A module plus what hlomap knows about its entry parameters.

    `step`, `args`, `in_tree` are set when captured from JAX (args are abstract
    `jax.ShapeDtypeStruct`s); they are None for a bare HLO dump.
    """

    module: Module
    parameters: tuple[EntryParameter, ...]
    source: str  # "jax:<function name>", the SOURCE it was loaded from (`api.load_source`), or an HLO file
    text_sha256: str
    step: Callable[..., Any] | None = field(default=None, repr=False)
    args: tuple[Any, ...] | None = field(default=None, repr=False)
    in_tree: Any = field(default=None, repr=False)
    arg_names: tuple[str, ...] = ()
    #: the step's jaxpr as traced for the capture (a `ClosedJaxpr`, flat arguments and results)
    #: and the tree of its results; None for a bare HLO dump. `program()` runs it.
    jaxpr: Any = field(default=None, repr=False)
    out_tree: Any = field(default=None, repr=False)
    #: how the roles were decided: "given" (by the caller), "argument names" (inferred from a
    #: dump's metadata paths), "" (captured from JAX, or no roles)
    role_source: str = ""

    @cached_property
    def structure_sha256(self) -> str:
        """The module's structure fingerprint (`hlo.fingerprint`): equal for the lowered step and
        an HLO text dump of it, which `text_sha256` is not."""
        return structure_fingerprint(self.module)

    @cached_property
    def signature(self) -> ModuleSignature:
        """The entry parameters' shapes and the instruction count, to say how modules differ."""
        return module_signature(self.module)

    @property
    def has_roles(self) -> bool:
        return any(p.role is not Role.UNKNOWN for p in self.parameters)

    def program(self) -> Callable[..., Any]:
        """The captured step as a function of the same arguments that replays the traced jaxpr.

        `jax.jit` of it traces in a fraction of the step's own tracing (it binds the recorded
        equations instead of running the model's Python), and computes the same thing, so a
        caller that has captured the step need not trace it again (`hlomap.auto_shard`)."""
        if self.jaxpr is None or self.in_tree is None or self.out_tree is None:
            raise ValueError(f"{self.source} was not captured from JAX: it has no program to run")
        from jax.extend import core as jcore

        import jax

        run, in_tree, out_tree = jcore.jaxpr_as_fun(self.jaxpr), self.in_tree, self.out_tree

        def program(*args: Any) -> Any:
            flat, tree = jax.tree_util.tree_flatten(args)
            if tree != in_tree:
                raise ValueError(f"the arguments' structure {tree} is not the captured step's {in_tree}")
            return jax.tree_util.tree_unflatten(out_tree, run(*flat))

        program.__name__ = getattr(self.step, "__name__", "program")
        return program

    def with_role(self, role: Role) -> tuple[EntryParameter, ...]:
        return tuple(p for p in self.parameters if p.role is role)

    @property
    def trainable(self) -> tuple[EntryParameter, ...]:
        return self.with_role(Role.TRAINABLE)

    @property
    def batch_size(self) -> int | None:
        """The examples of one step: the leading dim every data input shares (what microbatches
        and data parallelism split); None when there is no data input or they disagree."""
        sizes = {p.shape.dims[0] for p in self.with_role(Role.DATA) if getattr(p.shape, "dims", None)}
        return sizes.pop() if len(sizes) == 1 else None

    def parameter(self, key: int | str) -> EntryParameter:
        """An entry parameter by index, path or HLO name."""
        for p in self.parameters:
            if key in (p.index, p.path, p.name):
                return p
        raise KeyError(f"no entry parameter {key!r}; paths: {[p.path for p in self.parameters][:10]}...")

    def phase(self, inst: Instruction) -> Phase:
        return instruction_phase(inst)


def instruction_phase(inst: Instruction) -> Phase:
    """JAX tags backward ops `transpose(jvp(...))` and forward ops of a differentiated function
    `jvp(...)` in metadata op_name; ops outside both run after the gradient (the update)."""
    md = inst.metadata
    if md is None or md.op_name is None:
        return Phase.UNKNOWN
    if "transpose(jvp(" in md.op_name:
        return Phase.BACKWARD
    if "jvp(" in md.op_name:
        return Phase.FORWARD
    return Phase.UPDATE


# ---------------------------------------------------------------------------------------------
# Capture from JAX
# ---------------------------------------------------------------------------------------------


class StepTraceError(ValueError):
    """The train step raised while JAX traced it: its message names the step, the exception and
    the line of the user's code it came from (not a bug of hlomap's)."""

    def __init__(self, step: Callable[..., Any], error: BaseException):
        name = getattr(step, "__name__", type(step).__name__)
        where = _user_frame(error)
        super().__init__(f"tracing {name} failed{f' at {where}' if where else ''}: {type(error).__name__}: {error}")


def _user_frame(error: BaseException) -> str:
    """`file:line` of the innermost frame of `error`'s traceback outside JAX and hlomap."""
    import traceback

    ours = (f"{os.sep}jax{os.sep}", f"{os.sep}jaxlib{os.sep}", f"{os.sep}hlomap{os.sep}hlo{os.sep}")
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not any(part in f.filename for part in ours)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def capture(
    step: Callable[..., Any],
    *args: Any,
    roles: RoleOverride | None = None,
    arg_names: Sequence[str] | None = None,
) -> Capture:
    """Lower `step(*args)` with `jax.jit` and return its Module with parameter roles and paths.

    `args` may be real arrays or `jax.ShapeDtypeStruct`s; either way nothing is allocated here,
    because lowering only needs shapes. See the module docstring for how roles are decided.
    """
    import jax

    from hlomap.hlo.parser import parse

    names = tuple(arg_names) if arg_names is not None else _argument_names(step, len(args))
    _check_traceable(args, names)
    _check_role_values(roles)
    abstract = jax.tree.map(_to_abstract, args)
    try:
        traced = jax.jit(step, keep_unused=True).trace(*abstract)
    except Exception as err:  # the step's own code failed on these arguments: the user's to fix
        raise StepTraceError(step, err) from err
    lowered = traced.lower()
    # debug_info keeps metadata (op_name with jvp/transpose tags, source lines) in the text.
    text = lowered.as_text(dialect="hlo", debug_info=True)
    fn_name = getattr(step, "__name__", type(step).__name__)
    module = parse(text, filename=f"<jax:{fn_name}>")
    flat, in_tree = jax.tree_util.tree_flatten_with_path(abstract)
    entry_params = module.entry.parameters
    if len(entry_params) != len(flat):
        raise RuntimeError(
            f"lowered module of {fn_name} has {len(entry_params)} entry parameters but the arguments"
            f" have {len(flat)} leaves; cannot map parameters to pytree paths"
        )
    in_optax_state = _optax_state_flags(abstract)
    _check_role_keys(roles, [_path_string(key_path, names) for key_path, _ in flat], len(args))
    parameters = tuple(
        EntryParameter(
            index=i,
            name=inst.name,
            path=_path_string(key_path, names),
            shape=_array_shape(inst),
            role=_decide_role(key_path, leaf, names, roles, in_optax_state[i]),
        )
        for i, ((key_path, leaf), inst) in enumerate(zip(flat, entry_params))
    )
    return Capture(
        module=module,
        parameters=parameters,
        source=f"jax:{fn_name}",
        text_sha256=module_fingerprint(text),
        step=step,
        args=abstract,
        in_tree=in_tree,
        arg_names=names,
        jaxpr=traced.jaxpr,
        out_tree=jax.tree_util.tree_structure(traced.out_info),
    )


def from_module(
    module: Module,
    *,
    trainable: Iterable[int | str] | None = None,
    trainable_prefix: Iterable[str] = (),
    data: Iterable[int | str] | None = None,
    source: str = "<hlo>",
    text: str | None = None,
    infer_roles: bool = False,
) -> Capture:
    """Wrap a bare HLO module (e.g. a dump from any framework).

    Roles, the first rule that applies:
    1. As in Auto-MAP, the caller names the trainable parameters: `trainable` by index or HLO
       name, `trainable_prefix` by the start of their path or name; `data` names data inputs.
       The others are then optimizer state when their path says so (`opt_state/...`), data
       inputs when not scalar (unless `data` names them), else other.
    2. With `infer_roles`, nothing named, but JAX's metadata carries the parameters' pytree paths
       (a dump of a jitted step: `params['layers_0']...`, `opt_state[0].mu...`, `batch['tokens']`):
       the argument-name rules of `capture` apply (params -> trainable, opt_state -> optimizer state,
       batch -> data), and `Capture.role_source` says that the roles were inferred.
    3. Otherwise every role is UNKNOWN.
    Raises ValueError naming an index out of range, an unknown name or a prefix matching nothing.
    """
    params = module.entry.parameters
    from_metadata = {inst.name: _metadata_path(inst) for inst in params}
    paths = {name: path or name for name, path in from_metadata.items()}
    trainable_keys = set(trainable or ())
    data_keys = set(data or ())
    _check_keys(trainable_keys | data_keys, params)
    for prefix in trainable_prefix:
        hits = {inst.name for inst in params if paths[inst.name].startswith(prefix) or inst.name.startswith(prefix)}
        if not hits:
            raise ValueError(f"trainable prefix {prefix!r} matches no entry parameter; paths start with "
                             f"{sorted({paths[i.name].split('/')[0] for i in params})}")
        trainable_keys |= hits
    named_any = bool(trainable_keys or data_keys)
    inferred = infer_roles and not named_any and any(path is not None and _arg_name(path) in _KNOWN_ARG_NAMES
                                                     for path in from_metadata.values())

    def role_of(inst: Instruction) -> Role:
        keys = {inst.parameter_number, inst.name}
        shape = inst.shape
        is_float = isinstance(shape, ArrayShape) and _is_float_name(shape.dtype)
        if keys & trainable_keys:
            return Role.TRAINABLE
        if keys & data_keys:
            return Role.DATA
        if inferred:
            return _role_by_argument_name(_arg_name(paths[inst.name]), shape, is_float)
        if not named_any:
            return Role.UNKNOWN
        if _arg_name(paths[inst.name]) in OPTIMIZER_ARG_NAMES:
            return Role.OPTIMIZER_STATE if is_float else Role.OTHER
        return Role.DATA if isinstance(shape, ArrayShape) and shape.rank > 0 and not data_keys else Role.OTHER

    parameters = tuple(
        EntryParameter(
            index=inst.parameter_number or 0,
            name=inst.name,
            path=paths[inst.name],
            shape=_array_shape(inst),
            role=role_of(inst),
        )
        for inst in params
    )
    digest = module_fingerprint(text if text is not None else str(module))
    role_source = "given" if named_any else ("argument names" if inferred else "")
    return Capture(module=module, parameters=parameters, source=source, text_sha256=digest, role_source=role_source)


_KNOWN_ARG_NAMES = TRAINABLE_ARG_NAMES | DATA_ARG_NAMES | OPTIMIZER_ARG_NAMES
#: JAX's key path as metadata prints it: `params['layers_0']['attn']`, `opt_state[0].mu['w']`.
_KEYSTR_PART = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)")


def _arg_name(path: str) -> str:
    return path.split("/", 1)[0]


def _role_by_argument_name(arg_name: str, shape: Any, is_float: bool) -> Role:
    """`capture`'s argument-name rules for one parameter of a dump (rule 2 of `from_module`)."""
    if arg_name in OPTIMIZER_ARG_NAMES:
        return Role.OPTIMIZER_STATE if is_float else Role.OTHER
    if arg_name in TRAINABLE_ARG_NAMES:
        return Role.TRAINABLE if is_float else Role.OTHER
    if arg_name in DATA_ARG_NAMES:
        return Role.DATA
    return Role.OTHER


def _is_float_name(dtype: str) -> bool:
    return dtype.startswith(("f", "bf"))


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _check_traceable(args: Sequence[Any], names: Sequence[str]) -> None:
    """Every leaf of the arguments is an array, a `jax.ShapeDtypeStruct` or a number: JAX traces
    them all, and a string or another object would fail deep inside its lowering."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tuple(args))
    for key_path, leaf in flat:
        if isinstance(leaf, (jax.ShapeDtypeStruct, bool, int, float, complex)) or (
                hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            continue
        index = getattr(key_path[0], "idx", 0)
        name = f" ({names[index]})" if index < len(names) else ""
        raise TypeError(f"capture: argument {jax.tree_util.keystr(key_path)}{name} is a {type(leaf).__name__}, not "
                        "an array or a number: the step's arguments are traced; bind other values into the step "
                        "first (functools.partial)")


def _check_role_values(roles: RoleOverride | None) -> None:
    if roles is None or (callable(roles) and not isinstance(roles, Mapping)):
        return
    for key, role in roles.items():
        if not isinstance(role, Role):
            raise TypeError(f"capture: roles[{key!r}] is {role!r}; expected a hlomap.Role "
                            f"({', '.join(r.name for r in Role)})")


def _check_role_keys(roles: RoleOverride | None, paths: Sequence[str], n_args: int) -> None:
    """Each key of a roles mapping names something: an argument index, or a path or path prefix
    of a leaf (a misspelt key would otherwise be ignored without a word)."""
    if roles is None or (callable(roles) and not isinstance(roles, Mapping)):
        return
    for key in roles:
        if isinstance(key, int):
            if not 0 <= key < n_args:
                raise ValueError(f"capture: roles key {key}: the step takes {n_args} arguments")
        elif not any(path == key or path.startswith(str(key).rstrip("/") + "/") for path in paths):
            tops = sorted({path.split("/", 1)[0] for path in paths})
            raise ValueError(f"capture: roles key {key!r} matches no argument path (paths start with "
                             f"{', '.join(tops)}; e.g. {paths[0] if paths else '-'})")


def _to_abstract(leaf: Any) -> Any:
    import jax

    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    return jax.ShapeDtypeStruct(getattr(leaf, "shape", ()), getattr(leaf, "dtype", type(leaf)))


def _argument_names(step: Callable[..., Any], count: int) -> tuple[str, ...]:
    try:
        sig = inspect.signature(step)
    except (TypeError, ValueError):
        return tuple(f"arg{i}" for i in range(count))
    positional = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return tuple(positional[i] if i < len(positional) else f"arg{i}" for i in range(count))


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path_string(key_path: Sequence[Any], arg_names: Sequence[str]) -> str:
    """`(SequenceKey(0), DictKey('layers_0'), ...)` -> "params/layers_0/..."."""
    if not key_path:
        return "args"
    head, *rest = key_path
    first = arg_names[head.idx] if hasattr(head, "idx") and head.idx < len(arg_names) else _key_name(head)
    return "/".join([first, *(_key_name(k) for k in rest)])


def _is_float(dtype: Any) -> bool:
    import numpy as np

    try:
        return bool(np.issubdtype(np.dtype(dtype), np.floating)) or str(dtype) == "bfloat16"
    except TypeError:
        return False


def _decide_role(
    key_path: Sequence[Any], leaf: Any, arg_names: Sequence[str], roles: RoleOverride | None, in_optax_state: bool
) -> Role:
    path = _path_string(key_path, arg_names)
    arg_index = key_path[0].idx if key_path and hasattr(key_path[0], "idx") else 0
    if roles is not None:
        chosen = _override_role(roles, path, arg_index, leaf)
        if chosen is not None:
            return chosen
    is_float = _is_float(leaf.dtype)
    if in_optax_state:
        return Role.OPTIMIZER_STATE if is_float else Role.OTHER
    arg_name = arg_names[arg_index] if arg_index < len(arg_names) else ""
    if arg_name in OPTIMIZER_ARG_NAMES:
        return Role.OPTIMIZER_STATE if is_float else Role.OTHER
    if arg_name in TRAINABLE_ARG_NAMES:
        return Role.TRAINABLE if is_float else Role.OTHER
    if arg_name in DATA_ARG_NAMES:
        return Role.DATA
    if len(leaf.shape) == 0:
        return Role.OTHER
    if arg_index == 0 and is_float:
        return Role.TRAINABLE
    return Role.DATA


def _override_role(roles: RoleOverride, path: str, arg_index: int, leaf: Any) -> Role | None:
    if callable(roles) and not isinstance(roles, Mapping):
        return roles(path, leaf)
    best: tuple[int, Role] | None = None
    for key, role in roles.items():
        if isinstance(key, int):
            if key == arg_index and (best is None or best[0] < 0):
                best = (0, role)
            continue
        if path == key or path.startswith(key.rstrip("/") + "/"):
            if best is None or len(key) > best[0]:
                best = (len(key), role)
    return best[1] if best else None


def _is_optax_node(node: Any) -> bool:
    return type(node).__module__.split(".", 1)[0] == "optax"


def _optax_state_flags(args: Any) -> list[bool]:
    """For each leaf of `args` in flatten order: does it sit inside an optax state object?

    Key paths name fields, not node types, so flatten once more with optax nodes as leaves and
    expand each optax node into as many True flags as it has leaves.
    """
    import jax

    flags: list[bool] = []
    for item in jax.tree_util.tree_leaves(args, is_leaf=_is_optax_node):
        if _is_optax_node(item):
            flags.extend([True] * len(jax.tree_util.tree_leaves(item)))
        else:
            flags.append(False)
    return flags


def _array_shape(inst: Instruction) -> ArrayShape:
    shape = inst.shape
    if not isinstance(shape, ArrayShape):
        raise ValueError(f"entry parameter {inst.name} has tuple shape {shape}; hlomap expects flat parameters")
    return shape


def _metadata_path(inst: Instruction) -> str | None:
    """A parameter's pytree path from JAX's metadata, `/`-joined (`params['embed']['w']` ->
    `params/embed/w`); the op_name as is when it is not a key path; None without metadata."""
    md = inst.metadata
    if md is None or not md.op_name:
        return None
    text = md.op_name.replace("\\'", "'")  # HLO text escapes the quotes of JAX's key path
    head = re.match(r"^(\w+)", text)
    if head is None:
        return md.op_name
    rest = text[head.end():]
    parts = _KEYSTR_PART.findall(rest)
    if "".join(f"['{a}']" if a else (f"[{b}]" if b else f".{c}") for a, b, c in parts) != rest:
        return md.op_name
    return "/".join([head.group(1), *(a or b or c for a, b, c in parts)])


def _check_keys(keys: set[int | str], params: Sequence[Instruction]) -> None:
    out_of_range = sorted(k for k in keys if isinstance(k, int) and not 0 <= k < len(params))
    if out_of_range:
        raise ValueError(f"unknown entry parameter {out_of_range[0]}: index out of range, the entry has "
                         f"{len(params)} parameters, 0..{len(params) - 1}")
    known = {p.parameter_number for p in params} | {p.name for p in params}
    unknown = sorted(map(str, keys - known))
    if unknown:
        raise ValueError(
            f"unknown entry parameter(s) {unknown}: name them by index (0..{len(params) - 1}) or by HLO "
            f"name, e.g. {[p.name for p in params][:3]} (`hlomap inspect` lists them)"
        )
