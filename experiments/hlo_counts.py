"""What a compiled step does, read from its optimized HLO: kernels and passes over memory.

Timings move with the machine; these counts do not, so they show progress on
any backend (:mod:`experiments.bench_compression` prints them beside the
milliseconds). From the text of ``jax.jit(f).lower(...).compile()``:

* **kernels**: the instructions that run as a unit of work (a fusion, a
  copy, a concatenate, a sort, a dot, a collective), in the entry
  computation and in the computations a ``while`` or ``call`` runs (loop
  bodies once, not per iteration) and in the lightest branch of a
  ``conditional`` that does any work (a selection's fast path, not its rare
  fallback); parameters, constants, tuples and bitcasts are free and not
  counted.
* **passes**: the bytes those kernels read and write, divided by the bytes
  of one f32 buffer of ``n`` elements (the gradient's size): a step that
  reads the gradient once and writes it once makes 2 passes. A fusion's
  operand that it only slices counts the slices it reads (through a
  concatenation, at most the slice: its own part of it is not worked out);
  a kernel that updates a buffer in place (``scatter``,
  ``dynamic-update-slice``, alone or as a fusion's root over one of its
  operands) counts the update, not the buffer; a fusion's update of a
  buffer it computes itself writes all of it. Which fusions write in place
  is the backend's rule: XLA:CPU, one whose buffer is read by the root
  alone; XLA:GPU also one that reads it by a ``dynamic-slice`` with the
  write's own start and shape (``backend="gpu"``). Any other read of the
  buffer (a static ``slice`` included) makes the kernel copy all of it.
  A custom call whose output aliases an operand
  (``output_to_operand_aliasing``) writes over it in place and counts it as
  written, not read: jaxcomp's one such call
  (:func:`jaxcomp._src.native.lowrank_residual`) reads nothing of it.

Example::

  compiled = jax.jit(update).lower(grads, state).compile()
  counts = hlo_counts.count(compiled.as_text(), n=25_557_032)
  print(counts.kernels, f"{counts.passes:.1f}")
"""

from __future__ import annotations

import re
from typing import NamedTuple

_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "partition-id", "replica-id"}
CONTROL = {"while", "conditional", "call"}  # ops that run other computations
_IN_PLACE = {"scatter", "dynamic-update-slice"}
_SLICES = {"slice", "dynamic-slice", "gather"}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?(%?[\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*?)\)(?:, (.*))?$")
_OPERAND = re.compile(r"%[\w.\-]+")
_ALIASED = re.compile(r"output_to_operand_aliasing=\{\{\}: \((\d+), \{\}\)\}")


class Counts(NamedTuple):
  """Kernels and passes of one compiled program (see the module docstring).

  Attributes:
    kernels: the instructions that do work, loop bodies counted once.
    passes: bytes read and written by them over ``4 n``.
    by_op: ``{opcode: kernels}``.
    heaviest: where to look next: the ten (opcode, source ``op_name``)
      pairs whose kernels move the most bytes, as ``(passes, kernels,
      opcode, op_name)``, heaviest first.
  """

  kernels: int
  passes: float
  by_op: dict
  heaviest: list


def _arrays(shape: str) -> list[tuple[str, int]]:
  """``(dtype, elements)`` of each array in an HLO shape (several for a tuple)."""
  arrays = []
  for dtype, dims in _SHAPE.findall(shape):
    elements = 1
    for d in dims.split(","):
      if d:
        elements *= int(d)
    arrays.append((dtype, elements))
  return arrays


def _bytes(shape: str) -> int:
  return sum(elements * _BYTES[dtype] for dtype, elements in _arrays(shape))


class _Instruction(NamedTuple):
  name: str
  shape: str
  op: str
  operands: list
  attributes: str


def computations(text: str) -> dict[str, list[_Instruction]]:
  """``{computation name: its instructions}`` of a program's text, each instruction's
  ``name``, ``shape``, ``op``, ``operands`` (names) and ``attributes``; the entry
  computation is ``"ENTRY"``."""
  computations: dict[str, list[_Instruction]] = {}
  current = None
  for line in text.splitlines():
    header = re.match(r"^(ENTRY )?(%?[\w.\-]+) .*\{\s*$", line)
    if header and not line.startswith(" "):
      current = "ENTRY" if header.group(1) else header.group(2).lstrip("%")
      computations[current] = []
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is None:
      continue
    match = _INSTRUCTION.match(line)
    if match:
      name, shape, op, args, attributes = match.groups()
      computations[current].append(_Instruction(
          name.lstrip("%"), shape, op, [o.lstrip("%") for o in _OPERAND.findall(args)],
          attributes or ""))
  return computations


