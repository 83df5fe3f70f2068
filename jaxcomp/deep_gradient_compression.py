"""Deep Gradient Compression: momentum correction, local clipping, factor masking,
warm-up and sampled top-k selection.

The sparse leaves (by default those of rank > 1, as in the paper) are fused
into one bucket that accumulates velocity locally and sends its top entries
with a sparse all-gather; the other leaves are fused into one dense
all-reduce, with the momentum applied to their mean. The optimizer after
:func:`dgc` is plain SGD without momentum: the momentum lives inside.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import base
from jaxcomp import collectives
from jaxcomp import error_feedback
from jaxcomp import fusion
from jaxcomp import sparsify

# The paper's exponential warm-up ramp, one equal stage each, then `density`.
WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)

SparseLeaves = Union[str, Callable[[tuple[int, ...]], bool]]
_SPARSE_RULES = {
    "rank>1": lambda shape: len(shape) > 1,
    "all": lambda shape: True,
}


class DGCState(NamedTuple):
  """State of :func:`dgc`.

  Attributes:
    count: int32 scalar, steps taken (saturating); it drives the warm-up.
    residual: f32 pytree shaped like the parameters: the accumulated velocity
      ``v`` not yet sent (zero on dense leaves). It differs per device.
    momentum: f32 pytree shaped like the parameters: the momentum ``u``, local
      on sparse leaves (differs per device), of the mean on dense leaves.
    rng_key: uint32 raw key data for the threshold's sample, split every
      step; the same on every device (the sample needs no per-device draw).
  """

  count: jax.Array
  residual: optax.Params
  momentum: optax.Params
  rng_key: jax.Array


def warmup_density(density: float, warmup_steps: int, step: int) -> float:
  """The density used at ``step``: the warm-up ramp, then ``density``.

  The ramp 25%, 6.25%, 1.5625%, 0.4% is spread over ``warmup_steps`` in four
  equal stages (step ``t`` is in stage ``floor(4 t / warmup_steps)``); a
  stage's density never goes below ``density``.
  """
  if step >= warmup_steps:
    return density
  stage = step * len(WARMUP_DENSITIES) // warmup_steps
  return max(WARMUP_DENSITIES[stage], density)


def _stage_ks(density: float, warmup_steps: int, n: int) -> tuple[int, ...]:
  """``k`` of every warm-up stage, then of ``density`` (the last entry)."""
  ramp = WARMUP_DENSITIES if warmup_steps else ()
  return tuple(base.num_selected(max(d, density), n) for d in ramp) + (
      base.num_selected(density, n),
  )


def capacity(density: float, warmup_steps: int, n: int) -> int:
  """Static payload size: the largest ``k`` of the schedule over ``n`` elements."""
  return max(_stage_ks(density, warmup_steps, n))


def _check_fraction(value, name: str, low_open: bool, allowed: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
    raise TypeError(f"`{name}` must be a float in {allowed}, got {value!r}")
  value = float(value)
  ok = (0.0 < value <= 1.0) if low_open else (0.0 <= value < 1.0)
  if not ok:  # also rejects NaN
    raise ValueError(f"`{name}` must be in {allowed}, got {value}")
  return value


def _check_args(momentum, nesterov, clip_norm, warmup_steps, sample_ratio, sparse_leaves):
  momentum = _check_fraction(momentum, "momentum", False, "[0, 1)")
  sample_ratio = _check_fraction(sample_ratio, "sample_ratio", True, "(0, 1]")
  if not isinstance(nesterov, (bool, np.bool_)):
    raise TypeError(f"`nesterov` must be a bool, got {nesterov!r}")
  if clip_norm is not None:
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float, np.floating)):
      raise TypeError(f"`clip_norm` must be None or a float in (0, inf), got {clip_norm!r}")
    if not 0.0 < float(clip_norm) < math.inf:
      raise ValueError(f"`clip_norm` must be None or in (0, inf), got {clip_norm}")
    clip_norm = float(clip_norm)
  if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer)):
    raise TypeError(f"`warmup_steps` must be an int >= 0, got {warmup_steps!r}")
  if warmup_steps < 0:
    raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}")
  if callable(sparse_leaves):
    where = sparse_leaves
  elif isinstance(sparse_leaves, str) and sparse_leaves in _SPARSE_RULES:
    where = _SPARSE_RULES[sparse_leaves]
  else:
    raise ValueError(
        "`sparse_leaves` must be 'rank>1', 'all' or a callable (shape) -> bool,"
        f" got {sparse_leaves!r}"
    )
  return momentum, bool(nesterov), clip_norm, int(warmup_steps), sample_ratio, where


def dgc(
    density: float,
    axis_name: base.AxisName,
    momentum: float = 0.9,
    nesterov: bool = False,
    clip_norm: Optional[float] = None,
    warmup_steps: int = 0,
    sample_ratio: float = 0.01,
    *,
    seed: int = 0,
    sparse_leaves: SparseLeaves = "rank>1",
) -> base.Compressor:
  """Deep Gradient Compression (all five parts of the paper).

  On the sparse leaves (fused into one bucket of ``n`` elements), per device:

  1. *Local gradient clipping*: with ``clip_norm``, the whole local gradient
     is scaled by ``min(1, clip_norm / sqrt(P) / ||g||)`` (its global L2
     norm over every leaf), before accumulation.
  2. *Momentum correction*: the velocity, not the gradient, accumulates
     locally: ``u <- m u + g``, ``v <- v + u`` (Nesterov, as the reference
     implementation: ``u <- m (u + g)``, ``v <- v + u + g``).
  3. *Sparsification* of ``v``: the ``k`` largest magnitudes, by the
     *sampled threshold* (:func:`jaxcomp.sparsify.sampled_topk`): the
     threshold is estimated on ``ceil(sample_ratio * n)`` entries drawn from
     the state's key, the entries above it are compacted into a candidate
     buffer and the ``k`` largest of them kept; when the count above the
     threshold is off (above ``CANDIDATE_FACTOR`` times the capacity, or
     below ``MIN_FRACTION * k``) it falls back to the exact ``lax.top_k``
     under a ``lax.cond`` with no collective inside (devices may take
     different branches). ``sample_ratio=1.0`` always uses ``lax.top_k``.
     Every device's ``(values, indices)`` is all-gathered and the mean is
     their scatter-add over ``P``.
  4. *Momentum factor masking*: ``v`` keeps what was not sent (``v - sent``,
     zero where sent) and ``u`` is zeroed where sent.
  5. *Warm-up*: the density follows 25%, 6.25%, 1.5625%, 0.4% in four equal
     stages over ``warmup_steps``, then ``density``. The payload has a static
     capacity, the largest ``k`` of that schedule, masked to the current
     ``k``, so nothing recompiles; the wire carries the full capacity every
     step (with ``warmup_steps=0`` the capacity is the ``k`` of ``density``).

  The other leaves (biases and norms under the default rule) are fused into
  one dense :func:`jaxcomp.collectives.mean` and get the momentum on the
  mean, ``u <- m u + mean`` (the same Nesterov form), identical on every
  device. So the optimizer after ``dgc`` must be plain SGD *without*
  momentum: ``optax.chain(dgc(...), optax.sgd(lr))``.

  Args:
    density: share of the sparse leaves each device sends after warm-up, in
      (0, 1].
    axis_name: the data-parallel mesh axis, or a pair of axes (one
      all-gather over both; the dense all-reduce runs as the 2D torus).
    momentum: the momentum ``m``, in [0, 1).
    nesterov: Nesterov momentum.
    clip_norm: ``None`` (no clipping) or the global threshold, in (0, inf);
      each device clips at ``clip_norm / sqrt(P)``.
    warmup_steps: steps of the warm-up ramp, an int >= 0 (0: none).
    sample_ratio: share of the entries sampled for the threshold, in (0, 1].
    seed: PRNG seed of the sample, an int in ``[0, 2**32)``.
    sparse_leaves: which leaves are sparsified: ``"rank>1"`` (the paper's
      rule; the rest go dense), ``"all"`` (every leaf in the sparse bucket,
      the message is then ``8 k`` bytes: ``4 n / 8 k = 1 / (2 density)``,
      500x at density 0.001), or a callable ``shape -> bool``.

  Returns:
    A :class:`jaxcomp.base.Compressor` with state :class:`DGCState`, whose
    ``update`` returns the update to apply with plain SGD, identical on
    every device, in the dtype of ``updates``.

  Wire: two all-gathers of the capacity ``K`` (f32 values, int32 indices),
  ``(P - 1) * 8 K`` bytes per device, plus the dense all-reduce of the
  ``n_d`` other elements, ``2 (P - 1) / P * 4 n_d``. One device's message
  is ``8 K + 4 n_d`` bytes.

  Example::

    tx = optax.chain(
        jaxcomp.dgc(1e-3, "data", momentum=0.9, clip_norm=1.0, warmup_steps=500),
        optax.sgd(0.1),  # no momentum here: it is inside dgc
    )

  References:
    Lin et al., `Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training <https://arxiv.org/abs/1712.01887>`_,
    ICLR 2018.
  """
  density = base.check_density(density)
  axes = base.check_axis_name(axis_name)
  momentum, nesterov, clip_norm, warmup_steps, sample_ratio, where = _check_args(
      momentum, nesterov, clip_norm, warmup_steps, sample_ratio, sparse_leaves
  )
  seed = base.check_seed(seed)

  def init_fn(params):
    return DGCState(
        count=base.zero_count(),
        residual=error_feedback.init(params),
        momentum=error_feedback.init(params),
        rng_key=base.raw_key(seed),
    )

  def accumulate(u, g):
    """``(new u, what v accumulates)``: the momentum correction."""
    if nesterov:
      u = momentum * (u + g)
      return u, u + g
    u = momentum * u + g
    return u, u

  def current_k(count, n):
    ks = _stage_ks(density, warmup_steps, n)
    if warmup_steps == 0:
      return ks[0]
    stage = jnp.where(
        count >= warmup_steps, len(ks) - 1,
        (count * len(WARMUP_DENSITIES)) // warmup_steps,
    )
    return jnp.asarray(ks, jnp.int32)[stage]

  def update_fn(updates, state, params=None):
    del params
    error_feedback.check_matches(updates, state.momentum)
    sparse, dense = fusion.partition(state.momentum, where)
    sparse_out, dense_out = fusion.partition(updates, where)
    size = math.prod(base.axis_sizes(axes))
    finite = base.all_finite(updates)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
    if clip_norm is not None:
      limit = clip_norm / math.sqrt(size)
      norm = optax.tree.norm(grads)
      scale = jnp.minimum(1.0, limit / norm)
      grads = jax.tree.map(lambda g: g * scale, grads)
    next_key, draw = jax.random.split(jax.random.wrap_key_data(state.rng_key))
    result, new_momentum, residual = updates, {}, state.residual

    if sparse.size:
      n = sparse.size
      u, acc = accumulate(sparse.flatten(state.momentum), sparse.flatten(grads))
      velocity = error_feedback.compensate(
          sparse, sparse.unflatten(acc, like=state.momentum), state.residual
      )
      k = current_k(state.count, n)
      cap = capacity(density, warmup_steps, n)
      if sample_ratio == 1.0:
        values, indices = sparsify.select_topk(velocity, cap, k)
      else:
        values, indices = sparsify.sampled_topk(velocity, cap, k, draw, sample_ratio)
      # The values sent are the velocity's own at `indices`: masking them.
      residual = error_feedback.absorb_sent(sparse, velocity, indices, state.residual)
      masked = u.at[indices].set(0.0, mode="drop")
      new_momentum.update(zip(sparse.leaves, sparse.split(masked)))
      all_values, all_indices = collectives.sparse_allgather(
          base.poison(values, finite), indices, axes
      )
      mean = collectives.densify(all_values, all_indices, n) / size
      result = sparse_out.unflatten(mean, like=result)

    if dense.size:
      mean = collectives.mean(base.poison(dense.flatten(grads), finite), axes)
      u, out = accumulate(dense.flatten(state.momentum), mean)
      new_momentum.update(zip(dense.leaves, dense.split(u)))
      result = dense_out.unflatten(out, like=result)

    new_state = DGCState(
        count=base.safe_increment(state.count),
        residual=residual,
        momentum=fusion.scatter_leaves(state.momentum, new_momentum),
        rng_key=jax.random.key_data(next_key),
    )
    return result, base.keep_if_finite(result, new_state, state)

  def wire_bytes(params, num_devices):
    sizes = base.normalize_axis_sizes(axes, num_devices)
    sparse, dense = fusion.partition(params, where)
    cost = ()
    if sparse.size:
      cost += collectives.sparse_allgather_bytes(
          capacity(density, warmup_steps, sparse.size), math.prod(sizes)
      )
    if dense.size:
      cost += collectives.mean_bytes(dense.size, sizes)
    return cost

  return base.Compressor(init_fn, update_fn, wire_bytes)
