"""Properties over random shapes and pytrees (hypothesis), on 8 fake CPU devices.

Shapes come from small fixed sets so that compiles stay few; values are drawn
freely. Each property is the spec of one shared mechanism: fusion, error
feedback, the gTop-k butterfly, the torus all-reduce, PowerSGD.
"""

import functools
from unittest import mock

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec
import numpy as np
import pytest

from jaxcomp import collectives
from jaxcomp._src import error_feedback
from jaxcomp._src import fusion
from jaxcomp._src import lowrank
from jaxcomp import selection
from jaxcomp._src import selection as selection_impl
from jaxcomp._src import sparsify
from jaxcomp import training
import harness

LEAF_SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (4, 1, 2, 3)]
DTYPES = [np.float32, jnp.bfloat16, np.float16]


@st.composite
def pytrees(draw, dtypes=DTYPES, max_leaves=4):
  """A dict of lists and leaves, of shapes from ``LEAF_SHAPES``, values of ``dtypes``."""
  count = draw(st.integers(1, max_leaves))
  seed = draw(st.integers(0, 2**16))
  rng = np.random.default_rng(seed)
  leaves = []
  for _ in range(count):
    shape = draw(st.sampled_from(LEAF_SHAPES))
    dtype = draw(st.sampled_from(dtypes))
    leaves.append(jnp.asarray(rng.normal(size=shape).astype(np.float32) * 10, dtype))
  split = draw(st.integers(0, count))
  return {"a": leaves[:split], "b": {"c": leaves[split:]}}


@hypothesis.given(tree=pytrees(), tail=st.sampled_from([None, 0, 1, 61]))
def test_fusion_round_trip_is_the_identity(tree, tail):
  """Fused (with ``tail`` zeros after the leaves when given) and split again."""
  bucket = fusion.Bucket.of(tree)
  size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
  flat = bucket.flatten(tree, None if tail is None else size + tail)
  assert flat.shape == (size + (tail or 0),)
  np.testing.assert_array_equal(np.asarray(flat[size:]), np.zeros(tail or 0, np.float32))
  again = bucket.unflatten(flat, like=tree)
  assert jax.tree.structure(again) == jax.tree.structure(tree)
  for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(tree)):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@hypothesis.given(tree=pytrees(), rule=st.sampled_from(["rank>1", "size>4"]))
def test_fusion_partition_round_trip(tree, rule):
  where = {"rank>1": lambda s: len(s) > 1, "size>4": lambda s: int(np.prod(s)) > 4}[rule]
  first, second = fusion.partition(tree, where)
  assert sorted(first.leaves + second.leaves) == list(range(len(jax.tree.leaves(tree))))
  again = second.unflatten(second.flatten(tree), like=first.unflatten(first.flatten(tree), like=tree))
  for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@hypothesis.given(
    tree=pytrees(dtypes=[np.float32]),
    residual_seed=st.integers(0, 2**16),
    density=st.sampled_from([0.1, 0.5, 1.0]),
)
def test_error_feedback_conserves_mass_exactly(tree, residual_seed, density):
  """``sent + new residual == grad + old residual`` bit for bit, for a sparse ``sent``."""
  rng = np.random.default_rng(residual_seed)
  bucket = fusion.Bucket.of(tree)
  residual = jnp.asarray(rng.normal(size=bucket.size), jnp.float32)
  k = max(1, int(np.ceil(density * bucket.size)))

  @jax.jit
  def step(tree, residual):
    corrected = bucket.flatten(tree) + residual
    values, indices = selection.select_topk(corrected, k)
    sent = collectives.densify(values, indices, bucket.size)
    # What a sparsifier keeps: the corrected gradient with the sent entries zeroed.
    kept = error_feedback.absorb(bucket, error_feedback.zeroed(corrected, indices))
    return corrected, sent, fusion.overwrite(residual, kept)

  corrected, sent, new = step(tree, residual)
  assert new.shape == residual.shape
  np.testing.assert_array_equal(np.asarray(sent + new), np.asarray(corrected))
  assert int(jnp.sum(sent != 0)) <= k


@pytest.mark.parametrize("native_route", harness.NATIVE_ROUTES)
@hypothesis.given(n=st.integers(1, 200), seed=st.integers(0, 2**16),
                  sent_from=st.one_of(st.none(), st.integers(0, 210)),
                  empty=st.integers(0, 3))
