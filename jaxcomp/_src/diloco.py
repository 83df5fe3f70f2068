"""DiLoCo: replica groups that train on their own and sync rarely, through any compressor.

DiLoCo (Douillard et al., arXiv:2311.08105): the devices form replica groups
along a slow mesh axis (between nodes, pods or datacentres). Inside a group,
an inner optimizer (AdamW in the paper; any optax transformation here) takes
steps on the group's own data, the gradient averaged over the group's fast
axis by any jaxcomp compressor, or the parameters sharded over it (FSDP).
Every ``H`` inner steps (``sync_period``, MaxText's ``diloco_sync_period``)
only the outer pseudo-gradient ``anchor - params`` (``anchor``: the
parameters at the last sync) crosses the slow links, averaged by any jaxcomp
compressor over the slow axis (with its own per-device error feedback), and
an outer optimizer applies it to the anchor (default: SGD with Nesterov
momentum, lr 0.7 and momentum 0.9, MaxText's ``diloco_outer_lr`` and
``diloco_outer_momentum``); every device then starts again from the same new
parameters.

Streaming DiLoCo (Douillard et al., arXiv:2501.18512): the parameters cut into
``F`` fragments (``num_fragments``, MaxText's ``num_diloco_fragments``),
fragment ``f`` synced after the inner steps ``t`` (counted from 1) with
``t % H == f * H / F``, so that the peak exchange is the largest fragment's,
about ``1/F`` of the model, and the slow links are busy on ``F`` steps of
every ``H``.

Wire per device: the inner step's (the inner compressor's formula over the
fast axis, or FSDP's reduce-scatter and all-gather) every step; on a sync of
fragment ``f``, the outer compressor's formula for the fragment's leaves over
the slow axis, on this device's ``1/X`` row-block shard of them (``X`` devices
on the fast axis: the pseudo-gradient is the same on every device of a group,
so each sends its own shard, :func:`jaxcomp.hierarchical` with
``fast_reduce=False``), then an all-gather of the means over the fast axis.
:meth:`DiLoCoStep.transfers` states it per kind of step and per inner step.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
import numpy as np
import optax

from jaxcomp._src import checks
from jaxcomp._src import dense
from jaxcomp._src import fsdp
from jaxcomp._src import hierarchical
from jaxcomp._src import layout
from jaxcomp._src import protocol
from jaxcomp._src import registry
from jaxcomp._src import steps
from jaxcomp._src import wire


class FragmentState(NamedTuple):
  """The outer state of one fragment.

  Attributes:
    compressor: the outer compressor's state (its residual sized to this
      device's shard of the fragment).
    optimizer: the outer optimizer's state (the same on every device).
  """

  compressor: optax.OptState
  optimizer: optax.OptState


class DiLoCoState(NamedTuple):
  """State of a :func:`make_diloco_step` run, every leaf laid out per device.

  Each leaf holds every device's block one after the other along its first
  dimension, sharded over the mesh's axes (the layout of
  :func:`jaxcomp.training.init_state`), so that one checkpoint holds it whole.

  Attributes:
    params: this device's parameters: its group's (the same on every device
      of a group), or with FSDP its row blocks of them.
    inner_state: the inner transformation's state.
    anchor: the parameters at each fragment's last sync, the same on every
      device (with FSDP, every group's copy of this device's row blocks).
    outer_state: one :class:`FragmentState` per fragment.
    step: int32, the inner steps taken (a skipped step counts: the sync
      schedule does not move).
  """

  params: optax.Params
  inner_state: optax.OptState
  anchor: optax.Params
  outer_state: tuple[FragmentState, ...]
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class DiLoCoTransfers:
  """What a DiLoCo run sends per device, by the formulas.

  Attributes:
    inner: the transfers of an inner step.
    outer: the transfers of the sync of each fragment (one tuple per fragment).
    sync_period: ``H``.
  """

  inner: wire.WireCost
  outer: tuple[wire.WireCost, ...]
  sync_period: int

  def per_inner_step(self) -> wire.WireBytes:
    """The bytes of an inner step plus each fragment's sync spread over its ``H`` steps."""
    spread = tuple(t._replace(weight=t.weight * Fraction(1, self.sync_period))
                   for cost in self.outer for t in cost)
    return wire.tally(self.inner + spread)


