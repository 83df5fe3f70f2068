"""Jitted data-parallel steps: the compressor's update alone, and a whole training step.

Parameters are replicated, the state is in the one per-device layout
(:mod:`jaxcomp._src.layout`), each device computes the gradient of its own part
of the batch::

  mesh = training.make_mesh(8)                             # axis "data"
  tx = optax.chain(jaxcomp.gtopk(1e-3, "data"), optax.sgd(0.1))
  params = training.replicate(params, mesh)
  opt_state = training.init_state(tx, params, mesh, "data")
  step = training.make_step(loss_fn, tx, mesh, "data")
  params, opt_state, metrics = step(params, opt_state, training.shard(batch, mesh, "data"))

The step skips itself on every device alike when the mean gradient is not
finite (parameters and state unchanged). To count skipped steps with
``optax.apply_if_finite`` instead, put it *after* the compressor,
``optax.chain(compressor, optax.apply_if_finite(optimizer, 5))``, and build
the step with ``skip_nonfinite=False`` (the step's own skip would also undo
its counters). Wrapped around the compressor, ``apply_if_finite`` tests each
device's local gradient, so one device's NaN sends that device down the skip
branch while the others wait in the collective for ever.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
import numpy as np
import optax

from jaxcomp._src import checks
from jaxcomp._src import fusion
from jaxcomp._src import layout
from jaxcomp._src import protocol

# loss_fn(params, batch) -> scalar loss over this device's part of the batch.
LossFn = Callable[[optax.Params, Any], jax.Array]


class _UpdateResult(tuple):
  """``(updates, opt_state)`` whose leaves flatten state first.

  ``jit`` hands a donated input's buffer to the first output of the same
  shape and dtype. An update shaped like a state leaf (a scalar's ``[devices]``,
  or any leaf's on a mesh of one device) would come first in
  ``(updates, opt_state)`` and take that leaf's buffer; the new state would be
  written elsewhere and copied back. Flattened state first, each state leaf
  is updated in its own buffer.
  """


jax.tree_util.register_pytree_node(
    _UpdateResult, lambda r: ((r[1], r[0]), None),
    lambda _, children: _UpdateResult((children[1], children[0])))


def make_update(
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name: checks.AxisName,
    *,
    wrap: Optional[Callable[[Callable], Callable]] = None,
    donate: bool = False,
) -> Callable:
  """``tx.update`` alone, jitted over ``mesh``: ``update(grads, opt_state)``.

  For looking at a compressor without a model (tests, benchmarks): every
  device runs ``tx.update`` on its own row of the stacked gradients and on
  its own block of the per-device state.

  Args:
    tx: a compressor, or a chain that needs no ``params``.
    mesh: the device mesh.
    axis_name: the data axis, or a pair of axes for the 2D torus.
    wrap: applied to the per-device function before ``shard_map`` (for
      instance ``lambda f: chex.assert_max_traces(f, n=1)``).
    donate: donate the state's buffers (the residuals are updated in place,
      as inside :func:`make_step`).

  Returns:
    ``update(grads, opt_state) -> (updates, opt_state)``: ``grads`` and
    ``updates`` stacked per device (``[devices, ...]``, see
    :func:`jaxcomp.training.stack_per_device`), each row of ``updates`` that device's result;
    ``opt_state`` laid out per device by :func:`jaxcomp.training.init_state`.
  """
  spec = layout.axes_spec(axis_name)

  def per_device(grads, blocks):
    grads = jax.tree.map(lambda x: x[0], grads)
    like = jax.eval_shape(tx.init, grads)
    # Gradients unlike the state's parameters: the blocks go in as they are,
    # for the transformation to name the mismatch (`updates`).
    state = (layout.blocks_to_local(blocks, like) if layout.is_blocks_of(blocks, like) else blocks)
    updates, state = tx.update(grads, state)
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), updates), layout.local_to_blocks(state)

  body = per_device if wrap is None else wrap(per_device)
  # check_vma=False: see make_step.
  sharded = jax.shard_map(
      body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False)
  count = layout.num_replicas(mesh, axis_name)

  def update(grads, opt_state):
    layout.check_layout(opt_state, count, "opt_state")
    return _UpdateResult(sharded(grads, opt_state))

  return jax.jit(update, donate_argnums=(1,) if donate else ())


def guarded_update(
    tx: optax.GradientTransformation, grads: optax.Updates, state: optax.OptState,
    params: optax.Params, *, skip_nonfinite: bool, agree_over: tuple[str, ...] = (),
    form: Optional[int] = None,
) -> tuple[optax.Params, optax.OptState, jax.Array]:
  """``(new_params, new_state, finite)``: ``tx``'s update applied, or the step skipped.

  Inside ``shard_map`` (or ``pmap``), on this device's gradient. ``finite``
  (bool scalar) says the update is finite; with ``skip_nonfinite`` a
  non-finite one leaves parameters and state as they were. The compressor's
  mean is identical on every device, so is this decision; where each device
  updates its own shard (FSDP), ``agree_over`` names the axes over which the
  devices agree on it (one int32 all-reduce). ``form``: the compressor's form
  of this step, picked on the host (:class:`FormedStep`), or ``None``.
  """
  extra = {} if form is None else {protocol.FORM: form}
  updates, new_state = tx.update(grads, state, params, **extra)
  # One reduction over the fused updates: one per leaf compiles in time that
  # grows with the square of the number of leaves.
  finite = protocol.all_finite(fusion.Bucket.of(updates).flatten(updates))
  if agree_over:
    finite = lax.pmin(finite.astype(jnp.int32), agree_over) > 0
  new_params = optax.apply_updates(params, updates)
  if skip_nonfinite:
    new_params = protocol.keep_if(finite, new_params, params)
    new_state = protocol.keep_if(finite, new_state, state)
  return new_params, new_state, finite


def replicated_body(tx, loss_fn, has_aux, skip_nonfinite, form=None, agree_over=()):
  """The per-device body of the shard_map and pmap steps: ``(params, state, metrics)``.

  ``agree_over``: axes beyond the compressor's over which the skip is agreed
  (:func:`guarded_update`).
  """

  def body(params, state, batch):
    (loss, aux), grads = jax.value_and_grad(
        loss_fn if has_aux else lambda p, b: (loss_fn(p, b), None), has_aux=True
    )(params, batch)
    new_params, new_state, finite = guarded_update(
        tx, grads, state, params, skip_nonfinite=skip_nonfinite, form=form,
        agree_over=agree_over)
    metrics = {"loss": loss, "finite": finite}
    if has_aux:
      metrics["aux"] = aux
    return new_params, new_state, metrics

  return body


class FormedStep:
  """A jitted step whose compressor's step takes one of several forms: one program per form.

  ACP-SGD's P and Q steps and DGC's warm-up stages (:attr:`jaxcomp.protocol.Method.form`)
  send different payloads. In one program they are the branches of a
  conditional, and XLA schedules a collective inside a conditional apart
  from the backward pass it could overlap. Here each form is a program of
  its own, picked on the host from the compressor's step ``count`` in the
  state: one int32 read to the host per step, which waits for the step
  before it to finish (a skipped step does not advance the count, so the
  host cannot count steps itself). The results are those of the one program
  that holds every form, bit for bit.

  For a step with no such compressor, or one the transformation does not
  hand the form to (a wrapper that drops optax's extra arguments), it is the
  one jitted program, and nothing is read. Called under a trace
  (``jax.make_jaxpr``) or lowered, it is the program that holds every form
  (``program(None)``), unless ``lower`` is given a form.
  """

  def __init__(self, build: Callable[[Optional[int]], Callable],
               find_spec: Callable[[tuple], Optional[protocol.Spec]]):
    """``build(form)``: the jitted program of one form (``None``: every form),
    called as ``(params, opt_state, batch)``; ``find_spec(args)``: the spec of
    the one compressor with forms, or ``None``."""
    self._build = build
    self._find_spec = find_spec
    self._programs: dict = {}
    self._searched = False
    self._spec: Optional[protocol.Spec] = None

  def program(self, form: Optional[int] = None) -> Callable:
    """The jitted program of ``form`` (``None``: the one that holds every form)."""
    if form not in self._programs:
      self._programs[form] = self._build(form)
    return self._programs[form]

  def lower(self, *args, form: Optional[int] = None):
    """``program(form).lower(*args)``."""
    return self.program(form).lower(*args)

  def cache_size(self) -> int:
    """Programs compiled, over every form."""
    return sum(p._cache_size() for p in self._programs.values())  # pylint: disable=protected-access

  def __call__(self, params, opt_state, batch):
    args = (params, opt_state, batch)
    if not self._searched:
      self._spec, self._searched = self._find_spec(args), True
    return self.program(form_of(self._spec, opt_state))(*args)


def host_int(x) -> int:
  """An int32 held the same on every device (a per-device step count), read on the host.

  The first copy this process holds: across processes the array spans
  devices it cannot read. Waits for the step that computes it.
  """
  if isinstance(x, jax.Array):
    x = x.addressable_shards[0].data
  return int(np.asarray(x).reshape(-1)[0])


def form_of(spec: Optional[protocol.Spec], state) -> Optional[int]:
  """The form of the step on ``state`` of the compressor ``spec``, or ``None`` (every form).

  ``None`` also without a compressor with forms, or under a trace.
  """
  if spec is None:
    return None
  found = [x.count for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, spec.state))
           if isinstance(x, spec.state)]
  if not found or isinstance(found[0], jax.core.Tracer):  # traced: every form
    return None
  return spec.form(host_int(found[0]))


def formed_spec(tx: optax.GradientTransformation, params: optax.Params) -> Optional[protocol.Spec]:
  """The spec of the one compressor with forms in ``tx`` that can be handed its form, or ``None``.

  ``tx`` must take optax's extra arguments (``optax.chain`` and every jaxcomp
  compressor do); with two compressors with forms, neither is picked.
  """
  if not isinstance(tx, optax.GradientTransformationExtraArgs):
    return None
  specs = [s for s in protocol.find_specs(tx, params) if s.form is not None]
  return specs[0] if len(specs) == 1 else None


def make_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name: checks.AxisName,
    *,
    has_aux: bool = False,
    donate: bool = True,
    skip_nonfinite: bool = True,
) -> Callable:
  """A jitted data-parallel step: ``step(params, opt_state, batch)``.

  Args:
    loss_fn: ``loss_fn(params, local_batch) -> loss`` (``(loss, aux)`` with
      ``has_aux``), the mean over this device's shard of the batch.
    tx: usually ``optax.chain(compressor, optimizer)``, the compressor's
      ``axis_name`` the same as here.
    mesh: the device mesh.
    axis_name: the data axis, or a pair of axes for the 2D torus.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    donate: donate the parameter and state buffers to the step.
    skip_nonfinite: keep parameters and state unchanged, on every device
      alike, when the mean gradient is not finite. Set it to ``False`` when
      ``tx`` holds ``optax.apply_if_finite`` after the compressor, so that
      its counters of non-finite steps advance.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` with
    ``params`` replicated, ``opt_state`` laid out per device (see
    :func:`jaxcomp.training.init_state`), ``batch`` sharded on its leading axis (see
    :func:`jaxcomp.training.shard`), and ``metrics`` holding per-device ``loss`` and ``finite``
    with a leading device axis (no collective is spent on them). A
    :class:`FormedStep`: one program per form of the compressor's step.
  """
  spec = layout.axes_spec(axis_name)
  count = layout.num_replicas(mesh, axis_name)

  def build(form: Optional[int]) -> Callable:
    body = replicated_body(tx, loss_fn, has_aux, skip_nonfinite, form)

    def per_device(params, blocks, batch):
      state = layout.blocks_to_local(blocks, jax.eval_shape(tx.init, params))
      params, state, metrics = body(params, state, batch)
      add_axis = lambda x: jnp.expand_dims(x, 0)
      return params, layout.local_to_blocks(state), jax.tree.map(add_axis, metrics)

    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), spec, spec),
        out_specs=(PartitionSpec(), spec, spec),
        # The compressors' outputs are equal on every device by construction
        # (tests check it bit for bit); the type system cannot see that through
        # ppermute and all-to-all.
        check_vma=False,
    )

    def step(params, opt_state, batch):
      layout.check_per_device(opt_state, jax.eval_shape(tx.init, protocol.abstract(params)),
                              count, "opt_state")
      return sharded(params, opt_state, batch)

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())

  return FormedStep(build, lambda args: formed_spec(tx, protocol.abstract(args[0])))


def make_pmap_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    axis_name: str,
    *,
    has_aux: bool = False,
    devices: Optional[Sequence[jax.Device]] = None,
    skip_nonfinite: bool = True,
) -> Callable:
  """The same step through ``jax.pmap``, bit for bit.

  Parameters and the batch have a leading device axis (:func:`pmap_stack`;
  the batch reshaped to ``[devices, per_device, ...]``); the state is in the
  one per-device layout (:func:`init_pmap_state`, the layout of
  :func:`jaxcomp.training.init_state`), handed to ``pmap`` as one row per device and returned
  in that layout.

  Example::

    tx = optax.chain(jaxcomp.gtopk(0.01, "data"), optax.sgd(0.1))
    params_d = training.pmap_stack(params)
    state_d = training.init_pmap_state(tx, params)
    step = training.make_pmap_step(loss_fn, tx, "data")
    params_d, state_d, metrics = step(params_d, state_d, batch.reshape(8, -1, ...))
  """
  devices = list(jax.local_devices() if devices is None else devices)
  mesh = _devices_mesh(devices)
  count = len(devices)
  pmapped = jax.pmap(replicated_body(tx, loss_fn, has_aux, skip_nonfinite),
                     axis_name=axis_name, devices=devices)

  def step(params, opt_state, batch):
    row = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)),
                       params)
    like = jax.eval_shape(tx.init, row)
    layout.check_per_device(opt_state, like, count, "opt_state")
    params, rows, metrics = pmapped(params, layout.device_rows(opt_state, like), batch)
    tiled = jax.tree.map(
        lambda x, l: jax.device_put(
            jnp.reshape(x, layout.per_device_shape(l.shape, count)),
            layout.state_sharding(mesh, _DEVICES, l)), rows, like)
    return params, tiled, metrics

  return step


_DEVICES = "devices"


def _devices_mesh(devices: Sequence[jax.Device]) -> Mesh:
  return Mesh(np.array(devices), (_DEVICES,))


def pmap_stack(tree: chex.ArrayTree, devices: Optional[Sequence[jax.Device]] = None
               ) -> chex.ArrayTree:
  """``tree`` copied once per device along a new leading axis, one row on each device.

  What ``jax.pmap`` takes for replicated values (parameters): ``devices``
  defaults to ``jax.local_devices()``, as ``pmap`` does.
  """
  devices = list(jax.local_devices() if devices is None else devices)
  return layout.stack_per_device(tree, _devices_mesh(devices), _DEVICES)


def init_pmap_state(
    tx: optax.GradientTransformation, params: optax.Params,
    devices: Optional[Sequence[jax.Device]] = None,
) -> optax.OptState:
  """:func:`jaxcomp.training.init_state` over ``devices`` (``jax.local_devices()`` by default), for :func:`make_pmap_step`."""
  devices = list(jax.local_devices() if devices is None else devices)
  return layout.init_state(tx, params, _devices_mesh(devices), _DEVICES)
