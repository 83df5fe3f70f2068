"""The shared path: a method written the way a newcomer would, the Spec search, the channel."""

import dataclasses
from typing import NamedTuple

import chex
import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import hlo_counts
import jaxcomp
from jaxcomp import protocol
from jaxcomp import training
from jaxcomp import wire
from jaxcomp._src import fusion
from jaxcomp._src import selection
import harness

PARAMS = {"w": jnp.zeros((6, 4)), "b": jnp.zeros((4,))}


class HalfState(NamedTuple):
  count: jax.Array
  residual: optax.Params


def toy(name, axis_name, step, **fields):
  """A toy method with error feedback whose wire cost is a dense mean of the bucket."""
  return protocol.compressor(protocol.Method(
      name=name, config={"axis_name": axis_name}, axes=(axis_name,), state=HalfState,
      step=step, wire=lambda bucket, sizes, steps: wire.mean(bucket.size, sizes),
      error_feedback=True, **fields))


def half(axis_name):
  """A toy method: every device sends half of its corrected gradient, densely."""

  def step(ctx, corrected, state):
    del state
    sent = corrected / 2
    return protocol.Output(mean=ctx.mean(sent), residual=corrected - sent)

  return toy("half", axis_name, step)


def _stacked(seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.normal(size=(8,) + x.shape).astype(np.float32), PARAMS)


def test_a_new_method_gets_the_whole_path_from_one_step_function():
  mesh = training.make_mesh(8)
  tx = half("data")
  state = training.init_state(tx, PARAMS, mesh, "data")
  update = training.make_update(tx, mesh, "data")
  grads = _stacked(0)
  out, state = jax.block_until_ready(update(training.shard(grads, mesh, "data"), state))
  rows = harness.state_rows(tx, state, PARAMS)
  for name in PARAMS:  # half of the mean, the other half kept per device
    np.testing.assert_allclose(np.asarray(out[name]),
                               np.broadcast_to(grads[name].mean(0) / 2, grads[name].shape),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(rows.residual[name]), grads[name] / 2, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(rows.count), np.ones(8))
  bad = _stacked(1)
  bad["w"][5, 0, 0] = np.nan
  before = jax.tree.map(np.asarray, state)
  out, after = jax.block_until_ready(update(training.shard(bad, mesh, "data"), state))
  assert all(not np.isfinite(np.asarray(out["w"][d])).all() for d in range(8))
  for got, was in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(got), was)
  assert wire.expected_bytes(tx, PARAMS, 8).total == 2 * 7 * 28 * 4 / 8


def lazy_half(axis_name):
  """``half`` whose residual is given as a function, formed where it is written."""

  def step(ctx, corrected, state):
    del state
    sent = corrected / 2
    return protocol.Output(mean=ctx.mean(sent), residual=lambda: corrected - sent)

  return toy("half", axis_name, step)


def test_a_residual_given_as_a_function_is_the_same_on_every_path():
  """Eager or lazy, kept or skipped: the same bits in the outputs and the state."""
  mesh = training.make_mesh(8)
  good, bad = _stacked(2), _stacked(3)
  bad["b"][2, 1] = np.inf
  results = []
  for tx in (half("data"), lazy_half("data")):
    state = training.init_state(tx, PARAMS, mesh, "data")
    update = training.make_update(tx, mesh, "data")
    run = []
    for grads in (good, bad, good):
      out, state = jax.block_until_ready(update(training.shard(grads, mesh, "data"), state))
      run.append((out, state))
    results.append(jax.tree.map(np.asarray, run))
  chex.assert_trees_all_equal(*results)


RUN_PARAMS = {"a": jnp.zeros((3, 5)), "b": jnp.zeros((4,)), "c": jnp.zeros((2, 2, 3)),
              "d": jnp.zeros((7,))}


def half_in_runs(axis_name, runs, seen, bucket_cap_mb=None):
  """``half``, reading the corrected gradient in runs of leaves; records each run's length."""

  def step(ctx, corrected, state):
    del state
    seen.append((ctx.bucket, tuple(c.shape for c in corrected)))
    flat = fusion.concat(list(corrected))
    sent = flat / 2
    return protocol.Output(mean=ctx.mean(sent), residual=flat - sent)

  return toy("half", axis_name, step, runs=runs, bucket_cap_mb=bucket_cap_mb)


