"""Parser for HLO text as XLA prints it (`HloModule::ToString`, JAX's `as_text(dialect="hlo")`,
compiled dumps, hand-written test files).

Grammar (whitespace, `// ...` and `/* ... */` comments may appear between any two tokens):

    file        ::= split ('// -----' split)*          one module per split
    split       ::= header? tables? computation+ tables?
    header      ::= 'HloModule' name (',' attribute)*
    tables      ::= 'FileNames' ... 'FunctionNames' ... 'FileLocations' ... 'StackFrames' ...
    computation ::= 'ENTRY'? name signature? '{' instruction+ '}' (',' attribute)*
    signature   ::= '(' (name ':' shape (',' name ':' shape)*)? ')' '->' shape
    instruction ::= 'ROOT'? name '=' shape? opcode '(' operands ')' (',' attribute)*
    operands    ::= (shape? name (',' shape? name)*)?   | literal (constant) | int (parameter)
    attribute   ::= key '=' value                       value kept verbatim (balanced brackets)

Names take an optional `%` sigil (classic style) or none (JAX style). Attribute values are kept
verbatim, except those naming computations or instructions (`to_apply`, `calls`, ...,
`control-predecessors`), which are stored without sigils so that both styles parse to equal
modules. Conventions shared with XLA's parser: without an ENTRY marker the last computation is
the entry; a file without a header is named `module_<entry>`; a computation without ROOT has its
last instruction marked ROOT; a result shape may be omitted where it can be inferred (tuple,
get-tuple-element, elementwise ops: the opcode table, `hlomap.hlo.opcodes`, says how; XLA infers a
few more). The stack-frame tables may also
follow the computations (XLA only reads them after the header, where the printer puts them).

Design, for speed: most instructions sit on one line in one of a few shapes, so each is first
tried against one compiled regular expression (the *fast path*) that captures name, shape text,
opcode, operands and the attributes on that line. Shapes are parsed once per distinct shape text
and cached. Anything the fast path does not accept (typed operands, comments inside, attributes
continued on the next line, multi-line JSON, omitted shapes, errors) goes through the general
recursive-descent *slow path*, which also produces every error message. The fast path only
accepts what the slow path would parse to the same result; the test suite checks that on every
corpus file.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from os import PathLike
from pathlib import Path
from typing import NoReturn

from hlomap.hlo.ir import (
    CALLED_COMPUTATION_KEYS,
    ELEMENT_BITS,
    NAME_PATTERN,
    NAME_VALUED_KEYS,
    ArrayShape,
    Computation,
    Instruction,
    Module,
    Shape,
    SourceLocation,
    TupleShape,
    _name_list,
    canonical_names,
    shape_at,
)
from hlomap.hlo.opcodes import OPCODES, InferredShape

__all__ = ["HloParseError", "parse", "parse_all", "parse_file", "split_modules"]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _operand_column(line: str, operand: str, default: int) -> int:
    """The 1-based column of `operand` in an instruction's operand list on `line` (after the first
    `(`, as a whole name, `%` or not), so that a caret points at it; `default` when not found."""
    found = re.search(r"[(,]\s*%?(" + re.escape(operand) + r")\s*[,)]", line[line.find("("):]) if "(" in line else None
    return line.find("(") + found.start(1) + 1 if found else default


class HloParseError(ValueError):
    """Malformed HLO text. Names the file, 1-based line and column, what was expected there and
    what was found; `str()` adds the offending source line and a caret under the column."""

    def __init__(
        self,
        filename: str,
        line: int,
        column: int,
        expected: str,
        found: str,
        source_line: str = "",
    ) -> None:
        self.filename = filename
        self.line = line
        self.column = column
        self.expected = expected
        self.found = found
        self.source_line = source_line
        message = f"{filename}:{line}:{column}: expected {expected}, found {found}"
        if source_line:
            # Tabs are kept so that the caret lines up under the same character in a terminal.
            pad = "".join("\t" if ch == "\t" else " " for ch in source_line[: column - 1])
            message += f"\n{source_line}\n{pad}^"
        super().__init__(message)

    def __reduce__(self):  # keeps the error picklable (multiprocessing, pytest-xdist)
        return (
            HloParseError,
            (self.filename, self.line, self.column, self.expected, self.found, self.source_line),
        )


# ---------------------------------------------------------------------------------------------
# Lexical patterns
# ---------------------------------------------------------------------------------------------

#: XLA's identifier (hlo_lexer.cc), shared with the IR's name-valued attributes.
_NAME = NAME_PATTERN
_NAME_RE = re.compile(r"%?(" + _NAME + r")")
_ATTR_KEY_RE = re.compile(_NAME)
_OPCODE_RE = re.compile(r"[a-z][a-z0-9\-]*")
_DTYPE_RE = re.compile(r"[a-z][a-z0-9]*")
_KEYWORD_END = r"(?![A-Za-z0-9_.\-])"
_ROOT_RE = re.compile(r"ROOT" + _KEYWORD_END)
_ENTRY_RE = re.compile(r"ENTRY" + _KEYWORD_END)
_HLOMODULE_RE = re.compile(r"HloModule" + _KEYWORD_END)
_FILENAMES_RE = re.compile(r"FileNames" + _KEYWORD_END)

#: Whitespace and comments, which XLA's lexer skips between any two tokens. An unterminated
#: `/*` is not matched, so it surfaces as an error at the comment's start.
_WS_RE = re.compile(r"(?:[ \t\r\n]+|//[^\n]*|/\*.*?\*/)*", re.S)

#: A run of characters that cannot open or close a group, a string, or end a value.
_BARE_RUN_RE = re.compile(r"""[^\s,{}()\[\]"']+""")
_STRING_RES = {
    '"': re.compile(r'"(?:[^"\\]|\\.)*"', re.S),
    "'": re.compile(r"'(?:[^'\\]|\\.)*'", re.S),
}
#: Inside a group only its own bracket kind nests (plus strings): a JSON dict in braces may
#: hold any brackets, and XLA's layouts `{1,0:T(8,128)}` hold parentheses.
_GROUP_SCAN = {
    "{": ("}", re.compile(r"""[{}"']""")),
    "[": ("]", re.compile(r"""[\[\]"']""")),
    "(": (")", re.compile(r"""[()"']""")),
}

