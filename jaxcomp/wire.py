"""Bytes on the wire: read from the compiled program, and from the formulas.

:func:`collective_bytes` reads the HLO text of a compiled function and counts
the bytes one device sends for every collective in it, with the ring formulas
of :mod:`jaxcomp.collectives`. :func:`expected_bytes` gives the figure a
compressor's formula predicts. Tests assert that both agree exactly; they are
``fractions.Fraction`` so that no rounding hides a difference.

A collective inside a branch of a ``conditional`` counts with weight ``1/B``
for ``B`` branches: the average per step when the branches alternate, as
ACP-SGD's P and Q steps do.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
import math
import re
from typing import Any, Union

import jax
import optax

from jaxcomp import base

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s+"
    r"(?P<op>" + "|".join(_KINDS) + r"|conditional|while|call)(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_NUM_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_REPLICA_COUNT = re.compile(r"replica_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective of a compiled program."""
  name: str
  kind: str
  group_size: int
  buffer_bytes: int
  bytes: Fraction
  weight: Fraction


@dataclasses.dataclass(frozen=True)
class WireBytes:
  """Bytes one device sends per step, per collective and in total."""
  ops: tuple[CollectiveOp, ...] = ()
  by_kind: dict[str, Fraction] = dataclasses.field(default_factory=dict)

  @property
  def total(self) -> Fraction:
    return sum(self.by_kind.values(), Fraction(0))

  def __float__(self) -> float:
    return float(self.total)


def _array_bytes(type_text: str) -> list[int]:
  sizes = []
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype not in _DTYPE_BYTES:
      continue
    count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    sizes.append(count * _DTYPE_BYTES[dtype])
  return sizes


def _group_size(line: str, num_devices: int) -> int:
  explicit = re.search(r"replica_groups=\{(\{[0-9,]*\})", line)
  if explicit:
    return len([d for d in explicit.group(1).strip("{}").split(",") if d])
  iota = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
  if iota:
    return int(iota.group(1).split(",")[-1])
  return num_devices


def _ring_bytes(kind: str, group: int, buffer: int) -> Fraction:
  if kind == "collective-permute":
    return Fraction(buffer)
  if group <= 1:
    return Fraction(0)
  if kind == "all-reduce":
    return Fraction(2 * (group - 1) * buffer, group)
  if kind == "reduce-scatter":  # result is one of ``group`` chunks of the buffer
    return Fraction((group - 1) * buffer)
  return Fraction((group - 1) * buffer, group)  # all-gather, all-to-all