@pytest.mark.parametrize("cap", [None, 3e-5], ids=["one_bucket", "two_buckets"])
def test_a_method_in_runs_gets_each_run_corrected_with_the_same_bits(cap):
  """Runs of leaves (an empty one too) reach ``step`` as one array each, end to end the
  bucket, with their spans of the residual added: outputs and state bit for bit those of
  the whole bucket, over a kept step, a skipped one (a NaN on one device) and a kept one."""
  mesh = training.make_mesh(8)
  rng = np.random.default_rng(5)
  batches = [jax.tree.map(lambda x: rng.normal(size=(8,) + x.shape).astype(np.float32),
                          RUN_PARAMS) for _ in range(3)]
  batches[1]["c"][6, 1, 0, 2] = np.nan
  seen = []
  results = []
  for tx in (protocol.compressor(dataclasses.replace(protocol.spec(half("data")).method,
                                                     bucket_cap_mb=cap)),
             half_in_runs("data", lambda b: (0, 1, len(b.leaves) - 1), seen, cap)):
    state = training.init_state(tx, RUN_PARAMS, mesh, "data")
    update = training.make_update(tx, mesh, "data")
    run = []
    for grads in batches:
      out, state = jax.block_until_ready(update(training.shard(grads, mesh, "data"), state))
      run.append((out, state))
    results.append(jax.tree.map(np.asarray, run))
  chex.assert_trees_all_equal(*results)
  assert not np.isfinite(results[1][1][0]["c"]).all()
  buckets = {bucket for bucket, _ in seen}
  assert len(buckets) == (1 if cap is None else 2)
  for bucket, shapes in seen:
    assert shapes == ((0,), (bucket.sizes[0],), (sum(bucket.sizes[1:]),))


class LastState(NamedTuple):
  count: jax.Array
  residual: optax.Params
  last: jax.Array


def summed(axis_name, calls, bucket_cap_mb=None, field="last"):
  """``half``, whose ``last`` (sized by the bucket) gains each step the bucket's mean plus
  the sum of every bucket's mean: work on the state across buckets, in ``finish``."""

  def step(ctx, corrected, state):
    sent = corrected / 2
    mean = ctx.mean(sent)
    return protocol.Output(mean=mean, residual=corrected - sent, finish=(mean, state.last))

  def finish(items):
    calls.append(len(items))
    total = sum(jnp.sum(mean) for mean, _ in items)
    return [{field: last + mean + total} for mean, last in items]

  return protocol.compressor(protocol.Method(
      name="summed", config={"axis_name": axis_name}, axes=(axis_name,), state=LastState,
      step=step, wire=lambda bucket, sizes, steps: wire.mean(bucket.size, sizes),
      init=lambda params, bucket: {"last": jnp.zeros(bucket.size, jnp.float32)},
      error_feedback=True, bucket_cap_mb=bucket_cap_mb, bucket_fields=("last",),
      finish=finish))


def _batches_with_a_nan(seed):
  """Three steps' normal gradients of ``RUN_PARAMS`` on 8 devices, the second holding a
  NaN on device 2 (a step every device skips)."""
  rng = np.random.default_rng(seed)
  batches = [jax.tree.map(lambda x: rng.normal(size=(8,) + x.shape).astype(np.float32),
                          RUN_PARAMS) for _ in range(3)]
  batches[1]["a"][2, 0, 1] = np.nan
  return batches


def _states_after_each(tx, batches):
  """``tx``'s state after each step of ``batches`` on 8 devices (each step synced)."""
  mesh = training.make_mesh(8)
  state = training.init_state(tx, RUN_PARAMS, mesh, "data")
  update = training.make_update(tx, mesh, "data")
  states = []
  for grads in batches:
    _, state = jax.block_until_ready(update(training.shard(grads, mesh, "data"), state))
    states.append(jax.tree.map(np.asarray, state))
  return states


def accumulated(axis_name, joint, bucket_cap_mb=None):
  """``half``, whose ``last`` gains each step the bucket's mean: written with the residual
  by one :class:`jaxcomp.protocol.Joint` function, or each on its own."""

  def step(ctx, corrected, state):
    sent = corrected / 2
    mean = ctx.mean(sent)
    if not joint:
      return protocol.Output(mean=mean, residual=corrected - sent,
                             state={"last": state.last + mean})
    return protocol.Output(mean=mean, joint=protocol.Joint(
        ("last", "residual"), lambda last, residual: (last + mean, corrected - sent)))

  return protocol.compressor(protocol.Method(
      name="accumulated", config={"axis_name": axis_name}, axes=(axis_name,), state=LastState,
      step=step, wire=lambda bucket, sizes, steps: wire.mean(bucket.size, sizes),
      init=lambda params, bucket: {"last": jnp.zeros(bucket.size, jnp.float32)},
      error_feedback=True, bucket_cap_mb=bucket_cap_mb, bucket_fields=("last",)))


