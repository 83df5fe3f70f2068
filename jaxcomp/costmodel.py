"""The alpha-beta cost of one gradient exchange, and which compressor to pick.

A compressor states its collectives as :class:`jaxcomp.base.Transfer` tuples
(``tx.wire_bytes(params, num_devices)``); this module prices them on a network
of a given bandwidth and latency. Each transfer of ``b`` bytes over a group of
``G`` devices costs

  ``weight * (alpha * steps(kind, G) + b / beta)``

with ``alpha`` the per-message latency, ``beta`` the link bandwidth and the
ring's sequential steps: all-reduce ``2 (G - 1)``; reduce-scatter, all-gather
and all-to-all ``G - 1``; collective-permute ``1``. The byte term is exactly the
wire formula's, so it is what :func:`jaxcomp.wire.collective_bytes` reads from
the compiled program. The latency term is what separates a flat ring from the
2D torus: on an ``R x C`` mesh the torus's steps are ``2 (R - 1) + 2 (C - 1)``
(reduce-scatter and all-gather along rows, all-reduce along columns) instead
of the ring's ``2 (R C - 1)`` (Mikami et al., 2018).

A step is predicted as ``compute_s + exchange_time``: the exchange is not
overlapped with the backward pass (the compressors select over the whole
fused gradient, so they must wait for all of it). ``compute_s`` is measured
(:func:`measure_compute`) or given; :func:`recommend` uses the given
per-element costs of :data:`GIVEN_NS_PER_ELEMENT` unless told otherwise.

Example::

  shapes = experiments.shapes.resnet50()
  for name, seconds, config in costmodel.recommend(shapes, 32, 1.0, 50.0):
    print(f"{name:10s} {seconds * 1e3:8.1f} ms  {config}")

References:
  Hockney, `The communication challenge for MPP: Intel Paragon and Meiko CS-2
  <https://doi.org/10.1016/0167-8191(94)90106-6>`_, Parallel Computing 1994
  (the alpha-beta model); Thakur et al., `Optimization of Collective
  Communication Operations in MPICH <https://doi.org/10.1177/1094342005051521>`_,
  IJHPCA 2005 (the ring steps); Mikami et al., `Massively Distributed SGD
  <https://arxiv.org/abs/1811.05233>`_, 2018 (the 2D torus).
"""

from __future__ import annotations

import importlib
import math
import statistics
import time
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from jaxcomp import base
from jaxcomp import training

NumDevices = Union[int, tuple[int, int]]

_RING_STEPS = {
    "all-reduce": lambda group: 2 * (group - 1),
    "reduce-scatter": lambda group: group - 1,
    "all-gather": lambda group: group - 1,
    "all-to-all": lambda group: group - 1,
    "collective-permute": lambda group: 1,
}


class Method(NamedTuple):
  """Where a compressor's factory lives and its default configuration.

  The factory is ``getattr(import_module(module), factory)`` and is called
  as ``factory(axis_name=..., **config)``.
  """
  module: str
  factory: str
  defaults: Mapping[str, Any]


# The nine compressors, imported only when used. Default configurations are
# the papers' usual settings: density 0.1% for the top-k family and DGC (DGC
# paper, after warm-up), 1% for random-k (it needs more to converge), rank 4
# for the low-rank methods (PowerSGD's ImageNet setting).
METHODS: dict[str, Method] = {
    "allreduce": Method("jaxcomp.dense", "allreduce", {}),
    "cast": Method("jaxcomp.dense", "cast", {"dtype": "bfloat16"}),
    "topk": Method("jaxcomp.sparsify", "topk", {"density": 0.001}),
    "gtopk": Method("jaxcomp.sparsify", "gtopk", {"density": 0.001}),
    "randomk": Method("jaxcomp.sparsify", "randomk", {"density": 0.01}),
    "dgc": Method("jaxcomp.deep_gradient_compression", "dgc", {"density": 0.001}),
    "signsgd": Method("jaxcomp.quantize", "signsgd", {}),
    "powersgd": Method("jaxcomp.lowrank", "powersgd", {"rank": 4}),
    "acpsgd": Method("jaxcomp.lowrank", "acpsgd", {"rank": 4}),
}

