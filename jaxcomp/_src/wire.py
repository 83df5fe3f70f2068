"""Bytes on the wire: every formula, and what the compiled program sends.

This module states the bytes of every collective once. The ring formulas, for
a buffer of ``s`` bytes over a group of ``G`` devices, per device:

* all-reduce ``2 (G - 1) / G * s``;
* all-gather, all-to-all and reduce-scatter ``(G - 1) / G * s`` of the full
  (gathered, or not yet scattered) buffer;
* collective-permute: its operand.

The compressors state their step as a tuple of :class:`Transfer` built with
the helpers here (:func:`mean`, :func:`sparse_allgather`, :func:`gtopk`, ...);
:func:`expected_bytes` finds the compressors inside any transformation
(:func:`jaxcomp.protocol.find_compressors`) and sums their formulas, each on
the leaves it is given. :func:`collective_bytes` reads the same figure
from the HLO text of a compiled program, with the same ring formulas. Tests
assert that both agree exactly; they are ``fractions.Fraction`` so that no
rounding hides a difference.

A collective inside a branch of a ``conditional`` counts with weight ``1/B``
for ``B`` branches (the average when the branches alternate, as ACP-SGD's P
and Q steps do) and carries its branch index, so a formula whose branches
have other weights (DGC's warm-up stages) is compared branch by branch.
"""

from __future__ import annotations

import dataclasses
import enum
from fractions import Fraction
import math
import re
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import checks
from jaxcomp._src import protocol


class Kind(str, enum.Enum):
  """The collectives XLA runs, named as its HLO names them."""

  ALL_REDUCE = "all-reduce"
  ALL_GATHER = "all-gather"
  REDUCE_SCATTER = "reduce-scatter"
  ALL_TO_ALL = "all-to-all"
  COLLECTIVE_PERMUTE = "collective-permute"


_KINDS = tuple(k.value for k in Kind)


def ring_bytes(kind: str, group: int, buffer: int) -> Fraction:
  """Bytes one device sends in a ring collective of ``kind`` over ``group`` devices.

  ``buffer`` is the full buffer's bytes: the reduced one, the gathered one,
  the one before scattering, or a permute's operand.
  """
  kind = Kind(kind)
  if kind is Kind.COLLECTIVE_PERMUTE:
    return Fraction(buffer)
  if group <= 1:
    return Fraction(0)
  if kind is Kind.ALL_REDUCE:
    return Fraction(2 * (group - 1) * buffer, group)
  return Fraction((group - 1) * buffer, group)


class Transfer(NamedTuple):
  """One collective of a compressor's step, as its wire formula states it.

  Attributes:
    kind: a :class:`Kind` value.
    group: devices taking part in it (1 for a permute: a pairwise exchange).
    bytes: what one device sends in it.
    weight: times per step on average (1/2: every other step).
    branch: the index of the branch of the step's one ``lax.switch`` that
      holds it, ``None`` outside any branch.
    axes: the mesh axes whose links it crosses (``None``: not stated).
  """

  kind: str
  group: int
  bytes: Fraction
  weight: Fraction = Fraction(1)
  branch: Optional[int] = None
  axes: Optional[tuple[str, ...]] = None


# The collectives of one step.
WireCost = tuple[Transfer, ...]


# The devices of a collective: a count, one size per axis, or the axes' names
# and sizes in mesh order (then every transfer is labelled with the axes it
# crosses, as :func:`collective_bytes` reads them from the program).
Group = Union[int, Sequence[int], Mapping[str, int]]


def _group(group: Group) -> tuple[tuple[int, ...], Optional[tuple[str, ...]]]:
  """``(sizes, names)`` of a :data:`Group` (``names`` is ``None`` when not given)."""
  if isinstance(group, Mapping):
    return tuple(int(s) for s in group.values()), tuple(group)
  if isinstance(group, (int, np.integer)):
    return (int(group),), None
  return tuple(int(s) for s in group), None


def _crossed(names: Optional[tuple[str, ...]], sizes: tuple[int, ...], distance: int):
  """The axes along which devices ``0`` and ``distance`` (in mesh order) differ."""
  if names is None:
    return None
  coords = np.unravel_index(distance, sizes)
  return tuple(n for n, c in zip(names, coords) if c)