@pytest.mark.parametrize("cap", [None, 3e-5], ids=["one_bucket", "two_buckets"])
def test_a_joint_write_keeps_and_drops_its_fields_with_the_step(cap):
  """Fields written together by one function: the same bits as each written on its own,
  each kept over a kept step, all dropped over a skipped one (a NaN on one device).
  ``last`` is the sum of the kept steps' means, the residual as ``half``'s."""
  batches = _batches_with_a_nan(3)
  tx = accumulated("data", True, cap)
  together = _states_after_each(tx, batches)
  apart = _states_after_each(accumulated("data", False, cap), batches)
  chex.assert_trees_all_equal(together, apart)
  chex.assert_trees_all_equal(together[1], together[0])  # the skipped step
  rows = harness.state_rows(tx, jax.tree.map(jnp.asarray, together[2]), RUN_PARAMS)
  last = protocol.as_tree(tx, rows.last, RUN_PARAMS)
  for name in RUN_PARAMS:
    corrected = batches[2][name] + batches[0][name] / 2  # the first step's residual added
    mean = batches[0][name].mean(0) / 2 + corrected.mean(0) / 2
    np.testing.assert_allclose(np.asarray(last[name]),
                               np.broadcast_to(mean, batches[0][name].shape), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(rows.residual[name]), corrected / 2,
                               rtol=1e-5, atol=1e-6)


def test_a_joint_write_names_fields_sized_by_the_bucket_given_nowhere_else():
  def method(fields, state, residual=None):
    def step(ctx, corrected, s):
      return protocol.Output(mean=ctx.mean(corrected), state=state, residual=residual,
                             joint=protocol.Joint(fields, lambda *old: old))

    return protocol.compressor(protocol.Method(
        name="bad", config={}, axes=("data",), state=LastState, step=step,
        wire=lambda bucket, sizes, steps: wire.mean(bucket.size, sizes),
        init=lambda params, bucket: {"last": jnp.zeros(bucket.size, jnp.float32)},
        error_feedback=True, bucket_fields=("last",)))

  for fields, state, residual in ((("count",), {}, None),
                                  (("last", "residual"), {"last": 0.0}, None),
                                  (("last", "residual"), {}, 0.0)):
    with pytest.raises(ValueError, match="a `Joint` field"):
      harness.one_step_of_normal_gradients(method(fields, state, residual), RUN_PARAMS, 0)


@pytest.mark.parametrize("cap, buckets", [(None, 1), (3e-5, 2)],
                         ids=["one_bucket", "two_buckets"])
def test_finish_takes_every_buckets_items_at_once_and_writes_with_the_step(cap, buckets):
  """``finish`` gets each bucket's item in one call; what it returns is each bucket's
  field, kept over a kept step and dropped over a skipped one (a NaN on one device)."""
  batches = _batches_with_a_nan(7)
  calls = []
  tx = summed("data", calls, cap)
  lasts = [jax.tree.map(np.asarray, protocol.as_tree(
      tx, training.device_rows(state, jax.eval_shape(tx.init, RUN_PARAMS)).last, RUN_PARAMS))
           for state in _states_after_each(tx, batches)]
  assert calls == [buckets]  # one trace, one call with every bucket's item
  # Error feedback: the second step skipped, the third's corrected gradient is its own
  # plus the residual of the first (half of it).
  means = [jax.tree.map(lambda g: g.mean(0) / 2, batches[0]),
           jax.tree.map(lambda g0, g2: (g0.mean(0) / 2 + g2.mean(0)) / 2,
                        batches[0], batches[2])]
  want, wants = jax.tree.map(np.zeros_like, means[0]), []
  for mean in means:
    total = sum(float(np.sum(m, dtype=np.float64)) for m in jax.tree.leaves(mean))
    want = jax.tree.map(lambda w, m: w + m + total, want, mean)
    wants.append(want)
  for got, want in zip(lasts, (wants[0], wants[0], wants[1])):
    for name in RUN_PARAMS:  # every device holds the same
      np.testing.assert_allclose(got[name], np.broadcast_to(want[name], got[name].shape),
                                 rtol=1e-5, atol=1e-5)


def test_finish_writes_only_fields_sized_by_the_bucket():
  tx = summed("data", [], field="count")
  with pytest.raises(ValueError, match="`finish` wrote 'count', which is not one of its"
                                       r" bucket_fields \('last',\)"):
    harness.one_step_of_normal_gradients(tx, RUN_PARAMS, 0)


def first_entries(axis_name, runs=None):
  """A toy sparsifier: entries 0 and 3 of the bucket sent exactly, the residual the rest
  (:class:`protocol.Zeroed`); in ``runs`` of leaves when given."""

  def step(ctx, corrected, state):
    del state
    flat = fusion.concat(list(jax.tree.leaves(corrected)))
    sent = jnp.zeros_like(flat).at[jnp.array([0, 3])].set(flat[jnp.array([0, 3])])
    return protocol.Output(mean=ctx.mean(sent), residual=protocol.Zeroed(jnp.array([0, 3])))

  return toy("first", axis_name, step, runs=runs)