_TABLE_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_TABLE_ENTRY_RE = re.compile(r"[ \t]*[0-9]+[ \t]+\S")
_SPLIT_RE = re.compile(r"^// -----[ \t]*\r?$", re.M)
_DIGITS_RE = re.compile(r"[0-9]+")
#: Bounds the recursion of the shape parser; real modules nest tuples a few levels deep.
_MAX_TUPLE_DEPTH = 100
_TOKEN_RE = re.compile(r"[A-Za-z0-9_.\-%]+|\S")

# -- the fast path ----------------------------------------------------------------------------
# Every repetition below is possessive (`*+`, `++`) and each alternation starts with distinct
# characters, so matching is linear and a value has exactly one decomposition; in particular the
# attribute list matched as a whole splits the same way under `findall`.

_STR_FAST = r'"(?:[^"\\\n]++|\\.)*+"'
_BRACED_FAST = r"\{(?:[^{}\"'\n]++|" + _STR_FAST + r")*+\}"
for _ in range(3):  # four levels of nested braces cover metadata, sharding and JSON configs
    _BRACED_FAST = r"\{(?:[^{}\"'\n]++|" + _STR_FAST + "|" + _BRACED_FAST + r")*+\}"
_BARE_FAST = r"""(?:[^\s,{}()\[\]"']++|\[[^\[\]"'\n]*+\]|\([^()"'\n]*+\))++"""
_VALUE_FAST = r"(?>" + _STR_FAST + "|" + _BRACED_FAST + "|" + _BARE_FAST + ")"
_ATTR_FAST = r",[ \t]*(" + _NAME + r")=(" + _VALUE_FAST + ")"
_ATTR_FAST_NOCAPTURE = r",[ \t]*" + _NAME + r"=" + _VALUE_FAST
_ARRAY_SHAPE_FAST = r"[a-z][a-z0-9]*\[[^\[\]\n]*\](?:\{[^{}\n]*\})?"
_TUPLE_SHAPE_FAST = r"\((?:[^()\n]++|\((?:[^()\n]++|\([^()\n]*+\))*+\))*+\)"
_INDEX_COMMENT = r"/\*index=[0-9]+\*/"
_OPERAND_FAST = r"(?:" + _INDEX_COMMENT + r")?%?" + _NAME + r"[ \t]*"
_FAST_RE = re.compile(
    r"(ROOT[ \t]+)?%?(" + _NAME + r")[ \t]*=[ \t]*"
    r"(" + _ARRAY_SHAPE_FAST + "|" + _TUPLE_SHAPE_FAST + r")[ \t]+"
    r"([a-z][a-z0-9\-]*)"
    r"(?:\([ \t]*(" + _OPERAND_FAST + r"(?:,[ \t]*" + _OPERAND_FAST + r")*+|)\)"
    r"|\(([^()\"'\n/\[\]]*)\))"
    r"((?:" + _ATTR_FAST_NOCAPTURE + r")*+)"
    r"(?=[ \t]*(?:[\r\n,}]|//|/\*|\Z))"
)
_ATTR_FAST_RE = re.compile(_ATTR_FAST)
_SHAPE_FAST_RE = re.compile(_ARRAY_SHAPE_FAST + "|" + _TUPLE_SHAPE_FAST)
_INDEX_COMMENT_RE = re.compile(_INDEX_COMMENT)


