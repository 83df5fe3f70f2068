"""Compression compute per step: every jaxcomp compressor against the dense all-reduce.

On one process with a mesh of one device the collectives cost next to
nothing, so the time of ``update`` (compress, reduce, decompress) is the
compressor's compute (:func:`experiments.compute.compile_update`). The rows
are every method of :data:`jaxcomp.registry.METHODS` with its defaults
(``--rank`` and ``--density`` replace its own), the :data:`VARIANTS`, and
each of the :data:`FORMS` of a method whose steps alternate (ACP-SGD).
Gradient shapes are generated (``experiments.shapes``): ResNet-50 and a
12-layer, width-768 transformer. Each row is the median of ``--repeats``
rounds after a warm-up round; a round runs every compressor's step once, in
an order rotated from round to round, the state fed back from step to step
(ACP-SGD alternates its two halves); the ratio is to dense ``allreduce``'s
median, so a change in the machine's load falls on both alike. Beside the
milliseconds it prints what the compiled program does, which does not move
with the machine (:mod:`experiments.hlo_counts`): the kernels a step
launches and its passes over memory, the bytes its kernels read and write
over those of one f32 copy of the gradient; and the bytes of the buffers it
allocates anew on every step (``fresh``, over the same unit: on CPU their
first writes fault the pages in, which costs more than the passes). The last column
is the formula's bytes per device per step for ``--devices`` workers on a
ring, for scale. Every method also runs with buckets of ``--bucket-cap-mb``
MiB (25 by default, torch DDP's; 0: one bucket only). ``--out`` writes the
table as Markdown.

With ``--fast X`` it times instead, on a mesh ``(1, X)`` of axes
``("slow", "fast")`` (``X`` fake CPU devices), every registered method two
ways: flat, built over both axes, so every device compresses the whole
gradient; and :func:`jaxcomp.hierarchical` around it built over ``"slow"``,
so every device compresses its ``1/X`` shard after a dense reduce-scatter
over ``"fast"``. Its compression compute is each step less its dense
counterpart's, every exchange taken out; the dense programs are timed in the
same rounds as each method (:class:`HierarchicalRow`, :data:`DEFINITIONS`).

  python -m experiments.bench_compression --model all --repeats 9 \\
      --out experiments/results/bench_compression.md
  python -m experiments.bench_compression --fast 2 --model resnet50 --repeats 9 \\
      --out experiments/results/bench_compression_hierarchical.md
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import re
import statistics
import sys
import time
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from experiments import compute
from experiments import hlo_counts
from experiments import shapes
import jaxcomp
from jaxcomp import protocol
from jaxcomp import registry
from jaxcomp import selection
from jaxcomp import training
from jaxcomp import wire


def tiny() -> dict:
  """Four small leaves (875 elements, a scalar among them): for tests, not for timing."""
  leaf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  return {"conv": leaf(3, 3, 4, 8), "w": leaf(18, 32), "b": leaf(10), "s": leaf()}


MODELS = {"resnet50": shapes.resnet50, "transformer": shapes.transformer, "tiny": tiny}
# The models --model all runs (tiny is for tests).
ALL_MODELS = ("resnet50", "transformer")
GOAL = 0.6  # issue 14: hierarchical compression compute <= 0.6x the flat method's
SLOW, FAST = "slow", "fast"


# Extra rows beside each method's registry defaults: name -> configurations.
VARIANTS = {"signsgd": ({"majority_vote": True},)}
# Methods whose step takes one of several forms, by default: name -> {form: what it is}.
# Each form gets a row of its own, the program that `training.make_step` compiles
# for it (the form picked on the host), beside the one program that holds every
# form in a conditional (what `update` alone compiles).
FORMS = {"acpsgd": {0: "P step", 1: "Q step"}}


def _label(name: str, config: dict) -> str:
  text = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in config.items())
  return f"{name}({text})" if text else name


def settings(name: str, rank: int, density: float) -> dict:
  """The registry defaults of ``name``, its ``rank`` or ``density`` (where it has one) replaced."""
  overrides = {"rank": rank, "density": density}
  return {k: overrides.get(k, v) for k, v in registry.get(name).defaults.items()}


def compressors(
    rank: int, density: float, bucket_cap_mb: float = 0.0
) -> dict[str, Callable[[], optax.GradientTransformation]]:
  """Label -> factory of every registered method, and of its :data:`VARIANTS`.

  Each method runs with its :data:`jaxcomp.registry.METHODS` defaults, its
  ``rank`` or ``density`` (where it has one) replaced by these; with
  ``bucket_cap_mb`` (> 0), each also with buckets of that many MiB.
  """
  table = {}
  buckets = ({"bucket_cap_mb": bucket_cap_mb},) if bucket_cap_mb else ()
  for method in registry.METHODS.values():
    config = settings(method.name, rank, density)
    for variant in ({}, *VARIANTS.get(method.name, ()), *buckets):
      chosen = {**config, **variant}
      label = _label(method.name, chosen)
      build = functools.partial(registry.build, method.name, compute.AXIS, **chosen)
      table[label] = build
      for form, what in FORMS.get(method.name, {}).items():
        table[f"{label} {what}"] = functools.partial(in_form, build, form)
  return table


def in_form(build: Callable[[], optax.GradientTransformation],
            form: int) -> optax.GradientTransformation:
  """``build()`` whose every step takes ``form``, as a program of
  :func:`jaxcomp.training.make_step` picked on the host for it."""
  tx = build()

  def update_fn(updates, state, params=None, **extra_args):
    return tx.update(updates, state, params, **{**extra_args, protocol.FORM: form})

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


PROGRAMS = ("dense", "local_dense", "hier_dense", "half_local_dense", "flat", "flat_local",
            "hier", "half_local")


class HierarchicalRow(NamedTuple):
  """One method on the ``(1, X)`` mesh: seconds of each program in the same rounds.

  The programs (every one a step of ``update`` on every device of the mesh):
  ``"dense"``, ``allreduce`` over both axes; ``"local_dense"``, ``allreduce``
  over ``"slow"`` alone (a group of one: the fused copy, no exchange);
  ``"hier_dense"``, ``hierarchical(allreduce)``; ``"flat"``, the method over
  both axes; ``"flat_local"``, the method over ``"slow"`` alone (the whole
  gradient compressed, its collectives over a group of one); ``"hier"``,
  ``hierarchical`` of the method over ``"slow"``; ``"half_local"`` and
  ``"half_local_dense"``, the method and ``allreduce`` over ``"slow"`` alone on
  a gradient shaped like one device's shard (:func:`jaxcomp.training.shard_shapes`),
  without the hierarchy around them.

  Attributes:
    name: the registry name.
    label: the name with the settings it ran with.
    rounds: ``{program: [seconds of each timed round]}``.
    compile_s: ``{program: seconds of its compile}`` (``lower(...).compile()``).
    state_elements: ``{"flat": ..., "hier": ...}``, the elements of one
      device's compressor state (residual, momentum, factors) in each
      program: the hierarchical one is sized to the shard.
    passes: ``{program: passes}``, read from its compiled program
      (:func:`experiments.hlo_counts.count`, in units of the whole
      gradient's ``f32[n]``): what the timings measure, without their noise.
  """

  name: str
  label: str
  rounds: dict
  compile_s: dict
  state_elements: dict
  passes: dict

  def ms(self, program: str) -> float:
    """Median milliseconds per step of ``program``."""
    return statistics.median(self.rounds[program]) * 1e3

  @property
  def flat_compute_ms(self) -> float:
    """``flat_local - local_dense``: compressing the whole gradient, no exchange."""
    return self.ms("flat_local") - self.ms("local_dense")

  @property
  def hier_compute_ms(self) -> float:
    """``hier - hier_dense``: compressing the shard, the hierarchy's exchange taken out."""
    return self.ms("hier") - self.ms("hier_dense")

  @property
  def flat_compute_passes(self) -> float:
    """``flat_local - local_dense`` in passes over memory."""
    return self.passes["flat_local"] - self.passes["local_dense"]

  @property
  def hier_compute_passes(self) -> float:
    """``hier - hier_dense`` in passes over memory."""
    return self.passes["hier"] - self.passes["hier_dense"]

  @property
  def half_compute_ms(self) -> float:
    """``half_local - half_local_dense``: compressing a shard-shaped gradient, no hierarchy."""
    return self.ms("half_local") - self.ms("half_local_dense")

  @property
  def flat_over_dense_ms(self) -> float:
    """``flat - dense``: what the flat step adds to the dense step."""
    return self.ms("flat") - self.ms("dense")

  @property
  def hier_over_dense_ms(self) -> float:
    """``hier - dense``: what the hierarchical step adds to the dense step."""
    return self.ms("hier") - self.ms("dense")

  def _over(self, part: float, whole: float) -> Optional[float]:
    # allreduce's differences are noise around 0: no ratio.
    return part / whole if whole > 0 and self.name != "allreduce" else None

  @property
  def ratio(self) -> Optional[float]:
    """``hier_compute_ms / flat_compute_ms``, the goal's; ``None`` if flat compute <= 0."""
    return self._over(self.hier_compute_ms, self.flat_compute_ms)

  @property
  def passes_ratio(self) -> Optional[float]:
    """``hier_compute_passes / flat_compute_passes``."""
    return self._over(self.hier_compute_passes, self.flat_compute_passes)

  @property
  def half_ratio(self) -> Optional[float]:
    """``half_compute_ms / flat_compute_ms``: how the method's compute follows n."""
    return self._over(self.half_compute_ms, self.flat_compute_ms)

  @property
  def step_ratio(self) -> Optional[float]:
    """``hier_over_dense_ms / flat_over_dense_ms``; ``None`` if flat is no slower than dense."""
    return self._over(self.hier_over_dense_ms, self.flat_over_dense_ms)

  @property
  def meets_goal(self) -> Optional[bool]:
    """``ratio <= GOAL``; ``None`` for ``allreduce`` (the baseline) or without a ratio."""
    return None if self.ratio is None else self.ratio <= GOAL


class _Program(NamedTuple):
  """One compiled step of :func:`hierarchical_rows`."""

  step: Callable[[], object]
  compile_s: float
  passes: float
  state_elements: int


def _program(tx, mesh, grads, params, n: int) -> _Program:
  """One step of ``tx.update`` on every device, its state fed back from step to step;
  its compile seconds, its passes over ``f32[n]`` and the elements of one device's state."""
  axes = (SLOW, FAST)  # the arrays' rows, one per device, whichever axes tx reduces over
  compiled = compute.compile_update(tx, params, mesh, axes, per_device_grads=grads)
  elements = sum(x.size for x in jax.tree.leaves(jax.eval_shape(tx.init, params)))
  return _Program(compiled.step, compiled.compile_s,
                  hlo_counts.count(compiled.program, n, jax.default_backend()).passes,
                  elements)


def _seconds(step: Callable[[], object]) -> float:
  start = time.perf_counter()
  jax.block_until_ready(step())
  return time.perf_counter() - start


def timed_rounds(programs: dict, repeats: int) -> tuple[dict, dict]:
  """A warm-up round, then ``repeats`` rounds of every program once: ``(warm-up s, rounds)``.

  The programs run one after the other, each step blocked before the next
  starts, in an order rotated by one from round to round, so a change in the
  machine's load falls on all of them alike.
  """
  order = list(programs)
  warmup_s = {p: _seconds(programs[p]) for p in order}
  rounds = {p: [] for p in order}
  for r in range(repeats):
    for p in order[r % len(order):] + order[:r % len(order)]:
      rounds[p].append(_seconds(programs[p]))
  return warmup_s, rounds


def hierarchical_rows(
    model_shapes, fast: int, names, rank: int, density: float, repeats: int,
    log: Callable[[str], None] = lambda line: None,
) -> list[HierarchicalRow]:
  """Times every method in ``names`` flat and hierarchical on a ``(1, fast)`` mesh.

  Each device gets its own Gaussian gradient shaped like ``model_shapes``.
  The three dense programs of :class:`HierarchicalRow` are compiled once and
  timed again in every method's rounds, so each row's differences and ratios
  come from the same rounds.
  """
  mesh = training.make_mesh((1, fast), (SLOW, FAST))

  def inputs(like, seed):
    stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((fast,) + s.shape, s.dtype), like)
    return (training.shard(shapes.normal(stacked, jax.random.key(seed)), mesh, (SLOW, FAST)),
            shapes.zeros(like))

  whole = inputs(model_shapes, 0)
  half = inputs(training.shard_shapes(model_shapes, fast), 1)
  n = shapes.num_params(model_shapes)
  build = lambda tx, data=whole: _program(tx, mesh, *data, n)  # noqa: E731
  allreduce = functools.partial(registry.build, "allreduce")
  dense = {
      "dense": build(allreduce((SLOW, FAST))),
      "local_dense": build(allreduce(SLOW)),
      "hier_dense": build(jaxcomp.hierarchical(allreduce(SLOW), FAST, fast)),
      "half_local_dense": build(allreduce(SLOW), half),
  }
  rows = []
  for name in names:
    config = settings(name, rank, density)
    programs = {
        **dense,
        "flat": build(registry.build(name, (SLOW, FAST), **config)),
        "flat_local": build(registry.build(name, SLOW, **config)),
        "hier": build(jaxcomp.hierarchical(registry.build(name, SLOW, **config), FAST, fast)),
        "half_local": build(registry.build(name, SLOW, **config), half),
    }
    _, rounds = timed_rounds({p: program.step for p, program in programs.items()}, repeats)
    row = HierarchicalRow(
        name, _label(name, config), rounds,
        {p: program.compile_s for p, program in programs.items()},
        {"flat": programs["flat"].state_elements, "hier": programs["hier"].state_elements},
        {p: program.passes for p, program in programs.items()})
    rows.append(row)
    log(f"  {row.label}: " + ", ".join(f"{p} {row.ms(p):.1f}" for p in PROGRAMS) + " ms")
    del programs  # their states go before the next method's are made
  return rows


