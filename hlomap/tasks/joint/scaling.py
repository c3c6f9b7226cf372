"""Every data width of one tensor-parallel stage option, priced from three estimates.

The joint planner prices a stage option (devices = data x model, a plan kind) by the cost model's
estimate of the whole step under the option's plan, summed per chain position
(`JointModel._work`). On a large cluster most options differ only in their data width: 8, 16,
..., 1,024 devices with the same tensor-parallel width. Under one plan array their work differs
only through the data axis's size d, and in a form that three widths determine exactly:

- an instruction's compute is its unsplit compute over its split degree, which has d as a factor
  or not (`compute_split`);
- the bytes it moves are a sum over its operands and result of full bytes over each tensor's
  degree (d or not), times d where its operands are gathered over the data axis first: so its
  memory time is m_-1 / d + m_0 + m_1 d, three coefficients that the widths 2, 4 and 8 solve for;
- its time is max(compute, memory) plus its kernel launches, whatever d is;
- a collective's bytes are a constant times d^-e (e is 0 or 1 for a partial result split or not
  by the data axis); its time is priced again on the option's own device groups;
- gradient and parameter bytes do not depend on d; stash and crossing bytes are a / d + b.

`fit_data_scaling` estimates the step at d = 2, 4, 8 (`FAMILY_WIDTHS`), checks each of these forms
against the third width (and that the plan array is the same at each), and `DataScaling.at(d)`
gives the work at any d. An option whose plan array differs (the data-parallel plan's greedy
choice depends on divisibility) or a family that fails a check is priced in full, so the result
is the full estimate's (up to float rounding: `tests/tasks/joint/test_scaling.py`). At 128
devices and more the planner prices hundreds of data widths; this turns each full estimate
(seconds on a GPT of billions of parameters) into array arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hlomap.cost.collectives import Collective
from hlomap.cost.estimate import Reason, step_arrays
from hlomap.cost.sharding import ShardedGraph
from hlomap.plan.sections import Recompute

if TYPE_CHECKING:
    from hlomap.tasks.joint.costs import JointModel, StageOption

__all__ = ["FAMILY_WIDTHS", "DataScaling", "PositionedCollective", "StageWork", "fit_data_scaling", "per_position"]

#: The data widths a family is fitted at: three points fix m_-1 / d + m_0 + m_1 d; the third also
#: checks the two-point forms.
FAMILY_WIDTHS = (2, 4, 8)
#: `JointModel`'s mark of an optimizer-update instruction (`costs._positions`).
UPDATE = -2
#: How close the third width must come to each fitted form (float rounding only).
_CHECK_RTOL = 1e-9


class PositionedCollective(NamedTuple):
    """A collective of a stage's work other than the gradient sync: where on the chain it is
    charged, its kind, mesh axes, bytes per device and runs per step."""

    position: int
    kind: Collective
    axes: tuple[str, ...]
    nbytes: float
    count: int


class StageWork(NamedTuple):
    """One option's work per chain position, before its collectives are priced on its devices:
    compute and forward seconds, the optimizer update's seconds in all, the other collectives,
    gradient bytes the data axis all-reduces and their buffers, parameter and stash bytes on one
    device, each crossing value's bytes on one device, the forward seconds other than the
    matmuls' (`redo`: what selective recomputation runs again) and the bytes of the forward's
    matmul outputs (`saved`: what it keeps)."""

    compute: np.ndarray
    forward: np.ndarray
    update_total: float
    collectives: tuple[PositionedCollective, ...]
    grads: np.ndarray
    buffers: np.ndarray
    params: np.ndarray
    stash: np.ndarray
    values: np.ndarray  # per crossing value, in `ChainAttribution.spans` order
    redo: np.ndarray
    saved: np.ndarray


@dataclass(frozen=True, eq=False)
class DataScaling:
    """The work of one (model width, plan kind) at every data width d >= 2 (module docstring).
    Per instruction: its chain position (UPDATE, or -1 where nothing is charged), whether it is
    forward, its compute seconds at the first width and whether d splits it, its memory seconds'
    coefficients of 1 / d, 1 and d, and its launch seconds."""

    plan: np.ndarray
    position: np.ndarray
    forward: np.ndarray
    compute: np.ndarray
    compute_split: np.ndarray
    memory: np.ndarray  # [3, I]
    launch: np.ndarray
    collectives: tuple[tuple[PositionedCollective, int], ...]  # at the first width, with its exponent e
    grads: np.ndarray
    buffers: np.ndarray
    params: np.ndarray
    stash: np.ndarray  # [2, n]: coefficients of 1 / d and 1
    values: np.ndarray  # [2, V]: each crossing value's (`ChainAttribution.spans` order)
    matmul: np.ndarray  # per instruction: a matmul (what selective recomputation keeps)
    saved: np.ndarray  # [2, n]: coefficients of 1 / d and 1

    def at(self, data: int) -> StageWork:
        """The work at data width `data` (>= 2)."""
        d, base = float(data), float(FAMILY_WIDTHS[0])
        compute = np.where(self.compute_split, self.compute * (base / d), self.compute)
        memory = self.memory[0] / d + self.memory[1] + self.memory[2] * d
        seconds = np.maximum(compute, memory) + self.launch
        total, forward, redo, update_total = per_position(seconds, self.position, self.forward, self.matmul,
                                                          len(self.params))
        collectives = tuple(c._replace(nbytes=c.nbytes * (base / d) ** e) for c, e in self.collectives)
        values = self.values[0] / d + self.values[1]
        return StageWork(total, forward, update_total, collectives, self.grads.copy(), self.buffers.copy(),
                         self.params.copy(), self.stash[0] / d + self.stash[1], values, redo,
                         self.saved[0] / d + self.saved[1])


def per_position(seconds: np.ndarray, position: np.ndarray, forward: np.ndarray, matmul: np.ndarray,
                 n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Instructions' seconds summed per chain position (`position`: UPDATE, -1 or a position):
    all of them, the forward ones, the forward ones other than matmuls (what selective
    recomputation runs again), and the optimizer update's in all."""
    charged = position >= 0
    ahead = charged & forward
    again = ahead & ~matmul
    return (np.bincount(position[charged], weights=seconds[charged], minlength=n),
            np.bincount(position[ahead], weights=seconds[ahead], minlength=n),
            np.bincount(position[again], weights=seconds[again], minlength=n),
            float(seconds[position == UPDATE].sum()))


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.allclose(a, b, rtol=_CHECK_RTOL, atol=1e-300))


