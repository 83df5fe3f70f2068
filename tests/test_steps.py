"""The step builders (``jaxcomp/_src/steps.py``): 8 devices with allreduce equal one
device with the full batch; pmap; the skip; donation; the chain checks."""

import re

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import registry
from jaxcomp import training


class _MLP(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(16, 32, rngs=rngs)
    self.out = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.tanh(self.hidden(x)))


def _model_and_loss():
  graphdef, params = nnx.split(_MLP(nnx.Rngs(0)), nnx.Param)
  params = jax.tree.map(jnp.asarray, nnx.to_pure_dict(params))

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, nnx.State(params))
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return params, loss_fn


def _batches(steps, batch_size=64):
  rng = np.random.default_rng(0)
  return [
      {"x": rng.standard_normal((batch_size, 16)).astype(np.float32),
       "y": rng.integers(0, 4, batch_size).astype(np.int32)}
      for _ in range(steps)
  ]


def test_twenty_steps_on_eight_devices_match_one_device_full_batch():
  params, loss_fn = _model_and_loss()
  batches = _batches(20)
  optimizer = optax.sgd(0.1, momentum=0.9)

  ref_params, ref_state = params, optimizer.init(params)

  @jax.jit
  def ref_step(p, s, b):
    grads = jax.grad(loss_fn)(p, b)
    updates, s = optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  for b in batches:
    ref_params, ref_state = ref_step(ref_params, ref_state, b)

  mesh = training.make_mesh(8)
  tx = optax.chain(jaxcomp.allreduce("data"), optimizer)
  dp_params = training.replicate(params, mesh)
  dp_state = training.init_state(tx, params, mesh, "data")
  step = training.make_step(loss_fn, tx, mesh, "data")
  for b in batches:
    # Blocked on every step: queued steps would pile up in the collectives.
    dp_params, dp_state, metrics = jax.block_until_ready(
        step(dp_params, dp_state, training.shard(b, mesh, "data")))
  assert metrics["loss"].shape == (8,)
  chex.assert_trees_all_close(dp_params, ref_params, rtol=1e-5, atol=1e-5)


def test_pmap_step_matches_shard_map_step():
  params, loss_fn = _model_and_loss()
  batches = _batches(3)
  tx = optax.chain(jaxcomp.allreduce("data"), optax.sgd(0.1))
  mesh = training.make_mesh(8)

  p_sm = training.replicate(params, mesh)
  s_sm = training.init_state(tx, params, mesh, "data")
  step = training.make_step(loss_fn, tx, mesh, "data", donate=False)

  p_pm = training.stack_per_device(params, mesh, "data")
  s_pm = training.init_state(tx, params, mesh, "data")
  pstep = training.make_pmap_step(loss_fn, tx, "data")
  for b in batches:
    p_sm, s_sm, _ = jax.block_until_ready(step(p_sm, s_sm, training.shard(b, mesh, "data")))
    local = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), b)
    p_pm, s_pm, _ = jax.block_until_ready(pstep(p_pm, s_pm, local))
  chex.assert_trees_all_close(
      jax.tree.map(lambda x: x[3], p_pm), p_sm, rtol=1e-6, atol=1e-6)


def test_a_nan_on_one_device_skips_the_step_everywhere():
  params, loss_fn = _model_and_loss()
  mesh = training.make_mesh(8)
  tx = optax.chain(jaxcomp.allreduce("data"), optax.sgd(0.1, momentum=0.9))
  p0 = training.replicate(params, mesh)
  s0 = training.init_state(tx, params, mesh, "data")
  step = training.make_step(loss_fn, tx, mesh, "data", donate=False)
  batch = _batches(1)[0]
  batch["x"][5] = np.nan  # row 5 lives on device 0
  p1, s1, metrics = step(p0, s0, training.shard(batch, mesh, "data"))
  assert not np.any(np.asarray(metrics["finite"]))
  chex.assert_trees_all_equal(p1, p0)
  chex.assert_trees_all_equal(s1, s0)


