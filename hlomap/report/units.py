"""Numbers as people read them: bytes in binary units, seconds, FLOPs, counts. The one copy of
each; every table and message of hlomap formats through these."""

from __future__ import annotations

__all__ = ["counted", "human_bytes", "human_count", "human_flops", "human_seconds"]


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.2f} {unit}"
    return f"{s * 1e9:.0f} ns"


def human_flops(f: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(f) >= scale:
            return f"{f / scale:.2f} {unit}"
    return f"{f:.0f} FLOP"


def human_count(n: float) -> str:
    """`1.23 G`: a count with a decimal prefix."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def counted(n: int, noun: str) -> str:
    """`1 stage`, `4 stages`, `1 microbatch`, `2 microbatches`: a whole count with its noun in
    the number it takes (a regular English plural)."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "ch", "sh", "x")) else f"{n} {noun}s"
