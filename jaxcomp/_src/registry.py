"""The one list of methods: each name's factory, defaults and what it requires after it.

The cost model, the experiments, the benchmarks and the test suites read
:data:`METHODS`; adding a method to jaxcomp is one module and one entry here.
A method's wire formula travels with the transformation its factory builds
(:func:`jaxcomp.protocol.spec`), so :func:`wire_cost` gives it by name.

Example::

  tx = registry.build("gtopk", "data", density=0.01)
  registry.check_chain(optax.chain(tx, optax.sgd(0.1)), params)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import numpy as np
import optax

from jaxcomp._src import checks
from jaxcomp._src import demo
from jaxcomp._src import dgc
from jaxcomp._src import dense
from jaxcomp._src import lowrank
from jaxcomp._src import signsgd
from jaxcomp._src import sparseloco
from jaxcomp._src import sparsify
from jaxcomp._src import qsgd
from jaxcomp._src import quantized
from jaxcomp._src import wire

# Optimizer states that carry a momentum (first moment) of their own.
_MOMENTUM_STATES = tuple(
    getattr(optax, name) for name in (
        "TraceState", "ScaleByAdamState", "ScaleByAmsgradState", "ScaleByBeliefState",
        "ScaleByLionState", "ScaleByNovogradState", "ScaleByAdanState")
    if hasattr(optax, name))


class Entry(NamedTuple):
  """One registered method.

  Attributes:
    name: its registry name (the public factory's name).
    factory: ``factory(axis_name=..., **config)``.
    state: the class of its state.
    defaults: the configuration a name alone stands for (the papers' usual
      settings).
    summary: one line for tables.
    forbids_after: optimizer state types that must not follow it in a chain.
    requirement: what a user must do after it, in words (``""``: nothing).
  """

  name: str
  factory: Callable[..., optax.GradientTransformation]
  state: type
  defaults: Mapping[str, Any]
  summary: str
  forbids_after: tuple[type, ...] = ()
  requirement: str = ""


# Default configurations: density 0.1% for the top-k family and DGC (DGC
# paper, after warm-up), 1% for random-k (it needs more to converge), rank 4
# for the low-rank methods (PowerSGD's ImageNet setting), 8 levels (4 bits) for
# QSGD as in its paper's ImageNet runs, 8 bits for the integer quantizer
# (INTELLECT-1's int8 all-reduce), 64 of every 4096 entries for SparseLoCo (its
# paper's k = 64), 2 of every 64 DCT coefficients for DeMo.
METHODS: dict[str, Entry] = {m.name: m for m in (
    Entry("allreduce", dense.allreduce, optax.EmptyState, {},
           "dense mean, the S-SGD baseline"),
    Entry("cast", dense.cast, optax.EmptyState, {"dtype": "bfloat16"},
           "16-bit values on the wire"),
    Entry("topk", sparsify.topk, sparsify.TopKState, {"density": 0.001},
           "local top-k, sparse all-gather"),
    Entry("gtopk", sparsify.gtopk, sparsify.GTopKState, {"density": 0.001},
           "global top-k butterfly"),
    Entry("randomk", sparsify.randomk, sparsify.RandomKState, {"density": 0.01},
           "shared random coordinates, one all-reduce"),
    Entry("dgc", dgc.dgc, dgc.DGCState,
           {"density": 0.001}, "Deep Gradient Compression", forbids_after=_MOMENTUM_STATES,
           requirement="plain SGD after it, without momentum: the momentum is inside dgc"),
    Entry("signsgd", signsgd.signsgd, signsgd.SignSGDState, {}, "scaled 1-bit signs"),
    Entry("qsgd", qsgd.qsgd, qsgd.QSGDState,
           {"levels": 8}, "stochastic quantization, int8 levels"),
    Entry("quantized", quantized.quantized, quantized.QuantizedState,
           {"bits": 8}, "8- or 4-bit integers per block, summed in f32"),
    Entry("sparseloco", sparseloco.sparseloco, sparseloco.SparseLoCoState,
           {"density": 1 / 64}, "top-k per chunk, 2-bit values, decaying error feedback"),
    Entry("demo", demo.demo, demo.DeMoState, {"density": 1 / 32},
           "top-k DCT coefficients per chunk, decaying error feedback"),
    Entry("powersgd", lowrank.powersgd, lowrank.PowerSGDState, {"rank": 4},
           "rank-r power iteration"),
    Entry("acpsgd", lowrank.acpsgd, lowrank.ACPSGDState, {"rank": 4},
           "alternate P and Q factors"),
)}


def names() -> tuple[str, ...]:
  """Every registered name, in the table's order."""
  return tuple(METHODS)


def get(name: str) -> Entry:
  """The entry of ``name``; a ``ValueError`` listing the names otherwise."""
  if name not in METHODS:
    raise ValueError(f"`name` must be one of {list(METHODS)}, got {name!r}")
  return METHODS[name]


def build(name: str, axis_name: checks.AxisName, **config: Any) -> optax.GradientTransformation:
  """The compressor ``name`` over ``axis_name``: its defaults updated by ``config``."""
  method = get(name)
  return method.factory(axis_name=axis_name, **{**method.defaults, **config})


def configuration(name: str, **config: Any) -> dict:
  """The defaults of ``name`` updated by ``config`` (what :func:`build` passes)."""
  return {**get(name).defaults, **config}


def wire_cost(
    name: str, params: optax.Params, num_devices, *, steps: Optional[int] = None,
    **config: Any,
) -> wire.WireCost:
  """The transfers of one step of ``name``: on one axis for a device count, on a
  pair of axes ``("x", "y")`` for a mesh shape ``(rows, cols)`` or ``{"x": rows, "y": cols}``."""
  axis_name = "data" if isinstance(num_devices, (int, np.integer)) else ("x", "y")
  return wire.transfers(build(name, axis_name, **config), params, num_devices, steps=steps)


def check_chain(tx: optax.GradientTransformation, params: optax.Params) -> None:
  """A ``ValueError`` when ``tx`` breaks what a method in it requires after it.

  Reads the order of the states ``tx.init(params)`` makes (abstractly: no
  array is allocated): ``dgc`` carries its momentum inside, so a momentum
  state after it (``optax.sgd(lr, momentum=...)``, ``adam``, ...) would apply
  momentum twice. :func:`jaxcomp.training.init_state` calls it.
  """
  watched = {m.state: m for m in METHODS.values() if m.forbids_after}
  markers = tuple(watched) + tuple(t for m in watched.values() for t in m.forbids_after)
  state = jax.eval_shape(tx.init, params)
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, markers))
  active: list[Entry] = []
  for leaf in leaves:
    if type(leaf) in watched:
      active.append(watched[type(leaf)])
      continue
    for method in active:
      if isinstance(leaf, method.forbids_after):
        raise ValueError(
            f"`{method.name}` is followed by an optimizer with {type(leaf).__name__}:"
            f" {method.requirement} (optax.chain(jaxcomp.{method.name}(...),"
            " optax.sgd(learning_rate)))")
