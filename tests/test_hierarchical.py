"""Every compressor on the slow axis only, on a (2, 4) mesh ("dcn", "ici"), 8 fake CPU devices."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import harness
import jaxcomp
from experiments import shapes
from jaxcomp import protocol
from jaxcomp import registry
from jaxcomp import training
from jaxcomp import wire

AXES = ("dcn", "ici")
MESH_SHAPE = (2, 4)
PARAMS = {"conv": jnp.zeros((3, 3, 4, 8)), "w": jnp.zeros((18, 12)), "b": jnp.zeros((10,)),
          "s": jnp.zeros(())}
SMALL_MODEL = {"density": 0.2, "rank": 2, "levels": 4, "bucket_size": 32}


def _inner(name, **config):
  small = {k: v for k, v in SMALL_MODEL.items() if k in registry.get(name).defaults}
  return registry.build(name, "dcn", **small, **config)


def _grads(seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.normal(size=(8,) + x.shape).astype(np.float32), PARAMS)


@functools.lru_cache(maxsize=None)
def _run(name):
  mesh = training.make_mesh(MESH_SHAPE, AXES)
  tx = jaxcomp.hierarchical(_inner(name), "ici", 4)
  state = training.init_state(tx, PARAMS, mesh, AXES)
  update = training.make_update(tx, mesh, AXES)
  grads = training.shard(_grads(0), mesh, AXES)
  compiled = update.lower(grads, state).compile()
  out, state = jax.block_until_ready(update(grads, state))
  bad = _grads(1)
  bad["w"][6, 2, 3] = np.nan
  before = jax.tree.map(np.asarray, state)
  bad_out, bad_state = jax.block_until_ready(update(training.shard(bad, mesh, AXES), state))
  return dict(tx=tx, compiled=compiled, out=out, state=state, before=before,
              bad_out=bad_out, bad_state=bad_state)


def test_dense_inner_gives_the_mean_over_the_whole_mesh():
  out = _run("allreduce")["out"]
  grads = _grads(0)
  for name in PARAMS:
    want = grads[name].mean(axis=0)
    for device in range(8):
      np.testing.assert_allclose(np.asarray(out[name][device]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", registry.names())
def test_every_compressor_on_the_shard_same_on_every_device(name):
  out = _run(name)["out"]
  for leaf in jax.tree.leaves(out):
    leaf = np.asarray(leaf)
    assert np.isfinite(leaf).all()
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))


@pytest.mark.parametrize("name", registry.names())
def test_state_is_sized_to_the_shard(name):
  state = _run(name)["state"].inner_state
  residual = getattr(state, "residual", ())
  if not jax.tree.leaves(residual):
    return
  # Rows of each leaf's matrix view, cut into 4 blocks: conv (36, 8) -> (9, 8),
  # w (18, 12) -> (5, 12) (padded), b (10,) -> (3,), a scalar -> (1,); fused
  # into one flat residual per device, the 8 devices' one after the other.
  assert residual.shape == (8 * (9 * 8 + 5 * 12 + 3 + 1),)
  rows = protocol.as_tree(_inner(name), residual.reshape(8, -1),
                          training.shard_shapes(PARAMS, 4))
  shapes = {k: v.shape for k, v in rows.items()}
  assert shapes == {"conv": (8, 9, 8), "w": (8, 5, 12), "b": (8, 3), "s": (8, 1)}


@pytest.mark.parametrize("name", registry.names())
def test_bytes_read_from_the_program_equal_the_formula(name):
  run = _run(name)
  read = wire.collective_bytes(run["compiled"])
  formula = wire.expected_bytes(run["tx"], PARAMS, {"dcn": 2, "ici": 4})
  assert read.by_branch == formula.by_branch
  # The fast and the slow links apart: the dense reduce-scatter and all-gather
  # on "ici", the compressor's collectives on "dcn" only.
  per_axis = wire.collective_bytes(run["compiled"], mesh_shape={"dcn": 2, "ici": 4}).by_axes
  assert per_axis == formula.by_axes
  assert set(per_axis) == {("dcn",), ("ici",)}


@pytest.mark.parametrize("name", registry.names())
def test_non_finite_on_one_device_poisons_every_mean_and_no_shard_state(name):
  run = _run(name)
  for device in range(8):
    assert not all(np.isfinite(np.asarray(x[device])).all()
                   for x in jax.tree.leaves(run["bad_out"]))
  for got, was in zip(jax.tree.leaves(run["bad_state"]), jax.tree.leaves(run["before"])):
    np.testing.assert_array_equal(np.asarray(got), was)


def test_slow_link_bytes_of_sparse_methods_fall_with_the_fast_axis():
  """gTop-k on the slow axis sends the k of a 1/X shard: 1/X of the flat method's."""
  shapes = {"w": jax.ShapeDtypeStruct((4096, 1024), jnp.float32)}
  flat = wire.expected_bytes(jaxcomp.gtopk(1e-3, "dcn"), shapes, 2).total
  nested = wire.expected_bytes(jaxcomp.hierarchical(jaxcomp.gtopk(1e-3, "dcn"), "ici", 4),
                               shapes, {"dcn": 2, "ici": 4})
  slow = nested.by_axes[("dcn",)]
  assert flat == 8 * math.ceil(1e-3 * 4096 * 1024)  # one round of k values and indices
  assert slow == 8 * math.ceil(1e-3 * 4096 * 1024 / 4)


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_a_low_rank_mean_is_gathered_as_its_factors(name):
  """The fast axis gathers each shard's P, Q and dense mean, not the shard's mean
  (the per-axis test above holds the compiled program to this formula)."""
  shapes = {"w": jax.ShapeDtypeStruct((4096, 1024), jnp.float32),
            "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
  tx = jaxcomp.hierarchical(registry.build(name, "dcn", rank=4), "ici", 4)
  gathers = [t for t in wire.transfers(tx, shapes, {"dcn": 2, "ici": 4})
             if t.kind == wire.Kind.ALL_GATHER.value and t.axes == ("ici",)]
  # a shard: the 1024 x 1024 row block at rank 4, and 256 elements of the bias
  factors = 4 * (1024 + 1024) + 256
  assert [t.bytes for t in gathers] == [wire.ring_bytes(wire.Kind.ALL_GATHER, 4, 4 * factors * 4)]


def _through_the_fused_path(tx, compact=False):
  """``tx`` with its ``update`` done by its spec's :class:`jaxcomp.protocol.Fused` path;
  ``compact``: the mean gathered as its message and decoded in a batch, as the hierarchy does."""
  fused = protocol.spec(tx).fused

  def update(updates, state, params=None):
    del params

    def exchange(index, bucket, after, compress):
      del index, after  # one exchange per bucket here, in order
      mean, out = compress(bucket.flatten(updates))
      if compact:
        decoded = jax.vmap(functools.partial(fused.message.decode, bucket))(mean[None])
        mean = jnp.concatenate([m[0].reshape(-1) for m in decoded])
      return (bucket, mean), out

    results, new_state, _ = fused.update(updates, state, exchange, compact=compact)
    for bucket, mean in results:
      updates = bucket.unflatten(mean, like=updates)
    return updates, new_state

  return optax.GradientTransformation(tx.init, update)


# A bf16 leaf, and buckets, each on its own: together they add nothing either misses. Nor
# does an all-f32 tree in one bucket: its leaves are the bf16 case's others, in one bucket
# with them, and the buckets' case is all f32.
@pytest.mark.parametrize("dtype,cap", [(jnp.bfloat16, None), (jnp.float32, 1e-4)],
                         ids=["bf16_leaf-one_bucket", "f32-buckets"])
@pytest.mark.parametrize("name", registry.names())
def test_the_fused_path_is_the_update_of_the_same_leaves(name, dtype, cap):
  """Flat in, flat out (what the hierarchy hands over): the same bits as ``update``,
  outputs and states, over three steps (ACP-SGD's two kinds, then a NaN skipped);
  a low-rank mean also as its gathered factors, decoded. With buckets of about 100
  bytes too, bucket by bucket."""
  params = {**PARAMS, "h": jnp.zeros((6, 5), dtype)}
  mesh = training.make_mesh((2,), ("dcn",))
  tx = _inner(name, bucket_cap_mb=cap)
  if cap is not None:
    assert len(protocol.spec(tx).fused.plan(params)) > 2
  candidates = [tx, _through_the_fused_path(tx)]
  if protocol.spec(tx).fused.message is not None:
    candidates.append(_through_the_fused_path(tx, compact=True))
  results = []
  for candidate in candidates:
    update = training.make_update(candidate, mesh, "dcn")
    state = training.init_state(candidate, params, mesh, "dcn")
    outs = []
    for seed in range(3):
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype),
                           harness.per_device_normal(params, seed, devices=2), params)
      if seed == 2:
        grads["w"] = grads["w"].at[1, 0, 0].set(jnp.nan)
      out, state = jax.block_until_ready(update(training.shard(grads, mesh, "dcn"), state))
      outs.append(out)
    results.append((outs, state))
  want = results[0]
  for got in results[1:]:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      harness.assert_bitwise_equal(got_leaf, want_leaf)