STEP_COLUMNS = ("compressor", "dense ms", "flat ms", "hier ms", "local dense ms",
                "flat local ms", "hier(dense) ms", "half local dense ms", "half local ms",
                "compile s flat / hier")
COMPUTE_COLUMNS = ("compressor", "flat compute ms", "hier compute ms", "hier/flat",
                   f"<= {GOAL:g}", "passes flat / hier compute", "hier/flat passes",
                   "half-n compute ms", "half-n/flat", "flat - dense ms",
                   "hier - dense ms", "(hier - dense)/(flat - dense)",
                   "state elements/device flat / hier")


def _ratio(value: Optional[float]) -> str:
  return "n/a" if value is None else f"{value:.2f}"


def _goal(row: HierarchicalRow) -> str:
  if row.name == "allreduce":
    return "n/a (baseline)"
  return {None: "n/a", True: "yes", False: "**no**"}[row.meets_goal]


def _markdown(columns, lines) -> str:
  return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                   + ["| " + " | ".join(cells) + " |" for cells in lines])


def render_rows(rows: list[HierarchicalRow]) -> str:
  """Two Markdown tables: :data:`STEP_COLUMNS` (ms/step), then :data:`COMPUTE_COLUMNS`."""
  steps = [[row.label,
            *(f"{row.ms(p):.2f}" for p in ("dense", "flat", "hier", "local_dense",
                                           "flat_local", "hier_dense", "half_local_dense",
                                           "half_local")),
            f"{row.compile_s['flat']:.1f} / {row.compile_s['hier']:.1f}"] for row in rows]
  computes = [[row.label, f"{row.flat_compute_ms:.2f}", f"{row.hier_compute_ms:.2f}",
               _ratio(row.ratio), _goal(row),
               f"{row.flat_compute_passes:.2f} / {row.hier_compute_passes:.2f}",
               _ratio(row.passes_ratio), f"{row.half_compute_ms:.2f}",
               _ratio(row.half_ratio), f"{row.flat_over_dense_ms:.2f}",
               f"{row.hier_over_dense_ms:.2f}", _ratio(row.step_ratio),
               f"{row.state_elements['flat']:,} / {row.state_elements['hier']:,}"]
              for row in rows]
  return (_markdown(STEP_COLUMNS, steps) + "\n\nCompression compute per device:\n\n"
          + _markdown(COMPUTE_COLUMNS, computes))