def test_the_packed_sent_mask_zeroes_exactly_the_sent_positions(native_route, n, seed,
                                                                sent_from, empty):
  """``zero_sent(sent_mask(n, indices, sent_from), x)``: 0 at each distinct index (below
  ``sent_from``) and at every position from ``sent_from`` on, ``x`` elsewhere (-0 and NaN
  kept bit for bit); ``EMPTY_INDEX`` slots and positions past ``n`` mark nothing; word
  edges included. By the native custom call and in JAX."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=n).astype(np.float32)
  x[rng.integers(0, n, 3)] = [-0.0, np.nan, np.inf]
  below = n if sent_from is None else min(n, sent_from)
  indices = rng.permutation(n + 40)[:rng.integers(0, n + 1)].astype(np.int32)
  indices = indices[(indices < below) | (indices >= n)]  # the ones >= n mark nothing
  indices = np.concatenate([indices, np.full(empty, collectives.EMPTY_INDEX, np.int32)])
  rng.shuffle(indices)
  with mock.patch.dict(selection_impl._BY_BACKEND,
                       {"cpu": selection_impl.Tuning(native=native_route)}):
    mask = jax.jit(lambda i: error_feedback.sent_mask(n, i, sent_from))
    assert ("jaxcomp_sent_mask" in mask.lower(indices).as_text()) == native_route
    sent = mask(jnp.asarray(indices))
  assert sent.shape == (-(-n // 32),) and sent.dtype == jnp.uint32
  got = jax.jit(error_feedback.zero_sent)(sent, jnp.asarray(x))
  want = x.copy()
  want[indices[indices < n]] = 0.0
  if sent_from is not None:
    want[sent_from:] = 0.0
  harness.assert_bitwise_equal(got, want)


@hypothesis.given(tree=pytrees(dtypes=[np.float32]), keep_seed=st.integers(0, 2**16),
                  keep=st.sampled_from([None, True, False]))
def test_error_feedback_absorbs_per_leaf_and_keeps_none_leaves(tree, keep_seed, keep):
  """Per-leaf ``kept``: each given leaf becomes its part of the new residual, a ``None`` leaf's
  stays; a skipped step (``keep`` false) leaves every part as it was. Written in place on CPU
  (inside a conditional) and with the choice fused into each write elsewhere: the same bits."""
  rng = np.random.default_rng(keep_seed)
  bucket = fusion.Bucket.of(tree)
  residual = jnp.asarray(rng.normal(size=bucket.size), jnp.float32)
  fresh = [jnp.asarray(rng.normal(size=n), jnp.float32) for n in bucket.sizes]
  unchanged = rng.random(len(fresh)) < 0.5
  kept = [None if same else x.reshape(s) for x, same, s in zip(fresh, unchanged, bucket.shapes)]
  pieces = error_feedback.absorb(bucket, kept)
  flag = None if keep is None else jnp.asarray(keep)
  ways = [fusion.overwrite]
  if flag is not None:
    ways += [fusion._written_in_branch, fusion._written_selected]
  # Given as they are, and as a function that forms them where they are written.
  written = [jax.jit(lambda r, f, way=way, lazy=lazy: way(
      r, (lambda: pieces) if lazy else pieces, f))(residual, flag)
             for way in ways for lazy in (False, True)]
  for new in written:
    assert new.shape == residual.shape
    for o, n, x, same in zip(bucket.offsets, bucket.sizes, fresh, unchanged):
      want = residual[o:o + n] if same or keep is False else x
      np.testing.assert_array_equal(np.asarray(new[o:o + n]), np.asarray(want))


@hypothesis.settings(max_examples=8)
@hypothesis.given(
    shape=st.sampled_from([(40,), (6, 7)]),
    density=st.sampled_from([0.05, 0.2]),
    seed=st.integers(0, 2**16),
)
def test_topk_every_coordinate_is_sent_or_kept(shape, density, seed):
  """Per device: the new residual is the corrected gradient less exactly ``k`` of its entries."""
  tx = sparsify.topk(density, "data")
  rng = np.random.default_rng(seed)
  grads = {"g": rng.normal(size=(8,) + shape).astype(np.float32)}
  old = {"g": rng.normal(size=(8,) + shape).astype(np.float32)}
  # The per-device layout: the devices' flat residuals one after the other.
  state = sparsify.TopKState(count=jnp.zeros(8, jnp.int32), residual=old["g"].reshape(-1))
  _, new_state = _update_fn(tx, shape)(grads, state)
  new_state = harness.state_rows(tx, new_state, {"g": grads["g"][0]})
  n = int(np.prod(shape))
  k = max(1, int(np.ceil(density * n)))
  for device in range(8):
    corrected = (grads["g"][device] + old["g"][device]).reshape(-1)
    kept = np.asarray(new_state.residual["g"][device]).reshape(-1)
    sent = corrected - kept
    assert np.count_nonzero(sent) == k
    np.testing.assert_array_equal(sent[sent != 0], corrected[sent != 0])
    assert np.all(kept[sent != 0] == 0)
    smallest_sent = np.min(np.abs(corrected[sent != 0]))
    assert np.all(np.abs(kept) <= smallest_sent)


@functools.lru_cache(maxsize=None)
def _update_fn(tx, shape):
  del shape  # a key of the cache: one compile per shape
  return training.make_update(tx, training.make_mesh(8), "data")


@hypothesis.settings(max_examples=10)
@hypothesis.given(
    num_devices=st.sampled_from([2, 4, 8]),
    k=st.sampled_from([1, 4, 9]),
    seed=st.integers(0, 2**16),
    levels=st.booleans(),
)
def test_gtopk_allreduce_equals_numpy_reference(num_devices, k, seed, levels):
  """Exact values and indices on every device; ``levels`` makes magnitude ties common."""
  n = 48
  rng = np.random.default_rng(seed)
  if levels:
    dense = rng.choice([-2.0, -1.0, 1.0, 2.0], (num_devices, n)).astype(np.float32)
  else:
    dense = rng.standard_normal((num_devices, n)).astype(np.float32)
  indices = np.stack([rng.choice(n, k, replace=False) for _ in range(num_devices)]).astype(np.int32)
  values = np.take_along_axis(dense, indices, axis=1)
  out_v, out_i = harness.gtopk_allreduce_fn(num_devices, k)(values, indices)
  ref_v, ref_i = harness.gtopk_allreduce_reference(list(zip(values, indices)), k)
  for device in range(num_devices):
    harness.assert_bitwise_equal(out_i[device], ref_i)
    harness.assert_bitwise_equal(out_v[device], ref_v)


@functools.lru_cache(maxsize=None)
def _torus_fn(rows, cols, shape):
  mesh = training.make_mesh((rows, cols), ("x", "y"))
  spec = PartitionSpec(("x", "y"))

  def per_device(x):
    x = x[0]
    return (collectives.torus_allreduce(x, "x", "y")[None],
            lax.psum(x, ("x", "y"))[None])

  del shape  # a key of the cache: one compile per shape
  return jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=spec, out_specs=(spec, spec), check_vma=False))


@hypothesis.given(
    mesh_shape=st.sampled_from([(2, 4), (4, 2)]),
    shape=st.sampled_from([(1,), (5,), (8,), (13,), (3, 7)]),
    seed=st.integers(0, 2**16),
)
def test_torus_allreduce_equals_psum(mesh_shape, shape, seed):
  """Integer-valued floats make every summation order exact, so equality is bitwise."""
  x = np.random.default_rng(seed).integers(-1000, 1000, (8,) + shape).astype(np.float32)
  torus, psum = _torus_fn(*mesh_shape, shape)(x)
  np.testing.assert_array_equal(np.asarray(torus), np.asarray(psum))
  for device in range(8):
    harness.assert_bitwise_equal(np.asarray(torus)[device], harness.reduce_sum_reference(x))


@hypothesis.settings(max_examples=8)
@hypothesis.given(
    dims=st.sampled_from([(12, 9), (20, 6), (3, 3, 2, 8)]),
    rank=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_powersgd_is_exact_on_rank_r_input(dims, rank, seed):
  """Gradients ``A B_i^T`` sharing a rank-r column space come back whole after one step."""
  rng = np.random.default_rng(seed)
  rows, cols = int(np.prod(dims[:-1])), dims[-1]
  column_space = rng.normal(size=(rows, rank)).astype(np.float32)
  grads = {"m": np.stack([
      (column_space @ rng.normal(size=(rank, cols))).astype(np.float32).reshape(dims)
      for _ in range(8)])}
  tx = lowrank.powersgd(rank, "data", min_compression_rate=1.0)
  state = training.init_state(tx, {"m": grads["m"][0]}, training.make_mesh(8), "data")
  out, _ = _update_fn(tx, dims)(grads, state)
  np.testing.assert_allclose(np.asarray(out["m"][0]), grads["m"].mean(0), rtol=1e-4, atol=1e-4)