def _without_message(tx):
  """``tx`` with its :class:`jaxcomp.protocol.Fused` path stripped of its message: a
  hierarchy around it gathers every shard's mean, as it did before factors were gathered."""
  spec = protocol.spec(tx)

  def update(updates, state, params=None):
    return tx.update(updates, state, params)

  protocol.attach_spec(update, dataclasses.replace(
      spec, fused=dataclasses.replace(spec.fused, message=None)))
  return optax.GradientTransformation(tx.init, update)


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_gathered_factors_give_every_device_the_gathered_means(name):
  """On the (2, 4) mesh, over two steps (ACP-SGD's two kinds): the X shards' products
  formed from the gathered factors are, bit for bit and in the same rows, the means a
  gather of the means hands over, and so are the states."""
  params = {"w": jnp.zeros((40, 32)), "conv": jnp.zeros((3, 3, 4, 8)), "b": jnp.zeros((10,))}
  mesh = training.make_mesh(MESH_SHAPE, AXES)
  results = []
  for inner in (_inner(name), _without_message(_inner(name))):
    tx = jaxcomp.hierarchical(inner, "ici", 4)
    update = training.make_update(tx, mesh, AXES)
    state = training.init_state(tx, params, mesh, AXES)
    outs = []
    for seed in range(2):
      grads = training.shard(harness.per_device_normal(params, seed, devices=8), mesh, AXES)
      out, state = jax.block_until_ready(update(grads, state))
      outs.append(out)
    results.append((outs, state))
  (got, got_state), (want, want_state) = results
  assert protocol.spec(_inner(name)).fused.message is not None
  for got_leaf, want_leaf in zip(jax.tree.leaves((got, got_state)),
                                 jax.tree.leaves((want, want_state))):
    harness.assert_bitwise_equal(got_leaf, want_leaf)


