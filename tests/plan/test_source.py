"""A plan recognises the module it was made for by structure: the same step as an HLO text dump
and lowered from JAX is one module; a truly different one is refused saying what differs; plans
written before the structure was recorded are still recognised by their text fingerprint."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from hlomap.hlo.capture import capture, from_module
from hlomap.hlo.fingerprint import structure_fingerprint
from hlomap.hlo.parser import parse
from hlomap.plan import Plan, PlanSource

PLANS = Path(__file__).resolve().parents[1] / "data" / "plans"


def _step(params: dict[str, jax.Array], batch: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(batch @ params["w"]) @ params["v"])


def _capture(width: int) -> object:
    params = {"w": jax.ShapeDtypeStruct((64, width), jnp.float32), "v": jax.ShapeDtypeStruct((width, 8), jnp.float32)}
    return capture(_step, params, jax.ShapeDtypeStruct((16, 64), jnp.float32))


def test_a_dumped_module_and_the_lowered_step_are_the_same_module() -> None:
    lowered = _capture(128)
    dumped = from_module(parse(str(lowered.module)), source="tiny.hlo")  # what `hlomap zoo dump` writes
    assert dumped.text_sha256 != lowered.text_sha256  # the texts differ (names, formatting)...
    assert dumped.structure_sha256 == lowered.structure_sha256  # ...the module does not
    plan = Plan.from_specs(dumped, [None] * len(dumped.parameters), mesh={"model": 2})
    plan.check_compatible(lowered)  # no error
    assert Plan.from_json(plan.to_json()).source == plan.source


def test_renaming_instructions_and_dropping_metadata_keep_the_fingerprint() -> None:
    module = _capture(128).module
    text = str(module)
    renamed = re.sub(r"%([A-Za-z_][A-Za-z0-9_.\-]*)", r"%x_\1", text)
    renamed = re.sub(r", metadata=\{[^}]*\}", "", renamed).replace(f"HloModule {module.name}", "HloModule other")
    assert renamed != text and "metadata" not in renamed.split("\n\n")[0]
    other = parse(renamed)
    assert other.name == "other" and other.entry_name != module.entry_name
    assert structure_fingerprint(other) == structure_fingerprint(module)


def test_another_module_is_refused_saying_what_differs() -> None:
    narrow, wide = _capture(128), _capture(256)
    assert narrow.structure_sha256 != wide.structure_sha256
    plan = Plan.from_specs(narrow, (None, None), mesh={"model": 2})
    with pytest.raises(ValueError, match=r"made for another module.*parameter \d: f32\[64,128\] vs f32\[64,256\]"):
        plan.check_compatible(wide, where="t.json")


def test_a_plan_file_written_before_structure_fingerprints_is_still_recognised() -> None:
    from hlomap.api import load_source

    old = Plan.load(PLANS / "spmd_v1.json")
    assert old.source.fingerprint == "" and old.source.signature is None
    old.check_compatible(load_source("zoo:gpt-tiny"))  # its text fingerprint still matches
    with pytest.raises(ValueError, match=r"made for another module.*HLO text sha256 858508a0a54d"):
        old.check_compatible(_capture(128))


def test_plan_source_of_a_capture_records_its_signature() -> None:
    cap = _capture(128)
    source = PlanSource.of(cap)
    assert source.signature is not None
    assert source.signature.entry_parameters == ("f32[128,8]", "f32[64,128]", "f32[16,64]")  # v, w, batch
    assert source.signature.instructions == cap.module.instruction_count
    assert PlanSource.from_json(source.to_json()) == source