def test_a_sparsifier_in_runs_keeps_what_it_did_not_send():
  mesh = training.make_mesh(8)
  rng = np.random.default_rng(6)
  batches = [jax.tree.map(lambda x: rng.normal(size=(8,) + x.shape).astype(np.float32),
                          RUN_PARAMS) for _ in range(2)]
  results = []
  for tx in (first_entries("data"), first_entries("data", lambda b: (2, 0, 2))):
    state = training.init_state(tx, RUN_PARAMS, mesh, "data")
    update = training.make_update(tx, mesh, "data")
    for grads in batches:
      _, state = jax.block_until_ready(update(training.shard(grads, mesh, "data"), state))
    results.append(harness.state_rows(tx, state, RUN_PARAMS).residual)
  chex.assert_trees_all_equal(*results)
  # Entries 0 and 3 of leaf "a" were sent at both steps; the rest piled up.
  residual = np.asarray(results[1]["a"]).reshape(8, -1)
  np.testing.assert_array_equal(residual[:, [0, 3]], 0.0)
  want = sum(b["a"] for b in batches).reshape(8, -1)
  np.testing.assert_allclose(residual[:, [1, 2, 4]], want[:, [1, 2, 4]], rtol=1e-6)


def test_runs_are_checked():
  def method(**fields):
    return protocol.Method(
        name="bad", config={}, axes=("data",), state=HalfState,
        step=lambda ctx, c, s: protocol.Output(mean=c), wire=lambda b, s, t: (),
        error_feedback=True, runs=lambda bucket: (1, 1), **fields)

  with pytest.raises(ValueError, match="neither `prepare` nor `flat_length`"):
    protocol.compressor(method(prepare=lambda ctx, g, s: (g, None)))
  with pytest.raises(ValueError, match="neither `prepare` nor `flat_length`"):
    protocol.compressor(method(flat_length=lambda bucket, p: bucket.size))
  with pytest.raises(ValueError, match=r"runs \(1, 1\) must cut the bucket's 4 leaves"):
    harness.one_step_of_normal_gradients(protocol.compressor(method()), RUN_PARAMS, 0)


def test_leaves_prepared_only_where_the_payload_carries_nonfinite_values():
  # The step may read the leaves itself: no fused gradient is there to test.
  leaves_prepared = lambda ctx, leaves, s: (None, None)  # noqa: E731

  def method(**fields):
    return protocol.Method(
        name="bad", config={}, axes=("data",), state=HalfState,
        step=lambda ctx, c, s: protocol.Output(mean=c), wire=lambda b, s, t: (),
        prepare_leaves=leaves_prepared, **fields)

  for fields in (dict(), dict(error_feedback=True, prepare=lambda ctx, g, s: (g, None))):
    with pytest.raises(ValueError, match="`prepare_leaves` needs `payload_carries_nonfinite`"):
      protocol.compressor(method(**fields))
  # Without error feedback (QSGD's), and with runs (the low-rank methods': a bucket it
  # leaves alone is cut into them).
  protocol.compressor(method(payload_carries_nonfinite=True))
  protocol.compressor(method(error_feedback=True, payload_carries_nonfinite=True,
                             runs=lambda bucket: (len(bucket.leaves),)))


def _reads_of_old_residual(tx) -> int:
  """Kernels outside any conditional that read the donated residual, in a one-device step
  (a custom call among them: the native route's sum)."""
  params = {"w": jnp.zeros((256, 128)), "b": jnp.zeros((128,))}
  mesh = training.make_mesh(1)
  state = training.init_state(tx, params, mesh, "data")
  grads = training.stack_per_device(params, mesh, "data")
  text = training.make_update(tx, mesh, "data", donate=True).lower(grads, state).compile(
  ).as_text()
  entry = hlo_counts.computations(text)["ENTRY"]
  names = [i.name for i in entry if i.op == "parameter" and "residual" in i.name]
  assert len(names) == 1, names
  return sum(1 for i in entry
             if i.op in ("fusion", "copy", "custom-call") and names[0] in i.operands)


