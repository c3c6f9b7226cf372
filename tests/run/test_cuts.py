"""HLO cuts -> loss equations on every zoo family, and the stage programs they make."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.extend import core as jcore

from hlomap.plan import PipelineCut
from hlomap.run.pipeline.cuts import assign_stages
from hlomap.run.pipeline.loss_split import split_loss
from hlomap.run.trace import trace_step
from tests.run.helpers import FAST_COMPILE, boundary_pivots

FAMILIES = ["gpt-tiny", "bert-tiny", "t5-tiny", "vgg19-tiny", "resnet50-tiny", "moe-tiny", "haiku-mlp"]
SLOW = {"resnet50-tiny", "moe-tiny", "vgg19-tiny", "bert-tiny"}  # the default run keeps three families


def _records(chain, pivots):
    return [PipelineCut(chain.pivots[k].instruction, chain.pivots[k].layer, chain.pivots[k].scope,
                      chain.pivots[k].source, k) for k in pivots]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in FAMILIES])
def test_cuts_map_to_equations_and_stages_compute_the_loss(name: str, zoo_case) -> None:
    case = zoo_case(name)
    traced = trace_step(case.model.train_step(), case.args, [p.path for p in case.cap.parameters])
    # Every candidate pivot at once: each maps, and most find their own equation.
    everything = assign_stages(case.cap, traced, _records(case.chain, range(len(case.chain.pivots))))
    exact = sum(c.exact for c in everything.cuts)
    assert exact >= 0.6 * len(everything.cuts), [c.note for c in everything.cuts if not c.exact][:5]
    assert everything.matched >= 0.8 * everything.on_loss
    for cut in everything.cuts:  # a snapped cut says why
        assert cut.exact or cut.note
    # Cuts between layers are exact, keep the plan's parameters per stage, and the stage
    # programs chained together compute the loss.
    pivots = boundary_pivots(case.chain, 2)
    assignment = assign_stages(case.cap, traced, _records(case.chain, pivots))
    assert all(c.exact for c in assignment.cuts), [c.note for c in assignment.cuts]
    assert not assignment.notes
    assert [c.cut.layer for c in assignment.cuts] == [case.chain.pivots[k].layer for k in pivots]
    split = split_loss(traced, assignment.stage_of_eqn, 3)
    assert all(stage.own for stage in split.stages)
    flat = jax.tree.leaves(case.args)
    values = [flat[item.leaf] if item.leaf is not None else item.value for item in traced.loss_inputs]

    def both(values):
        received: tuple = ()
        for stage in split.stages:
            received, _, loss = stage.run([values[p] for p in stage.params], [values[p] for p in stage.state],
                                          [values[p] for p in stage.data], received)
        return loss, jcore.jaxpr_as_fun(traced.loss)(*values)[0]

    loss, expected = jax.jit(both, compiler_options=FAST_COMPILE)(values)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(expected), rtol=1e-6)
    # Only values that depend on parameters cross a cut.
    for stage in split.stages[1:]:
        assert stage.receives


def test_t5_encoder_output_crosses_two_cuts(zoo_case) -> None:
    """A cut inside the decoder: the encoder output is read by every decoder layer, so it passes
    through the stage between (received and sent on)."""
    case = zoo_case("t5-tiny")
    traced = trace_step(case.model.train_step(), case.args, [p.path for p in case.cap.parameters])
    decoder = [k for k, p in enumerate(case.chain.pivots) if p.scope.startswith("decoder/layers_1")]
    encoder_end = max(k for k, p in enumerate(case.chain.pivots) if p.scope.startswith("encoder"))
    assignment = assign_stages(case.cap, traced, _records(case.chain, [encoder_end, decoder[0]]))
    split = split_loss(traced, assignment.stage_of_eqn, 3)
    passed = set(split.stages[1].receives) & set(split.stages[1].sends)
    assert any(v.aval.shape == (8, 32, 64) for v in passed), "the encoder output does not pass through stage 1"