def fragments(params: optax.Params, num_fragments: int) -> tuple[tuple[int, ...], ...]:
  """The leaves of each of ``num_fragments`` fragments (indices into ``jax.tree.leaves``).

  Leaves are kept whole and dealt largest first to the fragment holding the
  fewest elements so far (the first such fragment on a tie), so the largest
  fragment is as small as whole leaves allow; each fragment lists its leaves
  in tree order.

  Raises:
    ValueError: fewer non-empty leaves than fragments.
  """
  sizes = [math.prod(jnp.shape(x)) for x in jax.tree.leaves(params)]
  nonempty = [i for i, n in enumerate(sizes) if n]
  if len(nonempty) < num_fragments:
    raise ValueError(
        f"`num_fragments` is {num_fragments}, but the parameters have {len(nonempty)}"
        " non-empty leaves, and a leaf is never cut: use at most that many fragments")
  loads = [0] * num_fragments
  members: list[list[int]] = [[] for _ in range(num_fragments)]
  for i in sorted(nonempty, key=lambda i: -sizes[i]):
    lightest = loads.index(min(loads))
    loads[lightest] += sizes[i]
    members[lightest].append(i)
  empty = [i for i, n in enumerate(sizes) if not n]
  members[0].extend(empty)  # nothing to send: synced with the first fragment
  return tuple(tuple(sorted(m)) for m in members)


def _device_block(x: jax.Array, device: int, shape: tuple[int, ...]) -> np.ndarray:
  """Device ``device``'s block of a per-device leaf, shaped ``shape``, on the host."""
  rows = shape[0] if shape else 1
  if not math.prod(shape):
    return np.zeros(shape, x.dtype)
  for held in getattr(x, "addressable_shards", ()):
    if (held.index[0].start or 0) == device * rows and held.data.shape[0] == rows:
      return np.asarray(held.data).reshape(shape)
  return np.asarray(x)[device * rows:(device + 1) * rows].reshape(shape)


def _take(tree: optax.Params, indices: tuple[int, ...]) -> tuple:
  leaves = jax.tree.leaves(tree)
  return tuple(leaves[i] for i in indices)


def _put(tree: optax.Params, indices: tuple[int, ...], values) -> optax.Params:
  leaves, treedef = jax.tree.flatten(tree)
  for i, v in zip(indices, values):
    leaves[i] = v
  return jax.tree.unflatten(treedef, leaves)


