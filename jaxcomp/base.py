"""What every compressor shares: the transformation type, axis names, finiteness.

A compressor is an ``optax.GradientTransformation`` that also states its own
wire cost (:class:`Compressor`), so that :func:`jaxcomp.wire.expected_bytes`
can compare the formula with the bytes read from the compiled program.
"""

from __future__ import annotations

from fractions import Fraction
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import chex
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

AxisName = Union[str, tuple[str, str]]



class Transfer(NamedTuple):
  """One collective of a compressor's step, as its wire formula states it.

  Attributes:
    kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``,
      ``"all-to-all"`` or ``"collective-permute"``.
    group: devices taking part in it (1 for a permute: a pairwise exchange).
    bytes: what one device sends in it.
    weight: times per step on average (1/2: every other step).
  """

  kind: str
  group: int
  bytes: Fraction
  weight: Fraction = Fraction(1)


# The collectives of one step. wire_bytes(params, num_devices) -> WireCost,
# num_devices an int, or (rows, cols) / a mesh shape dict for a pair of axes.
WireCost = tuple[Transfer, ...]
WireBytesFn = Callable[[optax.Params, Any], WireCost]


class Compressor(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that knows its bytes on the wire.

  It is the ``(init, update)`` pair optax expects, so it chains like any
  other transformation; ``wire_bytes(params, axis_sizes)`` gives the bytes one
  device sends per step for gradients shaped like ``params`` on a mesh whose
  compressor axes have sizes ``axis_sizes`` (one int, or ``(rows, cols)`` for
  a pair of axes). (It is ``None`` on a copy rebuilt by ``jax.tree.map``,
  which sees a namedtuple of two fields.)
  """

  wire_bytes: Optional[WireBytesFn]

  def __new__(
      cls,
      init: optax.TransformInitFn,
      update: optax.TransformUpdateFn,
      wire_bytes: Optional[WireBytesFn] = None,
  ) -> "Compressor":
    self = super().__new__(cls, init, update)
    self.wire_bytes = wire_bytes
    return self


def check_axis_name(axis_name: AxisName) -> tuple[str, ...]:
  """Validates ``axis_name`` and returns it as a tuple of one or two names."""
  if isinstance(axis_name, str):
    if not axis_name:
      raise ValueError(
          "`axis_name` must be a non-empty mesh axis name or a pair of distinct"
          " ones, got ''"
      )
    return (axis_name,)
  if isinstance(axis_name, (tuple, list)):
    names = tuple(axis_name)
    if len(names) not in (1, 2):
      raise ValueError(
          "`axis_name` as a sequence must be a pair (row_axis, col_axis) of"
          f" mesh axes, got {len(names)} names: {axis_name!r}"
      )
    if not all(isinstance(n, str) for n in names):
      raise TypeError(
          "`axis_name` must hold strings (mesh axis names), got"
          f" {axis_name!r}"
      )
    if not all(names):
      raise ValueError(f"`axis_name` holds an empty name: {axis_name!r}")
    if len(set(names)) != len(names):
      raise ValueError(
          "`axis_name` pair must name two distinct mesh axes, got"
          f" {axis_name!r}"
      )
    return names
  raise TypeError(
      "`axis_name` must be a mesh axis name (str) or a pair of them, got"
      f" {type(axis_name).__name__} {axis_name!r}"
  )


def axis_sizes(axes: Sequence[str]) -> tuple[int, ...]:
  """Sizes of bound mesh axes; a clear error when one is not bound."""
  sizes = []
  for name in axes:
    try:
      sizes.append(lax.axis_size(name))
    except NameError as e:
      raise ValueError(
          f"`axis_name` {name!r} is not a bound mesh axis: call `update` inside"
          " `jax.shard_map` over a mesh with that axis (or `jax.pmap` with"
          " `axis_name`)."
      ) from e
  return tuple(sizes)


def normalize_axis_sizes(
    axes: Sequence[str], axis_sizes_or_count: Union[int, Sequence[int], Mapping[str, int]]
) -> tuple[int, ...]:
  """Turns a device count, a size tuple or a mesh shape into one size per axis."""
  if isinstance(axis_sizes_or_count, Mapping):
    return tuple(int(axis_sizes_or_count[a]) for a in axes)
  if isinstance(axis_sizes_or_count, int):
    if len(axes) != 1:
      raise ValueError(
          f"a pair of axes {tuple(axes)} needs the mesh shape (rows, cols), got"
          f" the device count {axis_sizes_or_count}"
      )
    return (axis_sizes_or_count,)
  sizes = tuple(int(s) for s in axis_sizes_or_count)
  if len(sizes) != len(axes):
    raise ValueError(f"axes {tuple(axes)} need {len(axes)} sizes, got {sizes}")
  return sizes


def check_density(density: float) -> float:
  """``density`` must be a number in (0, 1]."""
  if isinstance(density, bool) or not isinstance(density, (int, float)):
    raise TypeError(f"`density` must be a float in (0, 1], got {density!r}")
  if not (0.0 < density <= 1.0):  # also rejects NaN
    raise ValueError(f"`density` must be in (0, 1], got {density}")
  return float(density)


def check_seed(seed) -> int:
  """``seed`` must be a non-negative int (a PRNG seed)."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise TypeError(f"`seed` must be an int in [0, 2**32), got {seed!r}")
  if not 0 <= int(seed) < 2**32:
    raise ValueError(f"`seed` must be in [0, 2**32), got {seed}")
  return int(seed)


def raw_key(seed: int) -> jax.Array:
  """The uint32 key data of ``jax.random.key(seed)`` (what a state stores)."""
  return jax.random.key_data(jax.random.key(seed))


def num_selected(density: float, n: int) -> int:
  """``k = max(1, ceil(density * n))``, the fixed capacity of a sparse payload."""
  return max(1, min(n, math.ceil(density * n)))


def all_finite(tree: chex.ArrayTree) -> jax.Array:
  """A scalar bool: every element of every leaf is finite."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def poison(payload: jax.Array, finite: jax.Array) -> jax.Array:
  """NaN everywhere in a floating payload when this device saw non-finite input.

  A sparse or low-rank payload may drop the very coordinates that held the
  NaN, so every compressor poisons what it sends: the reduced mean is then
  non-finite on every device, and all of them skip the step alike.
  """
  return jnp.where(finite, payload, jnp.asarray(jnp.nan, payload.dtype))


def keep_if_finite(result: chex.ArrayTree, new_state, old_state):
  """The new state where the reduced ``result`` is finite, else the old one.

  ``result`` is identical on every device, so every device makes the same
  choice, and a skipped step writes nothing non-finite into any state.
  """
  ok = all_finite(result)
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, old_state)


def safe_increment(count: jax.Array) -> jax.Array:
  """``count + 1`` that saturates at the largest int32 (as optax's does)."""
  return optax.safe_increment(count)


def zero_count() -> jax.Array:
  return jnp.zeros([], jnp.int32)
