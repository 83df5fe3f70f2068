"""Where a compiled training step issues its exchanges among the backward pass's kernels.

Issue 27 asks that a bucket's exchange start while the backward pass still
computes the gradients of earlier layers, on CPU and GPU alike. This reads it
from the compiled program: for each pipelined row of the netbench
(:data:`experiments.netbench.workload.PIPELINED_ROWS`: dense ``allreduce``,
gTop-k, PowerSGD, ACP-SGD; one bucket and 25 MiB buckets) and for ``pmean``,
a ``lax.pmean`` per leaf whose reduction XLA places and combines itself, it
compiles ``training.make_step`` of :func:`workload.chain_loss` (a chain of
layers shaped like the gradient, whose backward pass makes the last leaf's
gradient first) with ``optax.sgd`` on ``P`` devices, each form's program
for ACP-SGD, and reads the entry computation of the optimized HLO in its
scheduled order (calls, such as XLA:GPU's command buffers, read in place):

* **exchanges**: the collectives (an asynchronous ``*-start``/``*-done``
  pair counted once); with buckets, every bucket's own, none merged.
* **gemms**: the backward pass's matrix kernels (a ``dot`` or a library
  matrix product, alone or in a fusion, whose source op is under
  ``transpose(...)``: autodiff's backward).
* **after first**: of those, the ones scheduled after the first exchange is
  issued: the exchange starts before the backward pass reaches the earlier
  layers. 0 means it waits for every gradient.
* **in flight**: backward gemms scheduled between an asynchronous exchange's
  start and its done: work the exchange overlaps (XLA:GPU's latency-hiding
  scheduler; XLA:CPU runs collectives synchronously, its thunk executor
  overlapping them by their dependencies, which the text does not show).
* **MB/dev**: the bytes one device sends per step, read off the program and
  by the formula (:mod:`jaxcomp.wire`).

Nothing runs. With ``--mock-gpus`` the process takes one GPU and mocks a
topology of ``P`` hosts of one GPU each (JAX's ``jax_mock_gpu_topology``), so
XLA:GPU compiles the ``P``-device program, with its collective combiners
and its latency-hiding scheduler; without it, ``P`` fake CPU devices.

  python -m experiments.schedule --out experiments/results/schedule_cpu.md
  XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_shard_autotuning=false \\
      --xla_gpu_autotune_level=0" python -m experiments.schedule --mock-gpus \\
      --out experiments/results/schedule_gpu.md

The mocked hosts cannot share autotuning results (XLA:GPU shards the
autotuning of a multi-host program among its hosts by default, and the
compile waits for results that never come): ``--xla_gpu_shard_autotuning=false``
is required. ``--xla_gpu_autotune_level=0`` (default configurations for the
matrix kernels, none timed) kept each compile to 12-29 s on an H200.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import time
from typing import NamedTuple, Optional, Sequence

import jax
from jax import lax
import numpy as np
import optax

from experiments import hlo_counts
from experiments.netbench import workload
from jaxcomp import protocol
from jaxcomp import training
from jaxcomp import wire

AXIS = "data"
PMEAN = "pmean"
ROWS = (PMEAN, *workload.PIPELINED_ROWS)
_COLLECTIVES = frozenset(k.value for k in wire.Kind)
_GEMMS = frozenset({"dot", "convolution"})
# Library matrix products: cuBLAS (``__cublas$gemm``, ``__cublas$lt$matmul``),
# oneDNN (``__onednn$matmul``), cuDNN convolutions.
_LIBRARY_GEMM = re.compile(r'custom_call_target="[^"]*(gemm|matmul|conv)[^"]*"')


class Schedule(NamedTuple):
  """What one compiled program's schedule shows (see the module docstring).

  Attributes:
    exchanges: collectives, an asynchronous pair counted once.
    asynchronous: those issued as a ``*-start``/``*-done`` pair.
    gemms: backward-pass matrix kernels.
    after_first: backward gemms scheduled after the first exchange is issued.
    in_flight: backward gemms scheduled while an asynchronous exchange is in flight.
  """

  exchanges: int
  asynchronous: int
  gemms: int
  after_first: int
  in_flight: int


def _phase(op: str) -> Optional[str]:
  """``"start"``, ``"done"`` or ``""`` (synchronous) for a collective's opcode, else ``None``."""
  for suffix in ("-start", "-done", ""):
    if op.endswith(suffix) and op[:len(op) - len(suffix)] in _COLLECTIVES:
      return suffix.lstrip("-")
  return None


