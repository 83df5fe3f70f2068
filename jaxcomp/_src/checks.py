"""Argument checks every factory shares: axis names, numbers, flags, seeds.

One rule for every hyperparameter: Python numbers and numpy scalars of the
right kind are accepted (``np.float32(0.01)`` as a density, ``np.int64(4)`` as
a rank), bools never stand in for numbers, and an out-of-range value raises a
``ValueError`` that names the argument and the allowed range.

Hyperparameters are static: fixed when the transformation is built, they set
the shapes of what is sent (``k``, the rank, the levels) and the program
itself. A JAX array, concrete or traced, is refused with a ``TypeError`` that
says so and how to wrap a factory in ``optax.inject_hyperparams`` anyway (it
passes every numeric argument as an array unless ``static_args`` names it).
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping, Optional, Sequence, Union

import jax
from jax import lax
import numpy as np

AxisName = Union[str, tuple[str, str]]


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
  if isinstance(axis_sizes_or_count, (int, np.integer)):
    if len(axes) != 1:
      raise ValueError(
          f"a pair of axes {tuple(axes)} needs the mesh shape (rows, cols), got"
          f" the device count {axis_sizes_or_count}"
      )
    return (int(axis_sizes_or_count),)
  sizes = tuple(int(s) for s in axis_sizes_or_count)
  if len(sizes) != len(axes):
    raise ValueError(f"axes {tuple(axes)} need {len(axes)} sizes, got {sizes}")
  return sizes


def _interval(low, high, low_open, high_open) -> str:
  left = "(" if low_open or low == -math.inf else "["
  right = ")" if high_open or high == math.inf else "]"
  def show(v):
    if math.isinf(v):
      return "inf" if v > 0 else "-inf"
    if float(v).is_integer():
      v = int(v)
      return f"2**{v.bit_length() - 1}" if v >= 2**16 and v & (v - 1) == 0 else str(v)
    return f"{v:g}"
  return f"{left}{show(low)}, {show(high)}{right}"


def check_static(value, name: str) -> None:
  """A ``TypeError`` naming ``name`` when ``value`` is a JAX array (a tracer included)."""
  if isinstance(value, jax.Array):
    raise TypeError(
        f"`{name}` must be a Python value, got a JAX array ({value.dtype}{list(value.shape)}):"
        " jaxcomp's hyperparameters are static, fixed when the transformation is built"
        " (they set the shapes of what is sent), so they cannot be traced, scheduled or"
        " injected. To wrap a jaxcomp factory in optax.inject_hyperparams, name every"
        " argument that takes a number in `static_args`, the defaults included (it makes"
        " an array of each): e.g. optax.inject_hyperparams(jaxcomp.qsgd,"
        " static_args=('levels', 'bucket_size', 'seed'))(8, 'data')"
    )


def check_number(
    value,
    name: str,
    *,
    integer: bool = False,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> Optional[Union[int, float]]:
  """``value`` as a Python int or float, within ``[low, high]`` (ends open as asked).

  Accepts Python numbers and numpy scalars (and 0-d numpy arrays) of the
  right kind: integers for ``integer=True``, any real otherwise. Refuses
  bools, strings and arrays with a ``TypeError`` (JAX arrays as static, see
  :func:`check_static`); NaN and values outside the range with a
  ``ValueError`` naming ``name`` and the range.
  """
  check_static(value, name)
  kind = "an int" if integer else "a number"
  interval = _interval(low, high, low_open, high_open)
  if value is None and allow_none:
    return None
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  wanted = numbers.Integral if integer else numbers.Real
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, wanted):
    also = "None or " if allow_none else ""
    raise TypeError(f"`{name}` must be {also}{kind} in {interval}, got {value!r}")
  value = int(value) if integer else float(value)
  below = value <= low if low_open else value < low
  above = value >= high if high_open else value > high
  if below or above or value != value:  # the last: NaN
    also = "None or " if allow_none else ""
    raise ValueError(f"`{name}` must be {also}in {interval}, got {value}")
  return value


def check_bool(value, name: str) -> bool:
  """``value`` as a bool: Python and numpy bools only (JAX arrays: :func:`check_static`)."""
  check_static(value, name)
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"`{name}` must be a bool, got {value!r}")
  return bool(value)


def check_density(density) -> float:
  """``density`` must be a number in (0, 1]."""
  return check_number(density, "density", low=0.0, high=1.0, low_open=True)


def check_bucket_cap_mb(bucket_cap_mb) -> Optional[float]:
  """``bucket_cap_mb`` must be ``None`` (one bucket) or a number of MiB in (0, inf)."""
  return check_number(bucket_cap_mb, "bucket_cap_mb", low=0.0, high=math.inf, low_open=True,
                      high_open=True, allow_none=True)


def check_chunked(density, chunk_size, max_chunk: int, error_decay, bucket_cap_mb
                  ) -> tuple[float, int, float, Optional[float]]:
  """A chunked top-k compressor's arguments, checked: ``(density, chunk_size, error_decay,
  bucket_cap_mb)``; ``chunk_size`` an int in ``[1, max_chunk]``, ``error_decay`` in [0, 1]."""
  return (check_density(density),
          check_number(chunk_size, "chunk_size", integer=True, low=1, high=max_chunk),
          check_number(error_decay, "error_decay", low=0.0, high=1.0),
          check_bucket_cap_mb(bucket_cap_mb))


def check_seed(seed) -> int:
  """``seed`` must be an int in ``[0, 2**32)`` (a PRNG seed)."""
  return check_number(seed, "seed", integer=True, low=0, high=2**32, high_open=True)


def raw_key(seed: int) -> jax.Array:
  """The uint32 key data of ``jax.random.key(seed)`` (what a state stores)."""
  return jax.random.key_data(jax.random.key(seed))


def num_selected(density: float, n: int) -> int:
  """``k = max(1, ceil(density * n))``, the fixed capacity of a sparse payload."""
  return max(1, min(n, math.ceil(density * n)))
