"""The shared path: a method written the way a newcomer would, the Spec search, the channel."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import protocol
from jaxcomp import training
from jaxcomp import wire

PARAMS = {"w": jnp.zeros((6, 4)), "b": jnp.zeros((4,))}


class HalfState(NamedTuple):
  count: jax.Array
  residual: optax.Params


def half(axis_name):
  """A toy method: every device sends half of its corrected gradient, densely."""

  def step(ctx, corrected, state):
    del state
    sent = corrected / 2
    return protocol.Output(mean=ctx.mean(sent), residual=corrected - sent)

  return protocol.compressor(protocol.Method(
      name="half", config={"axis_name": axis_name}, axes=(axis_name,), state=HalfState,
      step=step, wire=lambda bucket, sizes, steps: wire.mean(bucket.size, sizes),
      error_feedback=True))


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
  rows = training.device_rows(state, jax.eval_shape(tx.init, PARAMS))
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


@pytest.mark.parametrize("wrap", [
    lambda tx: tx,
    lambda tx: optax.chain(tx, optax.sgd(0.1)),
    lambda tx: optax.chain(optax.clip(1.0), optax.chain(tx, optax.adam(1e-3))),
    lambda tx: optax.named_chain(("compress", tx), ("sgd", optax.sgd(0.1))),
    lambda tx: optax.MultiSteps(optax.chain(tx, optax.sgd(0.1)), 4),
    lambda tx: optax.MultiSteps(optax.chain(tx, optax.sgd(0.1)), 4).gradient_transformation(),
    lambda tx: optax.masked(tx, {"w": True, "b": False}),
], ids=["alone", "chain", "nested", "named_chain", "multisteps", "multisteps_gt", "masked"])
def test_find_specs_sees_through_optax_wrappers(wrap):
  tx = jaxcomp.gtopk(0.25, "data")
  specs = protocol.find_specs(wrap(tx))
  assert [s.name for s in specs] == ["gtopk"]
  assert specs[0].config == {"density": 0.25, "axis_name": "data"}
  assert specs[0] is protocol.spec(tx)


def test_find_specs_of_plain_optax_is_empty_and_keeps_the_order():
  assert protocol.find_specs(optax.adamw(1e-3)) == []
  both = optax.chain(jaxcomp.topk(0.1, "data"), jaxcomp.signsgd("data"))
  assert [s.name for s in protocol.find_specs(both)] == ["topk", "signsgd"]


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


def test_a_seed_needs_a_key_field():
  method = protocol.Method(
      name="bad", config={}, axes=("data",), state=HalfState,
      step=lambda ctx, c, s: protocol.Output(mean=c), wire=lambda b, s, t: (), seed=0)
  with pytest.raises(ValueError, match="rng_key"):
    protocol.compressor(method)