def _canonical_attributes(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, canonical_names(v)) if k in NAME_VALUED_KEYS else (k, v) for k, v in pairs]


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def parse(text: str, filename: str | None = None) -> Module:
    """Parses text holding exactly one HLO module (with or without a `HloModule` header).

    Raises HloParseError on malformed text, or when the text holds several modules separated by
    `// -----` lines (use `parse_all` for those).
    """
    name = filename or "<string>"
    spans = [(start, end) for start, end in split_modules(text) if not _is_blank(text, start, end)]
    if len(spans) > 1:
        second = spans[1][0]
        line = text.count("\n", 0, second)  # the separator line, just above the second split
        raise HloParseError(
            name, line, 1, "a single module (use parse_all for several)",
            f"{len(spans)} modules separated by '// -----' lines",
            text.splitlines()[line - 1] if line >= 1 else "",
        )
    return _parse_all(text, name, fast=True)[0]


def parse_all(text: str, filename: str | None = None) -> list[Module]:
    """Parses every module of a file whose modules are separated by lines `// -----`.

    Splits holding only whitespace and comments are skipped; a text with no module at all is an
    error.
    """
    return _parse_all(text, filename or "<string>", fast=True)


def parse_file(path: str | PathLike[str]) -> list[Module]:
    """Reads and parses an HLO text file; see `parse_all`."""
    path = Path(path)
    return parse_all(path.read_text(encoding="utf-8"), filename=str(path))


def split_modules(text: str) -> list[tuple[int, int]]:
    """(start, end) offsets of the `// -----`-separated splits of `text` (one split if none)."""
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _SPLIT_RE.finditer(text):
        spans.append((start, match.start()))
        start = match.end() + 1 if match.end() < len(text) else match.end()
    spans.append((start, len(text)))
    return spans


def _is_blank(text: str, start: int, end: int) -> bool:
    """True when text[start:end] holds only whitespace and comments."""
    return _WS_RE.match(text, start, end).end() == end


def _parse_all(text: str, filename: str, *, fast: bool) -> list[Module]:
    """Parses every split; `fast=False` disables the fast path (tests compare both)."""
    if "\0" in text:
        _Parser(text, filename, 0, fast).error(text.index("\0"), "HLO text", "a NUL character")
    modules: list[Module] = []
    for start, end in split_modules(text):
        if _is_blank(text, start, end):
            log.debug("%s: skipping a split that holds only comments", filename)
            continue
        parser = _Parser(text[start:end], filename, text.count("\n", 0, start), fast)
        modules.append(parser.parse_module())
    if not modules:
        _Parser(text, filename, 0, fast).error(
            len(text), "an HLO module ('HloModule name' or a computation)", "end of input"
        )
    return modules


# ---------------------------------------------------------------------------------------------
# The parser proper (an imperative shell over one split of the text)
# ---------------------------------------------------------------------------------------------