class DiLoCoStep:
  """The step of :func:`make_diloco_step`: ``step(state, batch) -> (state, metrics)``.

  Two kinds of compiled program: the inner step (forward, backward and the
  inner update, on every call) and, after the inner steps that end a
  fragment's period, the outer step of that fragment (its pseudo-gradient
  through the outer compressor and the outer optimizer). Each is compiled
  once (once per form of a compressor with forms, :class:`jaxcomp.training.FormedStep`).
  The host keeps the step count from the state it returned last, and reads
  it from the devices only for a state it did not return (a restored one).
  """

  def __init__(self, loss_fn, inner_tx, outer_compressor, outer_optimizer, mesh, slow_axis,
               fast_axis, sync_period, num_fragments, use_fsdp, has_aux, donate,
               skip_nonfinite, skip_scope):
    self.mesh = mesh
    self.slow_axis = slow_axis
    self.fast_axis = fast_axis
    self.sync_period = sync_period
    self.num_fragments = num_fragments
    self.fsdp = use_fsdp
    self.inner_tx = inner_tx
    self.outer_optimizer = outer_optimizer
    self._loss_fn = loss_fn
    self._has_aux = has_aux
    self._donate = donate
    self._skip = skip_nonfinite
    self.skip_scope = skip_scope
    self.axes = (slow_axis,) if fast_axis is None else (slow_axis, fast_axis)
    self.fast_size = 1 if fast_axis is None else mesh.shape[fast_axis]
    self.count = layout.num_replicas(mesh, self.axes)
    # Replicated inside a group, every device sends its own shard of the
    # group's pseudo-gradient; with FSDP it holds only its shard already.
    self._outer_given = outer_compressor
    self.outer_compressor = outer_exchange(outer_compressor, fast_axis, self.fast_size, use_fsdp)
    self.outer_tx = optax.chain(self.outer_compressor, outer_optimizer)
    self._whole = None
    self._programs: dict = {}
    self._last: Optional[tuple[jax.Array, int]] = None

  # ------------------------------------------------------------ shapes

  def _bind(self, whole: optax.Params) -> None:
    """Checks the parameters' shapes once and derives every shape from them."""
    whole = protocol.abstract(whole)
    if self._whole is not None:
      if jax.tree.structure(whole) != jax.tree.structure(self._whole) or any(
          a.shape != b.shape for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(self._whole))):
        raise ValueError("this DiLoCo step was built for parameters of other shapes: build one"
                         " step per model")
      return
    self.fragments = fragments(whole, self.num_fragments)
    self.local_params = (hierarchical.shard_shapes(whole, self.fast_size) if self.fsdp
                         else whole)
    _check_inner(self.inner_tx, self.local_params, self.slow_axis, self.fast_axis,
                 self.fast_size, self.fsdp)
    registry.check_chain(self.inner_tx, self.local_params)
    self._inner_spec = steps.formed_spec(self.inner_tx, self.local_params)
    self._outer_specs = tuple(
        steps.formed_spec(self.outer_tx, _take(self.local_params, f)) for f in self.fragments)
    self.like = jax.eval_shape(self._local_init, self.local_params)
    self._whole = whole

  def _local_init(self, local_params):
    """One device's :class:`DiLoCoState` for its parameters ``local_params``."""
    outer = tuple(
        FragmentState(*self.outer_tx.init(_take(local_params, f))) for f in self.fragments)
    return DiLoCoState(params=local_params, inner_state=self.inner_tx.init(local_params),
                       anchor=local_params, outer_state=outer,
                       step=jnp.zeros((), jnp.int32))

  # ------------------------------------------------------------ state

  def init(self, params: optax.Params) -> DiLoCoState:
    """The state of a run from ``params`` (whole parameters, on the host or any device)."""
    self._bind(params)
    if not self.fsdp:
      return layout.tile_per_device(self._local_init(params), self.mesh, self.axes)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.local_params)
    state = layout.tile_per_device(self._local_init(zeros), self.mesh, self.axes)
    # Two copies: both are donated to the steps.
    return state._replace(params=self._per_device_shards(params),
                          anchor=self._per_device_shards(params))

  def _per_device_shards(self, params: optax.Params) -> optax.Params:
    """Every device's row blocks of ``params``, in the per-device layout over both axes."""
    groups = self.mesh.shape[self.slow_axis]

    def place(x):
      blocks = np.asarray(hierarchical.row_blocks(jnp.asarray(x), self.fast_size))
      blocks = blocks.reshape((self.fast_size, -1) + blocks.shape[1:])
      rows = np.broadcast_to(blocks[None], (groups,) + blocks.shape)
      rows = rows.reshape((-1,) + blocks.shape[2:])
      return jax.device_put(rows, layout.state_sharding(self.mesh, self.axes, rows))

    return jax.tree.map(place, params)

  def group_params(self, state: DiLoCoState, group: int = 0) -> optax.Params:
    """The whole parameters of replica group ``group`` (its first device's; FSDP: gathered)."""
    return self._whole_of(state.params, group)

  def global_params(self, state: DiLoCoState) -> optax.Params:
    """The parameters at each fragment's last sync (the anchor): the same on every device."""
    return self._whole_of(state.anchor, 0)

  def _whole_of(self, tree, group: int):
    """Host copies of ``group``'s whole parameters out of a per-device ``tree``, read
    from the devices' own blocks (no program runs)."""
    first = group * self.fast_size
    if not self.fsdp:
      return jax.tree.map(lambda x, l: _device_block(x, first, l.shape), tree, self.like.params)
    blocks = jax.tree.map(
        lambda x, l: np.concatenate([_device_block(x, d, l.shape)
                                     for d in range(first, first + self.fast_size)]),
        tree, self.like.params)
    return fsdp.gather_params(blocks, self._whole)

  # ------------------------------------------------------------ programs

  def fragment_after(self, t: int) -> Optional[int]:
    """The fragment synced after inner step ``t`` (counted from 1), or ``None``."""
    offset = t % self.sync_period
    every = self.sync_period // self.num_fragments
    return offset // every if offset % every == 0 else None

  def _spec(self):
    return PartitionSpec(self.axes)

  def _inner_program(self, form: Optional[int]) -> Callable:
    key = ("inner", form)
    if key not in self._programs:
      across = (self.slow_axis,) if self.skip_scope == "all" else ()
      if self.fsdp:
        body = fsdp.sharded_body(self._loss_fn, self.inner_tx, self._whole, self.fast_axis,
                                 self.fast_size, agree_over=across + (self.fast_axis,),
                                 skip_nonfinite=self._skip, form=form, has_aux=self._has_aux)
      else:
        body = steps.replicated_body(self.inner_tx, self._loss_fn, self._has_aux, self._skip,
                                     form, agree_over=across)
      like = self.like

      def per_device(params, inner_state, step, batch):
        params = layout.blocks_to_local(params, like.params)
        inner_state = layout.blocks_to_local(inner_state, like.inner_state)
        params, inner_state, metrics = body(params, inner_state, batch)
        add_axis = lambda x: jnp.expand_dims(x, 0)
        return (layout.local_to_blocks(params), layout.local_to_blocks(inner_state), step + 1,
                jax.tree.map(add_axis, metrics))

      spec = self._spec()
      sharded = jax.shard_map(per_device, mesh=self.mesh, in_specs=(spec,) * 4,
                              out_specs=(spec,) * 4, check_vma=False)
      self._programs[key] = jax.jit(sharded, donate_argnums=(0, 1, 2) if self._donate else ())
    return self._programs[key]

  def _outer_program(self, fragment: int, form: Optional[int]) -> Callable:
    key = ("outer", fragment, form)
    if key not in self._programs:
      like = self.like
      members = self.fragments[fragment]
      like_params = _take(like.params, members)
      like_state = like.outer_state[fragment]
      # With FSDP each device updates its own shard: the skip agrees over the fast axis.
      agree_over = (self.fast_axis,) if self.fsdp else ()

      def per_device(params, anchor, outer_state):
        params = layout.blocks_to_local(params, like_params)
        anchor = layout.blocks_to_local(anchor, like_params)
        outer_state = tuple(layout.blocks_to_local(outer_state, like_state))
        pseudo_gradient = tuple(a - p for a, p in zip(anchor, params))
        new_anchor, new_state, finite = steps.guarded_update(
            self.outer_tx, pseudo_gradient, outer_state, anchor, skip_nonfinite=self._skip,
            agree_over=agree_over, form=form)
        # Every device starts again from the new anchor; a skipped sync keeps
        # each group on its own parameters, and its drift joins the next sync.
        new_params = protocol.keep_if(finite, new_anchor, params) if self._skip else new_anchor
        return (layout.local_to_blocks(new_params), layout.local_to_blocks(new_anchor),
                layout.local_to_blocks(FragmentState(*new_state)), jnp.expand_dims(finite, 0))

      spec = self._spec()
      sharded = jax.shard_map(per_device, mesh=self.mesh, in_specs=(spec,) * 3,
                              out_specs=(spec,) * 4, check_vma=False)
      self._programs[key] = jax.jit(sharded, donate_argnums=(0, 1, 2) if self._donate else ())
    return self._programs[key]

  def lower(self, state: DiLoCoState, batch: Any = None, *, fragment: Optional[int] = None,
            form: Optional[int] = None):
    """The lowered inner step (``fragment=None``) or sync of ``fragment``, for inspection."""
    self._check_bound()
    if fragment is None:
      return self._inner_program(form).lower(state.params, state.inner_state, state.step, batch)
    members = self.fragments[fragment]
    return self._outer_program(fragment, form).lower(
        _take(state.params, members), _take(state.anchor, members), state.outer_state[fragment])

  def _check_bound(self) -> None:
    if self._whole is None:
      raise ValueError("call `init` first: the step learns the parameters' shapes there")

  def cache_size(self) -> int:
    """Programs compiled, over every kind of step and form."""
    return sum(p._cache_size() for p in self._programs.values())  # pylint: disable=protected-access

  # ------------------------------------------------------------ the step

  def _host_step(self, step: jax.Array) -> int:
    if self._last is not None and step is self._last[0]:
      return self._last[1]
    return steps.host_int(step)

  def __call__(self, state: DiLoCoState, batch: Any) -> tuple[DiLoCoState, dict]:
    """One inner step, then the sync of the fragment whose period it ends, if any.

    Returns:
      ``(state, metrics)``: ``metrics`` holds the inner step's per-device
      ``loss`` and ``finite`` (a leading device axis), ``synced`` (the
      fragment synced after it, or ``None``) and after a sync
      ``outer_finite`` (per device; ``False`` everywhere when the sync was
      skipped).
    """
    if not isinstance(state, DiLoCoState):
      raise TypeError(f"`state` must be the DiLoCoState of `init`, got {type(state).__name__}")
    self._check_bound()
    layout.check_per_device(state, self.like, self.count, "state")
    t = self._host_step(state.step)
    inner_form = steps.form_of(self._inner_spec, state.inner_state)
    params, inner_state, step, metrics = self._inner_program(inner_form)(
        state.params, state.inner_state, state.step, batch)
    state = state._replace(params=params, inner_state=inner_state, step=step)
    t += 1
    self._last = (step, t)
    fragment = self.fragment_after(t)
    metrics = {**metrics, "synced": fragment}
    if fragment is not None:
      members = self.fragments[fragment]
      outer_form = steps.form_of(self._outer_specs[fragment], state.outer_state[fragment])
      params, anchor, outer, finite = self._outer_program(fragment, outer_form)(
          _take(state.params, members), _take(state.anchor, members),
          state.outer_state[fragment])
      outer_state = list(state.outer_state)
      outer_state[fragment] = outer
      state = state._replace(params=_put(state.params, members, params),
                             anchor=_put(state.anchor, members, anchor),
                             outer_state=tuple(outer_state))
      metrics["outer_finite"] = finite
    return state, metrics

  # ------------------------------------------------------------ bytes

  def transfers(self, params: optax.Params) -> DiLoCoTransfers:
    """What each kind of step sends per device, by the formulas (``params``: whole, or shapes)."""
    return transfers(params, dict(self.mesh.shape), slow_axis=self.slow_axis,
                     sync_period=self.sync_period, fast_axis=self.fast_axis,
                     inner_tx=self.inner_tx, outer_compressor=self._outer_given,
                     num_fragments=self.num_fragments, fsdp=self.fsdp,
                     skip_scope=self.skip_scope)


