"""Probe results as plain rows, and a text table of them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class ProbeRow:
    """One tensor of one probe step (plain Python values, ready to plot or save).

    Attributes:
      kind: ``"param"`` (a parameter gradient) or ``"cotangent"`` (the cotangent of a
        module's output, i.e. the gradient flowing into the module from above).
      name: parameter path (``"block_0/attn/qkv/kernel"``) or module path
        (``"block_0/attn/qkv"``; ``""`` is the root, the model's output, printed as
        ``(root)``).
      shape: the tensor's shape.
      dtype: the dtype the low-precision run stored it in.
      fmt: the format the statistics refer to (``"float16"``, ...).
      size: number of elements.
      ref_nonzero: elements non-zero in the fp32 reference.
      flushed: elements non-zero in the reference and zero in the low-precision run.
      underflow_rate: ``flushed / max(ref_nonzero, 1)``.
      subnormal_share: share of all elements in the format's subnormal range (as stored,
        i.e. scaled).
      overflow_count: non-finite elements.
      rel_error: ``||unscaled - ref|| / ||ref||`` (L2).
      amax: largest magnitude as stored (scaled).
      headroom: ``log2(fmt.max / amax)``, binades left before overflow.
      scale: the scale the stored tensor carries.

    >>> r = ProbeRow("param", "w", (2,), "float16", "float16", 2, 2, 1, 0.5, 0.0, 0, 0.5,
    ...              1.0, 15.99, 1.0)
    >>> r.underflow_rate
    0.5
    """

    kind: str
    name: str
    shape: tuple
    dtype: str
    fmt: str
    size: int
    ref_nonzero: int
    flushed: int
    underflow_rate: float
    subnormal_share: float
    overflow_count: int
    rel_error: float
    amax: float
    headroom: float
    scale: float


def rows_as_dicts(rows: Iterable[ProbeRow], **extra: Any) -> list[dict[str, Any]]:
    """Rows as dicts, each with the ``extra`` columns (e.g. ``step=100, setting="fp16"``).

    Args:
      rows: probe rows.
      **extra: columns added to every row.

    Returns:
      A list of plain dicts.

    >>> r = ProbeRow("param", "w", (2,), "float16", "float16", 2, 2, 1, 0.5, 0.0, 0, 0.5,
    ...              1.0, 15.99, 1.0)
    >>> rows_as_dicts([r], step=3)[0]["step"]
    3
    """
    return [{**extra, **dataclasses.asdict(r)} for r in rows]


def _percent(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if x == 0:
        return "0"
    if x < 0.0001:
        return "<0.01%"
    return f"{100 * x:.2f}%"


def _float(x: float) -> str:
    return f"{x:.3g}"


def _binades(x: float) -> str:
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.1f}"


def display_name(name: str) -> str:
    """A tensor's name as tables print it: the root's empty path reads ``(root)``.

    Args:
      name: a parameter or module path (``""`` for the root).

    Returns:
      The name to print.

    >>> display_name(""), display_name("[0]"), display_name("Dense_0")
    ('(root)', '(root)[0]', 'Dense_0')
    """
    return name if name and not name.startswith(("[", "#", ".")) else f"(root){name}"


def _scale(x: float) -> str:
    if x > 0 and math.isfinite(x) and math.log2(x) == round(math.log2(x)):
        return f"2^{round(math.log2(x))}"
    return f"{x:.3g}"


_FORMATTERS = {
    "underflow_rate": _percent,
    "subnormal_share": _percent,
    "rel_error": _float,
    "amax": _float,
    "headroom": _binades,
    "scale": _scale,
    "name": display_name,
    "shape": lambda s: "x".join(str(d) for d in s) or "()",
}

DEFAULT_COLUMNS = (
    "kind", "name", "shape", "underflow_rate", "subnormal_share", "overflow_count",
    "rel_error", "headroom", "scale",
)

_HEADERS = {
    "underflow_rate": "underflow",
    "subnormal_share": "subnormal",
    "overflow_count": "overflow",
    "rel_error": "rel_err",
    "headroom": "headroom",
}


def format_table(
    rows: Sequence[ProbeRow] | Sequence[dict[str, Any]],
    columns: Sequence[str] = DEFAULT_COLUMNS,
) -> str:
    """Formats probe rows (or row dicts) as a fixed-width text table.

    Rates print as percentages, ``headroom`` in binades, ``scale`` as a power of two.

    Args:
      rows: :class:`ProbeRow` s or dicts with the same fields.
      columns: the fields to print, in order.

    Returns:
      The table, a string.

    Raises:
      ValueError: for a column that is not a row field.

    >>> r = ProbeRow("param", "w", (2,), "float16", "float16", 2, 2, 1, 0.5, 0.0, 0, 0.5,
    ...              1.0, 15.99, 1.0)
    >>> print(format_table([r], columns=("name", "underflow_rate", "headroom", "scale")))
    name  underflow  headroom  scale
    w     50.00%     16.0      2^0
    """
    dicts = [r if isinstance(r, dict) else dataclasses.asdict(r) for r in rows]
    for c in columns:
        if dicts and c not in dicts[0]:
            raise ValueError(f"columns: {c!r} is not a row field; fields are {list(dicts[0])}")
    header = [_HEADERS.get(c, c) for c in columns]
    body = [
        [_FORMATTERS.get(c, str)(d[c]) for c in columns]
        for d in dicts
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=False)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
             for line in [header, *body]]
    return "\n".join(lines)
