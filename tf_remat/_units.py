"""Parsing and printing byte sizes (no TensorFlow, no numpy)."""

import re

__all__ = ["parse_budget", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_budget(text, no_remat_peak=None):
    """Turn ``"12884901888"``, ``"12GB"``, ``"11.3GiB"`` or ``"0.8"`` into bytes.

    A bare number of at most 1.5 is a fraction of ``no_remat_peak``; larger bare numbers are
    bytes. Units: B, kB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB and K/M/G (powers of 2).

    >>> parse_budget("1.5KiB")
    1536
    >>> parse_budget("0.5", no_remat_peak=1000)
    500
    """
    if isinstance(text, (int, float)):
        text = repr(text)
    match = _BUDGET_RE.match(str(text))
    if not match and _BUDGET_RE.match(str(text).strip().lstrip("-")):
        raise ValueError(f"budget {text!r} is negative: a budget is a positive size")
    if not match:
        raise ValueError(
            f"budget {text!r} is not a number: give bytes (12884901888), a size with a unit "
            "(12GB, 11.3GiB) or a fraction of the no-rematerialization peak (0.8)")
    value, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"budget {text!r} has unknown unit {match.group(2)!r}; "
                         f"use one of B, kB, MB, GB, KiB, MiB, GiB")
    if not unit and value <= 1.5:
        if no_remat_peak is None:
            raise ValueError(f"budget {text!r} is a fraction, but no graph peak is known "
                             f"to scale it")
        return int(value * no_remat_peak)
    return int(value * _UNITS[unit])


def format_bytes(n):
    """Human-readable binary size.

    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    """
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