def _buffer_bytes(kind: str, type_text: str, is_start: bool) -> int:
  """Bytes of the buffer the ring formula is stated on (results only are printed)."""
  sizes = _array_bytes(type_text)
  if not is_start:
    return sum(sizes)
  # An async start returns (operands, results[, context]).
  if kind == "all-reduce":
    return sum(sizes)
  return sizes[1] if kind == "collective-permute" else sum(sizes[len(sizes) // 2:])


def _hlo_text(compiled: Any) -> str:
  if isinstance(compiled, str):
    return compiled
  if hasattr(compiled, "as_text"):
    return compiled.as_text()
  raise TypeError(
      "`compiled` must be a compiled function (`jax.jit(f).lower(...).compile()`)"
      f" or its HLO text, got {type(compiled).__name__}"
  )


def _split_computations(text: str) -> tuple[dict[str, list[str]], str]:
  computations: dict[str, list[str]] = {}
  entry = ""
  current = None
  for line in text.splitlines():
    stripped = line.strip()
    if current is None:
      match = _COMPUTATION.match(stripped)
      if match and "=" not in stripped.split("(")[0]:
        current = match.group("name")
        computations[current] = []
        if stripped.startswith("ENTRY"):
          entry = current
    elif stripped == "}":
      current = None
    else:
      computations[current].append(stripped)
  return computations, entry


def _callees(line: str, op: str) -> list[tuple[str, Fraction]]:
  if op == "conditional":
    listed = re.search(r"branch_computations=\{([^}]*)\}", line)
    if listed:
      names = [n.strip().lstrip("%") for n in listed.group(1).split(",")]
    else:
      names = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)
    return [(n, Fraction(1, len(names))) for n in names]
  if op == "while":
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    body = re.search(r"body=%?([\w.\-]+)", line)
    if body is None:
      return []
    if trips is None:
      raise ValueError(
          "a collective-bearing `while` loop with no known trip count: its bytes"
          " per step cannot be read from the program"
      )
    return [(body.group(1), Fraction(int(trips.group(1))))]
  called = re.search(r"to_apply=%?([\w.\-]+)", line)
  return [(called.group(1), Fraction(1))] if called else []


def collective_bytes(compiled: Any) -> WireBytes:
  """Bytes one device sends per step, read from a compiled program's HLO.

  Args:
    compiled: ``jax.jit(f).lower(*args).compile()``, or its ``as_text()``.

  Returns:
    :class:`WireBytes` with one :class:`CollectiveOp` per collective and the
    totals by kind. Ring formulas, ``s`` the buffer's bytes and ``G`` the
    replica group's size: all-reduce ``2(G-1)/G*s``; all-gather, all-to-all
    and reduce-scatter ``(G-1)/G*s`` of the full (gathered or unscattered)
    buffer; collective-permute its operand.
  """
  text = _hlo_text(compiled)
  header = text.split("\n", 1)[0]
  parts = _NUM_PARTITIONS.search(header)
  replicas = _REPLICA_COUNT.search(header)
  num_devices = max(
      int(parts.group(1)) if parts else 1, int(replicas.group(1)) if replicas else 1
  )
  computations, entry = _split_computations(text)
  ops: list[CollectiveOp] = []

  def visit(name: str, weight: Fraction) -> None:
    for line in computations.get(name, []):
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      op = match.group("op")
      if op in ("conditional", "while", "call"):
        for callee, share in _callees(line, op):
          visit(callee, weight * share)
        continue
      buffer = _buffer_bytes(op, match.group("type"), bool(match.group("start")))
      group = 1 if op == "collective-permute" else _group_size(line, num_devices)
      ops.append(CollectiveOp(
          name=match.group("name"), kind=op, group_size=group,
          buffer_bytes=buffer, bytes=_ring_bytes(op, group, buffer), weight=weight,
      ))

  visit(entry, Fraction(1))
  by_kind: dict[str, Fraction] = {}
  for op in ops:
    if op.bytes:
      by_kind[op.kind] = by_kind.get(op.kind, Fraction(0)) + op.bytes * op.weight
  return WireBytes(ops=tuple(ops), by_kind=by_kind)


def expected_bytes(
    tx: base.Compressor,
    params: optax.Params,
    num_devices: Union[int, tuple[int, int], dict[str, int]],
) -> WireBytes:
  """The bytes per device per step that ``tx``'s wire formula predicts.

  Args:
    tx: a jaxcomp compressor (it carries its formula as ``tx.wire_bytes``).
    params: the parameters (or gradients, or their shapes) it will see.
    num_devices: the device count for one axis; ``(rows, cols)`` or a mesh
      shape dict for a pair of axes.

  Returns:
    :class:`WireBytes` with ``by_kind`` and ``total`` (no ``ops``).
  """
  if not isinstance(tx, base.Compressor) or tx.wire_bytes is None:
    raise TypeError(
        "`tx` must be a jaxcomp compressor (it carries its wire formula), got"
        f" {type(tx).__name__}"
    )
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  by_kind: dict[str, Fraction] = {}
  for transfer in tx.wire_bytes(shapes, num_devices):
    if transfer.bytes:
      by_kind[transfer.kind] = (
          by_kind.get(transfer.kind, Fraction(0)) + transfer.bytes * transfer.weight
      )
  return WireBytes(by_kind=by_kind)