def fit_data_scaling(model: JointModel, option: StageOption) -> DataScaling | None:
    """`option`'s family fitted at `FAMILY_WIDTHS` (module docstring); None when the plan array
    changes between them or a form does not hold (the caller then prices each width in full)."""
    import dataclasses

    widths = FAMILY_WIDTHS
    options = [dataclasses.replace(option, devices=d * option.model, data=d, recompute=Recompute.NONE,
                                   split_state=False) for d in widths]
    plans = [model.plan_for(o) for o in options]
    if any(not np.array_equal(plans[0][0], p) for p, _ in plans[1:]):
        return None
    sgs = [ShardedGraph.build(model.graph, plan, axes) for plan, axes in plans]
    works = [step_arrays(sg, model.cluster, model._mapping(o), cache=model._cache, busy=model.cluster.n_devices)
             for sg, o in zip(sgs, options)]
    runs = [w.instructions for w in works]
    if any(not np.array_equal(r.node, runs[0].node) for r in runs[1:]):
        return None
    node = runs[0].node
    position = model.node_positions()[node]
    forward_node, matmul_node = model._node_kinds()
    forward, matmul = forward_node[node], matmul_node[node]
    compute = np.stack([r.compute_seconds for r in runs])  # [3, I]
    memory = np.stack([r.memory_seconds for r in runs])
    seconds = np.stack([r.seconds for r in runs])
    split = compute[1] < 0.75 * compute[0]
    expected = np.where(split, compute[0] * widths[0] / widths[2], compute[0])
    if not (_close(compute[1], np.where(split, compute[0] / 2, compute[0])) and _close(compute[2], expected)):
        return None
    basis = np.asarray([[1.0 / d, 1.0, float(d)] for d in widths])
    coefficients = np.linalg.solve(basis, memory)  # [3, I]
    launch = seconds - np.maximum(compute, memory)
    if not _close(launch[1], launch[0]) or not _close(launch[2], launch[0]):
        return None
    # gradient, parameter, stash and crossing bytes per position, and where each collective is
    # charged, by the rules the full estimate uses (`JointModel._gathered_work`)
    summed = [model._gathered_work(w.instructions, w.collectives, sg) for w, sg in zip(works, sgs)]
    collectives = _fit_collectives(works, summed[0].collectives)
    if collectives is None:
        return None
    first_sum = summed[0]
    if not all(_close(x.params, first_sum.params) and _close(x.grads, first_sum.grads)
               and np.array_equal(x.buffers, first_sum.buffers) for x in summed[1:]):
        return None
    stash = _one_over_d(widths, [x.stash for x in summed])
    saved = _one_over_d(widths, [x.saved for x in summed])
    values = _one_over_d(widths, [x.values for x in summed])
    if stash is None or values is None or saved is None:
        return None
    return DataScaling(plans[0][0], position, forward, compute[0], split, coefficients, launch[0], collectives,
                       first_sum.grads, first_sum.buffers, first_sum.params, stash, values, matmul,
                       saved)


def _one_over_d(widths: tuple[int, ...], samples: list[np.ndarray]) -> np.ndarray | None:
    """[2, n]: a, b with samples[k] = a / widths[k] + b, from the first two widths, checked at the
    third (None when it does not hold)."""
    d0, d1, d2 = widths
    x0, x1, x2 = samples
    a = (x0 - x1) / (1.0 / d0 - 1.0 / d1)
    b = x0 - a / d0
    return np.stack([a, b]) if _close(a / d2 + b, x2) else None


def _fit_collectives(works: list, positioned: tuple[PositionedCollective, ...],
                     ) -> tuple[tuple[PositionedCollective, int], ...] | None:
    """The non-gradient collectives at the first width (`positioned`, charged where the full
    estimate charges them) with the exponent e of their bytes' d^-e, checked at the other widths
    (None when they differ in kind, place or form)."""
    lists = [[c for c in w.collectives if c.reason is not Reason.GRADIENT_SYNC] for w in works]
    if any(len(x) != len(lists[0]) for x in lists[1:]):
        return None
    out = []
    d0, d1, d2 = FAMILY_WIDTHS
    for c0, c1, c2, at in zip(*lists, positioned):
        if (c0.kind, c0.axes, c0.instruction, c0.count) != (c1.kind, c1.axes, c1.instruction, c1.count) or \
                (c0.kind, c0.axes, c0.instruction, c0.count) != (c2.kind, c2.axes, c2.instruction, c2.count):
            return None
        if c0.nbytes <= 0 or c1.nbytes <= 0:
            e = 0
        else:
            e = round(math.log(c0.nbytes / c1.nbytes) / math.log(d1 / d0))
        for width, c in ((d1, c1), (d2, c2)):
            if not math.isclose(c0.nbytes * (d0 / width) ** e, c.nbytes, rel_tol=_CHECK_RTOL, abs_tol=1e-300):
                return None
        out.append((at, e))
    return tuple(out)
