"""Flax NNX loops keep nnx.Optimizer and nnx.jit; per-device state is never folded into one copy."""

import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import registry
from jaxcomp import training
import harness

AXIS = "data"


def _example_source() -> str:
  _, example = jaxcomp.nnx.__doc__.split("::\n\n", 1)
  return "\n".join(line[2:] for line in example.rstrip().splitlines())


def test_the_module_docstring_example_runs_and_adds_at_most_six_lines():
  source = _example_source()
  marked = [line for line in source.splitlines() if re.search(r"# (added|changed)$", line)]
  assert 1 <= len(marked) <= 6, marked
  assert "check_vma" not in source
  namespace = {}
  exec(compile(source + "\nloss = jax.block_until_ready(loss)\n", "example", "exec"), namespace)
  assert np.isfinite(float(namespace["loss"]))


class _MLP(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(12, 16, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def _data(step):
  rng = np.random.default_rng(step)
  x = rng.normal(size=(64, 12)).astype(np.float32)
  y = (x[:, :3].argmax(axis=1)).astype(np.int32)
  return x, y


def _loss(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _plain_step(mesh):
  """The NNX tutorial's train step, data-parallel."""

  @nnx.jit
  @jaxcomp.nnx.data_parallel(mesh, AXIS)
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss

  return train_step


def _nnx_run(mesh, tx, steps):
  model = _MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jaxcomp.nnx.per_device(tx, mesh, AXIS), wrt=nnx.Param)
  train_step = _plain_step(mesh)
  losses = [float(jax.block_until_ready(train_step(model, optimizer, *_data(i))))
            for i in range(steps)]
  return model, optimizer, losses


@pytest.mark.parametrize("explicit", [True, False], ids=["jax.make_mesh", "training.make_mesh"])
@pytest.mark.parametrize("name", ["gtopk", "powersgd"])
def test_nnx_loop_equals_the_training_step(name, explicit):
  mesh = jax.make_mesh((8,), (AXIS,)) if explicit else training.make_mesh(8)
  config = {k: v for k, v in {"density": 0.2, "rank": 2}.items() if k in registry.get(name).defaults}
  tx = optax.chain(registry.build(name, AXIS, **config), optax.sgd(0.1, momentum=0.9))
  model, optimizer, losses = _nnx_run(mesh, tx, 4)
  assert losses[-1] < losses[0]

  # The same model, compressor and batches through jaxcomp.training.
  params = nnx.state(_MLP(nnx.Rngs(0)), nnx.Param)
  graphdef = nnx.graphdef(_MLP(nnx.Rngs(0)))
  pure = nnx.as_pure(params)

  def loss_fn(p, batch):
    return _loss(nnx.merge(graphdef, p), batch["x"], batch["y"])

  mesh1 = training.make_mesh(8)
  step = training.make_step(loss_fn, tx, mesh1, AXIS)
  p, state = training.replicate(pure, mesh1), training.init_state(tx, pure, mesh1, AXIS)
  for i in range(4):
    x, y = _data(i)
    p, state, _ = jax.block_until_ready(step(p, state, training.shard({"x": x, "y": y}, mesh1, AXIS)))
  got = nnx.as_pure(nnx.state(model, nnx.Param))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(p)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  # The model's copies are one; the residuals are each device's own.
  training.check_replicas(nnx.state(model))
  residual = [np.asarray(v.get_value()).reshape(8, -1)  # device d's block on row d
              for path, v in nnx.to_flat_state(nnx.state(optimizer)) if "residual" in path]
  assert residual and any(not np.array_equal(rows[0], rows[1]) for rows in residual)


def test_an_optimizer_without_per_device_state_is_refused_at_first_trace():
  mesh = jax.make_mesh((8,), (AXIS,))
  model = _MLP(nnx.Rngs(0))
  tx = optax.chain(jaxcomp.topk(0.1, AXIS), optax.sgd(0.1))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  with pytest.raises(ValueError, match=r"jaxcomp.nnx.per_device\(tx, mesh, 'data'\)"):
    _plain_step(mesh)(model, optimizer, *_data(0))


def test_a_compressor_in_a_users_transformation_needs_per_device_too():
  mesh = jax.make_mesh((8,), (AXIS,))
  tx = harness.Clipped(optax.chain(jaxcomp.topk(0.1, AXIS), optax.sgd(0.1)), 1.0)
  model = _MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  with pytest.raises(ValueError, match=r"jaxcomp.nnx.per_device\(tx, mesh, 'data'\)"):
    _plain_step(mesh)(model, optimizer, *_data(0))
  optimizer = nnx.Optimizer(model, jaxcomp.nnx.per_device(tx, mesh, AXIS), wrt=nnx.Param)
  loss = jax.block_until_ready(_plain_step(mesh)(model, optimizer, *_data(0)))
  assert np.isfinite(float(loss))


def test_a_per_device_state_for_another_device_count_is_refused():
  model = _MLP(nnx.Rngs(0))
  tx = optax.chain(jaxcomp.topk(0.1, AXIS), optax.sgd(0.1))
  four = jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4])
  optimizer = nnx.Optimizer(model, jaxcomp.nnx.per_device(tx, four, AXIS), wrt=nnx.Param)
  with pytest.raises(ValueError, match="for 4 devices, the mesh has 8"):
    _plain_step(jax.make_mesh((8,), (AXIS,)))(model, optimizer, *_data(0))


