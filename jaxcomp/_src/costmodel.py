"""The alpha-beta cost of one gradient exchange, and which compressor to pick.

A compressor states its collectives as :class:`jaxcomp.wire.Transfer` tuples
(``wire.transfers(tx, params, num_devices)``); this module prices them on a network
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
fused gradient, so they must wait for all of it). ``compute_s`` (forward,
backward and compression) is the caller's: measured on the machine at hand
(``experiments/compute.py`` does it), never a constant of this module, which
is arithmetic only.

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

import math
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
import optax

from jaxcomp._src import hierarchical
from jaxcomp._src import registry
from jaxcomp._src import wire

NumDevices = Union[int, tuple[int, int], Mapping[str, int]]

_RING_STEPS = {
    wire.Kind.ALL_REDUCE: lambda group: 2 * (group - 1),
    wire.Kind.REDUCE_SCATTER: lambda group: group - 1,
    wire.Kind.ALL_GATHER: lambda group: group - 1,
    wire.Kind.ALL_TO_ALL: lambda group: group - 1,
    wire.Kind.COLLECTIVE_PERMUTE: lambda group: 1,
}


class Recommendation(NamedTuple):
  """One row of :func:`recommend`: a method, its predicted seconds, its configuration, its layout."""
  name: str
  seconds: float
  config: dict
  layout: str = "flat"


Network = Union[float, Mapping[str, float]]


def _check_network(bandwidth_gbit: Network, latency_us: Network) -> None:
  for value in (bandwidth_gbit.values() if isinstance(bandwidth_gbit, Mapping)
                else (bandwidth_gbit,)):
    if not value > 0 or not math.isfinite(value):
      raise ValueError(f"`bandwidth_gbit` must be in (0, inf), got {value}")
  for value in latency_us.values() if isinstance(latency_us, Mapping) else (latency_us,):
    if not value >= 0 or not math.isfinite(value):
      raise ValueError(f"`latency_us` must be in [0, inf), got {value}")


def _link(transfer: wire.Transfer, bandwidth_gbit: Network, latency_us: Network):
  """``(bandwidth, latency)`` of the links a transfer crosses: the slowest of its axes."""

  def pick(network: Network, slowest):
    if not isinstance(network, Mapping):
      return network
    axes = transfer.axes or tuple(network)
    missing = [a for a in axes if a not in network]
    if missing:
      raise ValueError(
          f"the network names axes {sorted(network)}, but a {transfer.kind} runs over"
          f" {missing}")
    return slowest(network[a] for a in axes)

  return pick(bandwidth_gbit, min), pick(latency_us, max)


def steps(kind: str, group: int) -> int:
  """Sequential messages of a ring collective of ``kind`` over ``group`` devices."""
  try:
    kind = wire.Kind(kind)
  except ValueError:
    raise ValueError(
        f"`kind` must be one of {[k.value for k in wire.Kind]}, got {kind!r}") from None
  return _RING_STEPS[kind](group) if group > 1 or kind is wire.Kind.COLLECTIVE_PERMUTE else 0


def exchange_time(
    cost: Sequence[wire.Transfer], bandwidth_gbit: Network, latency_us: Network
) -> float:
  """Seconds of one gradient exchange: the sum over ``cost`` of the alpha-beta time.

  Args:
    cost: the transfers of one step, ``wire.transfers(tx, params, num_devices)``.
    bandwidth_gbit: link bandwidth in Gbit/s (each device sends at this rate),
      or one per mesh axis (``{"ici": 400.0, "dcn": 10.0}``): a transfer is
      then priced at the slowest link among the axes it crosses (all the
      listed axes for a transfer whose axes are not stated).
    latency_us: per-message latency in microseconds, or one per mesh axis
      (the largest among a transfer's axes).

  Returns:
    ``sum(weight * (latency * steps(kind, group) + bytes / bandwidth))``.
  """
  _check_network(bandwidth_gbit, latency_us)
  seconds = 0.0
  for t in cost:
    bandwidth, latency = _link(t, bandwidth_gbit, latency_us)
    seconds += float(t.weight) * (
        latency * 1e-6 * steps(t.kind, t.group) + float(t.bytes) / (bandwidth * 1e9 / 8))
  return seconds


def predict(
    tx: optax.GradientTransformation,
    params: optax.Params,
    num_devices: NumDevices,
    bandwidth_gbit: Network,
    latency_us: Network,
    compute_s: float = 0.0,
    *,
    steps: Optional[int] = None,
) -> float:
  """Seconds of one step: ``compute_s`` plus the exchange of the compressors in ``tx``.

  Args:
    tx: a jaxcomp compressor, or a chain that holds one, built for one axis
      (then ``num_devices`` is an int) or a pair of axes (then ``num_devices``
      is ``(rows, cols)``).
    params: the parameters, or their shapes.
    num_devices: P, ``(rows, cols)`` for the 2D torus, or the mesh shape
      (``{"dcn": 4, "ici": 8}``) for :func:`jaxcomp.hierarchical`.
    bandwidth_gbit: link bandwidth in Gbit/s, or one per mesh axis (see
      :func:`exchange_time`).
    latency_us: per-message latency in microseconds, or one per mesh axis.
    compute_s: seconds of computation (forward, backward, compression) that
      the exchange does not overlap.
    steps: the horizon of a schedule (DGC's warm-up), see
      :func:`jaxcomp.wire.expected_bytes`.
  """
  if not compute_s >= 0:
    raise ValueError(f"`compute_s` must be in [0, inf), got {compute_s}")
  cost = wire.transfers(tx, params, num_devices, steps=steps)
  return compute_s + exchange_time(cost, bandwidth_gbit, latency_us)


def predict_diloco(
    cost: Any,
    bandwidth_gbit: Network,
    latency_us: Network,
    compute_s: float = 0.0,
) -> float:
  """Seconds per inner step of a DiLoCo run on a two-level network.

  ``compute_s`` and the inner step's exchange every step, plus each
  fragment's sync once every ``H`` steps, none of it overlapped (a
  Streaming DiLoCo sync that overlaps the next inner steps costs less).

  Args:
    cost: the run's :class:`jaxcomp.training.DiLoCoTransfers`
      (:func:`jaxcomp.training.diloco_transfers` for a mesh of any size, or
      ``step.transfers(params)``).
    bandwidth_gbit: one per mesh axis (``{"dcn": 10.0, "ici": 400.0}``), or
      one for all links; see :func:`exchange_time`.
    latency_us: likewise, in microseconds.
    compute_s: seconds of an inner step's computation.
  """
  if not compute_s >= 0:
    raise ValueError(f"`compute_s` must be in [0, inf), got {compute_s}")
  syncs = sum(exchange_time(c, bandwidth_gbit, latency_us) for c in cost.outer)
  return (compute_s + exchange_time(cost.inner, bandwidth_gbit, latency_us)
          + syncs / cost.sync_period)


LAYOUTS = ("flat", "torus", "hierarchical")


def _layout_cost(
    name: str, layout: str, config: Mapping[str, Any], params: optax.Params,
    mesh_shape: Mapping[str, int], slow: str, fast: str, steps: Optional[int],
) -> wire.WireCost:
  """The transfers of method ``name`` in ``layout`` on a two-level mesh."""
  axes = tuple(mesh_shape)
  if layout == "flat":
    # One ring (or butterfly) over every device, node after node: a ring is
    # bound by the slow links it crosses, so every transfer is priced there.
    tx = registry.build(name, "data", **config)
    cost = wire.transfers(tx, params, math.prod(mesh_shape.values()), steps=steps)
    return tuple(t._replace(axes=axes) for t in cost)
  if layout == "torus":
    # The pair of axes, fast first: a mean reduce-scatters over the fast
    # links, all-reduces 1/X of it over the slow ones and all-gathers back.
    tx = registry.build(name, (fast, slow), **config)
  else:
    tx = hierarchical.hierarchical(registry.build(name, slow, **config), fast, mesh_shape[fast])
  return wire.transfers(tx, params, mesh_shape, steps=steps)


def recommend(
    params: optax.Params,
    num_devices: NumDevices,
    bandwidth_gbit: Network,
    latency_us: Network,
    *,
    methods: Optional[Sequence[str]] = None,
    configs: Optional[Mapping[str, Mapping[str, Any]]] = None,
    compute_s: Optional[Mapping[str, float]] = None,
    base_compute_s: float = 0.0,
    layouts: Optional[Sequence[str]] = None,
) -> list[Recommendation]:
  """The compressors (and, on a two-level mesh, their layouts) ranked by seconds per step.

  Args:
    params: the parameters (or their shapes) whose gradients are exchanged.
    num_devices: P for a flat ring over one axis; ``(rows, cols)`` for the
      2D torus (the methods are then built over the pair of axes); or a
      two-level mesh shape ``{"dcn": nodes, "ici": X}``, whose slow axis is
      the one with the lower bandwidth: every method is then priced in each
      of ``layouts``.
    bandwidth_gbit: link bandwidth in Gbit/s, or one per mesh axis (needed
      for a two-level mesh).
    latency_us: per-message latency in microseconds, or one per mesh axis.
    methods: names from :data:`jaxcomp.registry.METHODS` (all by default).
    configs: per-method configuration overriding the registry's defaults,
      e.g. ``{"gtopk": {"density": 0.01}}``.
    compute_s: per-method compression seconds of one device compressing the
      whole gradient, measured on the machine the prediction is for; a
      method not in it is priced with none. In the hierarchical layout each
      device compresses ``1/X`` of it, priced at ``compute_s / X``.
    base_compute_s: forward and backward seconds, the same for every method.
    layouts: on a two-level mesh, among :data:`LAYOUTS` (all by default):
      ``"flat"``, one ring over all devices, every transfer priced at the
      slow links; ``"torus"``, the method over both axes, fast first (its
      mean is the 2D torus; its sparse gathers and butterfly span both,
      each collective priced at the slowest axis it crosses);
      ``"hierarchical"``, :func:`jaxcomp.hierarchical` (dense over the fast
      axis, the method over the slow one on this device's shard).

  Returns:
    :class:`Recommendation` ``(name, seconds, config, layout)`` tuples,
    sorted by seconds.
  """
  _check_network(bandwidth_gbit, latency_us)
  names = list(registry.names()) if methods is None else list(methods)
  configs = dict(configs or {})
  compute_s = dict(compute_s or {})
  unknown = sorted((set(names) | set(configs) | set(compute_s)) - set(registry.names()))
  if unknown:
    raise ValueError(
        f"unknown methods {unknown}; `methods` must be among {list(registry.names())}")
  if isinstance(num_devices, Mapping):
    return _recommend_two_level(params, dict(num_devices), bandwidth_gbit, latency_us, names,
                                configs, compute_s, base_compute_s, layouts)
  if layouts is not None:
    raise ValueError("`layouts` needs a two-level mesh shape for `num_devices`,"
                     f" e.g. {{'dcn': 4, 'ici': 8}}; got {num_devices!r}")
  if isinstance(num_devices, (int, np.integer)):
    axis_name: Any = "data"
    layout = "flat"
  else:
    axis_name = ("x", "y")
    num_devices = tuple(num_devices)
    layout = "torus"
  ranked = []
  for name in names:
    config = registry.configuration(name, **configs.get(name, {}))
    tx = registry.build(name, axis_name, **config)
    seconds = predict(
        tx, params, num_devices, bandwidth_gbit, latency_us,
        compute_s=base_compute_s + compute_s.get(name, 0.0),
    )
    ranked.append(Recommendation(name, seconds, config, layout))
  return sorted(ranked, key=lambda r: r.seconds)


def _recommend_two_level(params, mesh_shape, bandwidth_gbit, latency_us, names, configs,
                         compute_s, base_compute_s, layouts) -> list[Recommendation]:
  if len(mesh_shape) != 2 or not isinstance(bandwidth_gbit, Mapping):
    raise ValueError(
        "a two-level mesh needs two axes and a bandwidth per axis, e.g. num_devices="
        "{'dcn': 4, 'ici': 8}, bandwidth_gbit={'dcn': 10.0, 'ici': 2400.0}; got"
        f" {mesh_shape} and {bandwidth_gbit!r}")
  layouts = LAYOUTS if layouts is None else tuple(layouts)
  bad = [l for l in layouts if l not in LAYOUTS]
  if bad:
    raise ValueError(f"`layouts` must be among {LAYOUTS}, got {bad}")
  slow, fast = sorted(mesh_shape, key=lambda a: bandwidth_gbit[a])
  ranked = []
  for name in names:
    config = registry.configuration(name, **configs.get(name, {}))
    for layout in layouts:
      share = mesh_shape[fast] if layout == "hierarchical" else 1
      cost = _layout_cost(name, layout, config, params, mesh_shape, slow, fast, None)
      seconds = (base_compute_s + compute_s.get(name, 0.0) / share
                 + exchange_time(cost, bandwidth_gbit, latency_us))
      ranked.append(Recommendation(name, seconds, config, layout))
  return sorted(ranked, key=lambda r: r.seconds)