# Compression compute per gradient element, in nanoseconds, on the 2 CPU
# cores of the development machine (jax 0.10.2, one process, a quiet
# machine): `python -m experiments.bench_compression --model resnet50
# --repeats 9` (25.6M elements; rank 4, density 0.001), each method's median
# step less dense `allreduce`'s (106 ms: the fused copy in and out that every
# method pays, which is not compression), divided by n, and 0 where a method
# measured no slower than dense. Random-k draws its shared indices by a top-k
# of n uniform draws. Pass measured figures to `recommend` to replace these.
GIVEN_NS_PER_ELEMENT: dict[str, float] = {
    "allreduce": 0.0,
    "cast": 0.0,
    "topk": 1.71,
    "gtopk": 1.60,
    "randomk": 14.6,
    "dgc": 4.72,
    "signsgd": 1.73,
    "powersgd": 1.15,
    "acpsgd": 2.01,
}


class Recommendation(NamedTuple):
  """One row of :func:`recommend`: a method, its predicted seconds, its configuration."""
  name: str
  seconds: float
  config: dict


def build(name: str, axis_name: base.AxisName, **config: Any) -> base.Compressor:
  """The compressor ``name`` of :data:`METHODS` over ``axis_name``, its defaults updated by ``config``.

  Raises:
    ValueError: for a name not in :data:`METHODS`.
    ImportError: when the module that holds the method is not installed.
  """
  if name not in METHODS:
    raise ValueError(f"`name` must be one of {sorted(METHODS)}, got {name!r}")
  method = METHODS[name]
  factory = getattr(importlib.import_module(method.module), method.factory)
  return factory(axis_name=axis_name, **{**method.defaults, **config})


def _check_network(bandwidth_gbit: float, latency_us: float) -> None:
  if not bandwidth_gbit > 0 or not math.isfinite(bandwidth_gbit):
    raise ValueError(f"`bandwidth_gbit` must be in (0, inf), got {bandwidth_gbit}")
  if not latency_us >= 0 or not math.isfinite(latency_us):
    raise ValueError(f"`latency_us` must be in [0, inf), got {latency_us}")


def steps(kind: str, group: int) -> int:
  """Sequential messages of a ring collective of ``kind`` over ``group`` devices."""
  if kind not in _RING_STEPS:
    raise ValueError(f"`kind` must be one of {sorted(_RING_STEPS)}, got {kind!r}")
  return _RING_STEPS[kind](group) if group > 1 or kind == "collective-permute" else 0


def exchange_time(
    cost: Sequence[base.Transfer], bandwidth_gbit: float, latency_us: float
) -> float:
  """Seconds of one gradient exchange: the sum over ``cost`` of the alpha-beta time.

  Args:
    cost: the transfers of one step, ``tx.wire_bytes(params, num_devices)``.
    bandwidth_gbit: link bandwidth in Gbit/s (each device sends at this rate).
    latency_us: per-message latency in microseconds.

  Returns:
    ``sum(weight * (latency * steps(kind, group) + bytes / bandwidth))``.
  """
  _check_network(bandwidth_gbit, latency_us)
  bytes_per_s = bandwidth_gbit * 1e9 / 8
  latency_s = latency_us * 1e-6
  return sum(
      float(t.weight) * (latency_s * steps(t.kind, t.group) + float(t.bytes) / bytes_per_s)
      for t in cost
  )


def _shapes(params: optax.Params):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)


def predict(
    tx: base.Compressor,
    params: optax.Params,
    num_devices: NumDevices,
    bandwidth_gbit: float,
    latency_us: float,
    compute_s: float = 0.0,
) -> float:
  """Seconds of one step: ``compute_s`` plus the exchange of ``tx``'s collectives.

  Args:
    tx: a jaxcomp compressor built for one axis (then ``num_devices`` is an
      int) or a pair of axes (then ``num_devices`` is ``(rows, cols)``).
    params: the parameters, or their shapes.
    num_devices: P, or ``(rows, cols)`` for the 2D torus.
    bandwidth_gbit: link bandwidth in Gbit/s.
    latency_us: per-message latency in microseconds.
    compute_s: seconds of computation (forward, backward, compression) that
      the exchange does not overlap.
  """
  if not isinstance(tx, base.Compressor):
    raise TypeError(
        "`tx` must be a jaxcomp compressor (it carries its wire formula), got"
        f" {type(tx).__name__}"
    )
  if not compute_s >= 0:
    raise ValueError(f"`compute_s` must be in [0, inf), got {compute_s}")
  cost = tx.wire_bytes(_shapes(params), num_devices)
  return compute_s + exchange_time(cost, bandwidth_gbit, latency_us)