@pytest.mark.parametrize("make, reads", [
    (lazy_half, 1), (lambda axis: jaxcomp.topk(0.05, axis), 1),
    (lambda axis: jaxcomp.signsgd(axis), 1),
    # The sparse leaves' in the selection's pass, the dense leaves' (a slice) apart.
    (lambda axis: jaxcomp.dgc(0.05, axis), 2 if selection.native_route() else 1),
    (lambda axis: jaxcomp.demo(0.25, axis), 1),
], ids=["lazy_half", "topk", "signsgd", "dgc", "demo"])
def test_a_residual_formed_where_it_is_written_reads_the_old_one_once(make, reads):
  """On CPU the new residual is written inside the branch that keeps the step, so the old
  one is read once outside it, by error feedback's addition; a residual given eagerly is
  read again, by the ``where`` between the new and the old values (once more on jax
  0.10.2, twice on 0.10.0 and 0.10.1)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the conditional is XLA:CPU's form; elsewhere the where is fused")
  assert _reads_of_old_residual(make("data")) == reads
  assert _reads_of_old_residual(half("data")) >= 2


def test_a_skippable_write_elsewhere_moves_the_pieces_not_the_buffer():
  """Off CPU each piece's write is fused with the ``where`` that keeps the old span:
  a kernel that reads the buffer only where it writes, by a dynamic slice at the
  write's own start, which XLA:GPU writes in place. A constant start would fold into a
  static slice, and each piece's kernel would copy the whole buffer."""
  n, sizes = 1 << 16, (1 << 14, 1 << 13, 3000)
  offsets = (0, 1 << 14, 40_000)
  values = tuple(jnp.ones(size) for size in sizes)
  write = jax.jit(
      lambda old, values, keep: fusion._written_selected(old, fusion.Pieces(offsets, values),
                                                         keep),
      donate_argnums=0)
  text = write.lower(jnp.zeros(n), values, jnp.bool_(True)).compile().as_text()
  moved = 3 * sum(sizes) / n  # each span: its old values and its piece read, written
  chex.assert_trees_all_close(hlo_counts.count(text, n, "gpu").passes, moved, rtol=0.01)
  for keep in (True, False):
    got = np.asarray(write(jnp.full(n, 2.0), values, jnp.bool_(keep)))
    want = np.full(n, 2.0)
    for offset, size in zip(offsets, sizes):
      want[offset:offset + size] = 1.0 if keep else 2.0
    np.testing.assert_array_equal(got, want)


CARRIERS = {
    "signsgd_blocks": lambda axis: jaxcomp.signsgd(axis, block_size=16),
    "signsgd_vote": lambda axis: jaxcomp.signsgd(axis, majority_vote=True, block_size=16),
    "demo": lambda axis: jaxcomp.demo(0.125, axis, chunk_size=32),
    "sparseloco": lambda axis: jaxcomp.sparseloco(1 / 16, axis, chunk_size=64),
}


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
@pytest.mark.parametrize("make", CARRIERS.values(), ids=CARRIERS.keys())
def test_a_payload_that_carries_a_non_finite_gradient_skips_the_step_everywhere(make, bad):
  """Methods without the finiteness test and its poison: one non-finite entry on one
  device, in a block or chunk of its own, still makes every device's mean non-finite, and
  the state stays as it was; the next finite step is finite."""
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
  mesh = training.make_mesh(8)
  tx = make("data")
  state = training.init_state(tx, params, mesh, "data")
  update = training.make_update(tx, mesh, "data")
  rng = np.random.default_rng(4)
  batches = [jax.tree.map(lambda x: rng.normal(size=(8,) + x.shape).astype(np.float32), params)
             for _ in range(3)]
  batches[1]["w"][3, 40, 17] = bad
  outs, states = [], [jax.tree.map(np.asarray, state)]
  for grads in batches:
    out, state = jax.block_until_ready(update(training.shard(grads, mesh, "data"), state))
    outs.append(jax.tree.map(np.asarray, out))
    states.append(jax.tree.map(np.asarray, state))
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves((outs[0], outs[2])))
  for device in range(8):
    assert not all(np.isfinite(leaf[device]).all() for leaf in jax.tree.leaves(outs[1]))
  chex.assert_trees_all_equal(states[2], states[1])
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(states[3])
             if np.issubdtype(leaf.dtype, np.floating))


class _Parts:
  """A user's container: the transformation sits in a dict attribute."""

  def __init__(self):
    self.parts = {}


def registered(tx):
  """A user's wrapper function that reaches ``tx`` through a custom object's dict."""
  holder = _Parts()
  holder.parts["compress"] = tx

  def init_fn(params):
    return holder.parts["compress"].init(params)

  def update_fn(updates, state, params=None):
    return holder.parts["compress"].update(updates, state, params)

  return optax.GradientTransformation(init_fn, update_fn)


