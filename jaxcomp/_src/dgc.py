"""Deep Gradient Compression: momentum correction, local clipping, factor masking,
warm-up and sampled top-k selection.

The sparse leaves (by default those of rank > 1, as in the paper) are fused
into one bucket that accumulates velocity locally and sends its top entries
with a sparse all-gather; the other leaves are fused into one dense
all-reduce, with the momentum applied to their mean. The optimizer after
:func:`dgc` is plain SGD without momentum: the momentum lives inside.
"""

from __future__ import annotations

from fractions import Fraction
import functools
import math
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp._src import binade
from jaxcomp._src import checks
from jaxcomp._src import error_feedback
from jaxcomp._src import fusion
from jaxcomp._src import native
from jaxcomp._src import protocol
from jaxcomp._src import selection
from jaxcomp._src import wire

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
    residual: ``f32[n]``, the bucket of :func:`dgc`'s order (the sparse
      leaves, then the dense ones; a tuple of one per bucket with
      ``bucket_cap_mb``): the accumulated velocity ``v`` not yet sent (zero
      on dense leaves). It differs per device.
    momentum: ``f32[n]`` (or one per bucket), laid out as ``residual``: the
      momentum ``u``, local on sparse leaves (differs per device), of the
      mean on dense leaves.
    rng_key: uint32 raw key data for the threshold's sample, split every
      step; the same on every device (the sample needs no per-device draw).
  """

  count: jax.Array
  residual: Union[jax.Array, tuple]
  momentum: Union[jax.Array, tuple]
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


def form_densities(density: float, warmup_steps: int) -> tuple[float, ...]:
  """The density of each form of the step: the warm-up stages above ``density``, then ``density``.

  A stage whose ramp density is at or below ``density`` runs at ``density``
  (:func:`warmup_density`), the step after the warm-up: it is that form, and
  one program, not one more of the same. The ramp falls, so the stages above
  ``density`` are its first ones: stage ``s`` is form ``min(s, forms - 1)``.
  """
  ramp = WARMUP_DENSITIES if warmup_steps else ()
  return tuple(d for d in ramp if d > density) + (density,)


def _form_ks(density: float, warmup_steps: int, n: int) -> tuple[int, ...]:
  """``k`` of every form (:func:`form_densities`) on ``n`` sparse entries."""
  return tuple(checks.num_selected(d, n) for d in form_densities(density, warmup_steps))


def stage_weights(warmup_steps: int, steps) -> tuple[Fraction, ...]:
  """The share of the first ``steps`` steps spent in each stage (``None``: after the warm-up)."""
  stages = len(WARMUP_DENSITIES) + 1 if warmup_steps else 1
  if steps is None:
    return (Fraction(0),) * (stages - 1) + (Fraction(1),)
  steps = checks.check_number(steps, "steps", integer=True, low=1)
  counts = [0] * stages
  for t in range(min(steps, warmup_steps)):
    counts[t * len(WARMUP_DENSITIES) // warmup_steps] += 1
  counts[-1] += max(0, steps - warmup_steps)
  return tuple(Fraction(c, steps) for c in counts)


def _check_args(momentum, nesterov, clip_norm, warmup_steps, sample_ratio, sparse_leaves):
  momentum = checks.check_number(momentum, "momentum", low=0.0, high=1.0, high_open=True)
  sample_ratio = checks.check_number(
      sample_ratio, "sample_ratio", low=0.0, high=1.0, low_open=True)
  nesterov = checks.check_bool(nesterov, "nesterov")
  clip_norm = checks.check_number(clip_norm, "clip_norm", low=0.0, high=math.inf,
                                low_open=True, high_open=True, allow_none=True)
  warmup_steps = checks.check_number(warmup_steps, "warmup_steps", integer=True, low=0)
  if callable(sparse_leaves):
    where = sparse_leaves
  elif isinstance(sparse_leaves, str) and sparse_leaves in _SPARSE_RULES:
    where = _SPARSE_RULES[sparse_leaves]
  else:
    raise ValueError(
        "`sparse_leaves` must be 'rank>1', 'all' or a callable (shape) -> bool,"
        f" got {sparse_leaves!r}"
    )
  return momentum, nesterov, clip_norm, warmup_steps, sample_ratio, where


def dgc(
    density: float,
    axis_name: checks.AxisName,
    momentum: float = 0.9,
    clip_norm: Optional[float] = None,
    warmup_steps: int = 0,
    sample_ratio: float = 0.01,
    *,
    nesterov: bool = False,
    seed: int = 0,
    sparse_leaves: SparseLeaves = "rank>1",
    bucket_cap_mb: Optional[float] = None,
) -> optax.GradientTransformation:
  """Deep Gradient Compression (all five parts of the paper).

  On the sparse leaves (fused into one bucket of ``n`` elements), per device:

  1. *Local gradient clipping*: with ``clip_norm``, the whole local gradient
     is scaled by ``min(1, clip_norm / sqrt(P) / ||g||)`` (its global L2
     norm over every leaf, one reduction over the fused bucket), before
     accumulation.
  2. *Momentum correction*: the velocity, not the gradient, accumulates
     locally: ``u <- m u + g``, ``v <- v + u`` (Nesterov, as the reference
     implementation: ``u <- m (u + g)``, ``v <- v + u + g``).
  3. *Sparsification* of ``v``: the ``k`` largest magnitudes, by the
     *sampled threshold* (:func:`jaxcomp.selection.sampled_topk`): the
     threshold is estimated on ``ceil(sample_ratio * n)`` entries drawn from
     the state's key, the entries above it are compacted into a candidate
     buffer and the ``k`` largest of them kept; when the count above the
     threshold is off (above ``CANDIDATE_FACTOR`` times the capacity, or
     below ``MIN_FRACTION * k``) it falls back to the exact ``lax.top_k``
     under a ``lax.cond`` with no collective inside (devices may take
     different branches). ``sample_ratio=1.0`` always uses ``lax.top_k``,
     and so does every ratio on GPU and TPU, where one ``top_k`` kernel is
     faster than the threshold's passes (``selection.tuning_for``), and on
     CPU a sparse bucket of fewer than 4,096 entries, where ``lax.top_k`` is
     exact and quicker to compile (``selection.Tuning.sampled_min_size``).
     On CPU all of it but the draw of the sample's positions is one native
     custom call where it could be built (``selection.Tuning.native``), the
     same bits as in JAX; without ``clip_norm`` that call forms the velocity
     from the leaves, the momentum and the residual in its own pass, so that
     nothing of ``n`` entries is written before the exchange, and one more
     call forms it again where the step is kept and writes the momentum and
     the residual over the old ones (9 passes over the gradient a step).
     Every device's ``(values / P, indices)`` is all-gathered and the mean
     is their scatter-add.
  4. *Momentum factor masking*: ``v`` keeps what was not sent (``v - sent``,
     zero where sent) and ``u`` is zeroed where sent.
  5. *Warm-up*: the density follows 25%, 6.25%, 1.5625%, 0.4% in four equal
     stages over ``warmup_steps``, then ``density`` (a stage never goes below
     ``density``). Each stage above ``density`` is one form of the step with
     its own static ``k``, so each sends its own payload; the stages at
     ``density`` share the form of the steps after the warm-up
     (:func:`form_densities`), whose wire carries the ``k`` of ``density``
     only. The step builders compile one program per form and pick it on the
     host (no exchange inside a conditional); ``update`` alone holds them all
     in one program, a ``lax.switch`` on the step count (the same on every
     device).

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
    clip_norm: ``None`` (no clipping) or the global threshold, in (0, inf);
      each device clips at ``clip_norm / sqrt(P)``.
    warmup_steps: steps of the warm-up ramp, an int >= 0 (0: none).
    sample_ratio: share of the entries sampled for the threshold, in (0, 1].
    nesterov: Nesterov momentum.
    seed: PRNG seed of the sample, an int in ``[0, 2**32)``.
    sparse_leaves: which leaves are sparsified: ``"rank>1"`` (the paper's
      rule; the rest go dense), ``"all"`` (every leaf in the sparse bucket,
      the message is then ``8 k`` bytes: ``4 n / 8 k = 1 / (2 density)``,
      500x at density 0.001), or a callable ``shape -> bool``.
    bucket_cap_mb: ``None`` (one bucket, the default) or the MiB of gradient
      per bucket, in (0, inf): torch DDP's buckets, filled in reverse leaf order
      and exchanged one after the other (:func:`jaxcomp.protocol.plan`); each bucket has
      its own ``k`` (of its sparse leaves, the warm-up's too), its own
      sample, and its own clip: ``clip_norm`` then bounds each bucket's
      norm, not the whole gradient's.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`DGCState`, whose
    ``update`` returns the update to apply with plain SGD, identical on
    every device, in the dtype of ``updates``.

  Wire: two all-gathers of the stage's ``k`` (f32 values, int32 indices),
  ``(P - 1) * 8 k`` bytes per device, plus the dense all-reduce of the
  ``n_d`` other elements, ``2 (P - 1) / P * 4 n_d``. One device's message
  is ``8 k + 4 n_d`` bytes. :func:`jaxcomp.wire.expected_bytes` with
  ``steps=T`` weights the stages over the first ``T`` steps; without, it
  gives the steady state after the warm-up. With buckets, the formula of
  each bucket's sparse and dense leaves.

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
  density = checks.check_density(density)
  axes = checks.check_axis_name(axis_name)
  momentum, nesterov, clip_norm, warmup_steps, sample_ratio, where = _check_args(
      momentum, nesterov, clip_norm, warmup_steps, sample_ratio, sparse_leaves
  )
  seed = checks.check_seed(seed)
  bucket_cap_mb = checks.check_bucket_cap_mb(bucket_cap_mb)
  forms = len(form_densities(density, warmup_steps))

  def accumulate(u, g):
    """``(new u, what v accumulates)``: the momentum correction."""
    if nesterov:
      u = momentum * (u + g)
      return u, u + g
    u = momentum * u + g
    return u, u

  def prepare(ctx, gradient, state):
    """Clipping, then the momentum correction of the sparse leaves (before error feedback).

    Elementwise over the whole bucket (the head, the sparse leaves, by
    position), so that it fuses into the addition of the residual. The
    carry is the clipped gradient: ``step`` forms every leaf's new momentum
    from it."""
    clipped = gradient
    if clip_norm is not None:
      limit = clip_norm / math.sqrt(ctx.num_devices)
      norm = jnp.sqrt(jnp.sum(gradient * gradient))

      def overflowed():
        # The squares' sum overflowed (a norm past 1.8e19), and limit / inf would
        # clip the gradient to 0: its direction, from the gradient brought to its
        # largest entry's unit binade (exact), times the limit.
        unit, norm = binade.unit_norm(gradient)
        return unit, limit / norm

      unit, scale = lax.cond(jnp.isfinite(norm),
                             lambda: (jnp.float32(1.0), jnp.minimum(1.0, limit / norm)),
                             overflowed)
      clipped = gradient * unit * scale
    _, velocity = accumulate(state.momentum, clipped)
    return jnp.where(_in_head(ctx.bucket, where), velocity, clipped), _Carry(gradient=clipped)

  def in_pass(head: int) -> bool:
    """The sampled selection of every form's ``k`` among the ``head`` sparse entries is
    one native call (:func:`jaxcomp._src.selection.sampled_in_call`)."""
    tuning = selection.tuning_for()
    return head > 0 and sample_ratio < 1.0 and all(
        selection.sampled_in_call(head, k, tuning)
        for k in _form_ks(density, warmup_steps, head))

  def prepare_leaves(ctx, leaves, state):
    """``prepare`` (without clipping, whose norm reads the fused gradient) and the
    residual's addition by custom calls that read the leaves where they lie (the
    same bits).

    Where the selection is one native call, the sparse leaves' corrected gradient
    is never written: the selection forms it in its pass
    (:func:`jaxcomp._src.native.momentum_sampled_topk`) and the branch that keeps
    the step again, where it writes the momentum and the residual over the old
    ones (:func:`jaxcomp._src.native.momentum_masked`); the carry is the leaves,
    the corrected gradient only the dense leaves' (``f32[n - head]``). Else one
    call writes it and every leaf's new momentum
    (:func:`jaxcomp._src.native.momentum_corrected`), which is the carry:
    ``step`` masks it where it writes it."""
    sparse = _sparse(ctx.bucket, where)
    if in_pass(sparse.size):
      tail = [leaf.reshape(-1) for leaf in leaves[len(sparse.leaves):]]
      dense = fusion.concat(tail) if tail else jnp.zeros((0,), jnp.float32)
      return dense + state.residual[sparse.size:], _Carry(leaves=leaves)
    corrected, whole = native.momentum_corrected(
        leaves, state.momentum, state.residual, sparse.size, momentum, nesterov)
    return corrected, _Carry(momentum=whole)

  def step(ctx, corrected, state):
    sparse, dense = _sparse(ctx.bucket, where), _dense(ctx.bucket, where)
    leaves = None if ctx.carry is None else ctx.carry.leaves
    # The dense leaves' corrected gradient: all that ``prepare_leaves`` wrote, or the tail.
    dense_corrected = corrected if leaves is not None else corrected[sparse.size:]
    means, witness = [], []
    # What was sent exactly, packed: the dense leaves all, from sparse.size on.
    sent = error_feedback.sent_mask(ctx.bucket.size, jnp.zeros((0,), jnp.int32), sparse.size)
    dense_momentum = jnp.zeros((0,), jnp.float32)
    if sparse.size:

      def exchange(k):
        # The velocity is the head of ``corrected``, selected where it lies, or
        # formed from the leaves in the selection's pass.
        if leaves is not None:
          tuning = selection.tuning_for()
          positions, rank, candidates = selection.call_sample(
              sparse.size, k, k, ctx.key, sample_ratio, tuning)
          values, indices = native.momentum_sampled_topk(
              leaves, state.momentum, state.residual, momentum, nesterov, k, k, positions,
              rank, size=sparse.size, candidates=candidates, min_fraction=tuning.min_fraction)
        elif sample_ratio == 1.0:
          values, indices = selection.select_topk(corrected[:sparse.size], k)
        else:
          values, indices = selection.sampled_topk(
              corrected, k, k, ctx.key, sample_ratio, selection.tuning_for(),
              size=sparse.size)
        all_values, all_indices = ctx.sparse_allgather(values, indices)
        # 0, or NaN when a gathered value is not finite (then so is the mean):
        # the k-sized test stands in for one over the n-sized mean.
        check = jnp.sum(all_values - all_values)
        # Densified once the momentum is written: its zeros then take the fused
        # gradient's memory, which the momentum reads until then.
        sparse_mean = protocol.Later.densified(all_values, all_indices, sparse,
                                               received=all_indices)
        return (sparse_mean, error_feedback.sent_mask(ctx.bucket.size, indices, sparse.size),
                check)

      ks = _form_ks(density, warmup_steps, sparse.size)
      if forms > 1:
        # The forms' k differ, so a branch returns the n-sized mean and the
        # packed mask of what was sent, not its indices.
        sparse_mean, sent, check = ctx.switch([functools.partial(exchange, k) for k in ks])
      else:
        sparse_mean, sent, check = exchange(ks[-1])
      means.append(sparse_mean)
      witness.append(check)
    if dense.size:
      dense_momentum, out = accumulate(state.momentum[sparse.size:], ctx.mean(dense_corrected))
      means.append(out)
      witness.append(out)

    def new_momentum():
      """The new momentum written over the old: the sparse leaves' as in
      ``prepare``, with what was sent masked, formed over the whole bucket,
      then the dense leaves' written over its tail in place. The whole
      bucket's piece makes the write one elementwise loop, which XLA:CPU runs
      on every core; a piece of the sparse leaves alone was an in-place
      update, which it runs on one (ResNet-50 on 2 cores: 24 ms against 50
      for that kernel). Not one ``where`` over the bucket with the dense
      leaves padded in: XLA:CPU's loop over a small operand padded to ``n``
      took 5 times as long as the elementwise pass on an AVX-512 CPU (190 ms
      against 35 for ResNet-50). Formed again from its inputs where it is
      written, not shared with ``prepare``'s (XLA would write that out and
      read it back); where the native call read the leaves, taken from the
      momentum it wrote in that pass (no fused gradient to form it from is
      written then)."""
      whole = ctx.carry.momentum
      if whole is None:
        whole, _ = accumulate(state.momentum, ctx.carry.gradient)
      return fusion.Pieces((0, sparse.size),
                           (error_feedback.zero_sent(sent, whole), dense_momentum))

    # What was sent leaves the velocity. The dense leaves are sent exactly:
    # their residual is 0 (it never holds anything), written as such in the
    # same pass, so the residual is one elementwise write over the bucket.
    def joined(parts):
      """The sparse leaves' mean, then the dense leaves': one flat array, or one array
      per leaf where the sparse leaves' mean was made so."""
      if isinstance(parts[0], list):
        return parts[0] + (dense.split(parts[1]) if len(parts) > 1 else [])
      return fusion.concat(parts)

    mean = protocol.Later.join(joined, means)
    if leaves is not None:
      # Both formed again from the leaves in one pass that writes them over the old.
      return protocol.Output(mean=mean, witness=witness, joint=protocol.Joint(
          ("residual", "momentum"),
          lambda old_residual, old_momentum: native.momentum_masked(
              leaves, old_residual, old_momentum, sent, dense_momentum, sparse.size, momentum,
              nesterov)))
    return protocol.Output(
        mean=mean,
        residual=lambda: error_feedback.zero_sent(sent, corrected),
        witness=witness,
        state={"momentum": new_momentum})

  def wire_cost(bucket, sizes, steps):
    n_s = _sparse(bucket, where).size
    cost = wire.mean(bucket.size - n_s, sizes)
    if not n_s:
      return cost
    gathers = [wire.sparse_allgather(k, sizes) for k in _form_ks(density, warmup_steps, n_s)]
    if forms == 1:
      return gathers[0] + cost
    # Each form weighs the steps of its stages: the last, those at ``density`` too.
    stages = stage_weights(warmup_steps, steps)
    weights = stages[:forms - 1] + (sum(stages[forms - 1:]),)
    return sum((wire.in_branch(c, i, w) for i, (c, w) in enumerate(zip(gathers, weights))),
               cost)

  return protocol.compressor(protocol.Method(
      name="dgc",
      config=dict(density=density, axis_name=axis_name, momentum=momentum, nesterov=nesterov,
                  clip_norm=clip_norm, warmup_steps=warmup_steps, sample_ratio=sample_ratio,
                  seed=seed, sparse_leaves=sparse_leaves, bucket_cap_mb=bucket_cap_mb),
      axes=axes, state=DGCState, step=step, wire=wire_cost,
      init=lambda params, bucket: {"momentum": jnp.zeros((bucket.size,), jnp.float32)},
      bucket_fields=("momentum",),
      layout=lambda tree: _sparse_first(tree, where), error_feedback=True, prepare=prepare,
      prepare_leaves=prepare_leaves if clip_norm is None else None,
      payload_carries_nonfinite=True,
      seed=seed, bucket_cap_mb=bucket_cap_mb,
      form=(lambda count: _form(count, warmup_steps, forms)) if forms > 1 else None))


class _Carry(NamedTuple):
  """What DGC's preparation hands its step (:attr:`jaxcomp.protocol.Context.carry`):
  the clipped gradient ``f32[n]``, from which the step forms the new momentum where it
  writes it (read there with the old momentum, not written out before); or that new
  momentum itself, where the native call formed it in the pass that read the leaves;
  or the bucket's leaves, where the native calls form everything from them."""

  gradient: Optional[jax.Array] = None
  momentum: Optional[jax.Array] = None
  leaves: Optional[list] = None


def _sparse_first(tree, where) -> fusion.Bucket:
  """The bucket order: the sparse leaves, then the dense ones (tree order within each)."""
  return fusion.Bucket.of(tree, where) + fusion.Bucket.of(tree, lambda s: not where(s))


def _sparse(bucket: fusion.Bucket, where) -> fusion.Bucket:
  """The sparse leaves of a :func:`_sparse_first` bucket (its head)."""
  return bucket.part(0, sum(1 for shape in bucket.shapes if where(shape)))


def _dense(bucket: fusion.Bucket, where) -> fusion.Bucket:
  """The dense leaves of a :func:`_sparse_first` bucket (its tail)."""
  return bucket.part(len(_sparse(bucket, where).leaves), len(bucket.leaves))


def _in_head(bucket: fusion.Bucket, where) -> jax.Array:
  """``bool[bucket.size]``: true on the sparse leaves of a :func:`_sparse_first` bucket."""
  return jnp.arange(bucket.size) < _sparse(bucket, where).size


def _form(count: jax.Array, warmup_steps: int, forms: int) -> jax.Array:
  """The form of step ``count`` (:func:`form_densities`): its warm-up stage, 0 to 3, or 4
  after the warm-up, at most ``forms - 1``."""
  stages = len(WARMUP_DENSITIES)
  stage = jnp.where(count >= warmup_steps, stages, count * stages // warmup_steps)
  return jnp.minimum(stage, forms - 1)