def transfer(kind: str, group: int, buffer_bytes, axes: Optional[Sequence[str]] = None) -> Transfer:
  """A :class:`Transfer` of a ``buffer_bytes`` buffer, priced by :func:`ring_bytes`."""
  return Transfer(Kind(kind).value, group, ring_bytes(kind, group, buffer_bytes),
                  axes=None if axes is None else tuple(axes))


def in_branch(cost: WireCost, branch: int, weight) -> WireCost:
  """``cost`` run in branch ``branch`` of a switch, on a ``weight`` share of the steps."""
  return tuple(t._replace(weight=t.weight * Fraction(weight), branch=branch) for t in cost)


def allreduce(nbytes: int, group: Group) -> WireCost:
  """Ring all-reduce of a ``nbytes`` buffer over ``group``'s devices."""
  sizes, names = _group(group)
  return (transfer(Kind.ALL_REDUCE, math.prod(sizes), nbytes, names),)


def _itemsize(wire_dtype) -> int:
  return 4 if wire_dtype is None else jnp.dtype(wire_dtype).itemsize


def _reduce(n: int, sizes: tuple[int, ...], names, itemsize: int) -> WireCost:
  if len(sizes) == 1 and itemsize == 4:
    return allreduce(n * itemsize, sizes if names is None else dict(zip(names, sizes)))
  size, axis = sizes[0], None if names is None else names[:1]
  padded = -(-n // size) * size
  scatter = Kind.REDUCE_SCATTER if itemsize == 4 else Kind.ALL_TO_ALL
  inner = (_reduce(padded // size, sizes[1:], names and names[1:], itemsize)
           if len(sizes) > 1 else ())
  return (transfer(scatter, size, padded * itemsize, axis), *inner,
          transfer(Kind.ALL_GATHER, size, padded * itemsize, axis))


def mean(n: int, axis_sizes: Group, *, wire_dtype=None) -> WireCost:
  """:func:`jaxcomp.collectives.mean` of ``n`` f32 elements over axes of these sizes.

  One axis in f32: a ring all-reduce. A pair of axes (the 2D torus) or a
  16-bit ``wire_dtype``: reduce-scatter (all-to-all of the 16-bit chunks) of
  ``n`` padded to a multiple of the first axis, the inner reduction of the
  chunk over the second axis, all-gather back. Nothing for ``n == 0``.
  """
  if n == 0:
    return ()
  sizes, names = _group(axis_sizes)
  return _reduce(n, sizes, names, _itemsize(wire_dtype))


def torus_allreduce(n: int, rows: int, cols: int, itemsize: int = 4) -> WireCost:
  """:func:`jaxcomp.collectives.torus_allreduce` of ``n`` elements on ``rows x cols``."""
  return _reduce(n, (rows, cols), None, itemsize)


def allgather(nbytes: int, group: Group) -> WireCost:
  """All-gather of ``nbytes`` from each of ``group``'s G devices: ``(G - 1) * nbytes``."""
  sizes, names = _group(group)
  devices = math.prod(sizes)
  return (transfer(Kind.ALL_GATHER, devices, devices * nbytes, names),)


def all_to_all(nbytes: int, group: Group) -> WireCost:
  """All-to-all of ``nbytes`` to each of ``group``'s G devices: ``(G - 1) * nbytes``."""
  sizes, names = _group(group)
  devices = math.prod(sizes)
  return (transfer(Kind.ALL_TO_ALL, devices, devices * nbytes, names),)


def sparse_allgather(k: int, group: Group, value_itemsize: int = 4) -> WireCost:
  """``(P - 1) * k * (value bytes + 4)``: all-gathers of ``k`` values and ``k`` int32 indices."""
  return allgather(k * value_itemsize, group) + allgather(k * 4, group)


def gtopk(k: int, group: Group, value_itemsize: int = 4) -> WireCost:
  """The gTop-k butterfly: ``log2(P)`` permutes of ``k`` values and ``k`` indices.

  For P not a power of two the fold and the send-back count as two more
  rounds, as the compiled program holds them (only the extra devices and
  their partners use them). Over named axes, round ``r`` is labelled with
  the axes along which devices ``0`` and ``2**r`` differ (the fold and the
  send-back: ``0`` and ``Q``, the largest power of two below P).
  """
  sizes, names = _group(group)
  devices = math.prod(sizes)
  power = 1 << (devices.bit_length() - 1)
  distances = [1 << r for r in range(power.bit_length() - 1)]
  if devices != power:
    distances = [power] + distances + [power]
  return tuple(
      transfer(Kind.COLLECTIVE_PERMUTE, 1, k * itemsize, _crossed(names, sizes, d))
      for d in distances for itemsize in (value_itemsize, 4)
  )


# ------------------------------------------------------------ the compiled program

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
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
  branch: Optional[int] = None
  axes: Optional[tuple[str, ...]] = None


@dataclasses.dataclass(frozen=True)
class WireBytes:
  """Bytes one device sends per step: per collective, per kind and per branch.

  Attributes:
    ops: the collectives read from a compiled program (empty for a formula).
    by_kind: weighted bytes per step, per :class:`Kind` value.
    by_branch: unweighted bytes of each branch of the step's switch (``None``:
      outside any branch), for comparing a formula with a program branch by
      branch when the formula weights its branches by a schedule.
    by_axes: weighted bytes per step over each set of mesh axes (a fast and
      a slow link apart): for a program, read from each collective's device
      groups (with ``mesh_shape``); for a formula, stated by compressors over
      one axis and by :func:`jaxcomp.hierarchical` (fast and slow apart).
  """
  ops: tuple[CollectiveOp, ...] = ()
  by_kind: dict[str, Fraction] = dataclasses.field(default_factory=dict)
  by_branch: dict[Optional[int], Fraction] = dataclasses.field(default_factory=dict)
  by_axes: dict[tuple[str, ...], Fraction] = dataclasses.field(default_factory=dict)

  @property
  def total(self) -> Fraction:
    return sum(self.by_kind.values(), Fraction(0))

  def __float__(self) -> float:
    return float(self.total)


def _tally(items) -> WireBytes:
  """:class:`WireBytes` of ``(kind, bytes, weight, branch, axes)`` items."""
  by_kind: dict[str, Fraction] = {}
  by_branch: dict[Optional[int], Fraction] = {}
  by_axes: dict[tuple[str, ...], Fraction] = {}
  for kind, nbytes, weight, branch, axes in items:
    if nbytes:
      by_kind[kind] = by_kind.get(kind, Fraction(0)) + nbytes * weight
      by_branch[branch] = by_branch.get(branch, Fraction(0)) + nbytes
      if axes is not None:
        by_axes[axes] = by_axes.get(axes, Fraction(0)) + nbytes * weight
  return WireBytes(by_kind=by_kind, by_branch=by_branch, by_axes=by_axes)


def _array_bytes(type_text: str) -> list[int]:
  sizes = []
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype not in _DTYPE_BYTES:
      continue
    count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    sizes.append(count * _DTYPE_BYTES[dtype])
  return sizes


def _tuple_elements(type_text: str) -> list[str]:
  """The elements of a tuple type at its top level; an array type is its own one element."""
  text = type_text.strip()
  if not text.startswith("("):
    return [text]
  elements, depth, begin = [], 0, 1
  for i, char in enumerate(text):
    if char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    if (char == "," and depth == 1) or (char == ")" and depth == 0):
      elements.append(text[begin:i].strip())
      begin = i + 1
  return [e for e in elements if e]


def _buffer_bytes(kind: str, type_text: str, is_start: bool, group: int) -> int:
  """Bytes of the buffer the ring formula is stated on (HLO prints results only).

  An asynchronous start's type is ``(operands, results, contexts...)``. Newer
  XLA prints the operands as a tuple of their own, also for one operand
  (``((f32[n]), f32[n])``, ``((s32[k], f32[k]), (s32[k], f32[k]))``): then
  the results are the second element. Older XLA prints one operand bare, and
  an all-reduce-start's type is its results.
  """
  elements = _tuple_elements(type_text) if is_start else []
  sizes = _array_bytes(type_text)
  if len(elements) >= 2 and elements[0].startswith("("):  # (operands, results, ...)
    result = sum(_array_bytes(elements[1]))
  elif not is_start or kind == Kind.ALL_REDUCE:
    result = sum(sizes)
  elif kind == Kind.COLLECTIVE_PERMUTE:  # (operand, result, contexts...)
    result = sizes[1]
  else:  # (operands, results)
    result = sum(sizes[len(sizes) // 2:])
  # A reduce-scatter's result is one of ``group`` chunks of the full buffer.
  return group * result if kind == Kind.REDUCE_SCATTER else result


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


def _callees(line: str, op: str) -> list[tuple[str, Fraction, Optional[int]]]:
  """``(computation, share of the caller's weight, branch index or None)`` of a call."""
  if op == "conditional":
    listed = re.search(r"branch_computations=\{([^}]*)\}", line)
    if listed:
      names = [n.strip().lstrip("%") for n in listed.group(1).split(",")]
    else:  # a predicate: branch 0 is the false computation, as lax.cond lowers it
      names = [re.search(r"false_computation=%?([\w.\-]+)", line).group(1),
               re.search(r"true_computation=%?([\w.\-]+)", line).group(1)]
    return [(n, Fraction(1, len(names)), i) for i, n in enumerate(names)]
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
    return [(body.group(1), Fraction(int(trips.group(1))), None)]
  called = re.search(r"to_apply=%?([\w.\-]+)", line)
  return [(called.group(1), Fraction(1), None)] if called else []


def _groups(line: str) -> Optional[list[list[int]]]:
  """The device groups of a collective (pairs for a permute), ``None``: all devices."""
  pairs = re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", line)
  explicit = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", line)
  listed = pairs or explicit
  if listed:
    groups = [[int(d) for d in group.split(",") if d]
              for group in re.findall(r"\{([0-9,]*)\}", listed.group(1))]
    return groups or None  # replica_groups={}: every device
  mesh = _MESH_GROUPS.search(line)
  if mesh:
    return _mesh_axes_groups(*mesh.groups())
  iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
  if iota:
    shape = [int(d) for d in iota.group(1).split(",")]
    source = [int(d) for d in iota.group(2).split(",")]
    ids = np.arange(math.prod(source)).reshape(source)
    if iota.group(3):
      ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
    return ids.reshape(shape).tolist()
  return None


# Newer XLA states a collective's groups by mesh axes:
# ``replica_groups=mesh['dcn'=2,'ici'=4] {'ici'}``, a sub-axis as ``'x':(pre)size``
# (``pre``: the product of the sizes of the parts of ``x`` before it), the device
# order as ``, device_ids=(...)`` after the mesh when it is not 0, 1, 2, ...
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?\s*=\s*(\d+)")
_GROUP_AXIS = re.compile(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?")


def _mesh_axes_groups(mesh: str, device_ids: Optional[str], axes: str) -> list[list[int]]:
  """The device groups of a ``replica_groups=mesh[...] {...}`` list (XLA's rule).

  Each mesh axis that a sub-axis of the list names is cut into parts (before
  the sub-axis, the sub-axis, after it); the groups are the devices that
  differ along the listed (sub-)axes only, in the listed order.
  """
  names, sizes = zip(*[(n, int(s)) for n, s in _MESH_AXIS.findall(mesh)])
  count = math.prod(sizes)
  ids = np.array([int(d) for d in re.findall(r"\d+", device_ids)]) if device_ids else np.arange(count)
  listed = [(n, int(pre) if pre else None, int(size) if size else None)
            for n, pre, size in _GROUP_AXIS.findall(axes)]
  # Each mesh axis as its parts: [(size, listed position or None)].
  parts: list[list[tuple[int, Optional[int]]]] = []
  for name, full in zip(names, sizes):
    mine = sorted((pre, size, position) for position, (n, pre, size) in enumerate(listed)
                  if n == name and pre is not None)
    whole = [position for position, (n, pre, _) in enumerate(listed) if n == name and pre is None]
    if whole:
      parts.append([(full, whole[0])])
      continue
    axis_parts, done = [], 1
    for pre, size, position in mine:
      if pre != done:
        axis_parts.append((pre // done, None))
      axis_parts.append((size, position))
      done = pre * size
    if done != full:
      axis_parts.append((full // done, None))
    parts.append(axis_parts)
  flat = [part for axis_parts in parts for part in axis_parts]
  kept = [i for i, (_, position) in enumerate(flat) if position is None]
  grouped = sorted((position, i) for i, (_, position) in enumerate(flat) if position is not None)
  order = kept + [i for _, i in grouped]
  per_group = math.prod(flat[i][0] for _, i in grouped)
  arranged = ids.reshape([size for size, _ in flat]).transpose(order)
  return arranged.reshape(-1, per_group).tolist()


def _axes_of(groups: Optional[list[list[int]]], mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
  """The mesh axes along which the devices of the first group differ."""
  names, sizes = tuple(mesh_shape), tuple(mesh_shape.values())
  if groups is None:
    return names
  coords = np.array(np.unravel_index(groups[0], sizes)).T
  return tuple(n for i, n in enumerate(names) if len(set(coords[:, i])) > 1)


def collective_bytes(compiled: Any, *, mesh_shape: Optional[Mapping[str, int]] = None) -> WireBytes:
  """Bytes one device sends per step, read from a compiled program's HLO.

  Args:
    compiled: ``jax.jit(f).lower(*args).compile()``, or its ``as_text()``.
    mesh_shape: the mesh's axis sizes in order (``mesh.shape``): each
      collective is then labelled with the axes its device groups span, and
      ``by_axes`` gives the bytes over each (a fast and a slow link apart).

  Returns:
    :class:`WireBytes` with one :class:`CollectiveOp` per collective, the
    totals by kind, by branch (and by axes), priced by :func:`ring_bytes`
    with ``G`` the replica group's size.
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

  def visit(name: str, weight: Fraction, branch: Optional[int]) -> None:
    for line in computations.get(name, []):
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      op = match.group("op")
      if op in ("conditional", "while", "call"):
        for callee, share, index in _callees(line, op):
          # A branch index is the outermost switch's: a cond nested in a
          # branch (a selection's exact fallback) stays in that branch.
          visit(callee, weight * share, index if branch is None else branch)
        continue
      groups = _groups(line)
      if op == Kind.COLLECTIVE_PERMUTE:
        group = 1
      else:
        group = num_devices if groups is None else len(groups[0])
      buffer = _buffer_bytes(op, match.group("type"), bool(match.group("start")), group)
      axes = None if mesh_shape is None else _axes_of(groups, mesh_shape)
      ops.append(CollectiveOp(
          name=match.group("name"), kind=op, group_size=group, buffer_bytes=buffer,
          bytes=ring_bytes(op, group, buffer), weight=weight, branch=branch, axes=axes,
      ))

  visit(entry, Fraction(1), None)
  tally = _tally((op.kind, op.bytes, op.weight, op.branch, op.axes) for op in ops)
  return dataclasses.replace(tally, ops=tuple(ops))


# ---------------------------------------------------------------- the formulas


def expected_bytes(
    tx: Any,
    params: optax.Params,
    num_devices: Union[int, Sequence[int], Mapping[str, int]],
    *,
    steps: Optional[int] = None,
) -> WireBytes:
  """The bytes per device per step that the formulas of the compressors in ``tx`` predict.

  Args:
    tx: a jaxcomp compressor, or any transformation that runs them
      (``optax.chain``, ``optax.MultiSteps``, a user's own, ...): every
      compressor that :func:`jaxcomp.protocol.find_compressors` finds in it
      counts, priced on the leaves it is given (``optax.masked``: the masked
      ones).
    params: the parameters (or gradients, or their shapes) it will see.
    num_devices: the device count for one axis; ``(rows, cols)`` or a mesh
      shape dict for a pair of axes.
    steps: for a compressor whose bytes follow a schedule (DGC's warm-up),
      the average over the first ``steps`` steps; ``None``: after the
      schedule, the steady state.

  Returns:
    :class:`WireBytes` with ``by_kind``, ``by_branch`` and ``total`` (no
    ``ops``).

  Raises:
    TypeError: ``tx`` holds no jaxcomp compressor.
    ValueError: ``tx`` cannot be traced to find them (see
      :func:`jaxcomp.protocol.find_compressors`).
  """
  return tally(transfers(tx, params, num_devices, steps=steps))


def tally(cost: WireCost) -> WireBytes:
  """:class:`WireBytes` of the transfers ``cost`` (what :func:`expected_bytes` sums)."""
  return _tally((t.kind, t.bytes, t.weight, t.branch, t.axes) for t in cost)


def transfers(
    tx: Any, params: optax.Params, num_devices: Union[int, Sequence[int], Mapping[str, int]],
    *, steps: Optional[int] = None,
) -> WireCost:
  """The :class:`Transfer` tuples of every compressor in ``tx`` (what a cost model prices).

  Each compressor's formula on the updates it is given, in the order ``tx``
  runs them (see :func:`expected_bytes`).
  """
  found = protocol.find_compressors(tx, params)
  if not found:
    raise TypeError(
        "`tx` must be a jaxcomp compressor or a transformation that holds one"
        f" (optax.chain, optax.MultiSteps, ...); {type(tx).__name__} holds no jaxcomp"
        " compressor")
  cost = ()
  for spec, updates in found:
    sizes = checks.normalize_axis_sizes(spec.axes, num_devices)
    cost += spec.wire(updates, dict(zip(spec.axes, sizes)), steps)
  return cost