def test_only_a_method_with_a_message_hands_over_a_compact_mean():
  fused = protocol.spec(jaxcomp.gtopk(0.1, "dcn")).fused
  assert fused.message is None
  with pytest.raises(ValueError, match="`compact` needs a method with a message"):
    fused.update({"w": jnp.zeros(4)}, None, None, compact=True)
  for name in ("powersgd", "acpsgd"):
    assert protocol.spec(registry.build(name, "dcn")).fused.message is not None


def test_chains_and_trains():
  mesh = training.make_mesh(MESH_SHAPE, AXES)
  tx = optax.chain(jaxcomp.hierarchical(jaxcomp.gtopk(0.3, "dcn"), "ici", 4),
                   optax.sgd(0.1, momentum=0.9))

  def loss_fn(params, batch):
    return sum(jnp.mean((p[None] - b) ** 2) for p, b in
               zip(jax.tree.leaves(params), jax.tree.leaves(batch)))

  params = training.replicate(PARAMS, mesh)
  state = training.init_state(tx, PARAMS, mesh, AXES)
  step = training.make_step(loss_fn, tx, mesh, AXES)
  batch = training.shard(jax.tree.map(lambda x: np.concatenate([x, x]), _grads(3)), mesh, AXES)
  losses = []
  for _ in range(5):
    params, state, metrics = jax.block_until_ready(step(params, state, batch))
    losses.append(float(np.mean(np.asarray(metrics["loss"]))))
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("call,error,message", [
    (lambda: jaxcomp.hierarchical(optax.sgd(0.1), "ici", 4), TypeError, "jaxcomp compressor"),
    (lambda: jaxcomp.hierarchical(jaxcomp.hierarchical(jaxcomp.topk(0.1, "dcn"), "ici", 4),
                                  "pod", 2), TypeError, "not a hierarchical one"),
    (lambda: jaxcomp.hierarchical(jaxcomp.topk(0.1, "ici"), "ici", 4), ValueError,
     "also the compressor's axis"),
    (lambda: jaxcomp.hierarchical(jaxcomp.topk(0.1, "dcn"), "ici", 0), ValueError,
     r"`fast_size` must be in \[1, inf\)"),
    (lambda: jaxcomp.hierarchical(jaxcomp.topk(0.1, "dcn"), "ici", 4, fast_dtype=jnp.int8),
     TypeError, "fast_dtype"),
])
def test_bad_arguments(call, error, message):
  with pytest.raises(error, match=message):
    call()