def called(instruction: _Instruction, key: str) -> list[str]:
  """The computations an instruction names after ``key=`` (``calls``, ``to_apply``,
  ``body``, ``branch_computations``...)."""
  found = re.findall(key + r"=\{?(%?[\w.\-, %]+)\}?", instruction.attributes)
  return [name.strip().lstrip("%") for group in found for name in group.split(",") if name.strip()]


def source(instruction: _Instruction) -> str:
  """The JAX operation an instruction comes from (its ``op_name``), or ``""``."""
  found = re.search(r'op_name="([^"]*)"', instruction.attributes)
  return found.group(1) if found else ""


def _fusion_traffic(instruction: _Instruction, fused: list[_Instruction], sizes: dict,
                    operand_shapes: dict, reads_at_write: bool) -> int:
  """Bytes a fusion reads and writes: sliced operands by their slices, in-place roots by the update.

  A loop fusion without a reduction computes each output element once from
  about one element of each operand (a slice of a larger computation is
  computed on the slice). ``reads_at_write``: a root ``dynamic-update-slice``
  still writes in place where its buffer is also read by dynamic slices of
  the update's shape at the same start (XLA:GPU's rule); those read their
  slices.
  """
  users: dict[str, list[_Instruction]] = {}
  for inner in fused:
    for operand in inner.operands:
      users.setdefault(operand, []).append(inner)
  params = {_parameter_index(p): p for p in fused if p.op == "parameter"}
  fused_shapes = {inner.name: inner.shape for inner in fused}
  root = fused[-1] if fused else None
  # In place only over an operand's buffer: an update of a buffer the fusion computes
  # (``2 v + w``) is a loop over the whole output, which it writes.
  in_place = root.operands[0] if root is not None and root.op in _IN_PLACE else None
  if in_place not in {p.name for p in params.values()}:
    in_place = None
  # A loop fusion that reduces (a row of packed mask bits per output word)
  # reads many elements per output element.
  loop = ("kind=kLoop" in instruction.attributes
          and not any(inner.op == "reduce" for inner in fused))
  out_elements = _elements(instruction.shape)
  total = 0
  for position, operand in enumerate(instruction.operands):
    full = sizes.get(operand, 0)
    param = params.get(position)
    uses = users.get(param.name, []) if param is not None else []
    if param is not None and param.name == in_place:
      at_write = [u for u in uses if u is not root]
      if not at_write:
        continue  # updated in place: only the update moves
      if reads_at_write and all(_reads_where_written(u, root, fused_shapes)
                                for u in at_write):
        total += sum(_bytes(u.shape) for u in at_write)
        continue
    read = min(full, _read(param, users, full)) if param is not None else full
    if loop:  # one output element reads about one element of each operand
      read = min(read, out_elements * _itemsize(operand_shapes.get(operand, "")))
    total += read
  if in_place is not None:
    return total + sum(_bytes(fused_shapes.get(o, "")) for o in root.operands[1:])
  return total + _bytes(instruction.shape)


def _reads_where_written(read: _Instruction, write: _Instruction, shapes: dict) -> bool:
  """Whether ``read`` is a ``dynamic-slice`` of the span that the root
  ``dynamic-update-slice`` ``write`` writes: its buffer, start and shape
  (``shapes``: the fusion's instructions' shapes by name)."""
  return (read.op == "dynamic-slice" and read.operands[0] == write.operands[0]
          and read.operands[1:] == write.operands[2:]
          and read.shape == shapes.get(write.operands[1]))


def _elements(shape: str) -> int:
  return sum(elements for _, elements in _arrays(shape))


def _read(param: _Instruction, users: dict, full: int) -> int:
  """Bytes of ``param`` a fusion reads: the slices it ends in, else all of it.

  Element-wise ops between the parameter and a slice (a convert, an add with
  another operand of the same size) are computed on the slice only, and so is
  what follows a slice, down to the next slice (a token of one element taken
  from a whole message reads that element); a ``broadcast`` on the way (a
  block's scale spread over its entries) reads one element of ``param`` per
  element it repeats, so a slice after it reads the slice's share of ``param``.
  """
  elements = _elements(param.shape)
  if elements == 0:
    return 0
  per_element = full / elements
  # (instruction, elements of ``param`` per element of it, the most elements of
  # ``param`` it holds, whether a slice took it)
  read, frontier, seen = 0.0, [(param, 1.0, float(elements), False)], set()
  while frontier:
    current, ratio, most, sliced = frontier.pop()
    size = _elements(current.shape)
    followed = []
    for user in users.get(current.name, []):
      if user.op in _SLICES:
        followed.append((user, ratio, min(most, _elements(user.shape) * ratio), True))
      elif user.op == "broadcast" and user.operands == [current.name]:
        followed.append((user, ratio * size / max(1, _elements(user.shape)), most, sliced))
      elif user.op == "concatenate":
        # An element of the concatenation is one element of one operand, and
        # a slice of it is computed on the slice: at most the slice is read.
        followed.append((user, ratio, most, sliced))
      elif _elements(user.shape) == size and user.op not in _IN_PLACE:
        followed.append((user, ratio, most, sliced))  # element-wise: follow it
      else:
        followed = None  # a reduction, say: all of ``current`` is read
        break
    if followed is None or (not followed and current is not param):
      # Read whole here (or the fusion's output, which an element-wise chain
      # computes whole): all of the parameter, unless a slice took it first.
      if not sliced:
        return full
      read += min(size * ratio, most) * per_element
      continue
    for user, *rest in followed:
      if user.name not in seen:
        seen.add(user.name)
        frontier.append((user, *rest))
  return int(read)