WRAPPERS = {
    "alone": lambda tx: tx,
    "chain": lambda tx: optax.chain(tx, optax.sgd(0.1)),
    "nested": lambda tx: optax.chain(optax.clip(1.0), optax.chain(tx, optax.adam(1e-3))),
    "named_chain": lambda tx: optax.named_chain(("compress", tx), ("sgd", optax.sgd(0.1))),
    "multisteps": lambda tx: optax.MultiSteps(optax.chain(tx, optax.sgd(0.1)), 4),
    "multisteps_gt": lambda tx: optax.MultiSteps(optax.chain(tx, optax.sgd(0.1)),
                                                 4).gradient_transformation(),
    "masked": lambda tx: optax.masked(tx, {"w": True, "b": False}),
    "apply_if_finite_after": lambda tx: optax.chain(tx, optax.apply_if_finite(optax.sgd(0.1), 3)),
    "apply_if_finite_around": lambda tx: optax.apply_if_finite(optax.chain(tx, optax.sgd(0.1)), 3),
    "inject_hyperparams": lambda tx: optax.chain(
        tx, optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=1e-4)),
    "user_class": lambda tx: harness.Clipped(tx, 1.0),
    "user_class_in_chain": lambda tx: optax.chain(optax.clip(1.0), harness.Clipped(tx, 1.0),
                                                  optax.sgd(0.1)),
    "user_dict_attribute": lambda tx: optax.chain(registered(tx), optax.sgd(0.1)),
    "per_device": lambda tx: training.per_device(optax.chain(tx, optax.sgd(0.1)),
                                                 training.make_mesh(8), "data"),
}


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_find_specs_finds_the_compressor_inside_any_transformation(wrap):
  tx = jaxcomp.gtopk(0.25, "data")
  specs = protocol.find_specs(wrap(tx), PARAMS)
  assert [s.name for s in specs] == ["gtopk"]
  assert specs[0].config == {"density": 0.25, "axis_name": "data", "bucket_cap_mb": None}
  assert specs[0] is protocol.spec(tx)


def test_find_specs_of_plain_optax_is_empty_and_keeps_the_order():
  for tx in (optax.adamw(1e-3), optax.chain(optax.clip(1.0), optax.sgd(0.1)),
             optax.MultiSteps(optax.sgd(0.1), 2), harness.Clipped(optax.sgd(0.1), 1.0)):
    assert protocol.find_specs(tx, PARAMS) == []
  both = optax.chain(jaxcomp.topk(0.1, "data"), jaxcomp.signsgd("data"))
  assert [s.name for s in protocol.find_specs(both, PARAMS)] == ["topk", "signsgd"]
  nested = optax.chain(harness.Clipped(jaxcomp.signsgd("data"), 1.0),
                       optax.chain(optax.sgd(0.1), registered(jaxcomp.topk(0.1, "data"))))
  assert [s.name for s in protocol.find_specs(nested, PARAMS)] == ["signsgd", "topk"]


def test_find_compressors_reports_what_each_compressor_is_given():
  """The leaves and dtypes it sees, each compressor once however often it is traced."""
  tx = jaxcomp.gtopk(0.25, "data")
  assert protocol.find_compressors(tx, PARAMS) == protocol.find_compressors(
      optax.chain(tx), PARAMS)  # alone (not traced) as in a chain (traced): the whole tree
  (found,) = protocol.find_compressors(optax.masked(tx, {"w": True, "b": False}), PARAMS)
  assert [x.shape for x in jax.tree.leaves(found.updates)] == [(6, 4)]
  half_precision = optax.chain(
      optax.stateless(lambda g, p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), g)), tx)
  (found,) = protocol.find_compressors(half_precision, PARAMS)
  assert {x.dtype for x in jax.tree.leaves(found.updates)} == {jnp.dtype(jnp.bfloat16)}
  # MultiSteps traces the inner update in both branches of its lax.cond.
  (found,) = protocol.find_compressors(optax.MultiSteps(tx, 2), PARAMS)
  assert found.spec is protocol.spec(tx)
  # A hierarchy reports itself with the whole gradient; its inner compressor is not traced.
  nested = jaxcomp.hierarchical(tx, "ici", 4)
  (found,) = protocol.find_compressors(optax.chain(nested, optax.sgd(0.1)), PARAMS)
  assert found.spec is protocol.spec(nested)
  assert [x.shape for x in jax.tree.leaves(found.updates)] == [(4,), (6, 4)]


def _runs_the_mean(tx):
  """``tx``'s update on 8 devices returns the mean: its compressor runs, it is not passed through."""
  mesh = training.make_mesh(8)
  grads = _stacked(2)
  out, _ = training.make_update(tx, mesh, "data")(training.shard(grads, mesh, "data"),
                                                  training.init_state(tx, PARAMS, mesh, "data"))
  for name in PARAMS:
    np.testing.assert_allclose(np.asarray(out[name]),
                               np.broadcast_to(grads[name].mean(0), grads[name].shape),
                               rtol=1e-6, atol=1e-6)


