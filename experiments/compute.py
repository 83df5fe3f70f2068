"""Compression compute: timed on the machine at hand, and the figures timed here before.

The cost model (:mod:`jaxcomp.costmodel`) is arithmetic only; the seconds of
computation it adds to a step come from here. :func:`time_update` and
:func:`measure` time a compressor's ``update`` on a mesh of one device, where
its collectives run over a group of one, so what is left is the compression
itself (selection, packing, projections, error feedback) and the fused copy
in and out that dense pays too. :func:`measure_step` times a whole training
step (forward, backward and compression) the same way.

:data:`NS_PER_ELEMENT` holds figures measured with
``experiments.bench_compression`` on ResNet-50's 25.6M gradient elements:
each method's median step less dense ``allreduce``'s in the same run (the
fused copy every method pays, which is not compression), divided by the
element count, 0 where a method measured no slower than dense, averaged
over two runs. They are measurements of one machine (:data:`DEVICE`), not
properties of the methods: re-measure them for another.

Example::

  seconds = compute.measure(jaxcomp.topk(0.001, "data"), shapes.resnet50())
  figure = compute.compression_s("topk", shapes.num_params(shapes.resnet50()))
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple, Optional, Union

import jax
from jax.sharding import Mesh
import optax

from experiments import shapes
from jaxcomp import training

AXIS = "data"

DEVICE = "2 CPU cores, one process, one device, jax 0.10.2"
_ALL_METHODS = ("python -m experiments.bench_compression --model resnet50 --repeats 9"
                " --bucket-cap-mb 0")
_RUNS = ("the mean of two runs (dense 104.4 and 101.8 ms per step, every method's step"
         " timed in the same rotated rounds)")


class Measurement(NamedTuple):
  """Compression nanoseconds per gradient element, and how they were measured.

  Attributes:
    ns_per_element: the method's median step less dense ``allreduce``'s,
      divided by the element count (0 when no slower than dense).
    command: the benchmark run it comes from (rank 4, density 0.001: the
      benchmark's defaults; random-k at 0.001 too).
    date: the day of the run.
    note: what the run saw beside the figure.
  """

  ns_per_element: float
  command: str
  date: str
  note: str


_QUANTIZER_RUNS = ("the mean of two runs once the two-hop quantizers tested their gathered"
                   " scales instead of the mean (dense 109.1 and 111.2 ms per step; qsgd 205.3"
                   " and 208.3, quantized 197.4 and 205.3, in the same rotated rounds)")


_CHUNKED_RUNS = ("the mean of two runs once the per-chunk top-k searched blocks and DeMo"
                 " padded its chunks in error feedback's addition (dense 129.9 and 120.0 ms"
                 " per step; sparseloco 150.0 and 151.6, demo 174.3 and 173.1, in the same"
                 " rotated rounds; density 0.001: one of every 64 DCT coefficients for demo)")


_SPARSIFIER_RUNS = ("the mean of two runs once the mask of what was sent came to be packed"
                    " (dense 127.0 and 125.1 ms per step; topk 117.9 and 118.9, gtopk 116.6"
                    " and 117.3, randomk 102.9 and 106.4, dgc 144.3 and 151.2, in the same"
                    " rotated rounds)")
_SPARSIFIERS = _ALL_METHODS + " --only allreduce,topk,gtopk,randomk,dgc"


def _bench_run(figure: float, command: str = _ALL_METHODS, note: str = _RUNS,
               date: str = "2026-11-26") -> Measurement:
  return Measurement(figure, command, date, note)


# On :data:`DEVICE`, ResNet-50 shapes (25,557,032 elements), one bucket, after
# the residual came to be written in place with the keep-or-skip decision in
# the same kernels (experiments/results/bench_compression.md): each method's
# step less dense's, in ms per step, in the two runs: signsgd 7.2 and 11.1,
# powersgd 24.7 and 31.7, acpsgd 25.1 and 25.9; cast faster than dense in
# both (0); a run no slower than dense counts 0. The sparsifiers, the
# quantizers and the per-chunk methods come from later pairs of runs (their
# notes): topk, gtopk and randomk were faster than dense in both of theirs.
NS_PER_ELEMENT: dict[str, Measurement] = {
    "allreduce": _bench_run(0.0),
    "cast": _bench_run(0.0),
    "topk": _bench_run(0.0, _SPARSIFIERS, _SPARSIFIER_RUNS, "2026-11-27"),
    "gtopk": _bench_run(0.0, _SPARSIFIERS, _SPARSIFIER_RUNS, "2026-11-27"),
    "randomk": _bench_run(0.0, _SPARSIFIERS, _SPARSIFIER_RUNS, "2026-11-27"),
    "dgc": _bench_run(0.85, _SPARSIFIERS, _SPARSIFIER_RUNS, "2026-11-27"),
    "signsgd": _bench_run(0.36),
    "qsgd": _bench_run(3.78, _ALL_METHODS + " --only allreduce,qsgd,quantized",
                       _QUANTIZER_RUNS),
    "quantized": _bench_run(3.57, _ALL_METHODS + " --only allreduce,qsgd,quantized",
                            _QUANTIZER_RUNS),
    "sparseloco": _bench_run(1.01, _ALL_METHODS + " --only allreduce,sparseloco,demo",
                             _CHUNKED_RUNS, "2026-11-27"),
    "demo": _bench_run(1.91, _ALL_METHODS + " --only allreduce,sparseloco,demo",
                       _CHUNKED_RUNS, "2026-11-27"),
    "powersgd": _bench_run(1.10),
    "acpsgd": _bench_run(1.00),
}


def compression_s(name: str, num_elements: int) -> float:
  """Seconds of compression of ``num_elements`` by ``name``, from :data:`NS_PER_ELEMENT`."""
  if name not in NS_PER_ELEMENT:
    raise ValueError(f"`name` must be one of {list(NS_PER_ELEMENT)}, got {name!r}")
  return NS_PER_ELEMENT[name].ns_per_element * 1e-9 * num_elements


def _timed(call: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
  """``(seconds of the first call, seconds of each of the next repeats)``."""
  if repeats < 1:
    raise ValueError(f"`repeats` must be >= 1, got {repeats}")
  start = time.perf_counter()
  jax.block_until_ready(call())
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return first, times


class UpdateTiming(NamedTuple):
  """What :func:`time_update` measured.

  Attributes:
    compile_s: seconds to compile the step (``lower(...).compile()``).
    step_s: median seconds of a step after a warm-up step.
    program: the compiled program's optimized HLO text (for
      :func:`experiments.hlo_counts.count`).
  """

  compile_s: float
  step_s: float
  program: str


class CompiledUpdate(NamedTuple):
  """What :func:`compile_update` built.

  Attributes:
    compile_s: seconds to compile the step (``lower(...).compile()``).
    step: runs one step on the fixed gradient, the state fed back; returns
      ``(updates, state)`` without blocking.
    program: the compiled program's optimized HLO text.
    fresh_bytes: the bytes of the buffers a step allocates anew (XLA's
      temporaries and outputs, less the outputs written over a donated
      input; the temporaries of a conditional's branches count whether the
      branch runs or not); ``None`` where the backend gives no memory analysis.
  """

  compile_s: float
  step: Callable[[], object]
  program: str
  fresh_bytes: Optional[int] = None


def compile_update(
    tx: optax.GradientTransformation, grads: optax.Updates, mesh: Optional[Mesh] = None,
    axis_name: Union[str, tuple[str, str]] = AXIS,
    per_device_grads: Optional[optax.Updates] = None,
) -> CompiledUpdate:
  """``tx.update`` compiled on ``mesh`` (one device by default), its donated state fed back
  from step to step.

  ``grads`` shapes the state; every device is given ``grads`` itself, or its
  own row of ``per_device_grads`` (:func:`jaxcomp.training.make_update`'s
  layout). ``tx`` must be built over ``axis_name`` (ACP-SGD alternates its
  two halves from step to step, DGC walks its schedule).
  """
  mesh = training.make_mesh(1) if mesh is None else mesh
  state = training.init_state(tx, grads, mesh, axis_name)
  if per_device_grads is None:
    per_device_grads = training.stack_per_device(grads, mesh, axis_name)
  start = time.perf_counter()
  update = training.make_update(tx, mesh, axis_name, donate=True).lower(
      per_device_grads, state).compile()
  compile_s = time.perf_counter() - start

  def step():
    nonlocal state
    out, state = update(per_device_grads, state)
    return out, state

  memory = update.memory_analysis()
  fresh = None if memory is None else (memory.temp_size_in_bytes + memory.output_size_in_bytes
                                       - memory.alias_size_in_bytes)
  return CompiledUpdate(compile_s, step, update.as_text(), fresh)


def time_update(
    tx: optax.GradientTransformation, grads: optax.Updates, repeats: int
) -> UpdateTiming:
  """Compile seconds, median seconds per step and the program of ``tx.update`` on one device.

  ``tx`` must be built over the axis ``"data"`` (see :func:`compile_update`).
  """
  compiled = compile_update(tx, grads)
  _, times = _timed(compiled.step, repeats)
  return UpdateTiming(compiled.compile_s, statistics.median(times), compiled.program)


def measure(tx: optax.GradientTransformation, params: optax.Params, repeats: int = 5) -> float:
  """Median seconds of ``tx.update`` on one device, on a Gaussian gradient like ``params``."""
  grads = shapes.normal(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
                        jax.random.key(0))
  return time_update(tx, grads, repeats).step_s


def measure_step(
    loss_fn: training.LossFn, tx: optax.GradientTransformation, params: optax.Params,
    batch, repeats: int = 10,
) -> float:
  """Median seconds of one training step (forward, backward, ``tx``) on one device.

  The step a worker runs between exchanges, on a mesh of one device (its
  collectives over a group of one), without other devices sharing the cores.
  ``batch`` is one worker's batch; ``tx`` must be built over the axis ``"data"``.
  """
  mesh = training.make_mesh(1)
  params = training.replicate(params, mesh)
  state = training.init_state(tx, params, mesh, AXIS)
  batch = training.shard(batch, mesh, AXIS)
  train_step = training.make_step(loss_fn, tx, mesh, AXIS)

  def step():
    nonlocal params, state
    params, state, metrics = train_step(params, state, batch)
    return metrics

  return statistics.median(_timed(step, repeats)[1])