def _is_backward_gemm(instruction, computations: dict, seen: frozenset = frozenset()) -> bool:
  """A matrix kernel of autodiff's backward pass, alone or inside what it calls."""
  gemm = (instruction.op in _GEMMS
          or (instruction.op == "custom-call" and _LIBRARY_GEMM.search(instruction.attributes)))
  if gemm:
    return "transpose(" in hlo_counts.source(instruction)
  for callee in hlo_counts.called(instruction, "calls"):
    if callee not in seen and any(_is_backward_gemm(inner, computations, seen | {callee})
                                  for inner in computations.get(callee, [])):
      return True
  return False


def _in_order(name: str, computations: dict, seen: tuple = ()) -> list:
  """The instructions of computation ``name`` in order, a ``call``'s callee read in its place."""
  found = []
  for instruction in computations.get(name, []):
    callees = hlo_counts.called(instruction, "to_apply")
    if instruction.op == "call" and callees and callees[0] not in seen:
      found.extend(_in_order(callees[0], computations, seen + (name,)))
    else:
      found.append(instruction)
  return found


def read(text: str) -> Schedule:
  """The :class:`Schedule` of an optimized, scheduled HLO module's text (``compiled.as_text()``)."""
  computations = hlo_counts.computations(text)
  if "ENTRY" not in computations:
    raise ValueError("`text` holds no ENTRY computation (pass compiled.as_text())")
  exchanges = asynchronous = gemms = after_first = in_flight = 0
  pending: set[str] = set()
  started = False
  for instruction in _in_order("ENTRY", computations):
    phase = _phase(instruction.op)
    if phase is not None:
      if phase == "done":
        pending -= set(instruction.operands)
        continue
      exchanges += 1
      started = True
      if phase == "start":
        asynchronous += 1
        pending.add(instruction.name)
    elif _is_backward_gemm(instruction, computations):
      gemms += 1
      after_first += started
      in_flight += bool(pending)
  return Schedule(exchanges, asynchronous, gemms, after_first, in_flight)


def pmean(axis_name: str = AXIS) -> optax.GradientTransformation:
  """Every leaf's ``lax.pmean``: the dense step whose reductions XLA places and combines."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (lax.pmean(updates, axis_name), state))


def build(row: str) -> optax.GradientTransformation:
  """The compressor of a row over :data:`AXIS`."""
  return pmean() if row == PMEAN else workload.build(row)


def abstract_inputs(chain: optax.GradientTransformation, shapes, mesh, batch: int):
  """``(params, opt_state, batch)`` of :func:`training.make_step` as shapes with their
  shardings: nothing is placed (a mocked device cannot hold an array)."""
  params = jax.eval_shape(lambda p: training.replicate(p, mesh), shapes)
  state = jax.eval_shape(lambda p: training.init_state(chain, p, mesh, AXIS), shapes)
  count = training.num_replicas(mesh, AXIS)
  inputs = jax.eval_shape(lambda: workload.chain_batch(shapes, jax.random.key(0), batch))
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXIS))
  inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct((count * x.shape[0],) + x.shape[1:],
                                                       x.dtype, sharding=sharded), inputs)
  return params, state, inputs


class Row(NamedTuple):
  """One program of a row: its form (``None``: the only one), buckets, compile s, schedule,
  and the MB one device sends: read off the program (``wire.collective_bytes``) and
  the formula's (``wire.expected_bytes``; a method with forms: its mean over them;
  ``None`` for ``pmean``, which is no compressor)."""

  row: str
  form: Optional[int]
  buckets: int
  compile_s: float
  schedule: Schedule
  read_mb: float
  formula_mb: Optional[float]


def programs(row: str, shapes, mesh, batch: int = workload.PIPELINED_BATCH,
             save_hlo: str = "") -> list[Row]:
  """Compile and read every program ``make_step`` runs for ``row`` (one per form);
  with ``save_hlo``, write each one's text into that folder."""
  tx = build(row)
  chain = optax.chain(tx, optax.sgd(1e-3))
  step = training.make_step(workload.chain_loss, chain, mesh, AXIS)
  args = abstract_inputs(chain, shapes, mesh, batch)
  spec = protocol.spec(tx) if row != PMEAN else None
  buckets = len(spec.fused.plan(shapes)) if spec is not None else 1
  forms = sorted({spec.form(count) for count in range(8)}) if spec and spec.form else [None]
  devices = training.num_replicas(mesh, AXIS)
  formula = (float(wire.expected_bytes(tx, shapes, devices).total) / 1e6
             if spec is not None else None)
  found = []
  for form in forms:
    start = time.perf_counter()
    compiled = step.lower(*args, form=form).compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    if save_hlo:
      suffix = "" if form is None else f"_form{form}"
      with open(os.path.join(save_hlo, f"{row}{suffix}.hlo.txt"), "w") as f:
        f.write(text)
    sent = float(wire.collective_bytes(text).total) / 1e6
    found.append(Row(row, form, buckets, seconds, read(text), sent, formula))
  return found