def test_a_transformation_that_fails_when_traced_is_named():
  def bound(updates, state, params=None):
    return jax.lax.pmean(updates, "data"), state  # binds a mesh axis itself

  tx = optax.chain(jaxcomp.allreduce("data"),
                   optax.GradientTransformation(lambda p: optax.EmptyState(), bound))
  with pytest.raises(ValueError, match=r"cannot find the compressors in `tx`.*NameError"):
    protocol.find_specs(tx, PARAMS)
  with pytest.raises(TypeError, match=r"`tx` must be a transformation with `init"):
    protocol.find_specs(jaxcomp.gtopk(0.25, "data").update, PARAMS)
  _runs_the_mean(tx)  # the failed search is over: the compressor runs again


class Jitted:
  """A user's transformation whose update is jitted: a trace cached across calls."""

  def __init__(self, inner):
    self.init = inner.init
    self.update = jax.jit(inner.update)


def test_every_search_traces_a_jitted_update_again():
  """A search is a jit cache key of its own: the last one's cached trace is not reused."""
  tx = Jitted(jaxcomp.allreduce("data"))
  for _ in range(2):
    assert [s.name for s in protocol.find_specs(tx, PARAMS)] == ["allreduce"]
  _runs_the_mean(tx)


def test_send_scales_by_the_group_and_poisons_on_demand():
  mesh = training.make_mesh(8)
  bucket = jaxcomp.protocol.Bucket.of(PARAMS)

  def body(x, finite):
    ctx = protocol.Context(bucket, ("data",), (8,), finite=finite[0])
    return ctx.send(x), ctx.mean(x)

  x = np.full((8, 3), 2.0**127, np.float32)  # 8 of them overflow f32; their mean does not
  finite = np.array([True] * 8)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"),
                             out_specs=jax.P("data"), check_vma=False))
  sent, mean = fn(x, finite)
  np.testing.assert_array_equal(np.asarray(sent), x / 8)
  np.testing.assert_array_equal(np.asarray(mean), x)
  finite[2] = False
  sent, mean = fn(x, finite)
  assert np.isnan(np.asarray(sent)[2]).all() and np.isfinite(np.asarray(sent)[3]).all()
  assert np.isnan(np.asarray(mean)).all()


def test_a_message_of_parts_is_packed_with_the_order_token_in_every_part():
  mesh = training.make_mesh(8)
  bucket = jaxcomp.protocol.Bucket.of(PARAMS)

  def body(payload, scales, after):
    # A token of 1, not the 0 of a real exchange, so that it shows.
    ctx = protocol.Context(bucket, ("data",), (8,), after=after[0])
    return (ctx.allgather([payload, scales]), ctx.all_to_all([payload, scales]),
            ctx.packed([payload]))

  rng = np.random.default_rng(0)
  payload = rng.integers(0, 255, size=(8, 8, 5), dtype=np.uint8)
  scales = rng.integers(0, 255, size=(8, 8, 3), dtype=np.uint8)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"),
                             out_specs=(jax.P(None, "data"), jax.P("data"), jax.P("data")),
                             check_vma=False))
  gathered, exchanged, alone = fn(payload.reshape(64, 5), scales.reshape(64, 3),
                                  np.ones(8, np.float32))
  message = np.concatenate([payload, scales], axis=-1) + np.uint8(1)  # [device, row, byte]
  np.testing.assert_array_equal(np.asarray(gathered).reshape(8, 8, 8, 8)[:, 0], message)
  # Row j of device i's message went to device j.
  np.testing.assert_array_equal(np.asarray(exchanged).reshape(8, 8, 8),
                                message.transpose(1, 0, 2))
  np.testing.assert_array_equal(np.asarray(alone).reshape(8, 8, 5), payload + np.uint8(1))


def test_a_seed_needs_a_key_field():
  method = protocol.Method(
      name="bad", config={}, axes=("data",), state=HalfState,
      step=lambda ctx, c, s: protocol.Output(mean=c), wire=lambda b, s, t: (), seed=0)
  with pytest.raises(ValueError, match="rng_key"):
    protocol.compressor(method)