def test_make_mesh_checks_its_arguments():
  with pytest.raises(ValueError, match="needs 16 devices"):
    training.make_mesh(16)
  with pytest.raises(ValueError, match="differ in length"):
    training.make_mesh((2, 4), ("data",))


def test_steps_refuse_a_state_without_the_device_axis():
  """``tx.init(params)`` is one device's state: the steps name ``init_state`` instead."""
  params, loss_fn = _model_and_loss()
  mesh = training.make_mesh(8)
  tx = optax.chain(jaxcomp.topk(0.1, "data"), optax.sgd(0.1))
  step = training.make_step(loss_fn, tx, mesh, "data", donate=False)
  batch = training.shard(_batches(1)[0], mesh, "data")
  with pytest.raises(ValueError, match="per-device state of 8 devices.*init_state"):
    step(training.replicate(params, mesh), tx.init(params), batch)
  update = training.make_update(tx, mesh, "data")
  grads = jax.tree.map(lambda x: jnp.zeros((8,) + x.shape), params)
  with pytest.raises(ValueError, match="per-device state of 8 devices.*init_state"):
    update(grads, tx.init(params))
  updates, _ = update(grads, training.init_state(tx, params, mesh, "data"))
  assert not any(np.asarray(x).any() for x in jax.tree.leaves(updates))


def test_a_donating_update_writes_each_state_leaf_over_its_own_buffer():
  # jit hands a donated buffer to the first output of its shape: a scalar's
  # stacked update is shaped like its per-device residual and the count,
  # [devices], so the updates must not come first.
  params = {"b": jnp.zeros(5), "s": jnp.zeros(()), "w": jnp.zeros((4, 3))}
  mesh = training.make_mesh(8)
  tx = jaxcomp.topk(0.5, "data")
  state = training.init_state(tx, params, mesh, "data")
  grads = training.stack_per_device(params, mesh, "data")
  update = training.make_update(tx, mesh, "data", donate=True)
  text = update.lower(grads, state).compile().as_text()
  aliases = re.findall(r"\{(\d+)\}: \((\d+), \{\}", text.split("\n", 1)[0])
  num_grads, num_state = len(jax.tree.leaves(grads)), len(jax.tree.leaves(state))
  assert sorted((int(out), int(arg)) for out, arg in aliases) == [
      (i, num_grads + i) for i in range(num_state)]
  out, new_state = update(grads, state)
  chex.assert_trees_all_equal_shapes(out, grads)
  chex.assert_trees_all_equal_shapes(new_state, state)


@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd"])
def test_donated_residuals_are_updated_in_place(name):
  """No step copies a residual-sized buffer: each residual is written over its own."""
  params = {f"w{i}": jnp.zeros((512, 512)) for i in range(8)}
  mesh = training.make_mesh(1)
  config = {"density": 0.05} if name != "powersgd" else {"rank": 2}
  tx = optax.chain(registry.build(name, "data", **config), optax.sgd(0.1))
  state = training.init_state(tx, params, mesh, "data")

  def loss_fn(p, batch):
    x = batch["x"]
    for i in range(8):
      x = jnp.tanh(x @ p[f"w{i}"])
    return jnp.mean(x)

  batch = training.shard({"x": jnp.ones((2, 512))}, mesh, "data")
  step = training.make_step(loss_fn, tx, mesh, "data")
  text = step.lower(training.replicate(params, mesh), state, batch).compile().as_text()
  copies = [line for line in text.splitlines() if " copy(" in line and "512,512]" in line]
  assert not copies, copies


def test_init_state_refuses_momentum_after_dgc():
  params, _ = _model_and_loss()
  mesh = training.make_mesh(8)
  with pytest.raises(ValueError, match="`dgc` is followed by an optimizer with TraceState"):
    training.init_state(optax.chain(jaxcomp.dgc(0.1, "data"), optax.sgd(0.1, momentum=0.9)),
                        params, mesh, "data")
  state = training.init_state(optax.chain(jaxcomp.dgc(0.1, "data"), optax.sgd(0.1)),
                              params, mesh, "data")
  assert state[0].count.shape == (8,)