def outer_exchange(outer_compressor, fast_axis: Optional[str], fast_size: int, use_fsdp: bool):
  """The outer compressor as each device runs it: on its own row-block shard of a group's
  pseudo-gradient (:func:`jaxcomp.hierarchical` without the reduce-scatter), or with FSDP
  (or no fast axis) on what it holds."""
  if fast_axis is None or use_fsdp:
    return outer_compressor
  return hierarchical.hierarchical(outer_compressor, fast_axis, fast_size, fast_reduce=False)


def transfers(
    params: optax.Params,
    mesh_shape: Mapping[str, int],
    *,
    slow_axis: str,
    sync_period: int,
    fast_axis: Optional[str] = None,
    inner_tx: Optional[optax.GradientTransformation] = None,
    outer_compressor: Optional[optax.GradientTransformation] = None,
    num_fragments: int = 1,
    fsdp: bool = False,
    skip_scope: str = "group",
) -> DiLoCoTransfers:
  """What a :func:`make_diloco_step` run sends per device, by the formulas, without a mesh.

  Args:
    params: the whole parameters, or their shapes.
    mesh_shape: the size of each mesh axis, e.g. ``{"dcn": 64, "ici": 8}``.
    slow_axis, sync_period, fast_axis, num_fragments, fsdp, skip_scope: as
      for :func:`make_diloco_step`.
    inner_tx: the inner transformation (``None``: one that sends nothing,
      e.g. a plain optimizer with one device per group).
    outer_compressor: built over ``slow_axis`` (``None``: the dense mean).

  Returns:
    :class:`DiLoCoTransfers` (the cost model prices it:
    :func:`jaxcomp.costmodel.predict_diloco`).
  """
  sync_period, num_fragments = _check_schedule(sync_period, num_fragments)
  _check_skip_scope(skip_scope)
  fast_size = 1 if fast_axis is None else mesh_shape[fast_axis]
  groups = mesh_shape[slow_axis]
  if outer_compressor is None:
    outer_compressor = dense.allreduce(slow_axis)
  outer_compressor = outer_exchange(outer_compressor, fast_axis, fast_size, fsdp)
  whole = protocol.abstract(params)
  local = hierarchical.shard_shapes(whole, fast_size) if fsdp else whole
  if fsdp:
    padded = fast_size * sum(math.prod(s.shape) for s in jax.tree.leaves(local))
    inner = hierarchical.dense_transfers(padded, fast_axis, fast_size)
  elif inner_tx is not None and protocol.find_compressors(inner_tx, local):
    inner = wire.transfers(inner_tx, local, {fast_axis: fast_size})
  else:
    inner = ()
  # The inner step's skip flag: one int32 all-reduce over the axes that agree on it.
  if skip_scope == "all":
    agree = (slow_axis, fast_axis) if fsdp else (slow_axis,)
    inner += (wire.transfer(wire.Kind.ALL_REDUCE, groups * (fast_size if fsdp else 1), 4,
                            agree),)
  elif fsdp:
    inner += (hierarchical.skip_flag(fast_axis, fast_size),)
  axes = protocol.spec(outer_compressor).axes
  outer = []
  for members in fragments(whole, num_fragments):
    cost = wire.transfers(outer_compressor, _take(local, members),
                          {a: mesh_shape[a] for a in axes})
    if fsdp:  # the shards' skip decision, agreed over the fast axis
      cost += (hierarchical.skip_flag(fast_axis, fast_size),)
    outer.append(cost)
  return DiLoCoTransfers(inner=inner, outer=tuple(outer), sync_period=sync_period)


