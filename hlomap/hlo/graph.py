"""Graph views of the IR: users of instructions, topological order, the call graph.

All functions are pure and take the frozen IR; `ModuleGraph` memoizes them for one module when
a caller asks many questions of the same module.
"""

from __future__ import annotations

import heapq
from functools import cached_property
from typing import Mapping

from hlomap.hlo.ir import Computation, Instruction, Module

__all__ = [
    "HloGraphError",
    "ModuleGraph",
    "call_graph",
    "callers",
    "computations_postorder",
    "entry_parameters",
    "entry_root",
    "topological_order",
    "users",
]


class HloGraphError(ValueError):
    """A cycle among instructions or computations, or a reference to something missing."""


def users(computation: Computation) -> Mapping[str, tuple[str, ...]]:
    """For every instruction name, the instructions that take it as an operand, in program order,
    each listed once (`add(x, x)` is one use of x, as in XLA's `users()`)."""
    result: dict[str, list[str]] = {inst.name: [] for inst in computation.instructions}
    for inst in computation.instructions:
        seen: set[str] = set()
        for operand in inst.operands:
            if operand in seen:
                continue
            seen.add(operand)
            if operand not in result:
                raise HloGraphError(
                    f"instruction {inst.name!r} of computation {computation.name!r} uses "
                    f"{operand!r}, which the computation does not define"
                )
            result[operand].append(inst.name)
    return {name: tuple(names) for name, names in result.items()}


def _predecessors(inst: Instruction) -> tuple[str, ...]:
    """Data operands, then control predecessors: both must run before `inst`."""
    controls = inst.control_predecessors if inst.attributes else ()
    return inst.operands + controls if controls else inst.operands


def topological_order(computation: Computation) -> tuple[Instruction, ...]:
    """Instructions ordered so that operands and control predecessors come before their users.

    Among instructions that are ready at the same time, program order wins, so text that is
    already in definition-before-use order comes back unchanged. Raises HloGraphError on a cycle.
    Kept on the computation (as a `cached_property` would keep it): a pipeline attribution, its
    batch split and its forward chain each ask for the order of one step's entry.
    """
    found = computation.__dict__.get("_topological_order")
    if found is None:
        found = _topological_order(computation)
        object.__setattr__(computation, "_topological_order", found)  # a frozen dataclass, as cached_property does
    return found


def _topological_order(computation: Computation) -> tuple[Instruction, ...]:
    instructions = computation.instructions
    index = {inst.name: i for i, inst in enumerate(instructions)}
    pending = [0] * len(instructions)
    dependents: list[list[int]] = [[] for _ in instructions]
    for i, inst in enumerate(instructions):
        for name in set(_predecessors(inst)):
            j = index.get(name)
            if j is None:
                raise HloGraphError(
                    f"instruction {inst.name!r} of computation {computation.name!r} depends on "
                    f"{name!r}, which the computation does not define"
                )
            pending[i] += 1
            dependents[j].append(i)
    ready = [i for i, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)
    order: list[Instruction] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(instructions[i])
        for k in dependents[i]:
            pending[k] -= 1
            if pending[k] == 0:
                heapq.heappush(ready, k)
    if len(order) != len(instructions):
        stuck = sorted(inst.name for i, inst in enumerate(instructions) if pending[i] > 0)
        raise HloGraphError(
            f"computation {computation.name!r} has a dependency cycle through {stuck[:8]}"
        )
    return tuple(order)


def call_graph(module: Module) -> Mapping[str, tuple[str, ...]]:
    """For every computation, the computations its instructions call (to_apply, calls, body,
    condition, branch_computations, ...), each once, in order of first call."""
    graph: dict[str, tuple[str, ...]] = {}
    for computation in module.computations:
        callees: dict[str, None] = {}
        for inst in computation.instructions:
            if inst.attributes:
                for callee in inst.called_computations:
                    if callee not in module.by_name:
                        raise HloGraphError(
                            f"instruction {inst.name!r} of computation {computation.name!r} "
                            f"calls {callee!r}, which the module does not define"
                        )
                    callees[callee] = None
        graph[computation.name] = tuple(callees)
    return graph


def callers(module: Module) -> Mapping[str, tuple[str, ...]]:
    """The reverse of `call_graph`: for every computation, the computations that call it."""
    result: dict[str, list[str]] = {c.name: [] for c in module.computations}
    for caller, callees in call_graph(module).items():
        for callee in callees:
            result[callee].append(caller)
    return {name: tuple(names) for name, names in result.items()}


def computations_postorder(module: Module) -> tuple[Computation, ...]:
    """Every computation after all the computations it calls (callees first, entry last when
    everything is reachable from it), like XLA's MakeComputationPostOrder. Computations no one
    calls are included, in text order. Raises HloGraphError on recursion."""
    graph = call_graph(module)
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    order: list[Computation] = []
    # The entry goes last among the DFS roots so that it ends the order (nothing calls it).
    roots = [c.name for c in module.computations if c.name != module.entry_name]
    roots.append(module.entry_name)
    for root in roots:
        if state.get(root) == 2:
            continue
        # Iterative DFS: call chains in real modules are shallow, but a hostile input must not
        # hit Python's recursion limit.
        stack: list[tuple[str, int]] = [(root, 0)]
        state[root] = 1
        while stack:
            name, child = stack[-1]
            callees = graph[name]
            if child < len(callees):
                stack[-1] = (name, child + 1)
                callee = callees[child]
                mark = state.get(callee)
                if mark == 1:
                    raise HloGraphError(f"computation {callee!r} calls itself through {name!r}")
                if mark is None:
                    state[callee] = 1
                    stack.append((callee, 0))
            else:
                stack.pop()
                state[name] = 2
                order.append(module.by_name[name])
    return tuple(order)


def entry_parameters(module: Module) -> tuple[Instruction, ...]:
    """The entry computation's parameters, ordered by parameter number."""
    return module.entry.parameters


def entry_root(module: Module) -> Instruction:
    """The entry computation's ROOT instruction."""
    return module.entry.root


class ModuleGraph:
    """Memoized graph queries on one module (the module is immutable, so caching is safe)."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self._users: dict[str, Mapping[str, tuple[str, ...]]] = {}
        self._order: dict[str, tuple[Instruction, ...]] = {}

    def users(self, computation: str) -> Mapping[str, tuple[str, ...]]:
        if computation not in self._users:
            self._users[computation] = users(self.module.computation(computation))
        return self._users[computation]

    def users_of(self, computation: str, instruction: str) -> tuple[Instruction, ...]:
        comp = self.module.computation(computation)
        return tuple(comp[name] for name in self.users(computation)[instruction])

    def operands_of(self, computation: str, instruction: str) -> tuple[Instruction, ...]:
        comp = self.module.computation(computation)
        return tuple(comp[name] for name in comp[instruction].operands)

    def topological_order(self, computation: str) -> tuple[Instruction, ...]:
        if computation not in self._order:
            self._order[computation] = topological_order(self.module.computation(computation))
        return self._order[computation]

    @cached_property
    def call_graph(self) -> Mapping[str, tuple[str, ...]]:
        return call_graph(self.module)

    @cached_property
    def callers(self) -> Mapping[str, tuple[str, ...]]:
        return callers(self.module)

    @cached_property
    def postorder(self) -> tuple[Computation, ...]:
        return computations_postorder(self.module)

    @property
    def entry_parameters(self) -> tuple[Instruction, ...]:
        return entry_parameters(self.module)

    @property
    def entry_root(self) -> Instruction:
        return entry_root(self.module)