COLUMNS = ("row", "form", "buckets", "exchanges", "async", "backward gemms",
           "after first exchange", "in flight", "MB/dev read", "MB/dev formula", "compile s")


def markdown_row(r: Row) -> list[str]:
  s = r.schedule
  return [r.row, "" if r.form is None else str(r.form), str(r.buckets), str(s.exchanges),
          str(s.asynchronous), str(s.gemms), str(s.after_first), str(s.in_flight),
          f"{r.read_mb:.3f}", "" if r.formula_mb is None else f"{r.formula_mb:.3f}",
          f"{r.compile_s:.1f}"]


def report(rows: Sequence[Row], argv: Sequence[str], devices: int, mocked: bool,
           model: str = "resnet50") -> str:
  device = jax.devices()[0]
  flags = os.environ.get("XLA_FLAGS", "")
  flags = f"XLA_FLAGS `{flags}`" if flags else "XLA_FLAGS unset"
  where = (f"{devices} mocked one-GPU hosts ({device.device_kind}, jax_mock_gpu_topology)"
           if mocked else f"{devices} {device.platform} devices")
  lines = [
      "# Where the compiled step issues its exchanges", "",
      f"Command: `python -m experiments.schedule {' '.join(argv)}`", "",
      f"Date {datetime.date.today().isoformat()}; jax {jax.__version__}, backend"
      f" {jax.default_backend()}, {where}; {flags}."
      " The program of `training.make_step` (forward,"
      " backward, exchange, SGD) of `workload.chain_loss` over the leaves of"
      f" {model}, compiled,"
      " read in its scheduled order (`experiments.schedule`): exchanges are its collectives (an"
      " asynchronous start and done once), backward gemms the matrix kernels of autodiff's"
      " backward pass, *after first exchange* those scheduled after the first exchange is"
      " issued (0: it waits for every gradient), *in flight* those between an asynchronous"
      " exchange's start and its done. MB/dev: the bytes one device sends per step, read off"
      " the program (`wire.collective_bytes`) and by the formula (`wire.expected_bytes`; for"
      " ACP-SGD the mean over its two forms). `pmean` is a `lax.pmean` per leaf, placed and"
      " combined by XLA; a form is one of ACP-SGD's two programs.", "",
      "| " + " | ".join(COLUMNS) + " |",
      "|" + "|".join("---" for _ in COLUMNS) + "|"]
  lines += ["| " + " | ".join(markdown_row(r)) + " |" for r in rows]
  return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m experiments.schedule",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", type=int, default=8, help="data-parallel devices P")
  parser.add_argument("--mock-gpus", action="store_true",
                      help="compile for P mocked one-GPU hosts (needs one GPU)")
  parser.add_argument("--model", choices=sorted(workload.MODELS), default="resnet50")
  parser.add_argument("--rows", default=",".join(ROWS),
                      help=f"comma-separated rows of {', '.join(ROWS)}")
  parser.add_argument("--out", default="", help="also write the Markdown table to this path")
  parser.add_argument("--save-hlo", default="",
                      help="also write each compiled program's text into this folder")
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  rows = [r for r in args.rows.split(",") if r]
  unknown = [r for r in rows if r not in ROWS]
  if unknown:
    parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
  if args.devices < 2:
    parser.error("--devices must be >= 2")
  if args.mock_gpus:
    if "--xla_gpu_shard_autotuning=false" not in os.environ.get("XLA_FLAGS", ""):
      parser.error("--mock-gpus needs XLA_FLAGS to hold --xla_gpu_shard_autotuning=false:"
                   " the mocked hosts cannot share their autotuning results, and the"
                   " compile waits for them")
    jax.config.update("jax_mock_gpu_topology", f"1x{args.devices}x1")
    jax.config.update("jax_cuda_visible_devices", "0")
    if jax.default_backend() != "gpu":
      parser.error("--mock-gpus needs a GPU")
  else:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
  if len(jax.devices()) != args.devices:
    parser.error(f"JAX has {len(jax.devices())} devices, not {args.devices}")
  mesh = jax.sharding.Mesh(np.array(jax.devices()), (AXIS,))
  shapes = workload.MODELS[args.model]()
  if args.save_hlo:
    os.makedirs(args.save_hlo, exist_ok=True)
  found = []
  print("  ".join(COLUMNS), flush=True)
  for row in rows:
    for r in programs(row, shapes, mesh, save_hlo=args.save_hlo):
      print("  ".join(markdown_row(r)), flush=True)
      found.append(r)
  text = report(found, argv, args.devices, args.mock_gpus, args.model)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