DEFINITIONS = f"""\
- Programs (each a step of `update` on both devices at once, ms/step):
  - **dense**: `allreduce` over `("slow", "fast")`: one `psum` of the whole gradient over
    the X devices, the baseline step.
  - **flat**: the method built over `("slow", "fast")`: every device compresses the whole
    gradient and exchanges its payload with the other devices.
  - **hier**: `jaxcomp.hierarchical(method over "slow", "fast", X)`: a dense reduce-scatter
    over "fast", the method on this device's 1/X row-block shard, an all-gather back. The
    "slow" axis is a group of one here, so the method's own collectives exchange nothing.
  - **local dense**: `allreduce` over "slow" alone (a group of one): the fused copy in and out
    that every method pays, without any exchange.
  - **flat local**: the method over "slow" alone: every device compresses the whole
    gradient, its collectives over a group of one (nothing exchanged).
  - **hier(dense)**: `hierarchical(allreduce("slow"), "fast", X)`: the hierarchy's
    reduce-scatter, layout and all-gather around a fused copy of the shard.
  - **half local**, **half local dense**: the method and `allreduce` over "slow" alone on a
    gradient shaped like one device's shard (`jaxcomp.training.shard_shapes`), no hierarchy.
- **flat compute** = flat local - local dense; **hier compute** = hier - hier(dense): the
  compression's own compute per device, every exchange taken out of both (the hierarchical
  method's "slow" collectives are over a group of one, as flat local's are). **hier/flat** is
  their ratio, the goal's (issue 14: <= {GOAL:g}); n/a where flat compute <= 0 and for allreduce.
  A method whose mean has a compact form (`protocol.Message`: powersgd, acpsgd) gathers its
  factors over "fast", not the shard's mean: hier(dense)'s gradient-sized all-gather is then
  taken out of hier without being paid there, so its hier compute is its compute (the
  products of every shard included) less the all-gather the factors save, and can be near 0
  or below; its half-n/flat is the ratio of its compute alone.
- **passes flat / hier compute** and **hier/flat passes**: the same differences in passes
  over memory, read from each compiled program (`experiments.hlo_counts`; bytes read and
  written over 4n, n the whole gradient's elements): the traffic the timings measure, free
  of their noise (0.5 when the hierarchy halves each device's traffic).
- **half-n compute** = half local - half local dense: the method's compute on the shard's
  shapes without the hierarchy; **half-n/flat** shows how the method's own compute follows n
  (0.5 if it is proportional to n): where hier/flat misses the goal and half-n/flat misses it
  too, the method's compute does not halve with n; where only hier/flat misses, the hierarchy
  costs more around the method than around a fused copy.
- **flat - dense**, **hier - dense** and their ratio: each step less the dense step, shown for
  comparison, not for the goal. flat - dense holds flat's own exchange over the X devices
  (flat - flat local) less dense's (dense - local dense), which hier, on a "slow" group of one,
  does not pay; hier - dense holds the hierarchy's exchange and layout beyond dense's.
- Each dense program is timed in every method's rounds; the allreduce row's flat, flat local,
  hier and half local are the same programs as dense, local dense, hier(dense) and half local
  dense compiled again, so their differences show the noise of a difference here.
- **state elements/device**: the elements of one device's compressor state (residual,
  momentum, factors, counters), flat and hierarchical: the hierarchical state is sized to the
  shard (rows padded to a multiple of X)."""