class _Parser:
    """Parses one split. Positions are offsets into `self.text` (the split); line numbers
    add `line_offset` so that they point into the whole file."""

    def __init__(self, text: str, filename: str, line_offset: int, fast: bool) -> None:
        self.text = text
        self.filename = filename
        self.line_offset = line_offset
        self.fast = fast
        self.shape_cache: dict[str, Shape] = {}
        # Monotone line counter for locations: instructions are visited in text order.
        self._line_pos = 0
        self._line_no = 1

    # -- positions and errors ----------------------------------------------------------------

    def location(self, pos: int) -> SourceLocation:
        text = self.text
        if pos >= self._line_pos:
            self._line_no += text.count("\n", self._line_pos, pos)
        else:
            self._line_no = text.count("\n", 0, pos) + 1
        self._line_pos = pos
        column = pos - text.rfind("\n", 0, pos)
        return SourceLocation(self.filename, self._line_no + self.line_offset, column)

    def error(self, pos: int, expected: str, found: str | None = None) -> NoReturn:
        text = self.text
        pos = min(max(pos, 0), len(text))
        line = text.count("\n", 0, pos) + 1
        line_start = text.rfind("\n", 0, pos) + 1
        line_end = text.find("\n", pos)
        source_line = text[line_start : line_end if line_end >= 0 else len(text)].rstrip("\r")
        if found is None:
            found = self.describe(pos)
        raise HloParseError(
            self.filename, line + self.line_offset, pos - line_start + 1, expected, found,
            source_line,
        )

    def describe(self, pos: int) -> str:
        """What sits at `pos`, for "found ..." in error messages."""
        text = self.text
        if pos >= len(text):
            return "end of input"
        match = _TOKEN_RE.match(text, pos)
        if match is None:
            return "whitespace"
        token = match.group()
        if len(token) > 40:
            token = token[:37] + "..."
        return repr(token)

    def skip_ws(self, pos: int) -> int:
        return _WS_RE.match(self.text, pos).end()

    def expect(self, pos: int, char: str, expected: str) -> int:
        if self.text.startswith(char, pos):
            return pos + 1
        self.error(pos, expected)

    def name(self, pos: int, what: str) -> tuple[str, int]:
        match = _NAME_RE.match(self.text, pos)
        if match is None:
            self.error(pos, what)
        return match.group(1), match.end()

    # -- module --------------------------------------------------------------------------------

    def parse_module(self) -> Module:
        text = self.text
        end = len(text)
        pos = self.skip_ws(0)
        module_pos = pos
        name: str | None = None
        attributes: list[tuple[str, str]] = []
        if _HLOMODULE_RE.match(text, pos):
            pos = self.skip_ws(pos + len("HloModule"))
            name, pos = self.name(pos, "a module name after 'HloModule'")
            attributes, pos = self.attributes(pos)
        trailer = ""
        pos = self.skip_ws(pos)
        if _FILENAMES_RE.match(text, pos):
            trailer, pos = self.tables(pos)
        computations: list[Computation] = []
        entry_name: str | None = None
        seen: dict[str, SourceLocation] = {}
        while True:
            pos = self.skip_ws(pos)
            if pos >= end:
                break
            if _FILENAMES_RE.match(text, pos):
                if trailer:
                    self.error(pos, "a single stack-frame table", "a second 'FileNames' table")
                # XLA reads the tables only after the header; hlomap accepts them at the end too
                # and prints them where XLA expects them.
                log.debug("%s: stack-frame tables after the computations", self.filename)
                trailer, pos = self.tables(pos)
                continue
            if _HLOMODULE_RE.match(text, pos):
                self.error(
                    pos, "a computation (separate modules with a line '// -----')",
                    "a second 'HloModule' header",
                )
            start = pos
            is_entry, computation, pos = self.computation(pos)
            if computation.name in seen:
                self.error(
                    start, f"a new computation name ('{computation.name}' is already defined "
                    f"at {seen[computation.name]})", repr(computation.name),
                )
            seen[computation.name] = computation.location
            if is_entry:
                if entry_name is not None:
                    self.error(start, "only one ENTRY computation", "a second ENTRY")
                entry_name = computation.name
            computations.append(computation)
        if not computations:
            self.error(pos, "a computation")
        if entry_name is None:
            # XLA's rule: without an ENTRY marker the last computation is the entry.
            entry_name = computations[-1].name
        if name is None:
            name = f"module_{entry_name}"  # what XLA names a module parsed without a header
        module = Module(
            name=name,
            computations=tuple(computations),
            entry_name=entry_name,
            attributes=tuple(attributes),
            trailer=trailer,
            location=self.location(module_pos) if module_pos < end else None,
        )
        self.check_calls(module)
        return module

    def check_calls(self, module: Module) -> None:
        """Every called computation must exist (XLA rejects the module otherwise)."""
        names = module.by_name
        for computation in module.computations:
            for inst in computation.instructions:
                if not inst.attributes:
                    continue
                for key, value in inst.attributes:
                    if key not in CALLED_COMPUTATION_KEYS:
                        continue
                    for callee in _name_list(value):
                        if callee not in names:
                            loc = inst.location
                            raise HloParseError(
                                self.filename, loc.line, loc.column,
                                f"a computation of this module in {key}= of instruction "
                                f"'{inst.name}'", repr(callee),
                                self._source_line(loc.line),
                            )

    def _source_line(self, line: int) -> str:
        lines = self.text.split("\n")
        index = line - self.line_offset - 1
        return lines[index].rstrip("\r") if 0 <= index < len(lines) else ""

    def tables(self, pos: int) -> tuple[str, int]:
        """JAX's FileNames/FunctionNames/FileLocations/StackFrames tables, kept verbatim."""
        text = self.text
        start = pos
        sections: list[str] = []
        line_start = pos
        last_content_end = pos
        while line_start < len(text):
            line_end = text.find("\n", line_start)
            if line_end < 0:
                line_end = len(text)
            line = text[line_start:line_end]
            stripped = line.strip()
            if stripped in _TABLE_SECTIONS:
                expected = _TABLE_SECTIONS[len(sections)] if len(sections) < 4 else None
                if stripped != expected:
                    self.error(
                        line_start + line.index(stripped),
                        f"'{expected}' section" if expected else "no further table section",
                    )
                sections.append(stripped)
            elif stripped and not _TABLE_ENTRY_RE.match(line):
                break
            if stripped:
                last_content_end = line_end
            line_start = line_end + 1
        if len(sections) != len(_TABLE_SECTIONS):
            self.error(last_content_end, f"'{_TABLE_SECTIONS[len(sections)]}' section")
        return text[start:last_content_end].rstrip(), last_content_end

    # -- computation ---------------------------------------------------------------------------

    def computation(self, pos: int) -> tuple[bool, Computation, int]:
        text = self.text
        start = pos
        is_entry = False
        if _ENTRY_RE.match(text, pos):
            is_entry = True
            pos = self.skip_ws(pos + len("ENTRY"))
        if _NAME_RE.match(text, pos) is None:
            self.error(pos, "a computation (a name followed by '{')")
        name, pos = self.name(pos, "a computation name")
        location = self.location(start)
        pos = self.skip_ws(pos)
        if text.startswith("(", pos):
            pos = self.signature(pos)
            pos = self.skip_ws(pos)
        pos = self.expect(pos, "{", f"'{{' to open the body of computation '{name}'")
        instructions, pos = self.body(pos, name)
        attributes, pos = self.attributes(pos + 1)
        instructions = self.finish_computation(name, instructions)
        return (
            is_entry,
            Computation(name, tuple(instructions), location, tuple(attributes)),
            pos,
        )

    def signature(self, pos: int) -> int:
        """`(p0: f32[2], p1: (s32[], f32[])) -> f32[2]`; checked for syntax, not stored (the
        parameters and root carry the same information)."""
        text = self.text
        pos = self.skip_ws(pos + 1)
        if not text.startswith(")", pos):
            while True:
                _, pos = self.name(pos, "a parameter name in the computation signature")
                pos = self.skip_ws(pos)
                pos = self.expect(pos, ":", "':' after the parameter name")
                _, pos = self.cached_shape(self.skip_ws(pos))
                pos = self.skip_ws(pos)
                if text.startswith(",", pos):
                    pos = self.skip_ws(pos + 1)
                    continue
                break
        pos = self.expect(pos, ")", "',' or ')' in the computation signature")
        pos = self.skip_ws(pos)
        if not text.startswith("->", pos):
            self.error(pos, "'->' and the result shape after the parameter list")
        _, pos = self.cached_shape(self.skip_ws(pos + 2))
        return pos

    def body(self, pos: int, computation: str) -> tuple[list[Instruction], int]:
        """Instructions up to the closing brace, and the offset of that brace."""
        text = self.text
        end = len(text)
        ws_match = _WS_RE.match
        fast_match = _FAST_RE.match if self.fast else None
        instructions: list[Instruction] = []
        by_name: dict[str, Instruction] = {}
        while True:
            pos = ws_match(text, pos).end()
            if pos >= end:
                self.error(pos, f"'}}' to close computation '{computation}'")
            if text[pos] == "}":
                break
            start = pos
            inst = None
            if fast_match is not None:
                match = fast_match(text, pos)
                if match is not None:
                    inst = self.fast_instruction(match)
                    if inst is not None:
                        pos = match.end()
            if inst is None:
                inst, pos = self.slow_instruction(pos, by_name)
            # Attributes continued after the line (or after a comment) go the general way.
            after = ws_match(text, pos).end()
            if text.startswith(",", after):
                more, pos = self.attributes(pos)
                inst = replace(inst, attributes=inst.attributes + tuple(more))
            if inst.name in by_name:
                self.error(
                    start, f"a new instruction name ('{inst.name}' is already defined at "
                    f"{by_name[inst.name].location})", repr(inst.name),
                )
            by_name[inst.name] = inst
            instructions.append(inst)
        if not instructions:
            self.error(pos, f"at least one instruction in computation '{computation}'")
        return instructions, pos

    def finish_computation(self, name: str, instructions: list[Instruction]) -> list[Instruction]:
        """Checks operands and ROOT; marks the last instruction ROOT when none is (as XLA)."""
        names = {inst.name for inst in instructions}
        roots = [i for i, inst in enumerate(instructions) if inst.is_root]
        if len(roots) > 1:
            loc = instructions[roots[1]].location
            raise HloParseError(
                self.filename, loc.line, loc.column, f"one ROOT in computation '{name}'",
                "a second ROOT", self._source_line(loc.line),
            )
        for inst in instructions:
            for operand in inst.operands + (inst.control_predecessors if inst.attributes else ()):
                if operand not in names:
                    loc = inst.location
                    text = self._source_line(loc.line)
                    raise HloParseError(
                        self.filename, loc.line, _operand_column(text, operand, loc.column),
                        f"operands of '{inst.name}' to be instructions of computation "
                        f"'{name}'", f"unknown operand {operand!r}", text,
                    )
        if not roots:
            instructions[-1] = replace(instructions[-1], is_root=True)
        return instructions

    # -- instructions --------------------------------------------------------------------------

    def fast_instruction(self, match: re.Match[str]) -> Instruction | None:
        """Builds the instruction a fast-path match describes, or None to use the slow path."""
        root, name, shape_text, opcode, operand_text, payload_text, attr_text = match.groups()
        if root is None and name == "ROOT":
            return None  # `ROOT = ...`: the keyword without a name, which the slow path reports
        shape = self.shape_cache.get(shape_text)
        if shape is None:
            try:
                shape, shape_end = self.shape(match.start(3))
            except HloParseError:
                return None  # the slow path reports the error in its own words
            if shape_end != match.end(3):
                return None
            self.shape_cache[shape_text] = shape
        payload = None
        if opcode == "constant" or opcode == "parameter":
            payload = (operand_text if payload_text is None else payload_text).strip()
            if not payload or (opcode == "parameter" and not _DIGITS_RE.fullmatch(payload)):
                return None
            operands: tuple[str, ...] = ()
        elif operand_text == "":
            operands = ()
        elif operand_text is not None:
            if "/" in operand_text:
                operand_text = _INDEX_COMMENT_RE.sub("", operand_text)
            operands = tuple(
                part.strip().lstrip("%") for part in operand_text.split(",")
            )
        else:
            return None
        if attr_text:
            found = _ATTR_FAST_RE.findall(attr_text)
            for key, _ in found:
                if key in NAME_VALUED_KEYS:
                    found = _canonical_attributes(found)
                    break
            attributes = tuple(found)
        else:
            attributes = ()
        return Instruction(
            name, opcode, shape, operands, attributes, payload, root is not None,
            self.location(match.start()),
        )

    def slow_instruction(
        self, pos: int, by_name: dict[str, Instruction]
    ) -> tuple[Instruction, int]:
        text = self.text
        start = pos
        is_root = False
        if _ROOT_RE.match(text, pos):
            is_root = True
            pos = self.skip_ws(pos + 4)
        name, pos = self.name(pos, "an instruction ('name = shape opcode(operands)') or '}'")
        pos = self.skip_ws(pos)
        pos = self.expect(pos, "=", f"'=' after instruction name '{name}'")
        pos = self.skip_ws(pos)
        shape: Shape | None = None
        shape_pos = pos
        if self.can_be_shape(pos):
            shape, pos = self.shape(pos)
            pos = self.skip_ws(pos)
        match = _OPCODE_RE.match(text, pos)
        if match is None:
            self.error(pos, "an opcode" if shape is not None else "a shape or an opcode")
        opcode = match.group()
        if text.startswith("[", match.end()):
            self.error(pos, "a shape with a known element type, or an opcode")
        pos = self.skip_ws(match.end())
        pos = self.expect(pos, "(", f"'(' after opcode '{opcode}'")
        payload: str | None = None
        operands: list[str] = []
        if opcode == "constant":
            close = self.group_end(pos - 1)
            payload = text[pos : close - 1].strip()
            if not payload:
                self.error(pos, "a literal in constant(...)")
            pos = close
        elif opcode == "parameter":
            pos = self.skip_ws(pos)
            match = _DIGITS_RE.match(text, pos)
            if match is None:
                self.error(pos, "a parameter number")
            payload = match.group()
            pos = self.skip_ws(match.end())
            pos = self.expect(pos, ")", "')' after the parameter number")
        else:
            pos = self.skip_ws(pos)
            if text.startswith(")", pos):
                pos += 1
            else:
                while True:
                    if self.can_be_shape(pos):
                        _, pos = self.cached_shape(pos)  # a typed operand: the type is redundant
                        pos = self.skip_ws(pos)
                    operand, pos = self.name(pos, "an operand name")
                    operands.append(operand)
                    pos = self.skip_ws(pos)
                    if text.startswith(",", pos):
                        pos = self.skip_ws(pos + 1)
                        continue
                    pos = self.expect(pos, ")", "',' or ')' in the operand list")
                    break
        attributes, pos = self.attributes(pos)
        if shape is None:
            shape = self.infer_shape(shape_pos, opcode, operands, attributes, by_name)
        inst = Instruction(
            name, opcode, shape, tuple(operands), tuple(attributes), payload, is_root,
            self.location(start),
        )
        return inst, pos

    def infer_shape(
        self,
        pos: int,
        opcode: str,
        operands: list[str],
        attributes: list[tuple[str, str]],
        by_name: dict[str, Instruction],
    ) -> Shape:
        """The result shape of an instruction printed without one (XLA infers these)."""
        shapes = []
        for operand in operands:
            if operand not in by_name:
                self.error(
                    pos, f"a result shape (it cannot be inferred: operand {operand!r} is not "
                    "defined above)", self.describe(pos),
                )
            shapes.append(by_name[operand].shape)
        info = OPCODES.get(opcode)
        rule = info.inferred_shape if info is not None else None
        if rule is InferredShape.TUPLE_OF_OPERANDS:
            return TupleShape(tuple(shapes))
        if rule is InferredShape.TOKEN:
            return ArrayShape("token")
        if rule is InferredShape.U32_SCALAR:
            return ArrayShape("u32")
        if rule is InferredShape.TUPLE_ELEMENT and len(shapes) == 1:
            index = dict(attributes).get("index", "")
            if _DIGITS_RE.fullmatch(index):
                try:
                    return shape_at(shapes[0], (int(index),))
                except IndexError:
                    pass
        if shapes and isinstance(shapes[0], ArrayShape):
            if rule is InferredShape.SAME_AS_FIRST:
                return shapes[0]
            if rule is InferredShape.PREDICATE_OF_FIRST:
                return replace(shapes[0], dtype="pred")
        if rule is InferredShape.SAME_AS_SECOND and len(shapes) == 3:
            return shapes[1]
        self.error(pos, f"a result shape (hlomap cannot infer it for '{opcode}')")

    def attributes(self, pos: int) -> tuple[list[tuple[str, str]], int]:
        """`(',' key '=' value)*`; returns the pairs and the offset after the last value."""
        text = self.text
        attributes: list[tuple[str, str]] = []
        after = self.skip_ws(pos)
        while text.startswith(",", after):
            key_pos = self.skip_ws(after + 1)
            match = _ATTR_KEY_RE.match(text, key_pos)
            if match is None:
                self.error(key_pos, "an attribute name after ','")
            pos = self.skip_ws(match.end())
            pos = self.expect(pos, "=", f"'=' after attribute name '{match.group()}'")
            pos = self.skip_ws(pos)
            value_end = self.value_end(pos)
            # Newer XLA prints mesh replica groups as `device_ids=([2,4]T(1,0)) {'a'}`: a group
            # after whitespace still belongs to the value (no attribute starts with '{').
            follow = self.skip_ws(value_end)
            while text.startswith("{", follow):
                value_end = self.group_end(follow)
                follow = self.skip_ws(value_end)
            key, value = match.group(), text[pos:value_end]
            if key in NAME_VALUED_KEYS:
                value = canonical_names(value)
            attributes.append((key, value))
            pos = value_end
            after = self.skip_ws(pos)
        return attributes, pos

    def value_end(self, pos: int) -> int:
        """End of an attribute value starting at `pos`: bare text, strings and balanced groups,
        up to whitespace, a comma or an unmatched closing bracket at the top level."""
        text = self.text
        start = pos
        while pos < len(text):
            match = _BARE_RUN_RE.match(text, pos)
            if match is not None:
                pos = match.end()
                continue
            char = text[pos]
            if char in _GROUP_SCAN:
                pos = self.group_end(pos)
            elif char in _STRING_RES:
                pos = self.string_end(pos)
            else:
                break
        if pos == start:
            self.error(pos, "an attribute value")
        return pos

    def group_end(self, pos: int) -> int:
        """Offset just past the bracket matching the one at `pos`."""
        text = self.text
        opener = text[pos]
        closer, scan = _GROUP_SCAN[opener]
        depth = 0
        cursor = pos
        while True:
            match = scan.search(text, cursor)
            if match is None:
                self.error(len(text), f"'{closer}' to close the '{opener}' at {self.location(pos)}")
            char = match.group()
            if char == opener:
                depth += 1
                cursor = match.end()
            elif char == closer:
                depth -= 1
                cursor = match.end()
                if depth == 0:
                    return cursor
            else:
                cursor = self.string_end(match.start())

    def string_end(self, pos: int) -> int:
        match = _STRING_RES[self.text[pos]].match(self.text, pos)
        if match is None:
            self.error(pos, "a closing quote for this string", "an unterminated string")
        return match.end()

    # -- shapes --------------------------------------------------------------------------------

    def can_be_shape(self, pos: int) -> bool:
        """A shape starts with '(' or an element type (reserved words in XLA's lexer)."""
        text = self.text
        if text.startswith("(", pos):
            return True
        match = _DTYPE_RE.match(text, pos)
        return match is not None and match.group() in ELEMENT_BITS and not (
            match.end() < len(text) and (text[match.end()].isalnum() or text[match.end()] in "_.-")
        )

    def cached_shape(self, pos: int) -> tuple[Shape, int]:
        """`shape`, through the cache when the shape's extent is plain (no comments or spaces)."""
        match = _SHAPE_FAST_RE.match(self.text, pos)
        if match is None:
            return self.shape(pos)
        key = match.group()
        shape = self.shape_cache.get(key)
        if shape is not None:
            return shape, match.end()
        shape, end = self.shape(pos)
        if end == match.end():
            self.shape_cache[key] = shape
        return shape, end

    def shape(self, pos: int, depth: int = 0) -> tuple[Shape, int]:
        text = self.text
        if text.startswith("(", pos):
            if depth >= _MAX_TUPLE_DEPTH:
                self.error(pos, f"at most {_MAX_TUPLE_DEPTH} levels of nested tuple shapes")
            elements: list[Shape] = []
            pos = self.skip_ws(pos + 1)
            if text.startswith(")", pos):
                return TupleShape(()), pos + 1
            while True:
                element, pos = self.shape(pos, depth + 1)
                elements.append(element)
                pos = self.skip_ws(pos)
                if text.startswith(",", pos):
                    pos = self.skip_ws(pos + 1)
                    continue
                pos = self.expect(pos, ")", "',' or ')' in a tuple shape")
                return TupleShape(tuple(elements)), pos
        match = _DTYPE_RE.match(text, pos)
        if match is None or match.group() not in ELEMENT_BITS:
            self.error(pos, "a shape (an element type such as f32[2,3], or a '(' tuple)")
        dtype = match.group()
        pos = self.skip_ws(match.end())
        pos = self.expect(pos, "[", f"'[' after element type '{dtype}'")
        dims: list[int] = []
        dynamic: list[bool] = []
        pos = self.skip_ws(pos)
        if not text.startswith("]", pos):
            while True:
                is_dynamic = False
                if text.startswith("<=", pos):
                    is_dynamic = True
                    pos = self.skip_ws(pos + 2)
                if text.startswith("?", pos):
                    dims.append(-1)
                    dynamic.append(True)
                    pos += 1
                else:
                    number = _DIGITS_RE.match(text, pos)
                    if number is None:
                        self.error(pos, "a dimension size")
                    dims.append(int(number.group()))
                    dynamic.append(is_dynamic)
                    pos = number.end()
                pos = self.skip_ws(pos)
                if text.startswith(",", pos):
                    pos = self.skip_ws(pos + 1)
                    continue
                break
        pos = self.expect(pos, "]", "',' or ']' in the dimensions")
        layout: str | None = None
        brace = self.skip_ws(pos)
        if text.startswith("{", brace):
            inside = self.skip_ws(brace + 1)
            if inside < len(text) and text[inside] in "0123456789:}":
                close = text.find("}", brace)
                bad = text.find("{", brace + 1, close if close >= 0 else len(text))
                if close < 0 or bad >= 0:
                    self.error(close if close < 0 else bad, "'}' to close the layout")
                layout = text[brace + 1 : close]
                pos = close + 1
        return ArrayShape(dtype, tuple(dims), tuple(dynamic) if any(dynamic) else (), layout), pos