def test_update_outside_data_parallel_says_where_to_call_it():
  mesh = jax.make_mesh((8,), (AXIS,))
  model = _MLP(nnx.Rngs(0))
  tx = optax.chain(jaxcomp.topk(0.1, AXIS), optax.sgd(0.1))
  optimizer = nnx.Optimizer(model, jaxcomp.nnx.per_device(tx, mesh, AXIS), wrt=nnx.Param)
  grads = nnx.grad(_loss)(model, *_data(0))
  with pytest.raises(ValueError, match="inside a step wrapped by jaxcomp.nnx.data_parallel"):
    optimizer.update(model, grads)


def test_integer_outputs_are_refused_by_name():
  mesh = jax.make_mesh((8,), (AXIS,))

  @nnx.jit
  @jaxcomp.nnx.data_parallel(mesh, AXIS)
  def count(x):
    return jnp.sum(x > 0)

  with pytest.raises(TypeError, match="return floats"):
    count(jnp.ones((8, 2)))


def test_bad_axis_is_named_at_construction():
  mesh = jax.make_mesh((8,), (AXIS,))
  with pytest.raises(ValueError, match=r"names axes \['batch'\]"):
    jaxcomp.nnx.data_parallel(mesh, "batch")
  with pytest.raises(ValueError, match=r"names axes \['batch'\]"):
    jaxcomp.nnx.per_device(optax.sgd(0.1), mesh, "batch")


# ------------------------------------------------------- silent divergence


def test_per_device_update_outside_data_parallel_is_refused():
  """Every device's blocks at once (no data_parallel around the step): a clear error."""
  mesh = training.make_mesh(8)
  params = {"w": jnp.zeros((12, 3)), "b": jnp.zeros(3)}
  tx = jaxcomp.nnx.per_device(optax.chain(jaxcomp.topk(0.2, AXIS), optax.sgd(0.1)), mesh, AXIS)
  state = tx.init(params)
  assert jax.tree.leaves(state)[0].shape == (8,)  # the count, one per device
  with pytest.raises(ValueError, match="one device's block is.*data_parallel"):
    tx.update(params, state, params)


def test_check_replicas_catches_a_compressor_state_held_replicated():
  """The natural mistake: the optimizer replicated (P()) with check_vma=False."""
  mesh = training.make_mesh(8)
  P = jax.sharding.PartitionSpec
  params = {"w": jnp.zeros((12, 3))}
  tx = optax.chain(jaxcomp.topk(0.2, AXIS), optax.sgd(0.1))
  state = tx.init(params)

  def per_device(params, state, x, y):
    grads = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        x @ p["w"], y).mean())(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                               out_specs=(P(), P()), check_vma=False))
  params, state = jax.block_until_ready(step(params, state, *_data(0)))
  training.check_replicas(params, "params")  # the mean is identical: fine
  with pytest.raises(ValueError, match=r"opt_state\[0\]\.residual is held replicated"):
    training.check_replicas(state, "opt_state")
  with pytest.raises(ValueError, match="held replicated"):
    training.save_checkpoint("/nonexistent/never-written", params, state)


# -------------------------------------------------------------------- pmap


def test_pmap_state_is_initialised_and_stepped_with_current_jax():
  tx = optax.chain(jaxcomp.gtopk(0.2, AXIS), optax.sgd(0.1))
  params = {"w": jnp.zeros((12, 3)), "b": jnp.zeros(3)}

  def loss_fn(p, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        batch["x"] @ p["w"] + p["b"], batch["y"]).mean()

  params_d = training.pmap_stack(params)
  state_d = training.init_pmap_state(tx, params)
  assert jax.tree.leaves(state_d)[0].shape[0] == 8
  step = training.make_pmap_step(loss_fn, tx, AXIS)
  mesh = training.make_mesh(8)
  shard_step = training.make_step(loss_fn, tx, mesh, AXIS)
  p, s = training.replicate(params, mesh), training.init_state(tx, params, mesh, AXIS)
  for i in range(3):
    x, y = _data(i)
    params_d, state_d, _ = jax.block_until_ready(
        step(params_d, state_d, {"x": x.reshape(8, 8, 12), "y": y.reshape(8, 8)}))
    p, s, _ = jax.block_until_ready(shard_step(p, s, training.shard({"x": x, "y": y}, mesh, AXIS)))
  for a, b in zip(jax.tree.leaves(params_d), jax.tree.leaves(p)):
    np.testing.assert_array_equal(np.asarray(a)[5], np.asarray(b))
  assert "device_put_replicated" not in (training.make_pmap_step.__doc__ or "")


class _BatchNormMLP(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(12, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.norm(self.hidden(x))))


def test_batch_norm_statistics_stay_one_copy():
  mesh = jax.make_mesh((8,), (AXIS,))
  model = _BatchNormMLP(nnx.Rngs(0))
  tx = optax.chain(jaxcomp.gtopk(0.2, AXIS), optax.sgd(0.1))
  optimizer = nnx.Optimizer(model, jaxcomp.nnx.per_device(tx, mesh, AXIS), wrt=nnx.Param)
  x, y = _data(0)
  jax.block_until_ready(_plain_step(mesh)(model, optimizer, x, y))
  training.check_replicas(nnx.state(model))
  # The mean over devices of each device's batch statistics: the whole batch's mean.
  hidden = np.asarray(_BatchNormMLP(nnx.Rngs(0)).hidden(x))
  want = 0.99 * 0 + 0.01 * hidden.mean(axis=0)
  np.testing.assert_allclose(np.asarray(model.norm.mean.get_value()), want, rtol=1e-5, atol=1e-7)
