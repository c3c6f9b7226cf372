"""Times hlomap's HLO text parser against XLA's C++ parser on the same text.

    python scripts/bench_parse.py [--repeat N] [--zoo NAME ...] [--file PATH ...]

Default inputs: zoo:gpt-base and zoo:t5-11b train steps (lowered HLO, when hlomap.zoo is
available) and the largest file of the shared corpus. For each it prints the instruction count,
the best-of-N wall time of `hlomap.hlo.parse_all` and of `jaxlib._hlo.hlo_module_from_text`, and
their ratio (the goal is a ratio within 10). XLA's figure includes building its C++ module and
the verifier checks its parser runs; hlomap's includes building the frozen IR with locations.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Callable

from hlomap.hlo import parse_all

DEFAULT_ZOO = ("gpt-base", "t5-11b")
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "hlo"


def best_time(run: Callable[[], object], repeat: int) -> float:
    """Best wall time of `repeat` runs, with the garbage collector paused (as timeit does)."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
    return best


def inputs(zoo_names: list[str], files: list[str]) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if zoo_names:
        try:
            from hlomap import zoo
        except ImportError as error:
            print(f"(hlomap.zoo unavailable: {error}; zoo entries skipped)")
        else:
            for name in zoo_names:
                start = time.perf_counter()
                text = zoo.get(name).hlo_text()
                print(f"(lowered zoo:{name} in {time.perf_counter() - start:.1f} s)")
                found.append((f"zoo:{name}", text))
    paths = [Path(f) for f in files]
    if not files and CORPUS.is_dir():
        paths = [max(CORPUS.glob("*/*.hlo"), key=lambda p: p.stat().st_size)]
    for path in paths:
        found.append((f"corpus:{path.name}" if CORPUS in path.parents else str(path), path.read_text()))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per parser (best is kept)")
    parser.add_argument("--zoo", nargs="*", default=list(DEFAULT_ZOO), help="zoo entries")
    parser.add_argument("--file", nargs="*", default=[], help="HLO text files (default: largest corpus file)")
    args = parser.parse_args()

    from jaxlib import _hlo

    rows = []
    for label, text in inputs(args.zoo, args.file):
        modules = parse_all(text, label)
        count = sum(m.instruction_count for m in modules)
        ours = best_time(lambda: parse_all(text, label), args.repeat)
        theirs = best_time(lambda: _hlo.hlo_module_from_text(text), args.repeat)
        rows.append((label, len(text), count, ours, theirs))

    header = f"{'input':<58} {'chars':>9} {'instrs':>7} {'ours ms':>9} {'XLA ms':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for label, chars, count, ours, theirs in rows:
        print(f"{label[:58]:<58} {chars:>9} {count:>7} {ours * 1e3:>9.1f} {theirs * 1e3:>9.1f} "
              f"{ours / theirs:>6.2f}")


if __name__ == "__main__":
    main()