def given_compute_s(name: str, num_elements: int) -> float:
  """Compression seconds from :data:`GIVEN_NS_PER_ELEMENT`."""
  return GIVEN_NS_PER_ELEMENT[name] * 1e-9 * num_elements


def measure_compute(tx: base.Compressor, params: optax.Params, repeats: int = 5) -> float:
  """Median seconds of ``tx.update`` on one device (its collectives over a group of one).

  What is left is the compression itself: selection, packing, projections,
  error feedback. The gradient is a fixed Gaussian pytree shaped like
  ``params``; the compressor must be built over the axis ``"data"``.
  """
  mesh = training.make_mesh(1)
  leaves, treedef = jax.tree.flatten(_shapes(params))
  keys = jax.random.split(jax.random.key(0), len(leaves))
  grads = jax.tree.unflatten(treedef, [
      jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype) for k, s in zip(keys, leaves)
  ])
  state = training.init_state(tx, grads, mesh, "data")
  grads = training.stack_per_device(grads, mesh, "data")
  update = training.make_update(tx, mesh, "data", donate=True)
  _, state = jax.block_until_ready(update(grads, state))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    _, state = jax.block_until_ready(update(grads, state))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def recommend(
    params: optax.Params,
    num_devices: NumDevices,
    bandwidth_gbit: float,
    latency_us: float,
    *,
    methods: Optional[Sequence[str]] = None,
    configs: Optional[Mapping[str, Mapping[str, Any]]] = None,
    compute_s: Optional[Mapping[str, float]] = None,
    base_compute_s: float = 0.0,
) -> list[Recommendation]:
  """The compressors ranked by predicted seconds per step, fastest first.

  Args:
    params: the parameters (or their shapes) whose gradients are exchanged.
    num_devices: P for a flat ring over one axis, or ``(rows, cols)`` for the
      2D torus (the methods are then built over the pair of axes).
    bandwidth_gbit: link bandwidth in Gbit/s.
    latency_us: per-message latency in microseconds.
    methods: names from :data:`METHODS` (all nine by default).
    configs: per-method configuration overriding the defaults of
      :data:`METHODS`, e.g. ``{"gtopk": {"density": 0.01}}``.
    compute_s: per-method compression seconds (measured with
      :func:`measure_compute`, say); methods not in it use
      :func:`given_compute_s`.
    base_compute_s: forward and backward seconds, the same for every method.

  Returns:
    :class:`Recommendation` ``(name, seconds, config)`` tuples, sorted by
    seconds.
  """
  _check_network(bandwidth_gbit, latency_us)
  names = list(METHODS) if methods is None else list(methods)
  configs = dict(configs or {})
  compute_s = dict(compute_s or {})
  unknown = sorted((set(names) | set(configs) | set(compute_s)) - set(METHODS))
  if unknown:
    raise ValueError(f"unknown methods {unknown}; `methods` must be among {sorted(METHODS)}")
  if isinstance(num_devices, int):
    axis_name: base.AxisName = "data"
  else:
    axis_name = ("x", "y")
    num_devices = tuple(num_devices)
  shapes = _shapes(params)
  n = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))
  ranked = []
  for name in names:
    config = {**METHODS[name].defaults, **configs.get(name, {})}
    tx = build(name, axis_name, **config)
    compression = compute_s.get(name, given_compute_s(name, n))
    seconds = predict(
        tx, shapes, num_devices, bandwidth_gbit, latency_us,
        compute_s=base_compute_s + compression,
    )
    ranked.append(Recommendation(name, seconds, config))
  return sorted(ranked, key=lambda r: r.seconds)
