"""The one per-device layout: a hand-written shard_map, init_state and the pmap helpers alike."""

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import training

PARAMS = {"w": jnp.zeros((12, 6)), "b": jnp.zeros(6)}


def _loss(params, batch):
  logits = batch["x"] @ params["w"] + params["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batch(step, devices=8, per_device=4):
  rng = np.random.default_rng(step)
  return {"x": rng.normal(size=(devices * per_device, 12)).astype(np.float32),
          "y": rng.integers(0, 6, devices * per_device).astype(np.int32)}


def _chain(axis="data"):
  return optax.chain(jaxcomp.gtopk(0.2, axis), optax.sgd(0.1, momentum=0.9))


def _hand_written_step(tx, mesh):
  """The README's first example: per_device's state through jax.shard_map."""

  def per_device_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss[None]

  return jax.jit(jax.shard_map(
      per_device_step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
      out_specs=(P(), P("data"), P("data")), check_vma=False))


def test_per_device_in_a_shard_map_is_the_training_step_bit_for_bit():
  mesh = training.make_mesh(8)
  tx = training.per_device(_chain(), mesh, "data")
  state = tx.init(PARAMS)
  reference = training.init_state(_chain(), PARAMS, mesh, "data")
  # One layout: per_device's init is init_state's, leaf by leaf and shard by shard.
  chex.assert_trees_all_equal(state.jaxcomp_per_device, reference)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(reference)):
    assert got.sharding == want.sharding
  assert jax.tree.leaves(reference)[0].shape == (8,)  # gtopk's count, one per device

  step = _hand_written_step(tx, mesh)
  reference_step = training.make_step(_loss, _chain(), mesh, "data", donate=False)
  params = reference_params = training.replicate(PARAMS, mesh)
  for i in range(3):
    batch = training.shard(_batch(i), mesh, "data")
    params, state, _ = jax.block_until_ready(step(params, state, batch))
    reference_params, reference, _ = jax.block_until_ready(
        reference_step(reference_params, reference, batch))
  chex.assert_trees_all_equal(params, reference_params)
  chex.assert_trees_all_equal(state.jaxcomp_per_device, reference)
  # Each device's residual is its own: the layout holds eight different blocks.
  residual = np.asarray(state.jaxcomp_per_device[0].residual).reshape(8, -1)
  assert not np.array_equal(residual[0], residual[1])


def test_a_state_handed_whole_to_update_names_the_block_and_the_specs():
  mesh = training.make_mesh(8)
  tx = training.per_device(_chain(), mesh, "data")

  def per_device_step(params, opt_state, batch):
    grads = jax.grad(_loss)(params, batch)
    return tx.update(grads, opt_state, params)[0]

  step = jax.jit(jax.shard_map(per_device_step, mesh=mesh, in_specs=(P(), P(), P("data")),
                               out_specs=P(), check_vma=False))
  with pytest.raises(ValueError, match=r"has shape \(8,\) here, but one device's block is"
                                       r" \(1,\).*in_specs=P\('data'\)"):
    step(PARAMS, tx.init(PARAMS), training.shard(_batch(0), mesh, "data"))


def test_a_stacked_state_is_refused_naming_the_layout_and_the_helper():
  mesh = training.make_mesh(8)
  tx = _chain()
  step = training.make_step(_loss, tx, mesh, "data", donate=False)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 8), tx.init(PARAMS))
  with pytest.raises(ValueError, match=r"residual has shape \(8, 78\), but the per-device"
                                       r" state of 8 devices has \(624,\).*new leading device"
                                       r" axis is not that layout.*init_state"):
    step(training.replicate(PARAMS, mesh), stacked, training.shard(_batch(0), mesh, "data"))


def test_per_device_wraps_once_and_init_state_refuses_a_wrapped_transformation():
  mesh = training.make_mesh(8)
  tx = training.per_device(_chain(), mesh, "data")
  with pytest.raises(TypeError, match="already held per device"):
    training.per_device(tx, mesh, "data")
  with pytest.raises(TypeError, match=r"call `tx.init\(params\)`"):
    training.init_state(tx, PARAMS, mesh, "data")
  with pytest.raises(ValueError, match=r"names axes \['model'\]"):
    training.per_device(_chain("model"), mesh, "model")


def test_the_pmap_step_keeps_the_layout_and_the_bits_of_the_shard_map_step():
  mesh = training.make_mesh(8)
  tx = _chain()
  state = training.init_pmap_state(tx, PARAMS)
  reference = training.init_state(tx, PARAMS, mesh, "data")
  chex.assert_trees_all_equal(state, reference)
  params = training.pmap_stack(PARAMS)
  step = training.make_pmap_step(_loss, tx, "data")
  reference_step = training.make_step(_loss, tx, mesh, "data", donate=False)
  reference_params = training.replicate(PARAMS, mesh)
  for i in range(3):
    batch = _batch(i)
    params, state, metrics = jax.block_until_ready(
        step(params, state, jax.tree.map(lambda x: x.reshape((8, -1) + x.shape[1:]), batch)))
    reference_params, reference, _ = jax.block_until_ready(
        reference_step(reference_params, reference, training.shard(batch, mesh, "data")))
  assert np.asarray(metrics["finite"]).all()
  for device in range(8):
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[device], params), reference_params)
  chex.assert_trees_all_equal(state, reference)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(reference)):
    assert got.shape == want.shape
