"""The dense baselines: allreduce (f32) and cast (16-bit on the wire)."""

from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import training
from jaxcomp import wire
import harness

N = 1000  # elements in the gradient below; not a multiple of 8 on purpose (pads)


def _grads(num_devices, dtype=jnp.float32):
  key = jax.random.key(0)
  return {
      "w": jax.random.normal(key, (num_devices, 25, 30)).astype(dtype),
      "b": jax.random.normal(jax.random.fold_in(key, 1), (num_devices, 250)).astype(dtype),
  }


def _grid_grads(num_devices, seed=0):
  """Gradients on a grid of 2**-10 below 16: 16-bit rounding shows, f32 partial sums are exact."""
  rng = np.random.default_rng(seed)
  grid = lambda shape: (rng.integers(-2**14, 2**14, shape) / 2**10).astype(np.float32)
  return {"w": grid((num_devices, 25, 30)), "b": grid((num_devices, 250))}


def _mean_oracle(grads, wire_dtype=None):
  """:func:`harness.mean_reference` of each leaf, broadcast back to every device."""
  return {name: np.broadcast_to(
      harness.mean_reference(x.reshape(x.shape[0], -1), wire_dtype).reshape(x.shape[1:]),
      x.shape) for name, x in grads.items()}


def _run(tx, grads, mesh, axis_name):
  spec = P(axis_name)

  def per_device(g):
    g = jax.tree.map(lambda x: x[0], g)
    out, _ = tx.update(g, tx.init(g), None)
    return jax.tree.map(lambda x: x[None], out)

  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec,
                             check_vma=False))
  return fn(grads), wire.collective_bytes(fn.lower(grads).compile())


def _assert_same_on_every_device(tree):
  for leaf in jax.tree.leaves(tree):
    for d in range(1, leaf.shape[0]):
      np.testing.assert_array_equal(np.asarray(leaf[d]), np.asarray(leaf[0]))


@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_allreduce_is_pmean_and_sends_ring_bytes(num_devices):
  grads = _grads(num_devices)
  tx = jaxcomp.allreduce("data")
  out, sent = _run(tx, grads, training.make_mesh(num_devices), "data")
  want = jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), grads)
  chex.assert_trees_all_close(out, want, rtol=1e-6, atol=1e-6)
  _assert_same_on_every_device(out)
  p = num_devices
  assert sent.total == Fraction(2 * (p - 1) * 4 * N, p)
  assert sent.by_kind == wire.expected_bytes(tx, jax.tree.map(lambda x: x[0], grads), p).by_kind


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_cast_sends_16_bits_and_stays_close(num_devices, dtype):
  grads = _grads(num_devices)
  tx = jaxcomp.cast(dtype, "data")
  out, sent = _run(tx, grads, training.make_mesh(num_devices), "data")
  want = jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), grads)
  chex.assert_trees_all_close(out, want, rtol=2e-2, atol=2e-2)
  _assert_same_on_every_device(out)
  p = num_devices
  padded = -(-N // p) * p
  assert sent.total == Fraction(2 * (p - 1) * 2 * padded, p)
  assert set(sent.by_kind) == {"all-to-all", "all-gather"}
  assert sent.by_kind == wire.expected_bytes(tx, jax.tree.map(lambda x: x[0], grads), p).by_kind


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("num_devices", [2, 8])
def test_cast_equals_the_narrow_mean_oracle(num_devices, dtype):
  """Each device's ``g / P`` rounded to 16 bits, summed in f32, the sum rounded again."""
  grads = _grid_grads(num_devices)
  out, _ = _run(jaxcomp.cast(dtype, "data"), grads, training.make_mesh(num_devices), "data")
  want = _mean_oracle(grads, dtype)
  for name in grads:
    harness.assert_bitwise_equal(out[name], want[name])
  assert not np.array_equal(want["w"], _mean_oracle(grads)["w"])  # the rounding shows


def test_cast_float32_is_allreduce():
  grads = _grads(8)
  mesh = training.make_mesh(8)
  out_cast, sent_cast = _run(jaxcomp.cast(jnp.float32, "data"), grads, mesh, "data")
  out_dense, sent_dense = _run(jaxcomp.allreduce("data"), grads, mesh, "data")
  chex.assert_trees_all_equal(out_cast, out_dense)
  assert sent_cast.by_kind == sent_dense.by_kind


@pytest.mark.parametrize("factory", [
    lambda axes: jaxcomp.allreduce(axes),
    lambda axes: jaxcomp.cast(jnp.bfloat16, axes),
], ids=["allreduce", "cast_bf16"])
def test_torus_variant_matches_and_runs_the_torus_pattern(factory):
  grads = _grads(8)
  tx = factory(("x", "y"))
  out, sent = _run(tx, grads, training.make_mesh((2, 4), ("x", "y")), ("x", "y"))
  want = jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), grads)
  chex.assert_trees_all_close(out, want, rtol=2e-2, atol=2e-2)
  _assert_same_on_every_device(out)
  assert sent.by_kind == wire.expected_bytes(tx, jax.tree.map(lambda x: x[0], grads), (2, 4)).by_kind
  groups = [op.group_size for op in sent.ops]
  assert groups[0] == 2 and groups[-1] == 2 and 4 in groups


