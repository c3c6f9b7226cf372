"""Mutation fuzzing: damaged HLO must either still parse or raise HloParseError, never another
exception and never hang. Mutations: truncation, deleting a token, swapping a bracket for
another kind, inserting a stray character, deleting or duplicating a line. Each mutant is also
parsed with the regex fast path switched off: both must give the same module or the same error."""

from __future__ import annotations

import re
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlomap.hlo import HloParseError, parse_all
from hlomap.hlo.parser import _parse_all

#: Small and medium corpus files in both styles, so that each example parses in milliseconds.
SOURCES = (
    "jax/control_flow.lowered.hlo",
    "jax/collectives.compiled.hlo",
    "jax/types.compiled.hlo",
    "xla/backends__gpu__tests__pad_to_static.hlo",
    "xla/service__gpu__tests__prefetch.hlo",
    "xla/hlo__translate__hlo_to_mhlo__tests__if_conditional.hlo",
    "xla/backends__gpu__codegen__emitters__tests__scatter__variadic_scatter_argmax.hlo",
    "xla/backends__gpu__codegen__triton__tests__collectives__all_gather.hlo",
)
TOKEN_RE = re.compile(r"[A-Za-z0-9_.\-%]+|\S")
BRACKETS = "(){}[]<>"
STRAY = list(BRACKETS) + ['"', "'", ",", "=", "%", "/*", "//", "\n", "\0", "é", "²", "ROOT ", "ENTRY "]
HANG_SECONDS = 20


@pytest.fixture(scope="module")
def texts(corpus_dir: Path) -> list[str]:
    return [(corpus_dir / "hlo" / name).read_text() for name in SOURCES]


@contextmanager
def no_hang(seconds: int) -> Iterator[None]:
    """Fails (instead of blocking the suite) if the body runs longer than `seconds`."""

    def on_alarm(signum, frame):  # noqa: ARG001
        raise TimeoutError(f"parser still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def mutate(text: str, kind: str, a: int, b: int, stray: str) -> str:
    tokens = list(TOKEN_RE.finditer(text))
    if kind == "truncate":
        return text[: a % (len(text) + 1)]
    if kind == "delete_token":
        if not tokens:
            return text
        token = tokens[a % len(tokens)]
        return text[: token.start()] + text[token.end() :]
    if kind == "swap_bracket":
        spots = [m.start() for m in re.finditer(r"[(){}\[\]]", text)]
        if not spots:
            return text
        spot = spots[a % len(spots)]
        return text[:spot] + BRACKETS[b % len(BRACKETS)] + text[spot + 1 :]
    if kind == "insert":
        spot = a % (len(text) + 1)
        return text[:spot] + stray + text[spot:]
    lines = text.split("\n")
    line = a % len(lines)
    if kind == "delete_line":
        return "\n".join(lines[:line] + lines[line + 1 :])
    return "\n".join(lines[: line + 1] + [lines[line]] + lines[line + 1 :])  # duplicate_line


def outcome(text: str, *, fast: bool) -> object:
    """The modules, or (line, column, expected) of the HloParseError; anything else propagates."""
    with no_hang(HANG_SECONDS):
        try:
            return _parse_all(text, "mutant.hlo", fast=fast)
        except HloParseError as error:
            assert error.filename == "mutant.hlo"
            assert error.line >= 1 and error.column >= 1
            assert str(error).startswith(f"mutant.hlo:{error.line}:{error.column}: expected ")
            return (error.line, error.column, error.expected)


def check(text: str) -> None:
    assert outcome(text, fast=True) == outcome(text, fast=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    source=st.integers(0, len(SOURCES) - 1),
    kinds=st.lists(
        st.sampled_from(["truncate", "delete_token", "swap_bracket", "insert", "delete_line",
                         "duplicate_line"]),
        min_size=1, max_size=3,
    ),
    a=st.integers(0, 10**6),
    b=st.integers(0, 10**6),
    stray=st.sampled_from(STRAY),
)
def test_mutants_parse_or_raise_hlo_parse_error(texts, source, kinds, a, b, stray) -> None:
    text = texts[source]
    for i, kind in enumerate(kinds):
        text = mutate(text, kind, a + 7919 * i, b + i, stray)
    check(text)


@pytest.mark.parametrize(
    "text",
    [
        "ENTRY e {\n  ROOT a = " + "(" * 5000 + "f32[]" + ")" * 5000 + " parameter(0)\n}\n",
        "ENTRY e {\n  ROOT a = f32[] constant(" + "{" * 20000 + ")\n}\n",
        "ENTRY e {\n  ROOT a = f32[] negate(b), k=" + "[" * 20000 + "\n}\n",
        "ENTRY e {\n  ROOT a = f32[] parameter(0), backend_config=\"" + "\\\"" * 20000 + "\n}\n",
        "ENTRY e {\n" + "  a = f32[] parameter(0), x={" * 3000 + "\n}\n",
        "HloModule m\n" + "/*" * 10000,
        "ENTRY e {\n  ROOT a = f32[" + "1," * 50000 + "] parameter(0)\n}\n",
        "ENTRY e {\n  ROOT a = f32[] parameter(²)\n}\n",
        "ENTRY e {\n  t = (f32[]) parameter(0)\n  ROOT g = get-tuple-element(t), index=²\n}\n",
    ],
    ids=["deep-tuple", "deep-literal", "open-brackets", "escaped-quotes", "many-open-braces",
         "open-comments", "many-dims", "unicode-digit-parameter", "unicode-digit-index"],
)
def test_hostile_inputs(text: str) -> None:
    check(text)


def test_mutation_helpers_change_the_text(texts) -> None:
    """Guards the fuzz test itself: every mutation kind must actually damage the text."""
    text = texts[0]
    for kind in ["truncate", "delete_token", "swap_bracket", "insert", "delete_line", "duplicate_line"]:
        assert mutate(text, kind, 12345, 3, "(") != text, kind
    with pytest.raises(HloParseError):
        parse_all(mutate(text, "truncate", len(text) // 2, 0, ""))