def _cpu_note(fast: int) -> str:
  cores = os.cpu_count()
  device = jax.devices()[0]
  if device.platform != "cpu":
    return f"{fast} devices of {device.device_kind} ({device.platform})"
  return (f"{fast} fake CPU devices (`jax_num_cpu_devices`) in one process on {cores} CPU"
          f" cores ({processor()}): each device gets roughly {cores / fast:g} core(s) (the"
          " devices share XLA's CPU thread pool; nothing is pinned)")


def run_hierarchical(args, argv, names, log=print) -> str:
  """The ``--fast`` mode: times every model of ``args``, returns the Markdown report."""
  start, load_start = time.perf_counter(), os.getloadavg()[0]
  models = list(ALL_MODELS) if args.model == "all" else [args.model]
  header = [
      f"# Hierarchical vs flat compression compute, fast axis of {args.fast}", "",
      f"Command: `python -m experiments.bench_compression {' '.join(argv)}`", "",
      f"Date {datetime.date.today().isoformat()}; jax {jax.__version__}, backend"
      f" {jax.default_backend()}; {_cpu_note(args.fast)}. Mesh (1, {args.fast}), axes"
      f" (\"slow\", \"fast\"). Each figure is the median of {args.repeats} rounds after a"
      " warm-up round (the compiles, excluded); a round runs each of the eight programs below"
      " once, one after the other, each step under `jax.block_until_ready`, in an order"
      f" rotated from round to round. Rank {args.rank}, density {args.density:g}, other"
      " settings the registry's defaults.", ""]
  log("\n".join(header))
  sections = []
  for model in models:
    model_shapes = MODELS[model]()
    title = f"## {model}: {shapes.num_params(model_shapes):,} gradient elements"
    log(title)
    rows = hierarchical_rows(model_shapes, args.fast, names, args.rank, args.density,
                             args.repeats, log=log)
    met = [r.name for r in rows if r.meets_goal]
    missed = [r.name for r in rows if r.meets_goal is False]
    by_step = [r.name for r in rows
               if r.name != "allreduce" and r.step_ratio is not None and r.step_ratio <= GOAL]
    summary = (f"hier/flat <= {GOAL:g}: {', '.join(met) or 'none'}; missed:"
               f" {', '.join(missed) or 'none'}. By (hier - dense)/(flat - dense) <= {GOAL:g}:"
               f" {', '.join(by_step) or 'none'}.")
    table = render_rows(rows)
    log("\n" + table + "\n\n" + summary + "\n")
    sections += [title, "", "Step time:", "", table, "", summary, ""]
  wall = time.perf_counter() - start
  footer = [f"Wall time of the run: {wall:.0f} s; 1-minute load average {load_start:.2f} at"
            f" the start, {os.getloadavg()[0]:.2f} at the end (the run's own threads included).",
            "", "How to read it:", "", DEFINITIONS, ""]
  log("\n".join(footer))
  return "\n".join(header + sections + footer)