SKIP_SCOPES = ("group", "all")


def _check_skip_scope(skip_scope) -> None:
  if skip_scope not in SKIP_SCOPES:
    raise ValueError(f"`skip_scope` must be one of {SKIP_SCOPES}, got {skip_scope!r}")


def _check_schedule(sync_period, num_fragments) -> tuple[int, int]:
  sync_period = checks.check_number(sync_period, "sync_period", integer=True, low=1)
  num_fragments = checks.check_number(num_fragments, "num_fragments", integer=True, low=1)
  if sync_period % num_fragments:
    raise ValueError(
        f"`num_fragments` ({num_fragments}) must divide `sync_period` ({sync_period}):"
        " fragment f syncs on the steps t with t % sync_period == f * sync_period /"
        " num_fragments")
  return sync_period, num_fragments


def _check_inner(inner_tx, local_params, slow_axis, fast_axis, fast_size, use_fsdp) -> None:
  """A clear error for an inner transformation that the layout cannot run."""
  specs = protocol.find_specs(inner_tx, local_params)
  for s in specs:
    if slow_axis in s.axes:
      raise ValueError(
          f"`inner_tx` holds {s.name} over {s.axes}, which crosses the slow axis"
          f" {slow_axis!r} on every inner step: the inner steps stay inside a replica group;"
          " build the inner compressor over the fast axis, and give the slow axis's"
          " compressor as `outer_compressor`")
  over_fast = [s for s in specs if fast_axis is not None and fast_axis in s.axes]
  if use_fsdp and over_fast:
    raise ValueError(
        f"`inner_tx` holds {over_fast[0].name} over {fast_axis!r}, but with `fsdp=True` the"
        " gradient arrives reduce-scattered over the fast axis already: give a plain optax"
        " optimizer as `inner_tx`")
  if not use_fsdp and fast_size > 1 and not over_fast:
    raise ValueError(
        f"`inner_tx` must average the gradient over the fast axis {fast_axis!r} ({fast_size}"
        " devices per replica group), or the devices of a group drift apart: chain a"
        f" compressor over it first, e.g. optax.chain(jaxcomp.allreduce({fast_axis!r}),"
        " optax.adamw(...)), or pass `fsdp=True`")