@pytest.mark.parametrize("cap", [None, 1e-4], ids=["one_bucket", "buckets"])
@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd"])
def test_as_tree_and_from_tree_lay_a_residual_out_like_the_parameters(name, cap):
  """Each leaf's part of the flat residual lands on that leaf (whatever the method's
  order: tree order, DGC's sparse leaves first, the low-rank groups), device rows kept;
  ``from_tree`` is its inverse; a frozen leaf is zero and sent nowhere."""
  params = {"w": jnp.zeros((6, 4)), "b": jnp.zeros((4,)), "c": jnp.zeros((3, 3, 2, 2)),
            "frozen": jnp.zeros((0, 3))}
  tx = {"topk": jaxcomp.topk(0.1, "data", bucket_cap_mb=cap),
        "dgc": jaxcomp.dgc(0.1, "data", bucket_cap_mb=cap),
        "powersgd": jaxcomp.powersgd(1, "data", bucket_cap_mb=cap)}[name]
  buckets = protocol.spec(tx).fused.plan(params)
  assert (len(buckets) > 1) == (cap is not None)
  # Row d of leaf k holds 1000 d + k + its position: every value says where it belongs.
  leaves, treedef = jax.tree.flatten(params)
  tree = jax.tree.unflatten(treedef, [
      jnp.stack([1000.0 * d + 100.0 * k + jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape)
                 for d in range(3)]) for k, x in enumerate(leaves)])
  flat = protocol.from_tree(tx, tree, params)
  state = tx.init(params)
  tree_leaves = jax.tree.leaves(tree)
  for bucket, got, want in zip(buckets, flat if cap else (flat,),
                               state.residual if cap else (state.residual,)):
    assert got.shape == (3,) + want.shape
    # The bucket's leaves end to end, in the order the method lays them out.
    np.testing.assert_array_equal(got, np.concatenate(
        [np.asarray(tree_leaves[i]).reshape(3, -1) for i in bucket.leaves], axis=1))
  again = protocol.as_tree(tx, flat, params)
  chex.assert_trees_all_equal(again, tree)
  assert protocol.as_tree(tx, state.residual, params)["frozen"].shape == (0, 3)
  with pytest.raises(TypeError, match="jaxcomp compressor"):
    protocol.as_tree(optax.sgd(0.1), flat, params)


def _leaves_made_after_the_state(tx, params) -> list[bool]:
  """Per leaf of the update, in the jaxpr of ``update`` (nested calls taken whole):
  whether it is computed from the residual and the other fields sized by the bucket
  as the step leaves them, i.e. made once they are written."""
  state = tx.init(params)
  closed, shapes = jax.make_jaxpr(tx.update, axis_env=[("data", 8)], return_shape=True)(
      params, state)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
  outvars = closed.jaxpr.outvars
  written = {v for p, v in zip(paths, outvars) if p.startswith("[1]")
             and (".residual" in p or ".momentum" in p) and isinstance(v, jex_core.Var)}
  assert written, paths
  later = set(written)
  for eqn in closed.jaxpr.eqns:
    if any(isinstance(v, jex_core.Var) and v in later for v in eqn.invars):
      later.update(eqn.outvars)
  return [v in later for p, v in zip(paths, outvars) if p.startswith("[0]")]


@pytest.mark.parametrize("cap", [None, 1e-4], ids=["one_bucket", "buckets"])
@pytest.mark.parametrize("make", [
    lambda cap: jaxcomp.topk(0.1, "data", bucket_cap_mb=cap),
    lambda cap: jaxcomp.gtopk(0.1, "data", bucket_cap_mb=cap),
    lambda cap: jaxcomp.randomk(0.1, "data", bucket_cap_mb=cap),
    lambda cap: jaxcomp.dgc(0.1, "data", bucket_cap_mb=cap),
    lambda cap: jaxcomp.sparseloco(0.1, "data", chunk_size=8, bucket_cap_mb=cap),
], ids=["topk", "gtopk", "randomk", "dgc", "sparseloco"])
def test_a_sparse_mean_is_densified_once_the_state_is_written(make, cap):
  """A sparsifier's mean is a :class:`protocol.Later`: its zeros are made from a
  token of the written state, so on CPU they take the memory of a buffer dead by then
  (DGC's fused gradient, read by its momentum until it is written: 141-148 ms a step
  against 157-163 on ResNet-50). A mean made with the exchange (a dense one) does
  not wait for the state."""
  # Matrices only: DGC sends a vector densely, and its mean is then the exchange's.
  params = {"w": jnp.zeros((6, 4)), "v": jnp.zeros((2, 4)), "c": jnp.zeros((3, 8))}
  tx = make(cap)
  assert (len(protocol.spec(tx).fused.plan(params)) > 1) == (cap is not None)
  assert all(_leaves_made_after_the_state(tx, params))
  assert not any(_leaves_made_after_the_state(jaxcomp.qsgd(4, "data", error_feedback=True),
                                              params))


def test_a_later_mean_needs_a_witness():
  def step(ctx, corrected, state):
    del state
    return protocol.Output(mean=protocol.Later(lambda after: ctx.mean(corrected), ()),
                           residual=corrected * 0)

  with pytest.raises(ValueError, match="a `Later` mean needs a `witness`"):
    harness.one_step_of_normal_gradients(toy("no_witness", "data", step), PARAMS, 0)
