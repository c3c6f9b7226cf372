"""Small views of jaxprs that the runner needs: an equation's layer name and source line (the
names HLO metadata carries, so HLO cuts can be found again), dependence, and running a subset
of a jaxpr's equations as a function.

JAX lowers equation `e` to HLO ops whose metadata op_name is `<name stack of e>/<primitive>` and
whose source line is the first user frame of `e`'s traceback; `eqn_layer` and `eqn_source`
rebuild both from the equation, in the form `hlomap.cost.pipeline.chain.layer_name` and
`hlomap.hlo.source_info.source_location` read them from HLO.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from jax.extend import core as jcore
from jax.extend import source_info_util

__all__ = [
    "describe_eqn",
    "eqn_label",
    "eqn_layer",
    "eqn_source",
    "free_vars",
    "is_literal",
    "jaxpr_function",
    "needed_eqns",
]

#: Primitives that call a named function: HLO names their ops after the function.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def is_literal(atom: Any) -> bool:
    return isinstance(atom, jcore.Literal)


def eqn_label(eqn: Any) -> str:
    """What HLO metadata calls the equation: the primitive, or the called function's name."""
    name = eqn.primitive.name
    if name in _CALLS and isinstance(eqn.params.get("name"), str):
        return eqn.params["name"]
    if name in _CUSTOM:
        inner = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        info = getattr(getattr(inner, "jaxpr", inner), "debug_info", None)
        described = getattr(info, "func_src_info", None) or ""
        if described:
            return described.split(" ", 1)[0]
    return name


def eqn_layer(eqn: Any) -> str:
    """`layers_0/attn/dot_general`: the equation's name stack and label."""
    scope = str(eqn.source_info.name_stack)
    label = eqn_label(eqn)
    return f"{scope}/{label}" if scope else label


def eqn_source(eqn: Any) -> str | None:
    """`file:line` of the equation's first user frame (None when JAX recorded none)."""
    text = source_info_util.summarize(eqn.source_info)
    if not text or text == "unknown":
        return None
    location = text.rsplit(" (", 1)[0]
    parts = location.rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit():
        return f"{parts[0]}:{parts[1]}"
    return location


def describe_eqn(eqn: Any) -> str:
    """`layers_0/add (gpt.py:81)`: what a person reads to find the equation in the source."""
    source = eqn_source(eqn)
    short = source.rsplit("/", 1)[-1] if source else "unknown source"
    return f"{eqn_layer(eqn)} ({short})"


def free_vars(eqns: Iterable[Any], outvars: Iterable[Any] = ()) -> list[Any]:
    """Variables the equations (and `outvars`) read but do not define, in first-read order."""
    defined: set[Any] = set()
    free: dict[Any, None] = {}
    for eqn in eqns:
        for v in eqn.invars:
            if not is_literal(v) and v not in defined:
                free.setdefault(v)
        defined.update(eqn.outvars)
    for v in outvars:
        if not is_literal(v) and v not in defined:
            free.setdefault(v)
    return list(free)


def needed_eqns(eqns: Sequence[Any], wanted: Iterable[Any]) -> list[int]:
    """Indices of the equations `wanted` variables depend on (transitively), in program order."""
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    need: set[int] = set()
    stack = [v for v in wanted if not is_literal(v)]
    seen: set[Any] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        i = producer.get(v)
        if i is None or i in need:
            continue
        need.add(i)
        stack.extend(u for u in eqns[i].invars if not is_literal(u))
    return sorted(need)


def jaxpr_function(eqns: Sequence[Any], invars: Sequence[Any], outvars: Sequence[Any],
                   consts: Mapping[Any, Any] | None = None) -> Callable[..., list[Any]]:
    """A function `(*values of invars) -> [values of outvars]` that runs `eqns` with JAX's own
    jaxpr evaluator; `consts` binds further variables to fixed values."""
    consts = dict(consts or {})
    constvars = list(consts)
    effects: set[Any] = set()
    for eqn in eqns:
        effects.update(eqn.effects)
    jaxpr = jcore.Jaxpr(constvars, list(invars), list(outvars), list(eqns), effects=frozenset(effects))
    closed = jcore.ClosedJaxpr(jaxpr, [consts[v] for v in constvars])

    def run(*args: Any) -> list[Any]:
        return list(jcore.jaxpr_as_fun(closed)(*args))

    return run