def make_diloco_step(
    loss_fn: steps.LossFn,
    inner_tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    slow_axis: str,
    sync_period: int,
    fast_axis: Optional[str] = None,
    outer_compressor: Optional[optax.GradientTransformation] = None,
    outer_optimizer: Optional[optax.GradientTransformation] = None,
    num_fragments: int = 1,
    fsdp: bool = False,
    has_aux: bool = False,
    donate: bool = True,
    skip_nonfinite: bool = True,
    skip_scope: str = "group",
) -> DiLoCoStep:
  """A DiLoCo run on ``mesh``: replica groups along ``slow_axis`` that sync every ``sync_period`` steps.

  Args:
    loss_fn: ``loss_fn(params, local_batch) -> loss`` (``(loss, aux)`` with
      ``has_aux``) on whole parameters, the mean over this device's part of
      the batch.
    inner_tx: the inner step's transformation, e.g.
      ``optax.chain(jaxcomp.allreduce(fast_axis), optax.adamw(4e-4))``: with
      a fast axis of more than one device, it must start with a jaxcomp
      compressor over it (any one: ``jaxcomp.topk(0.01, fast_axis)``); with
      ``fsdp``, a plain optimizer. It never crosses the slow axis.
    mesh: a mesh whose axes are ``(slow_axis, fast_axis)``, or ``(slow_axis,)``.
    slow_axis: the axis of the replica groups (between nodes or pods).
    sync_period: ``H``, the inner steps between two syncs of a fragment, an
      int >= 1.
    fast_axis: the axis inside a group, or ``None`` (one device per group).
    outer_compressor: a jaxcomp compressor built over ``slow_axis`` alone
      (default ``jaxcomp.allreduce(slow_axis)``, the dense mean), with its own
      error feedback per device.
    outer_optimizer: any optax transformation, learning-rate schedules
      included, applied to the mean pseudo-gradient; default
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``. Its schedule counts
      syncs of each fragment.
    num_fragments: ``F`` (Streaming DiLoCo), dividing ``sync_period``; the
      leaves are dealt to fragments by :func:`fragments`.
    fsdp: the parameters sharded over ``fast_axis`` inside each group
      (:func:`jaxcomp.training.make_fsdp_step`'s row blocks).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    donate: donate the state's buffers to each step.
    skip_nonfinite: an inner step whose mean gradient is not finite is
      skipped (see ``skip_scope``); a sync whose mean pseudo-gradient is not
      finite is skipped by every device: anchor and outer state unchanged,
      each group on its own parameters.
    skip_scope: who skips an inner step that is not finite: ``"group"``
      (the default), every device of the replica group that met it (the
      groups share nothing between syncs); ``"all"``, every device, at the
      price of one int32 all-reduce over the slow axis per inner step, a
      slow-link round trip.

  Returns:
    A :class:`DiLoCoStep`: ``state = step.init(params)``, then
    ``state, metrics = step(state, batch)`` with ``batch`` sharded over the
    mesh's axes (:func:`jaxcomp.training.shard` with ``step.axes``): each
    group trains on its devices' parts. ``step.global_params(state)`` is the
    synced model; ``step.transfers(params)`` the bytes.

  Raises:
    ValueError: ``sync_period`` < 1, ``num_fragments`` < 1 or not dividing
      it, an outer compressor over another axis than ``slow_axis``, a mesh
      of other axes, an ``inner_tx`` that crosses the slow axis or (with a
      fast axis) does not average over it.
  """
  sync_period, num_fragments = _check_schedule(sync_period, num_fragments)
  _check_skip_scope(skip_scope)
  fsdp = checks.check_bool(fsdp, "fsdp")
  if not isinstance(slow_axis, str) or not slow_axis:
    raise TypeError(f"`slow_axis` must be a mesh axis name (str), got {slow_axis!r}")
  axes = (slow_axis,) if fast_axis is None else (slow_axis, fast_axis)
  if tuple(mesh.axis_names) != axes:
    raise ValueError(
        f"`mesh` has the axes {tuple(mesh.axis_names)}, but `slow_axis` and `fast_axis`"
        f" name {axes}: build the mesh with exactly these axes, the slow one first")
  if fsdp and fast_axis is None:
    raise ValueError("`fsdp=True` shards the parameters over `fast_axis`: name it")
  if outer_compressor is None:
    outer_compressor = dense.allreduce(slow_axis)
  outer_spec = protocol.spec(outer_compressor)
  if outer_spec is None or outer_spec.fused is None:
    raise TypeError(
        "`outer_compressor` must be one jaxcomp compressor built over the slow axis"
        f" (jaxcomp.quantized(4, {slow_axis!r}), ...), got {type(outer_compressor).__name__}")
  if outer_spec.axes != (slow_axis,):
    raise ValueError(
        f"`outer_compressor` is built over {outer_spec.axes}, but the pseudo-gradient"
        f" crosses the slow axis {slow_axis!r} alone: build it with"
        f" axis_name={slow_axis!r}")
  if outer_optimizer is None:
    outer_optimizer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  return DiLoCoStep(loss_fn, inner_tx, outer_compressor, outer_optimizer, mesh, slow_axis,
                    fast_axis, sync_period, num_fragments, fsdp, has_aux, donate,
                    skip_nonfinite, skip_scope)
