"""The contract every compressor keeps, one suite over all of them (8 fake CPU devices).

Init outside any mesh into plain numeric arrays; bf16 in, bf16 out, in one
trace, with a state whose structure, dtypes and shapes never change; the
same mean on every device; chained in front of ``optax.sgd``,
``optax.adamw`` and inside ``optax.MultiSteps``. What each method computes is
tested in its own module; the reliability suite trains them end to end.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import training

# A conv kernel and two dense kernels (low rank pays), a bias and a small
# matrix (sent dense by the low-rank methods and, by default, by DGC).
PARAMS = {
    "conv": jnp.zeros((3, 3, 4, 8)),
    "dense": {"kernel": jnp.zeros((16, 12)), "bias": jnp.zeros((12,))},
    "dense2": jnp.zeros((16, 12)),
    "small": jnp.zeros((2, 3)),
}

COMPRESSORS = {
    "allreduce": lambda: jaxcomp.allreduce("data"),
    "cast": lambda: jaxcomp.cast(jnp.bfloat16, "data"),
    "topk": lambda: jaxcomp.topk(0.2, "data"),
    "topk_no_error_feedback": lambda: jaxcomp.topk(0.2, "data", error_feedback=False),
    "gtopk": lambda: jaxcomp.gtopk(0.2, "data"),
    "randomk": lambda: jaxcomp.randomk(0.2, "data", seed=3),
    "dgc": lambda: jaxcomp.dgc(0.1, "data", clip_norm=10.0, warmup_steps=4, sample_ratio=0.5),
    "signsgd": lambda: jaxcomp.signsgd("data"),
    "signsgd_majority": lambda: jaxcomp.signsgd("data", majority_vote=True),
    "powersgd": lambda: jaxcomp.powersgd(2, "data"),
    "powersgd_cold": lambda: jaxcomp.powersgd(2, "data", warm_start=False),
    "acpsgd": lambda: jaxcomp.acpsgd(2, "data"),
}
OPTIMIZERS = {
    "sgd": lambda name: optax.sgd(0.05) if name == "dgc" else optax.sgd(0.05, momentum=0.9),
    "adamw": lambda name: optax.adamw(1e-2),
}


def _per_device_normal(seed, dtype=jnp.float32, devices=8):
  leaves, treedef = jax.tree.flatten(PARAMS)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      jax.random.normal(k, (devices,) + x.shape).astype(dtype) for k, x in zip(keys, leaves)])


def _assert_same_on_devices(tree):
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))


@pytest.mark.parametrize("name", COMPRESSORS)
def test_init_outside_a_mesh_into_plain_arrays(name):
  state = COMPRESSORS[name]().init(jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS))
  assert type(state).__name__.endswith("State")
  for leaf in jax.tree.leaves(state):
    assert isinstance(leaf, jax.Array) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32  # residuals, momenta and factors keep f32
  if "count" in state._fields:
    assert state.count.dtype == jnp.int32 and state.count.shape == ()
  if "rng_key" in state._fields:
    assert state.rng_key.dtype == jnp.uint32


@pytest.mark.parametrize("name", COMPRESSORS)
def test_bf16_in_bf16_out_in_one_trace_with_a_stable_state(name):
  mesh = training.make_mesh(8)
  tx = COMPRESSORS[name]()
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  state = first = training.init_state(tx, params, mesh, "data")
  chex.clear_trace_counter()
  step = training.make_update(tx, mesh, "data", wrap=lambda f: chex.assert_max_traces(f, n=1))
  for seed in (1, 2):
    grads = training.shard(_per_device_normal(seed, jnp.bfloat16), mesh, "data")
    out, state = step(grads, state)
    chex.assert_trees_all_equal_structs(out, params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(out))
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(out))
    _assert_same_on_devices(out)
  chex.assert_trees_all_equal_structs(state, first)
  chex.assert_trees_all_equal_dtypes(state, first)
  chex.assert_trees_all_equal_shapes(state, first)
  if "count" in state._fields:
    np.testing.assert_array_equal(np.asarray(state.count), np.full(8, 2))


@pytest.mark.parametrize("optimizer", [*OPTIMIZERS, "multisteps"])
@pytest.mark.parametrize("name", COMPRESSORS)
def test_chains_into_optimizers(name, optimizer):
  if optimizer == "multisteps":
    tx = optax.MultiSteps(optax.chain(COMPRESSORS[name](), OPTIMIZERS["sgd"](name)),
                          every_k_schedule=2)
  else:
    tx = optax.chain(COMPRESSORS[name](), OPTIMIZERS[optimizer](name))
  mesh = training.make_mesh(8)

  def loss_fn(params, batch):
    return sum(jnp.mean(jnp.sum((p[None] - b) ** 2, axis=tuple(range(1, b.ndim))))
               for p, b in zip(jax.tree.leaves(params), jax.tree.leaves(batch)))

  params = training.replicate(PARAMS, mesh)
  state = training.init_state(tx, PARAMS, mesh, "data")
  step = training.make_step(loss_fn, tx, mesh, "data")
  batch = training.shard(_per_device_normal(4, devices=16), mesh, "data")
  losses = []
  for _ in range(4):
    params, state, metrics = step(params, state, batch)
    assert np.asarray(metrics["finite"]).all()
    losses.append(float(np.mean(metrics["loss"])))
  assert losses[-1] < losses[0], losses
  # The step donated the replicated copy, never the caller's own arrays.
  assert not any(x.is_deleted() for x in jax.tree.leaves(PARAMS))
