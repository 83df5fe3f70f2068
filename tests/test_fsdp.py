"""The FSDP step (``jaxcomp/_src/fsdp.py``): parameters sharded over the fast axis,
each compressor over the slow axis on its shard; the skip, checkpoints and bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp._src import fusion
from jaxcomp._src import hierarchical as hierarchical_lib
from jaxcomp import protocol
from jaxcomp import registry
from jaxcomp import training
from jaxcomp import wire

FSDP_AXES = ("dcn", "ici")


def _fsdp_problem():
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(10, 6)).astype(np.float32), "b": np.zeros(6, np.float32)}
  batch = {"x": rng.normal(size=(64, 10)).astype(np.float32),
           "y": rng.normal(size=(64, 6)).astype(np.float32)}
  return params, batch


def _fsdp_loss(p, batch):
  return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)


def _fsdp_run(tx, steps, bad_step=None):
  mesh = training.make_mesh((2, 4), FSDP_AXES)
  params, batch = _fsdp_problem()
  shard = training.shard_params(params, mesh, "ici")
  state = training.init_fsdp_state(tx, params, mesh, "dcn", "ici")
  step = training.make_fsdp_step(_fsdp_loss, tx, mesh, "dcn", "ici", params)
  history = []
  for i in range(steps):
    local = dict(batch)
    if i == bad_step:
      local["x"] = local["x"].copy()
      local["x"][40] = np.nan  # one example of device 5's part of the batch
    before = jax.tree.map(np.asarray, shard)
    shard, state, metrics = jax.block_until_ready(
        step(shard, state, training.shard(local, mesh, FSDP_AXES)))
    history.append((before, jax.tree.map(np.asarray, shard), metrics))
  return params, shard, state, history


def test_fsdp_with_a_dense_exchange_equals_the_replicated_step():
  params, shard, _, _ = _fsdp_run(optax.chain(jaxcomp.allreduce("dcn"), optax.sgd(0.1)), 3)
  mesh = training.make_mesh((2, 4), FSDP_AXES)
  tx = optax.chain(jaxcomp.allreduce(FSDP_AXES), optax.sgd(0.1))
  replicated, state = training.replicate(params, mesh), training.init_state(tx, params, mesh,
                                                                           FSDP_AXES)
  step = training.make_step(_fsdp_loss, tx, mesh, FSDP_AXES)
  batch = training.shard(_fsdp_problem()[1], mesh, FSDP_AXES)
  for _ in range(3):
    replicated, state, _ = jax.block_until_ready(step(replicated, state, batch))
  got = training.gather_params(shard, params)
  for name in params:
    np.testing.assert_allclose(np.asarray(got[name]), np.asarray(replicated[name]),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", registry.names())
def test_fsdp_with_every_compressor_on_the_slow_axis(name):
  config = {k: v for k, v in {"density": 0.3, "rank": 1}.items()
            if k in registry.get(name).defaults}
  tx = optax.chain(registry.build(name, "dcn", **config), optax.sgd(0.05))
  params, shard, state, history = _fsdp_run(tx, 4)
  losses = [float(np.mean(np.asarray(m["loss"]))) for _, _, m in history]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  # The state is the shard's (the 10 x 6 kernel in 4 row blocks of 3): one
  # flat residual per device of a quarter of the (padded) parameters.
  if jax.tree.leaves(getattr(state[0], "residual", ())):
    assert state[0].residual.shape == (8 * sum(x.size // 4 for x in jax.tree.leaves(shard)),)
    rows = protocol.as_tree(registry.build(name, "dcn", **config),
                            state[0].residual.reshape(8, -1), training.shard_shapes(params, 4))
    assert rows["w"].shape == (8, 3, 6)
  # Both nodes hold the same row block on the same fast-axis position.
  for leaf in jax.tree.leaves(shard):
    blocks = {}
    for s in leaf.addressable_shards:
      blocks.setdefault(str(s.index), []).append(np.asarray(s.data))
    for copies in blocks.values():
      assert len(copies) == 2
      np.testing.assert_array_equal(copies[0], copies[1])


def test_fsdp_skips_a_non_finite_step_on_every_device():
  tx = optax.chain(jaxcomp.gtopk(0.3, "dcn"), optax.sgd(0.05))
  _, _, _, history = _fsdp_run(tx, 3, bad_step=1)
  before, after, metrics = history[1]
  assert not np.asarray(metrics["finite"]).any()
  for got, was in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(got, was)
  assert np.asarray(history[2][2]["finite"]).all()


def test_fsdp_checkpoint_resumes_bit_exactly_and_refuses_another_layout(tmp_path):
  tx = optax.chain(jaxcomp.topk(0.3, "dcn"), optax.sgd(0.05))
  mesh = training.make_mesh((2, 4), FSDP_AXES)
  params, batch = _fsdp_problem()
  step = training.make_fsdp_step(_fsdp_loss, tx, mesh, "dcn", "ici", params, donate=False)
  batch = training.shard(batch, mesh, FSDP_AXES)
  shard = training.shard_params(params, mesh, "ici")
  state = training.init_fsdp_state(tx, params, mesh, "dcn", "ici")
  shard, state, _ = jax.block_until_ready(step(shard, state, batch))
  training.save_checkpoint(tmp_path / "ckpt", shard, state, step=1)
  want_shard, want_state, _ = jax.block_until_ready(step(shard, state, batch))
  like_shard = training.shard_params(params, mesh, "ici")
  like_state = training.init_fsdp_state(tx, params, mesh, "dcn", "ici")
  got_shard, got_state, at = training.restore_checkpoint(
      tmp_path / "ckpt", like_shard, like_state, mesh, FSDP_AXES,
      params_spec=jax.sharding.PartitionSpec("ici"))
  assert at == 1
  got_shard, got_state, _ = jax.block_until_ready(step(got_shard, got_state, batch))
  for got, want in zip(jax.tree.leaves((got_shard, got_state)),
                       jax.tree.leaves((want_shard, want_state))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match=r"parameter \['b'\] of shape \[8\], but `params` has \[6\]"):
    training.restore_checkpoint(tmp_path / "ckpt", training.replicate(params, mesh), like_state,
                                mesh, FSDP_AXES)


@pytest.mark.parametrize("name", registry.names())
def test_fsdp_bytes_per_axis_equal_the_hierarchical_formula(name):
  """The parameters' all-gather and the gradient's reduce-scatter are the dense
  fast-axis transfers (those of ``jaxcomp.hierarchical`` but for a low-rank mean's
  gather); the compressor sends the shard's formula on the slow axis; the skip is one
  int32 all-reduce over both axes, in place of the hierarchy's int32 flag on the fast
  axis."""
  config = {k: v for k, v in {"density": 0.3, "rank": 1}.items()
            if k in registry.get(name).defaults}
  compressor = registry.build(name, "dcn", **config)
  tx = optax.chain(compressor, optax.sgd(0.05))
  mesh = training.make_mesh((2, 4), FSDP_AXES)
  params, batch = _fsdp_problem()
  step = training.make_fsdp_step(_fsdp_loss, tx, mesh, "dcn", "ici", params)
  compiled = step.lower(training.shard_params(params, mesh, "ici"),
                        training.init_fsdp_state(tx, params, mesh, "dcn", "ici"),
                        training.shard(batch, mesh, FSDP_AXES)).compile()
  read = wire.collective_bytes(compiled, mesh_shape=dict(mesh.shape)).by_axes
  formula = wire.tally(training.fsdp_transfers(compressor, params, dict(mesh.shape),
                                               "dcn", "ici")).by_axes
  assert read == formula
  hierarchical = wire.expected_bytes(jaxcomp.hierarchical(compressor, "ici", 4), params,
                                     dict(mesh.shape)).by_axes
  assert formula[("dcn",)] == hierarchical[("dcn",)]
  padded = 4 * fusion.Bucket.of(hierarchical_lib.shard_shapes(params, 4)).size
  dense = wire.tally(hierarchical_lib.dense_transfers(padded, "ici", 4)).by_axes[("ici",)]
  assert formula[("ici",)] == dense
  fused = protocol.spec(compressor).fused
  if fused.message is None:  # a low-rank hierarchy gathers factors, FSDP the parameters
    flag = 0 if fused.propagates_nonfinite else 6
    assert dense == hierarchical[("ici",)] - flag
  assert formula[FSDP_AXES] == wire.ring_bytes("all-reduce", 8, 4)