def hierarchical_names(only: str = "") -> list[str]:
  """The registry's names (``allreduce`` always), kept to the ``--only`` prefixes if any."""
  return list(selected(dict.fromkeys(registry.names()), only))


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
  """``--rank`` and ``--density``, which replace each method's own (:func:`compressors`)."""
  parser.add_argument("--rank", type=int, default=4, help="PowerSGD / ACP-SGD rank")
  parser.add_argument("--density", type=float, default=0.001, help="sparsifiers' density")


def selected(table: dict, only: str) -> dict:
  """The rows of ``table`` whose label starts with one of the comma-separated prefixes
  of ``only`` (every row when it names none), and always the dense baseline's
  (``allreduce``, with buckets too)."""
  wanted = [p for p in only.split(",") if p]
  return {label: factory for label, factory in table.items()
          if label.startswith("allreduce") or not wanted
          or any(label.startswith(p) for p in wanted)}


def _use_cpu_devices(count: int) -> None:
  """``count`` fake CPU devices, where JAX has not started yet (a test's conftest may have)."""
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:  # the backend is up already: use its devices if there are enough
    pass


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m experiments.bench_compression",
      description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=[*MODELS, "all"], default="all",
                      help="all: resnet50 and transformer")
  parser.add_argument("--repeats", type=int, default=5, help="timed steps per compressor")
  add_setting_flags(parser)
  parser.add_argument("--devices", type=int, default=8,
                      help="workers for the bytes column (formula, ring)")
  parser.add_argument("--only", default="",
                      help="comma-separated name prefixes of compressors to run")
  parser.add_argument("--fast", type=int, default=0,
                      help="X >= 2: flat against jaxcomp.hierarchical on a (1, X) mesh of"
                           " X fake CPU devices (0: the one-device table)")
  parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                      help="also run every compressor with buckets of this many MiB"
                           " (bucket_cap_mb; 0: one bucket only)")
  parser.add_argument("--out", default="",
                      help="also write the Markdown report to this path")
  parser.add_argument("--save-hlo", default="",
                      help="also write each compiled program's text into this folder"
                           " (the one-device table)")
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error("--repeats must be >= 1")
  if args.fast == 1 or args.fast < 0:
    parser.error("--fast must be 0 (off) or >= 2")
  if args.bucket_cap_mb < 0:
    parser.error("--bucket-cap-mb must be >= 0 (0: one bucket only)")
  if args.save_hlo and args.fast:
    parser.error("--save-hlo writes the one-device table's programs: not with --fast")

  if args.fast:
    _use_cpu_devices(args.fast)
    if len(jax.devices()) < args.fast:
      parser.error(f"--fast {args.fast} needs {args.fast} devices, JAX has"
                   f" {len(jax.devices())} (set before JAX started)")
    report = run_hierarchical(args, argv, hierarchical_names(args.only))
  else:
    report = run_single(args, argv, selected(
        compressors(args.rank, args.density, args.bucket_cap_mb), args.only))
  if args.out:
    with open(args.out, "w") as f:
      f.write(report)