def test_dtype_is_kept():
  grads = _grads(8, jnp.bfloat16)
  out, _ = _run(jaxcomp.cast(jnp.bfloat16, "data"), grads, training.make_mesh(8), "data")
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(out))


def test_nan_on_one_device_is_nan_everywhere():
  grads = _grads(8)
  grads["b"] = grads["b"].at[3, 0].set(jnp.nan)
  for tx in (jaxcomp.allreduce("data"), jaxcomp.cast(jnp.bfloat16, "data")):
    out, _ = _run(tx, grads, training.make_mesh(8), "data")
    b = np.asarray(out["b"], np.float32)
    # The poisoned coordinate is NaN on every device; the others stay finite.
    assert np.all(np.isnan(b[:, 0]))
    assert np.all(np.isfinite(b[:, 1:])) and np.all(np.isfinite(np.asarray(out["w"])))


@pytest.mark.parametrize("make, match", [
    (lambda: jaxcomp.allreduce(""), "`axis_name`"),
    (lambda: jaxcomp.allreduce(("x", "x")), "`axis_name` pair must name two distinct"),
    (lambda: jaxcomp.allreduce(("x", 3)), "`axis_name` must hold strings"),
    (lambda: jaxcomp.allreduce(3), "`axis_name` must be a mesh axis name"),
    (lambda: jaxcomp.cast(jnp.int8, "data"), "`dtype` must be a 16- or 32-bit floating"),
    (lambda: jaxcomp.cast("not-a-dtype", "data"), "`dtype` must be a floating dtype"),
])
def test_bad_arguments_name_the_argument(make, match):
  with pytest.raises((ValueError, TypeError), match=match):
    make()


def test_unknown_axis_is_named_at_first_trace():
  tx = jaxcomp.allreduce("model")
  mesh = training.make_mesh(8)
  fn = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=P("data"),
                     out_specs=P("data"), check_vma=False)
  with pytest.raises(ValueError, match="`axis_name` 'model' is not a bound mesh axis"):
    jax.jit(fn).lower(jnp.ones(8))


def test_chains_into_optax_and_inits_outside_a_mesh():
  """Two adamw steps on the bf16 mean, from a state made outside any mesh, as optax alone."""
  params = {"w": jnp.ones((3, 4))}
  opt = optax.chain(jaxcomp.cast(jnp.bfloat16, "data"), optax.adamw(1e-3))
  state = opt.init(params)  # no mesh axis is bound here
  mesh = training.make_mesh(8)
  step = jax.jit(jax.shard_map(
      lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s, params),
      mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=False))
  reference = optax.adamw(1e-3)
  want_state = reference.init(params)
  for seed in (1, 2):
    grads = {"w": _grid_grads(8, seed)["w"][:, :3, :4]}
    updates, state = jax.block_until_ready(step(grads, state))
    mean = _mean_oracle(grads, jnp.bfloat16)["w"][0]
    want, want_state = reference.update({"w": jnp.asarray(mean)}, want_state, params)
    chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=0)
    chex.assert_trees_all_close(state[1], want_state, rtol=1e-6, atol=0)