def _itemsize(shape: str) -> int:
  """Bytes per element of an array shape (the widest, for a tuple)."""
  return max((_BYTES[dtype] for dtype, _ in _arrays(shape)), default=0)


def _parameter_index(parameter: _Instruction) -> int:
  return int(parameter.operands[0]) if parameter.operands else -1


BACKENDS = ("cpu", "gpu")


def count(text: str, n: int, backend: str = "cpu") -> Counts:
  """The :class:`Counts` of an optimized HLO module's text, passes in units of ``f32[n]``.

  ``backend``: the one that compiled ``text`` (``jax.default_backend()``), whose
  rule for writing a fusion's buffer in place is applied.
  """
  if n < 1:
    raise ValueError(f"`n` must be >= 1, got {n}")
  if backend not in BACKENDS:
    raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
  parsed = computations(_with_parameter_numbers(text))
  if "ENTRY" not in parsed:
    raise ValueError("`text` holds no ENTRY computation (pass compiled.as_text())")
  weights = _weights("ENTRY", parsed, n, (), backend == "gpu")
  by_op: dict[str, int] = {}
  for _, op, _ in weights:
    by_op[op] = by_op.get(op, 0) + 1
  by_source: dict[tuple[str, str], list] = {}
  for passes, op, source in weights:
    entry = by_source.setdefault((op, source), [0.0, 0])
    entry[0] += passes
    entry[1] += 1
  heaviest = sorted(((p, k, op, source) for (op, source), (p, k) in by_source.items()),
                    key=lambda row: -row[0])[:10]
  return Counts(kernels=len(weights), passes=sum(w[0] for w in weights), by_op=by_op,
                heaviest=heaviest)


def _weights(name: str, computations: dict, n: int, stack: tuple,
             reads_at_write: bool) -> list:
  """``[(passes, opcode, op_name)]`` of every kernel a run of computation ``name`` starts.

  A ``while`` counts its condition and body once; a ``conditional`` its
  lightest branch that launches a kernel (a selection's fast path, not its
  rare fallback; not a branch that only hands its operands back).
  """
  if name in stack or name not in computations:
    return []
  stack = stack + (name,)
  sizes, shapes, weights = {}, {}, []
  for instruction in computations[name]:
    sizes[instruction.name] = _bytes(instruction.shape)
    shapes[instruction.name] = instruction.shape
    if instruction.op == "conditional":
      branches = [_weights(b, computations, n, stack, reads_at_write)
                  for key in ("branch_computations", "true_computation", "false_computation")
                  for b in called(instruction, key)]
      working = [ws for ws in branches if ws] or [[]]
      weights.extend(min(working, key=lambda ws: sum(w[0] for w in ws)))
      continue
    if instruction.op in CONTROL:
      for key in ("condition", "body", "to_apply"):
        for callee in called(instruction, key):
          weights.extend(_weights(callee, computations, n, stack, reads_at_write))
      continue
    if instruction.op in _FREE:
      continue
    if instruction.op == "fusion":
      (callee,) = called(instruction, "calls")[:1] or ("",)
      moved = _fusion_traffic(instruction, computations.get(callee, []), sizes, shapes,
                              reads_at_write)
    elif instruction.op in _IN_PLACE:
      # Written over its first operand (copy insertion adds a copy where it
      # cannot be): the update and the indices are read, the update written.
      update = instruction.operands[1 if instruction.op == "dynamic-update-slice" else -1]
      moved = sizes.get(update, 0) + sum(sizes.get(o, 0) for o in instruction.operands[1:])
    else:
      aliased = _ALIASED.search(instruction.attributes or "")
      written_over = int(aliased.group(1)) if aliased else -1
      moved = _bytes(instruction.shape) + sum(
          sizes.get(o, 0) for i, o in enumerate(instruction.operands) if i != written_over)
    weights.append((moved / (4 * n), instruction.op, source(instruction)))
  return weights


def _with_parameter_numbers(text: str) -> str:
  """HLO text whose ``parameter(i)`` calls keep ``i`` as an operand (read by the parser)."""
  return re.sub(r"parameter\((\d+)\)", r"parameter(%\1)", text)