SINGLE_COLUMNS = ("compressor", "ms/step", "x dense", "compile s", "kernels", "passes",
                  "fresh", "MB/dev")


def _device_note() -> str:
  device = jax.devices()[0]
  if device.platform == "cpu":
    return (f"one CPU device on {os.cpu_count()} cores ({processor()}), {_malloc_note()},"
            f" {_native_note()}")
  return f"one {device.device_kind} ({device.platform})"


def _native_note() -> str:
  """Whether topk's and gTop-k's exact selections ran as the native custom call (one kernel
  each) or in JAX (about 43): their rows' kernels and compile time differ by it."""
  reason = selection.native_unavailable_reason()
  if reason is None:
    return "the exact top-k as jaxcomp's native custom call"
  return f"the exact top-k in JAX (no native custom call: {reason})"


def processor(cpuinfo: Optional[str] = None) -> str:
  """The CPU's model and the widest vector instructions XLA:CPU may use on it, e.g.
  ``"AMD EPYC, AVX2"``: XLA:CPU compiles for the CPU it runs on, so milliseconds
  compare across tables only between CPUs alike (kernels and passes do not
  change). Read from ``cpuinfo`` (the text of ``/proc/cpuinfo`` by default) and
  ``XLA_FLAGS`` (``--xla_cpu_max_isa``); ``"CPU not named"`` without the file."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    except OSError:
      return "CPU not named"
  model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
  parts = [model.group(1).strip() if model else "CPU"]
  flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
  if flags:  # x86's; other CPUs name their features otherwise
    flags = set(flags.group(1).split())
    parts.append("AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags
                 else "AVX" if "avx" in flags else "no AVX")
  capped = re.search(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", ""))
  if capped:
    parts.append(f"XLA capped at {capped.group(1)}")
  return ", ".join(parts)


def _malloc_note() -> str:
  """How glibc's malloc was told to back this process's memory (``GLIBC_TUNABLES``, read
  when the process starts): XLA:CPU allocates a step's temporaries and outputs anew each
  step, and glibc maps any buffer over 32 MiB afresh, so its pages fault in one by one
  unless malloc asks for huge pages (``glibc.malloc.hugetlb=1``)."""
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb=" in tunables:
    return f"`GLIBC_TUNABLES={tunables}`"
  return "glibc malloc's default pages"


def save_program(folder: str, label: str, text: str) -> str:
  """Write ``text`` to ``folder`` under ``label`` made a file name (letters, digits,
  ``.``, ``_``, ``-``); the path written."""
  os.makedirs(folder, exist_ok=True)
  name = re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9.-]", "_", label)).strip("_")
  path = os.path.join(folder, f"{name}.hlo.txt")
  with open(path, "w") as f:
    f.write(text)
  return path


def run_single(args, argv, table: dict, log=print) -> str:
  """The one-device table of every compressor in ``table`` (label -> factory); its Markdown."""
  models = list(ALL_MODELS) if args.model == "all" else [args.model]
  header = [
      "# Compression compute on one device", "",
      f"Command: `python -m experiments.bench_compression {' '.join(argv)}`", "",
      f"Date {datetime.date.today().isoformat()}; jax {jax.__version__}, backend"
      f" {jax.default_backend()}, {_device_note()}. ms/step is the median of"
      f" {args.repeats} rounds after a warm-up round; a round runs every compressor's step"
      " once, each blocked before the next, in an order rotated from round to round, so"
      " that a change in the machine's load falls on all alike; x dense is the ratio to"
      " `allreduce`'s median in the same rounds. The rows of one bucket and those with"
      " buckets run in rounds of their own, each with `allreduce` (the programs of a round"
      " hold their states at once: about 12 GB a phase for the transformer, twice that in"
      " one round). compile s is `lower(...).compile()`. **kernels** and **passes** are"
      " read from the compiled program (`experiments.hlo_counts`): the kernels a step"
      " launches (fusions, copies, sorts, collectives...; a loop body once, a conditional's"
      " lightest branch that does any work) and the bytes they read and write over 4n, the"
      " bytes of one f32 copy of the gradient (dense reads and writes the gradient three"
      " times: 6 passes). **fresh** is the bytes of the buffers a step allocates anew"
      " (XLA's memory analysis: temporaries and outputs, less the outputs written over the"
      " donated state; a conditional's branches counted whether taken or not) over 4n: on CPU"
      " each is new memory on every step, whose first writes fault its pages in, and it"
      " explains the milliseconds better than the passes do, unless malloc backs it with"
      " huge pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` set when the process starts,"
      " named above where it was): every step is then faster, dense's most."
      f" MB/dev is the formula's bytes per device per step for {args.devices} workers on a"
      " ring. A method whose steps alternate between forms (ACP-SGD's P and Q steps)"
      " has a row for the one program that holds both in a conditional (`update` alone)"
      " and a row for each form's own program, as `training.make_step` compiles and picks"
      " it on the host (its MB/dev the method's mean over its forms).", ""]
  log("\n".join(header))
  sections = []
  for model in models:
    grads = shapes.normal(MODELS[model](), jax.random.key(0))
    n = shapes.num_params(grads)
    title = f"## {model}: {n:,} gradient elements"
    log(title)
    txs = {label: factory() for label, factory in table.items()}
    # One device copy of the gradient for every program (a step donates its
    # state only): a copy each held 20 x 435 MB for the transformer.
    mesh = training.make_mesh(1)
    per_device = training.stack_per_device(grads, mesh, compute.AXIS)
    compiled, step_s, baseline, phase_dense = {}, {}, {}, []
    for phase in single_phases(list(txs)):
      programs = {label: compute.compile_update(txs[label], grads, mesh,
                                                per_device_grads=per_device)
                  for label in phase}
      _, rounds = timed_rounds({label: c.step for label, c in programs.items()}, args.repeats)
      dense = statistics.median(rounds["allreduce"]) if "allreduce" in rounds else None
      phase_dense.append(dense)
      for label in phase:
        if label not in compiled:  # allreduce: its first phase's row
          compiled[label] = programs[label]._replace(step=None)
          step_s[label] = statistics.median(rounds[label])
          baseline[label] = dense
      del programs  # and with them the phase's states
    lines = []
    for label, tx in txs.items():
      if args.save_hlo:
        save_program(args.save_hlo, f"{model} {label}", compiled[label].program)
      counts = hlo_counts.count(compiled[label].program, n, jax.default_backend())
      fresh = compiled[label].fresh_bytes
      mbytes = float(wire.expected_bytes(tx, grads, args.devices).total) / 1e6
      cells = [label, f"{step_s[label] * 1e3:.1f}",
               _ratio(step_s[label] / baseline[label] if baseline[label] else None),
               f"{compiled[label].compile_s:.1f}", f"{counts.kernels}", f"{counts.passes:.1f}",
               "" if fresh is None else f"{fresh / (4 * n):.1f}", f"{mbytes:.3f}"]
      log("  ".join(cells), flush=True)
      lines.append(cells)
    del compiled
    sections += [title, "", _markdown(SINGLE_COLUMNS, lines), ""]
    if len(phase_dense) > 1 and phase_dense[1]:
      note = (f"The rows with buckets were timed in rounds of their own, with `allreduce`"
              f" ({phase_dense[1] * 1e3:.1f} ms there): their x dense is to that.")
      log(note)
      sections += [note, ""]
  return "\n".join(header + sections)


def single_phases(labels: list[str]) -> list[list[str]]:
  """The rounds of the one-device table: the rows of one bucket, then those with
  buckets, each phase with ``allreduce`` (of one bucket) for its ratios.

  A phase holds the state of each of its programs at once (a residual of the
  whole gradient for most): the transformer's phases each held about 12 GB of a
  23 GB machine, every row in one round twice that, and a step's page faults
  grow slower as memory fills (dense's one-bucket step, 1.3 GB of new memory:
  570 ms alone, 893 ms beside 17 GB held). Its time also moves with the other
  programs of its round (539 ms among the one-bucket rows and 785 ms among
  those with buckets in one run; 1,138 ms with every row in one round).
  """
  one = [label for label in labels if "bucket_cap_mb" not in label]
  bucketed = [label for label in labels if "bucket_cap_mb" in label]
  phases = [one]
  if bucketed:
    phases.append((["allreduce"] if "allreduce" in labels else []) + bucketed)
  return phases


if __name__ == "__main__":
  main()
