"""The large mini-batch recipe of the 2D-torus paper: a growing batch and its learning rate.

Mikami et al. (arXiv:1811.05233) keep ImageNet/ResNet-50 accurate at
mini-batches beyond 32K with two techniques beside their 2D-torus
all-reduce: batch-size control (the global batch grows over training) and
label smoothing (``optax.smooth_labels`` with
``optax.softmax_cross_entropy``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
import numpy as np
import optax

from jaxcomp._src import checks
from jaxcomp._src import layout


class BatchSizeSchedule:
  """A piecewise-constant, growing global batch size: ``schedule(step) -> size``.

  Built by :func:`batch_size_schedule`. Attributes:
    boundaries: the steps at which each size starts, ascending, the first 0.
    sizes: the global batch size from each boundary on, strictly increasing.
  """

  def __init__(self, boundaries: tuple[int, ...], sizes: tuple[int, ...]):
    self.boundaries = boundaries
    self.sizes = sizes

  def __call__(self, step):
    """The global batch size at ``step``: a Python int, or an int32 array for a traced step.

    The traced form serves as part of an optax schedule
    (:func:`batch_scaled_learning_rate`), which optax calls with its count.
    """
    if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
      if step < 0:
        raise ValueError(f"`step` must be >= 0, got {step}")
      return self.sizes[int(np.searchsorted(self.boundaries, step, side="right")) - 1]
    index = jnp.searchsorted(jnp.asarray(self.boundaries), step, side="right") - 1
    return jnp.asarray(self.sizes, jnp.int32)[jnp.maximum(index, 0)]

  def examples(self, num_steps: int) -> int:
    """Examples the first ``num_steps`` steps draw (the sum of their batch sizes)."""
    num_steps = checks.check_number(num_steps, "num_steps", integer=True, low=0)
    ends = self.boundaries[1:] + (max(num_steps, self.boundaries[-1]),)
    return sum(size * max(0, min(end, num_steps) - start)
               for start, end, size in zip(self.boundaries, ends, self.sizes))

  def __repr__(self) -> str:
    return f"BatchSizeSchedule({dict(zip(self.boundaries, self.sizes))})"


def batch_size_schedule(
    boundaries_and_sizes: dict[int, int], *, num_replicas: Optional[int] = None,
) -> BatchSizeSchedule:
  """Batch-size control: a global batch that grows at given steps.

  Mikami et al. grow the mini-batch during training, small while the loss
  landscape is sharp early on and large later, and report that it keeps
  large mini-batch training stable. The schedule is piecewise constant:
  ``{0: 256, 150: 512, 225: 1024}`` trains steps 0 to 149 on 256 examples,
  150 to 224 on 512 and 1024 from step 225 on. Each distinct size is one
  compile of the step (a new batch shape): :func:`compile_batch_sizes`
  builds them all ahead of time, and a jitted :func:`make_step` fed batches
  of the schedule's sizes traces once per size. The learning rate is left to
  the caller (:func:`batch_scaled_learning_rate` scales it with the batch).

  Args:
    boundaries_and_sizes: step -> global batch size from that step on; the
      steps are ints >= 0, step 0 among them; the sizes ints >= 1, strictly
      increasing with the step.
    num_replicas: if given, every size must be a multiple of it (each device
      takes an equal part; :func:`check_batch_sizes` checks against a mesh).

  Returns:
    a :class:`BatchSizeSchedule`, ``schedule(step) -> global batch size``.

  Example::

    sizes = training.batch_size_schedule({0: 256, 150: 512, 225: 1024})
    steps = training.compile_batch_sizes(step, params, opt_state, batch, sizes, mesh, "data")
    for i in range(300):
      params, opt_state, metrics = steps[sizes(i)](params, opt_state, next_batch(sizes(i)))

  References:
    Mikami et al., `Massively Distributed SGD: ImageNet/ResNet-50 Training in
    a Flash <https://arxiv.org/abs/1811.05233>`_, 2018
  """
  if not hasattr(boundaries_and_sizes, "items"):
    raise TypeError("`boundaries_and_sizes` must be a dict {step: global batch size}, got"
                    f" {boundaries_and_sizes!r}")
  if num_replicas is not None:
    num_replicas = checks.check_number(num_replicas, "num_replicas", integer=True, low=1)
  pairs = sorted(
      (checks.check_number(step, "boundaries_and_sizes step", integer=True, low=0),
       checks.check_number(size, "boundaries_and_sizes size", integer=True, low=1))
      for step, size in boundaries_and_sizes.items())
  if not pairs or pairs[0][0] != 0:
    raise ValueError("`boundaries_and_sizes` must give the batch size at step 0, got"
                     f" {dict(boundaries_and_sizes)!r}")
  for (step, size), (next_step, next_size) in zip(pairs, pairs[1:]):
    if next_size <= size:
      raise ValueError(
          "`boundaries_and_sizes` sizes must grow strictly with the step (batch-size"
          f" control), got {size} at step {step} and {next_size} at step {next_step}")
  if num_replicas is not None:
    for step, size in pairs:
      if size % num_replicas:
        raise ValueError(
            f"`boundaries_and_sizes` size {size} (from step {step}) must be a multiple of"
            f" `num_replicas` {num_replicas}, so that each device takes an equal part")
  return BatchSizeSchedule(tuple(s for s, _ in pairs), tuple(b for _, b in pairs))


def check_batch_sizes(schedule: BatchSizeSchedule, mesh: Mesh,
                      axis_name: checks.AxisName) -> None:
  """Raises a ``ValueError`` unless every size of ``schedule`` splits evenly over the data axes."""
  count = layout.num_replicas(mesh, axis_name)
  for step, size in zip(schedule.boundaries, schedule.sizes):
    if size % count:
      raise ValueError(
          f"the batch-size schedule's size {size} (from step {step}) is not a multiple of"
          f" the {count} devices along `axis_name` {axis_name!r}: each device must take"
          " an equal part of the global batch")


def compile_batch_sizes(
    step: Callable,
    params: optax.Params,
    opt_state: optax.OptState,
    example_batch: chex.ArrayTree,
    schedule: BatchSizeSchedule,
    mesh: Mesh,
    axis_name: checks.AxisName,
) -> dict[int, Any]:
  """``step`` compiled once per distinct global batch size of ``schedule``, ahead of time.

  Args:
    step: a step of :func:`make_step` (or :func:`make_fsdp_step`).
    params: the parameters as the step takes them (only shapes are read).
    opt_state: the per-device state as the step takes it (only shapes are read).
    example_batch: a batch of any size: every leaf's leading axis is the
      examples' axis, replaced by each size of the schedule.
    schedule: the sizes (:func:`batch_size_schedule`).
    mesh: the device mesh.
    axis_name: the data axes the batch is sharded over (as :func:`shard`).

  Returns:
    ``{size: compiled step}``, each taking a batch of ``size`` examples
    sharded with :func:`shard`.

  Raises:
    ValueError: a size is not a multiple of the devices along ``axis_name``.
  """
  check_batch_sizes(schedule, mesh, axis_name)
  sharding = NamedSharding(mesh, layout.axes_spec(axis_name))

  def abstract(size):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((size,) + tuple(jnp.shape(x))[1:], jnp.result_type(x),
                                       sharding=sharding), example_batch)

  return {size: step.lower(params, opt_state, abstract(size)).compile()
          for size in schedule.sizes}


def batch_scaled_learning_rate(
    learning_rate: Union[float, optax.Schedule],
    schedule: BatchSizeSchedule,
    base_batch_size: int,
) -> optax.Schedule:
  """The linear scaling rule on a growing batch: ``lr(t) * schedule(t) / base_batch_size``.

  Goyal et al. scale the learning rate with the global batch (a batch ``k``
  times larger takes a ``k`` times larger rate); applied at every step, the
  rate grows with the batch of :func:`batch_size_schedule`. The schedule is
  read at optax's count, which equals the step index unless steps were
  skipped (a skipped step does not advance it).

  Args:
    learning_rate: the rate (or an optax schedule) for ``base_batch_size``.
    schedule: the global batch sizes.
    base_batch_size: the batch ``learning_rate`` is meant for, an int >= 1.

  Returns:
    an ``optax.Schedule`` for ``optax.sgd`` and the other optimizers.

  References:
    Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
    <https://arxiv.org/abs/1706.02677>`_, 2017
  """
  base_batch_size = checks.check_number(base_batch_size, "base_batch_size", integer=True, low=1)
  if not callable(learning_rate):
    learning_rate = checks.check_number(learning_rate, "learning_rate")
  rate = learning_rate if callable(learning_rate) else (lambda count: learning_rate)
  return lambda count: rate(count) * schedule(count) / base_batch_size
