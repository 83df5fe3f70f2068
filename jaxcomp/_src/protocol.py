"""The one path every compressor takes, around the math that differs between them.

A method is a :class:`Method`: the order in which it fuses the gradient's
leaves (``layout``), its own state fields (``init``), and one ``step`` that
turns this device's error-corrected gradient into a payload (*encode*), sends
it through the :class:`Context`'s collectives (*exchange*) and rebuilds the
mean (*decode*), saying what stays behind as residual. :func:`compressor`
wraps it into a plain ``optax.GradientTransformation`` whose ``update`` does
the rest, once, for every method:

1. checks: the updates' leaves are real floating arrays (``float0`` leaves pass
   through, complex ones are refused), shaped like the state's parameters;
   an empty bucket (no elements, every leaf frozen) is a no-op;
2. fusion into one flat f32 bucket (:class:`Bucket`), or, with
   ``bucket_cap_mb``, into buckets of that many MiB filled in the order a
   backward pass makes the gradients, each taken through steps 3-5 on its
   own and exchanged after the one before, so that an exchange can start
   while the backward pass computes earlier layers (pipelining); a method
   that reads the gradient in runs of leaves takes it as one flat array per
   run (:attr:`Method.runs`);
3. error feedback: ``c = g + e`` (``error_feedback.py``);
4. the finiteness test, one reduction over the fused bucket: a device that
   holds a NaN or Inf sends NaN in every floating payload (the *poison*), so
   the mean is non-finite on every device, whatever its payload dropped (a
   method whose payload is linear in the gradient needs neither: the NaN
   travels in it by itself; nor one that sends the entries of largest
   magnitude: a NaN or Inf ranks above them all and is sent);
5. the exchange scaled before the sum (every payload divided by ``P``), so
   a mean that fits in f32 never overflows on the way;
6. the new state (residual, the method's fields, the step ``count``, the
   PRNG key split every step by :func:`jaxcomp._src.draws.step_keys`)
   written only where the mean is finite (every bucket's, decided once after
   the last exchange): a skipped step leaves every state as it was, on every
   device alike; work on the state that no exchange waits for may be left
   to :attr:`Method.finish`, done once for every bucket after the last
   exchange;
7. the choice of ring or 2D torus for dense reductions (``axis_name`` a pair);
8. a step of several forms (:attr:`Method.form`): the form picked on the host
   (``update``'s ``compressor_form``, one program per form) or computed from
   ``count`` in the program (:meth:`Context.switch`).

Every compressor carries a :class:`Spec` (its registry name, its
configuration, its axes and its wire formula) on its ``update`` function, and
its ``update`` first calls :func:`announce`: while :func:`find_compressors`
traces a transformation abstractly, each compressor it runs reports its spec
and the updates it was given, so the compressors inside any transformation
(optax's wrappers, a user's own) are found by what it runs, and
:func:`jaxcomp.wire.expected_bytes` prices each on its own leaves. A
compressor's spec also holds its :class:`Fused` path: the same steps for a
wrapper that hands over the gradient already fused and takes the mean back
fused (:func:`jaxcomp.hierarchical`), or, for a method whose mean has a
compact form (:class:`Message`: the low-rank methods' factors), takes that
form back.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import chex
import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp._src import checks
from jaxcomp._src import collectives
from jaxcomp._src import draws
from jaxcomp._src import error_feedback
from jaxcomp._src import fusion
from jaxcomp._src import native
from jaxcomp._src import selection

_SPEC_ATTRIBUTE = "_jaxcomp_spec"


@dataclasses.dataclass(frozen=True)
class Context:
  """What a method's ``step`` sees beside the corrected gradient, at trace time.

  Attributes:
    bucket: the fused leaves, in the method's order (``f32[bucket.size]``).
    axes: the mesh axes of the exchange (one, or a pair for the torus).
    sizes: their sizes.
    count: int32 scalar, the steps taken before this one (the same on every
      device).
    key: a typed PRNG key for this step, the same on every device (``None``
      unless the method asks for one); draw a stream of it per device
      (:func:`jaxcomp._src.draws.bits`) for a draw that must differ per device.
    carry: what the method's ``prepare`` handed on (``None`` without one).
    finite: bool scalar, this device's corrected gradient is finite
      (``None`` when the method's exchange propagates non-finite values by
      itself).
    after: f32 scalar 0 read from the previous bucket's exchanged result
      (``None`` for the first bucket): :meth:`ordered` adds it to every
      payload the context's collectives send, so this bucket's exchange
      follows the one before.
    form: for a method with several forms of step (:attr:`Method.form`),
      this step's: a Python int when the step builder picked it on the host
      (``update``'s ``compressor_form`` argument), else an int32 scalar
      computed from ``count`` (the same on every device). :meth:`switch`
      branches on it.
  """

  bucket: fusion.Bucket
  axes: tuple[str, ...]
  sizes: tuple[int, ...]
  count: Optional[jax.Array] = None
  key: Optional[jax.Array] = None
  carry: Any = None
  finite: Optional[jax.Array] = None
  after: Optional[jax.Array] = None
  form: Any = None

  @property
  def num_devices(self) -> int:
    """``P``, the devices taking part in the exchange."""
    return math.prod(self.sizes)

  def send(self, payload: jax.Array) -> jax.Array:
    """A floating payload as it goes on the wire: divided by ``P``, NaN when poisoned.

    Every collective below applies it; a method that packs floats into bytes
    itself (signSGD's scale, QSGD's norms) applies it before packing.
    """
    payload = self.ordered(payload / jnp.asarray(self.num_devices, payload.dtype))
    if self.finite is None:
      return payload
    return jnp.where(self.finite, payload, jnp.asarray(jnp.nan, payload.dtype))

  def ordered(self, payload: jax.Array) -> jax.Array:
    """``payload`` plus :attr:`after`: sent, it follows the bucket before (any dtype)."""
    return payload if self.after is None else payload + self.after.astype(payload.dtype)

  def mean(self, x: jax.Array, *, wire_dtype=None) -> jax.Array:
    """The mean of a dense ``x`` over the axes (ring, or torus for a pair), f32."""
    return collectives.reduce_sum(self.send(x), self.axes, wire_dtype=wire_dtype)

  def sparse_allgather(self, values: jax.Array, indices: jax.Array):
    """Every device's ``(values / P, indices)``: ``([P, k], [P, k])``."""
    return collectives.sparse_allgather(self.send(values), self.ordered(indices), self.axes)

  def gtopk(self, values: jax.Array, indices: jax.Array, k: int):
    """The gTop-k butterfly of ``(values / P, indices)``: the global top-k of the mean."""
    return collectives.gtopk_allreduce(self.send(values), self.ordered(indices), k, self.axes)

  def packed(self, parts: Sequence[jax.Array]) -> jax.Array:
    """Byte arrays ``[..., L_i]`` end to end along the last axis, :attr:`after` added to each.

    The token goes into each part, not into the concatenated message:
    XLA:CPU emits a fusion that ends in a concatenation as one loop per part,
    but one that adds to the concatenation as a single loop that picks the
    part of every byte, which made QSGD's encoding of a bucket after the
    first 2-3 times as slow (ResNet-50 in 25 MiB buckets: 1.89 against 1.16x
    dense).
    """
    parts = [self.ordered(p) for p in parts]
    return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

  def _message(self, message) -> jax.Array:
    if isinstance(message, (list, tuple)):
      return self.packed(message)
    return self.ordered(message)

  def allgather(self, message: Union[jax.Array, Sequence[jax.Array]]) -> jax.Array:
    """Every device's ``message``: bytes, or byte parts sent as one message
    (:meth:`packed`); floats in it went through :meth:`send`."""
    return collectives.allgather(self._message(message), self.axes)

  def all_to_all(self, message: Union[jax.Array, Sequence[jax.Array]]) -> jax.Array:
    """Row ``i`` of ``message`` (``[P, ...]`` bytes, or byte parts as for
    :meth:`allgather`) to device ``i``; row ``j`` back from device ``j``."""
    return collectives.all_to_all(self._message(message), self.axes)

  def switch(self, branches: Sequence[Callable], *operands):
    """``branches[form](*operands)``, for this step's :attr:`form`.

    A form picked on the host runs its branch alone: no conditional in the
    program, so its collectives are scheduled with the rest (overlapping the
    backward pass). A traced form is a ``lax.switch``: a branch may hold
    collectives because every device takes the same one, and
    :func:`jaxcomp.wire.collective_bytes` reports their bytes by branch.
    A :class:`Later` mean cannot leave a traced conditional: a branch that
    returns one makes it there.
    """
    if isinstance(self.form, int):
      if not 0 <= self.form < len(branches):
        raise ValueError(f"`{FORM}` must be in [0, {len(branches)}), got {self.form}")
      return branches[self.form](*operands)
    return lax.switch(self.form, [lambda *xs, b=b: made_all(b(*xs)) for b in branches],
                      *operands)


Mean = Union[jax.Array, Sequence[jax.Array]]


class Later(NamedTuple):
  """A mean made once the step's state is written: ``make(after)``.

  On CPU a sparsifier's mean is zeros under a scatter
  (:func:`jaxcomp.collectives.densify`; with the native calls, its bucket's
  leaves written by one call). Made with the exchange, it is live
  with the buffers that the branch keeping the step still reads (DGC's fused
  gradient, read again for its momentum), and XLA:CPU gives it memory of its
  own, whose pages fault in on every step; made once the state is written,
  it takes memory those buffers give back. ResNet-50 on one CPU device:
  DGC 141-148 ms a step against 157-163, random-k 100-102 against 119-122
  (paired runs).

  Attributes:
    make: ``make(after) -> Mean``: ``after`` is an f32 scalar zero read from
      the state the step wrote, or ``None`` where the mean is needed sooner
      (a wrapper that exchanges it further, a traced conditional): the zeros
      then follow the exchange alone.
    received: the arrays the step's collectives returned that the mean is
      made from: the next bucket's order token reads them, with the
      witness (which a ``Later`` mean needs).
  """

  make: Callable[[Optional[jax.Array]], Mean]
  received: Any

  @staticmethod
  def densified(values: jax.Array, indices: jax.Array, bucket: fusion.Bucket,
                received: Any) -> "Later":
    """The scatter-add of sparse ``values`` at ``indices`` into ``f32[bucket.size]``
    (:func:`jaxcomp.collectives.densify`), its zeros made from ``after``.

    Made with ``after`` where the native custom calls run: one f32 array per
    leaf of ``bucket``, each written once by one call
    (:func:`jaxcomp._src.native.densify_leaves`, the same bits), where XLA:CPU
    writes the zeros of the whole vector, scatters into it, and copies each
    leaf out of it: 2 passes over the gradient and a kernel per leaf more.
    """
    def make(after):
      if after is not None and selection.native_route():
        return list(native.densify_leaves(values, indices, bucket.sizes, after))
      return collectives.densify(values, indices, bucket.size, after)

    return Later(make, received)

  @staticmethod
  def join(combine: Callable[[list], Mean], parts: Sequence[Any]):
    """``combine(parts)``, each part an array or a ``Later``; itself a ``Later``
    when a part is one (every part made with the same ``after``)."""
    received = tuple(p.received for p in parts if isinstance(p, Later))
    if not received:
      return combine(list(parts))
    return Later(lambda after: combine([made(p, after) for p in parts]), received)


def made(mean, after: Optional[jax.Array] = None):
  """``mean`` itself, or a :class:`Later` one made with ``after``."""
  return mean.make(after) if isinstance(mean, Later) else mean


def made_all(tree, after: Optional[jax.Array] = None):
  """``tree`` with every :class:`Later` in it made with ``after``."""
  return jax.tree.map(lambda x: made(x, after), tree, is_leaf=lambda x: isinstance(x, Later))


class Zeroed(NamedTuple):
  """A residual stated as the corrected gradient with the entries sent exactly set to 0.

  Attributes:
    indices: int32, any shape: flat positions in the bucket of the entries
      this device sent exactly, each at most once (``EMPTY_INDEX`` slots are
      ignored).
  """

  indices: jax.Array


class Joint(NamedTuple):
  """Fields sized by the bucket that one kernel writes together, where the step is kept
  (:func:`jaxcomp._src.fusion.overwrite_joint`): each old buffer read and written in
  the same pass, where a field each would read again what they share.

  Attributes:
    fields: the fields' names, each a ``bucket_fields`` entry or ``"residual"``
      (error feedback's, then not given as :attr:`Output.residual`).
    write: ``write(*old) -> tuple``: each field's new ``f32[bucket.size]`` in the
      order of ``fields`` from its old one, by a kernel that takes them in place (a
      custom call that aliases them).
  """

  fields: tuple[str, ...]
  write: Callable[..., tuple]


class Output(NamedTuple):
  """What a method's ``step`` returns.

  Attributes:
    mean: the decoded mean, ``f32[bucket.size]`` in the bucket's order, or
      one array per bucket leaf (any shape of the leaf's size), each of
      which depends on every collective the step ran (the next bucket's
      order token reads the first); or a :class:`Later` that makes either
      once the state is written (it needs a ``witness``).
    residual: what stays behind: ``f32[bucket.size]``; or one array per
      bucket leaf (``None`` for a leaf whose residual stays as it is); or
      :class:`jaxcomp.protocol.Pieces`, the spans that change, written over
      the old residual in place; or :class:`Zeroed` for a sparsifier; or a
      function of no arguments that returns one of these, called where the
      residual is written (:func:`jaxcomp._src.fusion.overwrite`: on CPU
      inside the branch that keeps the step, so that an elementwise
      residual is written without a pass over the old one); ignored without
      error feedback.
    state: new values of the method's own state fields, by name (a field
      sized by the bucket may be given as :class:`jaxcomp.protocol.Pieces`,
      or as a function of no arguments that returns its value or pieces,
      called where it is written, as ``residual``).
    witness: arrays that are all finite exactly when ``mean`` is (a
      low-rank method's factors, a sparsifier's gathered values), to test
      instead of the n-sized mean;
      ``None``: test ``mean``.
    message: for a method with a :class:`Message`, the mean in its compact
      form (``f32[message.size(bucket)]``, identical on every device), from
      which ``message.decode`` rebuilds ``mean``.
    finish: for a method with :attr:`Method.finish`, what this bucket hands
      it (any value: arrays, static shapes).
    joint: fields written together (:class:`Joint`), given neither as
      ``residual`` nor in ``state``.
  """

  mean: Mean
  residual: Any = None
  state: Mapping[str, Any] = {}
  witness: Any = None
  message: Optional[jax.Array] = None
  finish: Any = None
  joint: Optional[Joint] = None


@dataclasses.dataclass(frozen=True)
class Message:
  """A mean that has a compact form: a low-rank method's factors, far smaller than the mean.

  A wrapper that gathers every shard's mean (:func:`jaxcomp.hierarchical`)
  gathers the messages and decodes each, instead of gathering the means.

  Attributes:
    size: ``size(bucket) -> int``, the message's length in f32 elements.
    decode: ``decode(bucket, message) -> mean``: ``f32[size(bucket)]`` to
      the mean, as :attr:`Output.mean` (flat, or one array per bucket
      leaf), the same bits as the step's ``mean``.
  """

  size: Callable[[fusion.Bucket], int]
  decode: Callable[[fusion.Bucket, jax.Array], Mean]


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a compressor is, read by the registry, the wire formulas and the cost model.

  Attributes:
    name: its name in :mod:`jaxcomp.registry`.
    config: the factory's arguments (``axis_name`` included).
    axes: its mesh axes.
    wire: ``wire(shapes, axis_sizes, steps) -> WireCost``, the transfers of
      one step for gradients shaped like ``shapes``; ``axis_sizes`` maps each
      of ``axes`` to its size, and each transfer names the axes it crosses.
    fused: the compressor's :class:`Fused` path; ``None`` for a wrapper
      (:func:`jaxcomp.hierarchical`), which has none.
    form: ``form(count) -> int`` for a method with several forms of step
      (:attr:`Method.form`), ``None`` otherwise: a step builder reads the
      ``count`` in the state of type ``state`` and passes the step's form to
      ``update`` (:data:`FORM`).
    state: the type of the compressor's state (inside a wrapper's state).
    method: the :class:`Method` a compressor was made from (``None`` for a
      wrapper).
  """

  name: str
  config: Mapping[str, Any]
  axes: tuple[str, ...]
  wire: Callable[[Any, Mapping[str, int], Optional[int]], tuple]
  fused: Optional["Fused"] = None
  form: Optional[Callable[[int], int]] = None
  state: Optional[type] = None
  method: Optional["Method"] = None


@dataclasses.dataclass(frozen=True)
class Fused:
  """A compressor's path for a caller that holds the gradient fused already.

  A wrapper that builds the flat gradient itself (:func:`jaxcomp.hierarchical`
  reduce-scatters it) lays it out in the compressor's bucket order, hands it
  over flat, bucket by bucket, and takes each bucket's mean back flat: the
  compressor reads its leaves as slices of it, and no tree of leaves is
  built to be fused again, nor a flat mean split into leaves to be
  concatenated again. The results are those of the compressor's ``update``
  on the same leaves, bit for bit.

  Attributes:
    layout: ``layout(tree) -> Bucket``: the compressor's bucket of ``tree``
      (which leaves, in which order); ``tree``'s leaves may be
      ``jax.ShapeDtypeStruct``.
    plan: ``plan(tree) -> tuple[Bucket, ...]``: that bucket cut into the
      buckets it exchanges, in order (one without ``bucket_cap_mb``).
    update: ``update(like, state, exchange, compact=False, form=None,
      agree=None) -> (results, new_state, ok)``, inside ``shard_map`` over the compressor's
      axes; ``form`` as ``update``'s ``compressor_form`` (:data:`FORM`).
      ``like``: the leaves' shapes and dtypes (arrays or
      ``jax.ShapeDtypeStruct``), shaped like the state's parameters, with
      at least one element. For each bucket of ``plan(like)`` in order it
      calls ``exchange(index, bucket, after, compress) -> (result, out)``,
      which hands ``compress(flat) -> (mean, out)`` the bucket's gradient,
      ``f32[bucket.size]`` in the bucket's order (each leaf's part rounded
      to the leaf's dtype, as ``update`` would see it), after adding
      ``after`` (an f32 scalar 0, ``None`` for the first bucket) to what it
      sends first, so that the buckets' exchanges stay in order; ``mean`` is
      the decoded mean, ``f32[bucket.size]`` in the same order, not rounded
      to the leaves' dtypes (with ``compact``, for a method with a
      ``message`` only: the step's :attr:`Output.message` instead), and
      ``out`` the bucket's :class:`Output`, handed back for the next
      bucket's order token. ``results``: each bucket's ``result``.
      ``ok``: bool scalar, the same on every device of the compressor's
      axes: every bucket's mean is finite; ``agree(ok) -> ok``, when given,
      makes it the decision of a wider group (a hierarchy's shards agree
      over the fast axis); ``None`` when ``propagates_nonfinite``.
      ``new_state``: the state after the step where ``ok`` holds, else the
      old state (kept or dropped here, the residual in the same kernels
      that write it).
    propagates_nonfinite: the method's dense exchange carries a non-finite
      value to every device by itself and it has no state to protect, so
      there is no ``ok`` to combine.
    message: the method's :class:`Message`, or ``None``.
  """

  layout: Callable[[chex.ArrayTree], fusion.Bucket]
  plan: Callable[[chex.ArrayTree], tuple[fusion.Bucket, ...]]
  update: Callable[..., tuple[list, Any, Optional[jax.Array]]]
  propagates_nonfinite: bool = False
  message: Optional[Message] = None


@dataclasses.dataclass(frozen=True)
class Method:
  """The math that makes one compressor, everything else being :func:`compressor`'s.

  Attributes:
    name: the registry name.
    config: the factory's (validated) arguments.
    axes: the exchange's mesh axes.
    state: the state ``NamedTuple`` class; its fields ``count``, ``residual``
      and ``rng_key`` are the protocol's, any other is the method's own.
      ``optax.EmptyState`` for a method with none.
    step: ``step(ctx, corrected, state) -> Output``; ``corrected`` is
      ``f32[ctx.bucket.size]`` (a tuple of runs with ``runs``), ``state``
      the old state.
    wire: ``wire(bucket, axis_sizes, steps) -> WireCost`` (see
      :mod:`jaxcomp.wire`) for the bucket ``layout`` makes of the shapes;
      ``axis_sizes`` maps each of ``axes`` to its size (pass it to the
      :mod:`jaxcomp.wire` helpers, which label each transfer with its axes).
    init: ``init(params, bucket) -> dict`` of the method's own fields.
    layout: ``layout(tree) -> Bucket``: which leaves, in which order.
    error_feedback: keep a per-device residual (``state.residual``: one
      flat ``f32[bucket.size]`` per bucket, in the bucket's order, a tuple
      of them with two buckets or more).
    prepare: ``prepare(ctx, g, state) -> (prepared, carry)`` on the fused
      gradient ``g`` before error feedback (DGC's clipping and momentum
      correction); ``prepared``: ``f32[bucket.size]``, to which the residual
      is added.
    prepare_leaves: ``prepare_leaves(ctx, leaves, state) -> (corrected, carry)``:
      the fusion of the leaves, ``prepare`` (where there is one) and error
      feedback's addition (where there is) together,
      from the bucket's leaves where they lie, where the native custom calls
      sum the bucket (:func:`_native_sum`; no fused copy of the leaves first);
      ``corrected`` is what ``step`` receives in place of the corrected
      gradient: that gradient, or as much of it as the step reads (``None``
      where the step forms what it needs from the leaves in the carry). It
      may return ``None`` for a bucket it leaves alone, which is then
      prepared as without it (in ``runs`` where the method has them). Only
      with ``payload_carries_nonfinite``: no fused gradient is tested.
      ``None``: ``prepare`` and the addition always.
    seed: the initial seed of the ``rng_key`` field, split every step
      (``ctx.key`` is this step's draw); ``None``: no key, or one the method
      keeps itself.
    propagates_nonfinite: the exchange is a dense sum of the gradient, which
      carries a NaN or Inf to every device by itself, and there is no state
      to protect: no finiteness test, no poison.
    payload_carries_nonfinite: a device whose corrected gradient holds a NaN
      or Inf sends a non-finite value by itself, so that it reaches the mean:
      every payload is a linear map of the corrected gradient (low-rank
      products, the dense leaves as they are; ``x * 0`` is NaN for a
      non-finite ``x``), or holds its entries of largest magnitude as they
      are (top-k, gTop-k, DGC; per chunk, DeMo, whose non-finite chunk has
      only non-finite DCT coefficients, and SparseLoCo, whose levels are
      then non-finite: :mod:`jaxcomp.selection` ranks NaN and ``inf`` above
      every finite value), or scales each block by a number that is
      non-finite where the block is (the integer quantizer's largest
      magnitude, NaN counted as ``inf``; QSGD's norm; signSGD's mean
      magnitude). No finiteness test of the corrected gradient and no
      poison, a pass over it saved; the mean's test (or its witness's) still
      keeps the state.
    flat_length: ``flat_length(bucket, P) -> int``, at least ``bucket.size``:
      the length of the fused gradient ``step`` receives, zeros after the
      bucket's entries, written by the concatenation that fuses the leaves
      (a codec's whole blocks, a chunked method's whole chunks: no block of
      the bucket is then read through a slice, which XLA:CPU copies first,
      and error feedback corrects the buffer in place; with error feedback a
      bucket of few leaves is padded in the addition instead,
      :func:`_corrected`); ``None``: ``bucket.size``. The residual stays
      ``f32[bucket.size]``, and the mean too.
    message: the compact form of the mean, when there is one
      (:class:`Message`); ``step`` then returns it in :attr:`Output.message`.
    bucket_order: ``None`` (reverse tree order) or the tree positions of the
      leaves in the order their gradients are made, which fills the buckets
      (:func:`jaxcomp.protocol.plan`; set by :func:`with_bucket_order`).
    bucket_cap_mb: ``None`` (one bucket) or the MiB of gradient per bucket
      (:func:`jaxcomp.protocol.plan`); ``step`` then runs once per bucket,
      ``ctx.bucket`` that bucket, ``ctx.key`` derived with its index as the
      stream (:func:`jaxcomp._src.draws.derive`; with two buckets or more).
    bucket_fields: the method's own state fields sized by the bucket (made
      by ``init`` from it: the low-rank factors); with two buckets or more
      each holds a tuple of one array per bucket, and ``step`` sees its
      bucket's.
    form: ``form(count) -> int`` in ``[0, forms)``, for a method whose step
      takes one of several forms (ACP-SGD's P and Q steps, DGC's warm-up
      stages), each a branch of :meth:`Context.switch`; it must give the
      same on a traced ``count`` and on a Python int. ``update`` takes the
      step's form as ``compressor_form`` (a step builder picks it on the
      host, one program per form, no conditional in any); without it the
      form is computed from ``count`` in the program.
    runs: ``runs(bucket) -> tuple[int, ...]``, the bucket's leaves cut into
      consecutive runs (the number of leaves of each, summing to the
      bucket's): ``step`` then receives ``corrected`` as one flat f32 array
      per run, end to end the bucket, each concatenated from its leaves and
      corrected by its span of the residual in one kernel
      (:func:`_corrected_runs`); ``None``: one array for the bucket. For a
      method that reads the gradient run by run (the low-rank methods' matrix
      products, one run per matrix shape); not with ``prepare`` or
      ``flat_length``. Where ``prepare_leaves`` takes a bucket, it is not cut.
    finish: ``finish(items) -> fields``, the work on the state that no
      exchange waits for, done once for every bucket after the last
      bucket's exchange: ``items`` holds each bucket's
      :attr:`Output.finish` in order, ``fields`` is one mapping per bucket
      of its new ``bucket_fields`` values (as :attr:`Output.state` gives
      them), kept or dropped with the step. ACP-SGD orthonormalises the
      buckets' reduced factors there in a batch or two, not one per
      bucket. ``None``: nothing.
  """

  name: str
  config: Mapping[str, Any]
  axes: tuple[str, ...]
  state: type
  step: Callable[[Context, jax.Array, Any], Output]
  wire: Callable[[fusion.Bucket, Mapping[str, int], Optional[int]], tuple]
  init: Optional[Callable[[optax.Params, fusion.Bucket], dict]] = None
  layout: Callable[[chex.ArrayTree], fusion.Bucket] = fusion.Bucket.of
  error_feedback: bool = False
  prepare: Optional[Callable] = None
  prepare_leaves: Optional[Callable] = None
  seed: Optional[int] = None
  propagates_nonfinite: bool = False
  payload_carries_nonfinite: bool = False
  flat_length: Optional[Callable[[fusion.Bucket, int], int]] = None
  message: Optional[Message] = None
  bucket_cap_mb: Optional[float] = None
  bucket_fields: tuple[str, ...] = ()
  form: Optional[Callable[[Any], Any]] = None
  bucket_order: Optional[tuple[int, ...]] = None
  runs: Optional[Callable[[fusion.Bucket], tuple[int, ...]]] = None
  finish: Optional[Callable[[list], Sequence[Mapping[str, Any]]]] = None


# The keyword of ``update`` that carries a step's form picked on the host
# (an optax extra argument: ``optax.chain`` hands it to every member).
FORM = "compressor_form"


def _has(state_class: type, field: str) -> bool:
  return field in getattr(state_class, "_fields", ())


def all_finite(x: jax.Array) -> jax.Array:
  """bool scalar: every entry of ``x`` is finite, in one read of ``x``.

  ``sum(x - x)`` is NaN exactly when ``x`` holds a NaN or an infinity (and 0
  otherwise, so it never overflows), and a sum is one reduction that reads
  ``x`` once, where ``all(isfinite(x))`` writes an ``x``-sized mask first on
  XLA:CPU.
  """
  return jnp.isfinite(jnp.sum(x - x))


def _all_finite(tree) -> jax.Array:
  """One reduction per array of ``tree`` (a few fused buffers, never one per leaf)."""
  checks = [all_finite(x) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where the bool scalar ``ok`` holds, else ``old`` (pytrees alike)."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _token(out: "Output") -> jax.Array:
  """The order token (:func:`jaxcomp.collectives.order_token`) of every result of a bucket's exchange.

  Added to the next bucket's payloads (:meth:`Context.ordered`), it makes
  every collective of that bucket follow every collective of this one: read
  from the witness and the message, or the mean, or what a :class:`Later`
  mean is made from (each depends on every collective the step ran; one read
  per array, scalars fused into one kernel). Of a mean given per leaf, the
  first leaf: a token of each of 161
  leaves was 18 kernels a bucket on XLA:CPU (DeMo on ResNet-50 in 25 MiB
  buckets: 300 kernels against 227).
  """
  decoded = out.mean if out.message is None else out.message
  if isinstance(decoded, Later):
    decoded = decoded.received
  elif isinstance(decoded, (list, tuple)):
    decoded = decoded[0]  # each leaf of a mean given per leaf depends on every collective
  return _token_of((out.witness, decoded))


def _token_of(tree) -> Optional[jax.Array]:
  """The sum of the order tokens of the arrays of ``tree`` (``None`` when it has none)."""
  tokens = [collectives.order_token(x) for x in jax.tree.leaves(tree) if x.size]
  return sum(tokens[1:], tokens[0]) if tokens else None


def _native_sum(bucket: fusion.Bucket, leaves_apart: bool) -> bool:
  """Whether the custom call :func:`jaxcomp._src.native.corrected` sums the bucket
  (see :func:`_corrected`): f32 leaves apart, two or more, on the native route."""
  return (leaves_apart and len(bucket.leaves) > 1
          and all(dtype == jnp.float32 for dtype in bucket.dtypes) and selection.native_route())


def _bucket_leaves(bucket: fusion.Bucket, updates: optax.Updates) -> list[jax.Array]:
  leaves = jax.tree.leaves(updates)
  return [leaves[i] for i in bucket.leaves]


def _fused(bucket: fusion.Bucket, updates: optax.Updates, length: int,
           leaves_apart: bool) -> jax.Array:
  """:meth:`jaxcomp._src.fusion.Bucket.flatten` of ``updates`` to ``length``; by the
  custom call where it sums the bucket (:func:`_corrected`): a copy on two threads
  where XLA:CPU's concatenation copies on one, or fuses a few leaves into its reader
  in a loop as slow as :func:`_corrected` says."""
  if _native_sum(bucket, leaves_apart):
    return native.corrected(_bucket_leaves(bucket, updates), None, length)
  return bucket.flatten(updates, length)


def _corrected_runs(bucket: fusion.Bucket, runs: Sequence[int], updates: optax.Updates,
                    residual: Optional[jax.Array], leaves_apart: bool) -> tuple[jax.Array, ...]:
  """The corrected gradient as one flat f32 array per run of ``runs`` leaves (:attr:`Method.runs`).

  Each run's leaves concatenated, plus its span of ``residual``
  (``f32[bucket.size]``; ``None`` without error feedback): the same values
  as the whole bucket's, element by element. XLA:CPU fuses a concatenation
  of a few leaves into the add that follows it
  (:data:`jaxcomp._src.fusion.FUSED_CONCATENATION`, 8 on jax 0.10.2), and a
  matrix product then reads the run where it lies; the whole bucket's
  concatenation (161 leaves on ResNet-50) is a copy of its own that the add
  reads back, and a run cut from it a copy again for its product: 4 passes
  over the gradient more. Where :func:`_corrected` takes the custom call,
  one call writes every run, each an output of its own (ResNet-50's
  PowerSGD: one kernel where the runs' additions were 31).
  """
  if sum(runs) != len(bucket.leaves) or any(r < 0 for r in runs):
    raise ValueError(f"a method's runs {tuple(runs)} must cut the bucket's"
                     f" {len(bucket.leaves)} leaves into consecutive runs")
  if _native_sum(bucket, leaves_apart):
    bounds = list(itertools.accumulate(runs, initial=0))
    parts = tuple(bucket.part(a, b).size for a, b in zip(bounds, bounds[1:]))
    return native.corrected(_bucket_leaves(bucket, updates), residual, parts=parts)
  out, start, offset = [], 0, 0
  for count in runs:
    part = bucket.part(start, start + count)
    flat = part.flatten(updates)
    if residual is not None:
      flat = flat + residual[offset:offset + part.size]
    out.append(flat)
    start, offset = start + count, offset + part.size
  return tuple(out)


def _corrected(bucket: fusion.Bucket, updates: optax.Updates, residual: jax.Array,
               length: int, leaves_apart: bool) -> jax.Array:
  """The bucket's leaves of ``updates`` fused, ``f32[length]`` (zeros past ``bucket.size``,
  :attr:`Method.flat_length`), plus ``residual`` (``f32[bucket.size]``) on its first entries.

  ``leaves_apart``: the leaves are arrays of their own (``update``'s), not
  slices of one fused buffer (``fused.update``'s, whose concatenation XLA
  folds back into that buffer). Then, where the native custom calls run
  (:func:`jaxcomp._src.selection.native_route`) and the leaves are f32, two
  or more, one custom call (:func:`jaxcomp._src.native.corrected`, the same
  bits) reads each leaf and the residual once and writes the sum: 3 passes
  over the gradient where the concatenation and the addition make 5
  (ResNet-50's 161 leaves). A few leaves XLA:CPU fuses into the addition, but
  its loop over a concatenation whose large leaf comes before small ones (a
  bucket's reverse order: a kernel, then its norm's scale and bias) ran 50 to
  100 times slower than the call on an AMD EPYC with AVX-512 (ResNet-50's
  first 25 MiB bucket, four leaves of 1.06M entries: 54 ms against 0.4; DeMo's
  step 1.23-1.42x dense to 1.09x).

  Else, without padding, one addition. With it, on CPU, a concatenation of more
  leaves than XLA:CPU fuses into its reader
  (:data:`jaxcomp._src.fusion.FUSED_CONCATENATION`), which is a buffer of its
  own, takes the sum in place: a fusion of the addition with the residual's
  padding is one XLA:CPU does not write over its operand, so the corrected
  gradient had a buffer of its own beside the fused one (the same values;
  ResNet-50, one device: SparseLoCo's step allocated 3 gradients' worth of new
  memory where it now allocates 2, and took 131-134 ms against 109-118 ms, in
  paired runs). The barrier keeps XLA from cutting the slice out of the
  concatenation, a second concatenation. Fewer leaves are padded after their
  concatenation, so that both fuse into the addition (zeros as one more part
  of it would make it a copy).
  """
  n = bucket.size
  if _native_sum(bucket, leaves_apart):
    return native.corrected(_bucket_leaves(bucket, updates), residual, length)
  if length == n:
    return bucket.flatten(updates) + residual
  if len(bucket.leaves) <= fusion.FUSED_CONCATENATION:
    return jnp.pad(bucket.flatten(updates), (0, length - n)) + jnp.pad(residual, (0, length - n))

  def in_place(flat):
    flat = lax.optimization_barrier(flat)
    return lax.dynamic_update_slice(flat, flat[:n] + residual, (0,))

  return lax.platform_dependent(
      bucket.flatten(updates, length), cpu=in_place,
      default=lambda flat: flat + jnp.pad(residual, (0, length - n)))


def compressor(method: Method) -> optax.GradientTransformation:
  """The ``optax.GradientTransformation`` of ``method`` on the shared path.

  ``init`` binds no mesh axis; ``update`` runs inside ``shard_map`` (or
  ``pmap``) over ``method.axes`` and returns the mean gradient, identical on
  every device, in the dtypes of ``updates`` (in a :func:`find_compressors`
  search, ``updates`` unchanged: see :func:`announce`).

  With ``method.bucket_cap_mb`` the layout's leaves are cut into buckets
  (:func:`jaxcomp.protocol.plan`), each taken through the whole path on its
  own (error feedback, finiteness test and poison, encode, exchange, decode)
  in order, each bucket's exchange after the one before; the method's
  ``bucket_fields`` are then one array per bucket and each bucket draws from
  the step's key derived with its index. The state is kept or dropped once,
  after every bucket, on every device alike. A plan of one bucket is the
  path without buckets: the same state and the same bits.
  """
  fields = getattr(method.state, "_fields", ())
  counted = _has(method.state, "count")
  keyed = method.seed is not None
  if keyed and not _has(method.state, "rng_key"):
    raise ValueError(f"method {method.name!r} has a seed but no `rng_key` field")
  if method.runs is not None and (method.prepare is not None or method.flat_length is not None):
    raise ValueError(f"method {method.name!r} cuts its bucket into `runs`, which takes"
                     " neither `prepare` nor `flat_length`")
  if method.prepare_leaves is not None and not method.payload_carries_nonfinite:
    raise ValueError(f"method {method.name!r}: `prepare_leaves` needs"
                     " `payload_carries_nonfinite` (its step may read the leaves itself: no"
                     " fused gradient is there to test)")

  # The fields sized by the bucket: the residual and the method's own.
  sized = (("residual",) if method.error_feedback else ()) + tuple(method.bucket_fields)

  def plan(tree: chex.ArrayTree) -> tuple[fusion.Bucket, ...]:
    order, count = method.bucket_order, len(jax.tree.leaves(tree))
    if order is not None and len(order) != count:
      raise ValueError(
          f"the bucket order of {len(order)} positions is not an order of this tree's"
          f" {count} leaves: it must hold each position 0..{count - 1} once"
          " (jaxcomp.training.backward_order of the loss on these parameters)")
    return fusion.plan(method.layout(tree), method.bucket_cap_mb, order)

  def init_fn(params: optax.Params):
    if not fields:
      return method.state()
    buckets = plan(params)
    # With two buckets or more, the fields sized by the bucket are made once
    # per bucket (the others do not depend on it); else once, for the layout.
    parts = buckets if len(buckets) > 1 and sized else (method.layout(params),)
    per_part = [dict(method.init(params, part)) if method.init else {} for part in parts]
    if method.error_feedback:
      for values, part in zip(per_part, parts):
        values["residual"] = error_feedback.init(part)
    values = per_part[0]
    if len(per_part) > 1:
      values.update({f: tuple(v[f] for v in per_part) for f in sized})
    if counted:
      values["count"] = jnp.zeros([], jnp.int32)
    if _has(method.state, "residual") and not method.error_feedback:
      values["residual"] = ()
    if keyed:
      values["rng_key"] = checks.raw_key(method.seed)
    return method.state(**values)

  def bucket_step(updates: optax.Updates, state, bucket: fusion.Bucket, key, after, form,
                  leaves_apart: bool):
    """``(out, written, ok)`` of one bucket of at least one element.

    ``state``: the state as the buckets before left it, with this bucket's
    ``bucket_fields``. ``out``: the method's :class:`Output`; ``written``:
    the state fields this bucket wrote (its leaves of the per-leaf ones);
    ``ok``: the mean is finite (``None`` when ``propagates_nonfinite``).
    """
    ctx = Context(bucket, method.axes, checks.axis_sizes(method.axes),
                  state.count if counted else None, key=key, after=after, form=form)
    length = bucket.size
    if method.flat_length is not None:
      length = method.flat_length(bucket, ctx.num_devices)
    if method.prepare_leaves is not None and _native_sum(bucket, leaves_apart) and (
        prepared := method.prepare_leaves(ctx, _bucket_leaves(bucket, updates), state)):
      corrected, carry = prepared
      ctx = dataclasses.replace(ctx, carry=carry)
    elif method.runs is not None:
      corrected = _corrected_runs(bucket, method.runs(bucket), updates,
                                  state.residual if method.error_feedback else None,
                                  leaves_apart)
    elif method.prepare is not None:
      corrected, carry = method.prepare(ctx, _fused(bucket, updates, length, leaves_apart),
                                        state)
      ctx = dataclasses.replace(ctx, carry=carry)
      if method.error_feedback:
        corrected = corrected + jnp.pad(state.residual, (0, length - bucket.size))
    elif method.error_feedback:
      corrected = _corrected(bucket, updates, state.residual, length, leaves_apart)
    else:
      corrected = _fused(bucket, updates, length, leaves_apart)
    if not (method.propagates_nonfinite or method.payload_carries_nonfinite):
      # One reduction over the fused bucket (or each run): compile time stays
      # linear in the number of leaves (one per leaf grows with its square).
      ctx = dataclasses.replace(ctx, finite=_all_finite(corrected))

    out = method.step(ctx, corrected, state)
    written = dict(out.state)
    if out.joint is not None:
      for f in out.joint.fields:
        if f not in sized or f in written or (f == "residual" and out.residual is not None):
          raise ValueError(f"method {method.name!r}: a `Joint` field {f!r} must be one of"
                           f" {sized} and given nowhere else")
        written[f] = out.joint
    if method.error_feedback and "residual" not in written:
      kept = out.residual

      def absorbed(kept=kept):
        if callable(kept):
          kept = kept()
        if isinstance(kept, Zeroed):
          kept = error_feedback.zeroed(fusion.concat(list(jax.tree.leaves(corrected))),
                                       kept.indices)
        if isinstance(kept, jax.Array) and length > bucket.size:
          kept = kept[:bucket.size]
        return error_feedback.absorb(bucket, kept)

      # Zeroed and a function are formed where the residual is written (inside
      # the branch that keeps the step, on CPU): no pass over the old residual.
      lazy = isinstance(kept, Zeroed) or callable(kept)
      written["residual"] = absorbed if lazy else absorbed()
    if isinstance(out.mean, Later) and out.witness is None:
      raise ValueError(f"method {method.name!r}: a `Later` mean needs a `witness`")
    if method.propagates_nonfinite:
      return out, written, None
    # The mean is identical on every device, so is this choice.
    return out, written, _all_finite(out.mean if out.witness is None else out.witness)

  def step_form(state, form: Optional[int]):
    """The form of this step: ``form`` as picked on the host, else computed from ``count``."""
    if method.form is None:
      return None  # a form handed to every member of a chain is another's
    if form is None:
      return method.form(state.count)
    return int(checks.check_number(form, FORM, integer=True, low=0))

  def run(state, buckets: Sequence[fusion.Bucket], exchange: Callable, form: Optional[int],
          agree: Optional[Callable] = None, leaves_apart: bool = False):
    """``(results, new_state, ok)``: every bucket's step, in order, in the step's ``form``.

    ``exchange(index, bucket, after, compress) -> (result, out)``: hands
    bucket ``index`` to ``compress(updates) -> out`` (its :class:`Output`),
    ``updates`` a tree whose bucket leaves hold the bucket's gradient, after
    sending what it sends first with ``after`` added (the order token of the
    bucket before, ``None`` for the first); ``result`` is collected.
    ``leaves_apart``: those leaves are arrays of their own, not slices of
    one buffer (:func:`_corrected`).
    ``ok``: every bucket's, passed through ``agree`` when given;
    ``new_state`` is kept where it holds, else the old state.
    """
    new: dict[str, Any] = {}
    key = None
    if keyed:
      next_key, key = draws.step_keys(jax.random.wrap_key_data(state.rng_key))
      new["rng_key"] = jax.random.key_data(next_key)
    # One bucket is the unbucketed path: the same state layout and bits.
    split = len(buckets) > 1
    olds = {f: getattr(state, f) if split else (getattr(state, f),) for f in sized}
    pending = {f: [] for f in sized}
    threaded, results, oks, finishing, after = state, [], [], [], None
    form = step_form(state, form)
    for index, bucket in enumerate(buckets):
      view = threaded._replace(**{f: olds[f][index] for f in sized})
      draw = draws.derive(key, index) if (split and key is not None) else key
      written, ok = {}, None

      def compress(updates, view=view, bucket=bucket, draw=draw, after=after):
        nonlocal written, ok
        out, written, ok = bucket_step(updates, view, bucket, draw, after, form, leaves_apart)
        return out

      result, out = exchange(index, bucket, after, compress)
      results.append(result)
      oks.append(ok)
      finishing.append(out.finish)
      for f in sized:
        pending[f].append(written.pop(f, None))
      threaded = threaded._replace(**written)
      if index + 1 < len(buckets):
        after = _token(out)
    if method.finish is not None:
      for index, fields in enumerate(method.finish(finishing)):
        for f, value in fields.items():
          if f not in pending:
            raise ValueError(f"method {method.name!r}: `finish` wrote {f!r}, which is not"
                             f" one of its bucket_fields {tuple(method.bucket_fields)}")
          pending[f][index] = value
    if counted:
      new["count"] = optax.safe_increment(state.count)
    new_state = threaded._replace(**new)
    ok = None if method.propagates_nonfinite else (
        jnp.all(jnp.stack(oks)) if len(oks) > 1 else oks[0])
    if ok is not None:
      if agree is not None:
        ok = agree(ok)
      new_state = keep_if(ok, new_state, state)
    # The fields sized by the bucket are written in place, kept or dropped
    # in the same kernel (:func:`jaxcomp._src.fusion.overwrite`; a `Joint`'s
    # fields by one).
    values = {f: list(olds[f]) for f in sized}
    for index in range(len(buckets)):
      for f in sized:
        w = pending[f][index]
        if isinstance(w, Joint):
          if values[f][index] is olds[f][index]:  # not yet written with the others
            news = fusion.overwrite_joint(tuple(olds[g][index] for g in w.fields), w.write, ok)
            for g, value in zip(w.fields, news):
              values[g][index] = value
        elif w is not None:
          values[f][index] = fusion.overwrite(olds[f][index], w, ok)
    for f in sized:
      new_state = new_state._replace(**{f: tuple(values[f]) if split else values[f][0]})
    return results, new_state, ok

  def checked_buckets(updates: chex.ArrayTree, state) -> tuple[fusion.Bucket, ...]:
    buckets = plan(updates)
    if method.error_feedback:
      error_feedback.check_matches(buckets, state.residual)
    checks.axis_sizes(method.axes)  # an unknown axis is named even when nothing is sent
    return buckets

  def fused_update(like: chex.ArrayTree, state, exchange: Callable, compact: bool = False,
                   form: Optional[int] = None, agree: Optional[Callable] = None):
    if compact and method.message is None:
      raise ValueError(f"`compact` needs a method with a message; {method.name!r} has none")
    buckets = checked_buckets(like, state)

    def each(index, bucket, after, compress):
      def flat_in(flat):
        # Through the leaves (slices of ``flat``, rounded to their dtypes): the
        # same program as ``update``'s, so the same bits.
        out = compress(bucket.unflatten(flat, like=like))
        if compact:
          return out.message, out
        mean = made(out.mean)  # exchanged further: made now
        if isinstance(mean, (list, tuple)):
          mean = fusion.concat([m.reshape(-1) for m in mean])
        return mean, out
      return exchange(index, bucket, after, flat_in)

    return run(state, buckets, each, form, agree)

  def wire(shapes, axis_sizes, steps=None):
    return sum((method.wire(bucket, axis_sizes, steps) for bucket in plan(shapes)), ())

  spec_ = Spec(method.name, dict(method.config), method.axes, wire,
               fused=Fused(method.layout, plan, fused_update, method.propagates_nonfinite,
                           method.message),
               form=None if method.form is None else lambda count: int(method.form(count)),
               state=method.state, method=method)

  def written_token(state) -> Optional[jax.Array]:
    """An f32 zero read from each array of the fields sized by the bucket in
    ``state`` (:func:`jaxcomp.collectives.order_token`): it follows their writes;
    ``None`` when there are none."""
    return _token_of([getattr(state, f) for f in sized])

  def update_fn(updates: optax.Updates, state, params: Optional[optax.Params] = None,
                **extra_args):
    del params
    if announce(spec_, updates):
      return updates, state
    fusion.check_leaves(updates)
    buckets = checked_buckets(updates, state)
    if not buckets[0].size:  # nothing to exchange: a no-op, still a step
      return updates, (state._replace(count=optax.safe_increment(state.count))
                       if counted else state)

    def exchange(index, bucket, after, compress):
      out = compress(updates)
      return (bucket, out.mean), out

    means, new_state, _ = run(state, buckets, exchange, extra_args.get(FORM), leaves_apart=True)
    after = written_token(new_state) if any(isinstance(m, Later) for _, m in means) else None
    for bucket, mean in means:
      updates = bucket.unflatten(made(mean, after), like=updates)
    return updates, new_state

  attach_spec(update_fn, spec_)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def with_bucket_order(tx: optax.GradientTransformation,
                      order: Sequence[int]) -> optax.GradientTransformation:
  """The compressor ``tx`` with its buckets filled in ``order``, not in reverse tree order.

  Buckets are filled in the order a backward pass makes the gradients, so
  that the first exchange waits only for the first gradients made. The tree
  order is that order reversed only where the parameters' keys sort like the
  layers; a model whose keys do not (a stem, embeddings, ``Dense_10`` before
  ``Dense_2``) would put a gradient made last in the first bucket, and every
  exchange would wait for the whole backward pass. ``order`` is
  :func:`jaxcomp.training.backward_order` of the loss: the parameters' tree
  positions, first made first.

  Args:
    tx: a compressor made by :func:`compressor` (every jaxcomp method), with
      ``bucket_cap_mb`` (without it, one bucket: the order changes nothing).
    order: each tree position of the parameters once (checked against the
      tree at ``init`` and ``update``).

  Returns:
    The same compressor (the same configuration, state type and math) with
    the new plan; its state is laid out by that plan: build it from the
    returned transformation (:func:`jaxcomp.training.init_state`).
  """
  found = spec(tx)
  if found is None or found.method is None:
    raise TypeError("`tx` must be a compressor made by jaxcomp.protocol.compressor (any jaxcomp"
                    f" method, not a chain or a wrapper), got {type(tx).__name__}")
  try:
    order = tuple(operator.index(i) for i in order)
  except TypeError:
    raise TypeError(f"`order` must be a sequence of ints (tree positions), got {order!r}") from None
  if sorted(order) != list(range(len(order))):
    raise ValueError(f"`order` must hold each position 0..{len(order) - 1} once, got {order}")
  return compressor(dataclasses.replace(found.method, bucket_order=order))


def as_tree(tx: Any, value: Any, params: optax.Params) -> optax.Params:
  """A compressor's state field sized by its buckets, as f32 leaves shaped like ``params``.

  The residual (and DGC's momentum) is one flat ``f32[bucket.size]`` per
  bucket, in the bucket's order (the method's layout), so that the hot path
  reads and writes it in one kernel; this lays it out as the parameters
  are, to look at or to compare leaf by leaf.

  Args:
    tx: the compressor whose state holds ``value``.
    value: the field: ``f32[..., n]`` for one bucket, a tuple of one per
      bucket for several; leading axes (``training.device_rows``' device
      axis) are kept.
    params: the parameters (or their shapes) the state was made for.

  Returns:
    A tree like ``params`` of f32 arrays, each shaped ``leading + leaf
    shape``; a leaf in no bucket (``float0``, zero-size) is zero.

  Raises:
    TypeError: ``tx`` is not a compressor with buckets of its own (a wrapper).
  """
  buckets = _own_plan(tx, params)
  flats = value if len(buckets) > 1 else (value,)
  lead = tuple(jnp.shape(flats[0])[:-1])
  placed = {}
  for bucket, flat in zip(buckets, flats):
    for i, o, n, s in zip(bucket.leaves, bucket.offsets, bucket.sizes, bucket.shapes):
      placed[i] = jnp.asarray(flat)[..., o:o + n].reshape(lead + s)
  zeros = jax.tree.map(lambda p: jnp.zeros(lead + tuple(jnp.shape(p)), jnp.float32), params)
  return fusion.scatter_leaves(zeros, placed)


def from_tree(tx: Any, tree: optax.Params, params: optax.Params) -> Any:
  """The inverse of :func:`as_tree`: f32 leaves shaped like ``params`` as ``tx``'s flat field.

  Args:
    tx: the compressor.
    tree: arrays shaped ``leading + leaf shape``, like ``params``.
    params: the parameters (or their shapes) the state was made for.

  Returns:
    ``f32[..., n]`` for one bucket, a tuple of one per bucket for several.
  """
  buckets = _own_plan(tx, params)
  leaves = jax.tree.leaves(tree)
  lead = ()
  if buckets[0].leaves:  # the leading axes: those the first fused leaf has before its shape
    first = jnp.shape(leaves[buckets[0].leaves[0]])
    lead = first[:len(first) - len(buckets[0].shapes[0])]
  flats = tuple(
      jnp.concatenate([jnp.asarray(leaves[i], jnp.float32).reshape(lead + (-1,))
                       for i in bucket.leaves], axis=-1) if bucket.leaves
      else jnp.zeros(lead + (0,), jnp.float32)
      for bucket in buckets)
  return flats if len(buckets) > 1 else flats[0]


def _own_plan(tx: Any, params: optax.Params) -> tuple[fusion.Bucket, ...]:
  spec_ = spec(tx)
  if spec_ is None or spec_.fused is None:
    raise TypeError(f"`tx` must be a jaxcomp compressor, got {type(tx).__name__}")
  return spec_.fused.plan(params)


def attach_spec(update_fn: Callable, spec_: Spec) -> None:
  """Marks ``update_fn`` as a compressor's, for :func:`spec`.

  ``update_fn`` must call :func:`announce` with the same ``spec_`` first, so
  that :func:`find_compressors` finds it.
  """
  setattr(update_fn, _SPEC_ATTRIBUTE, spec_)


def spec(tx: Any) -> Optional[Spec]:
  """The :class:`Spec` of ``tx`` itself when it is a compressor, else ``None``.

  A direct read of ``tx.update``'s spec; :func:`find_specs` finds the
  compressors inside any transformation.
  """
  return getattr(getattr(tx, "update", None), _SPEC_ATTRIBUTE, None)


class Found(NamedTuple):
  """A compressor that a transformation's ``update`` runs (:func:`find_compressors`).

  Attributes:
    spec: its :class:`Spec`.
    updates: the updates it was given, with ``jax.ShapeDtypeStruct`` leaves:
      the leaves a wrapper hands it (``optax.masked``: the masked ones), in
      the dtypes they reach it in.
  """

  spec: Spec
  updates: chex.ArrayTree


class _Search:
  """The compressors reported during one :func:`find_compressors` trace, in order."""

  def __init__(self):
    self.found: list[Found] = []


# The search under way (a _Search), or None. A jit cache key rather than a
# plain context variable: a jitted function traced in a search, where the
# compressors pass their updates through, must not be reused outside it, and
# one traced before must be traced again in a search, or its compressors
# would go unreported; every search is a new value.
_SEARCH = jax.make_user_context(None)

# Set while jaxcomp.nnx.data_parallel traces a step, where a state is held as
# one replicated copy unless a per-device transformation lays it out (which
# sets None around the update it wraps): the error a compressor's update
# raises there. A jit cache key for the same reason as _SEARCH.
_REPLICATED_STATE = jax.make_user_context(None)


def abstract(tree: chex.ArrayTree) -> chex.ArrayTree:
  """``jax.ShapeDtypeStruct`` leaves of ``tree``: its shapes and dtypes, for abstract tracing."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def announce(spec_: Spec, updates: optax.Updates) -> bool:
  """What a compressor's ``update`` does first: ``True`` when it must pass ``updates`` through.

  During a :func:`find_compressors` search, reports the compressor
  (``spec_``, the shapes of ``updates``) once per search, however many times
  its update is traced, and returns ``True``: the update then returns
  ``updates`` and its state unchanged, binding no mesh axis (none is bound in
  the search). Otherwise returns ``False``, after refusing a state held as one
  replicated copy (:func:`replicated_state`).

  Raises:
    ValueError: inside :func:`replicated_state` with an error.
  """
  search = _SEARCH.value
  if search is not None:
    if not any(f.spec is spec_ for f in search.found):
      search.found.append(Found(spec_, abstract(updates)))
    return True
  error = _REPLICATED_STATE.value
  if error is not None:
    raise ValueError(error)
  return False


def replicated_state(error: Optional[str]):
  """A context in which the compressors traced hold their state as one replicated copy.

  Their update (:func:`announce`) raises ``ValueError(error)``: a compressor's
  state (residuals, momenta) differs per device and must be held per device.
  ``error=None`` lifts it, where a transformation lays its state out per
  device (:func:`jaxcomp.training.per_device`).
  """
  return _REPLICATED_STATE(error)


def searching() -> bool:
  """Whether a :func:`find_compressors` search is tracing: compressors pass through, no mesh is bound."""
  return _SEARCH.value is not None


def find_compressors(tx: Any, params: optax.Params) -> list[Found]:
  """The compressors that ``tx.update`` runs on gradients shaped like ``params``, in order.

  ``tx.init(params)`` and ``tx.update(params, state, params)`` are traced
  abstractly (``jax.eval_shape``: nothing is computed) while every jaxcomp
  compressor reports itself (:func:`announce`) and passes its updates
  through, binding no mesh axis. So any transformation is searched by what
  it runs, not by how it holds its parts: optax's wrappers and chains, a
  user's own class or function. A compressor traced twice (both branches of a
  ``lax.cond``, as in ``optax.MultiSteps``) counts once, where it was first
  reported; one that ``update`` never runs is not found. ``params`` is
  required: what an update runs, and on which leaves, depends on the tree.
  A compressor alone is not traced: it is given the whole tree.

  Args:
    tx: an object with ``init(params)`` and ``update(updates, state, params)``
      (an optax transformation, a jaxcomp compressor, ``optax.MultiSteps``).
    params: the parameters, or their shapes (``jax.ShapeDtypeStruct``).

  Returns:
    One :class:`Found` per compressor, in the order ``update`` runs them.

  Raises:
    TypeError: ``tx`` has no ``init`` or ``update``.
    ValueError: ``tx.init`` or ``tx.update`` fails when traced so (it needs
      arguments besides these, or binds a mesh axis itself), naming the error.
  """
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(
        "`tx` must be a transformation with `init(params)` and"
        " `update(updates, state, params)` (an optax transformation, a jaxcomp"
        f" compressor), got {type(tx).__name__}")
  shapes = abstract(params)
  own = spec(tx)
  if own is not None:  # a compressor alone is given the whole tree: what a trace would report
    return [Found(own, shapes)]
  search = _Search()

  def init_and_update(p):
    return tx.update(p, tx.init(p), p)

  try:
    with _SEARCH(search):
      jax.eval_shape(init_and_update, shapes)
  except Exception as e:  # whatever the transformation raises, named with the cause
    raise ValueError(
        f"cannot find the compressors in `tx` ({type(tx).__name__}): its `init(params)`"
        " and `update(params, state, params)`, traced abstractly with no mesh axis"
        " bound (the jaxcomp compressors in it pass their updates through), raised"
        f" {type(e).__name__}: {e}") from e
  return search.found


def find_specs(tx: Any, params: optax.Params) -> list[Spec]:
  """The :class:`Spec` of every compressor that ``tx`` runs, in order (:func:`find_compressors`)."""
  return [found.spec for found in find_compressors(tx, params)]