def test_a_fast_size_unlike_the_mesh_is_named_at_first_trace():
  mesh = training.make_mesh(MESH_SHAPE, AXES)
  tx = jaxcomp.hierarchical(jaxcomp.topk(0.5, "dcn"), "ici", 2)
  state = training.init_state(tx, PARAMS, mesh, AXES)
  with pytest.raises(ValueError, match=r"`fast_size` is 2 but the mesh axis 'ici' has 4"):
    training.make_update(tx, mesh, AXES)(training.shard(_grads(0), mesh, AXES), state)


def test_sixteen_bits_on_the_fast_axis_halve_its_bytes():
  mesh = training.make_mesh(MESH_SHAPE, AXES)
  f32 = jaxcomp.hierarchical(jaxcomp.allreduce("dcn"), "ici", 4)
  bf16 = jaxcomp.hierarchical(jaxcomp.allreduce("dcn"), "ici", 4, fast_dtype=jnp.bfloat16)
  sizes = {"dcn": 2, "ici": 4}
  wide, narrow = (wire.expected_bytes(tx, PARAMS, sizes) for tx in (f32, bf16))
  assert narrow.by_kind["all-to-all"] * 2 == wide.by_kind["reduce-scatter"]
  assert narrow.by_kind["all-gather"] * 2 == wide.by_kind["all-gather"]
  state = training.init_state(bf16, PARAMS, mesh, AXES)
  update = training.make_update(bf16, mesh, AXES)
  grads = training.shard(_grads(0), mesh, AXES)
  assert wire.collective_bytes(update.lower(grads, state).compile()).by_kind == narrow.by_kind
  out, _ = jax.block_until_ready(update(grads, state))
  for name in PARAMS:  # bf16 keeps 8 bits of mantissa, twice rounded
    np.testing.assert_allclose(np.asarray(out[name][0]), _grads(0)[name].mean(axis=0),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tx", [
    jaxcomp.gtopk(1e-3, "dcn"),
    jaxcomp.dgc(1e-3, "dcn", sparse_leaves="all"),
], ids=["gtopk", "dgc"])
def test_slow_link_bytes_at_density_1e3_are_under_1_300_of_dense(tx):
  resnet = shapes.resnet50()
  sizes = {"dcn": 2, "ici": 4}
  dense = wire.expected_bytes(jaxcomp.hierarchical(jaxcomp.allreduce("dcn"), "ici", 4),
                              resnet, sizes).by_axes
  sparse = wire.expected_bytes(jaxcomp.hierarchical(tx, "ici", 4), resnet, sizes).by_axes
  assert sparse[("dcn",)] * 300 <= dense[("dcn",)]
  # The fast links carry the same dense traffic, and the int32 flag of whether
  # every shard keeps its step.
  assert sparse[("ici",)] == dense[("ici",)] + wire.ring_bytes("all-reduce", 4, 4)
