"""The contract every compressor keeps, one suite over the registry (8 fake CPU devices).

Every method of :data:`jaxcomp.registry.METHODS` (and a few variants of them)
is run through the same checks, so a new method passes them by being
registered: init outside a mesh into plain arrays; bf16 in, bf16 out, in one
trace, with a stable state; the same mean on every device; bytes read from
the compiled program equal to the formula, on a ring and a torus; a NaN or
Inf on one device makes the mean non-finite everywhere and writes nothing
into any state; the mean of huge finite gradients stays finite; the same
bits through ``jax.pmap``; chaining into optax (and the refusal of a chain a
method forbids); odd trees (``float0`` and zero-size leaves, nothing to
send, complex leaves). What each method computes is tested in its own module.
"""

import functools
import inspect
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import protocol
from jaxcomp import registry
from jaxcomp import training
from jaxcomp import wire

# A conv kernel and two equal dense kernels (low rank pays), a bias and a small
# matrix (sent dense by the low-rank methods and, by default, by DGC).
PARAMS = {
    "conv": jnp.zeros((3, 3, 4, 8)),
    "dense": {"kernel": jnp.zeros((16, 12)), "bias": jnp.zeros((12,))},
    "dense2": jnp.zeros((16, 12)),
    "small": jnp.zeros((2, 3)),
}
# A model this small needs more than the papers' defaults to send anything.
SMALL_MODEL = {"density": 0.2, "rank": 2, "levels": 4, "bucket_size": 64}
VARIANTS = {
    "topk_no_error_feedback": ("topk", {"error_feedback": False}),
    "dgc_warmup_clip": ("dgc", {"density": 0.1, "clip_norm": 10.0, "warmup_steps": 4,
                                "sample_ratio": 0.5}),
    "signsgd_majority": ("signsgd", {"majority_vote": True}),
    "signsgd_blocks": ("signsgd", {"block_size": 16}),
    "qsgd_error_feedback": ("qsgd", {"error_feedback": True}),
    "powersgd_cold": ("powersgd", {"warm_start": False}),
    # Two buckets of PARAMS (1 KiB each): every check below holds bucket by bucket.
    "gtopk_buckets": ("gtopk", {"bucket_cap_mb": 1e-3}),
    "randomk_buckets": ("randomk", {"bucket_cap_mb": 1e-3}),
    "dgc_warmup_clip_buckets": ("dgc", {"density": 0.1, "clip_norm": 10.0, "warmup_steps": 4,
                                        "sample_ratio": 0.5, "bucket_cap_mb": 1e-3}),
    "acpsgd_buckets": ("acpsgd", {"bucket_cap_mb": 1e-3}),
}
CASES = {name: (name, {}) for name in registry.names()} | VARIANTS
MESHES = {"ring": (8, ("data",)), "torus": ((2, 4), ("x", "y"))}


def _config(case):
  name, extra = CASES[case]
  defaults = registry.get(name).defaults
  return name, {**{k: v for k, v in SMALL_MODEL.items() if k in defaults}, **extra}


def _make(case, axis):
  name, config = _config(case)
  return registry.build(name, axis, **config)


def _huge(tx) -> float:
  """The entry of the huge step: 1e38, or for QSGD, which sends each block's L2 norm as
  an f32, the entry whose block has norm 1e38 (the norm's reciprocal below f32's
  smallest normal)."""
  spec = protocol.spec(tx)
  return 1e38 / np.sqrt(spec.config["bucket_size"]) if spec.name == "qsgd" else 1e38


def _axis(names):
  return names[0] if len(names) == 1 else names


def _per_device_normal(seed, dtype=jnp.float32, devices=8, params=PARAMS, scale=1.0):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      (scale * jax.random.normal(k, (devices,) + x.shape)).astype(dtype)
      for k, x in zip(keys, leaves)])


def _rows_equal(tree):
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))


def _bits(tree):
  return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


@functools.lru_cache(maxsize=None)
def _run(case, mesh_name):
  """One compile on a mesh, then: a step, a step with NaN/Inf on device 3, a step of huge gradients."""
  shape, names = MESHES[mesh_name]
  axis = _axis(names)
  mesh = training.make_mesh(shape, names)
  tx = _make(case, axis)
  update = training.make_update(tx, mesh, axis)
  state = training.init_state(tx, PARAMS, mesh, axis)
  grads = training.shard(_per_device_normal(1), mesh, axis)
  compiled = update.lower(grads, state).compile()
  out, state = jax.block_until_ready(update(grads, state))
  bad = _per_device_normal(2)
  bad["dense"]["kernel"] = bad["dense"]["kernel"].at[3, 0, 0].set(
      np.nan if mesh_name == "ring" else np.inf)
  before = _bits(state)
  bad_out, bad_state = jax.block_until_ready(update(training.shard(bad, mesh, axis), state))
  huge = jax.tree.map(lambda x: jnp.full_like(x, _huge(tx)), _per_device_normal(3))
  huge_out, _ = jax.block_until_ready(update(training.shard(huge, mesh, axis), state))
  return dict(tx=tx, compiled=compiled, out=out, state=state, before=before,
              bad_out=bad_out, bad_state=bad_state, huge_out=huge_out)


@pytest.mark.parametrize("case", CASES)
def test_init_outside_a_mesh_into_plain_arrays(case):
  state = _make(case, "data").init(jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS))
  name, _ = CASES[case]
  assert type(state) is registry.get(name).state
  for leaf in jax.tree.leaves(state):
    assert isinstance(leaf, jax.Array) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32  # residuals, momenta and factors keep f32
  if "count" in state._fields:
    assert state.count.dtype == jnp.int32 and state.count.shape == ()
  if "rng_key" in state._fields:
    assert state.rng_key.dtype == jnp.uint32


@pytest.mark.parametrize("case", CASES)
def test_bf16_in_bf16_out_in_one_trace_with_a_stable_state(case):
  mesh = training.make_mesh(8)
  tx = _make(case, "data")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  state = first = training.init_state(tx, params, mesh, "data")
  chex.clear_trace_counter()
  step = training.make_update(tx, mesh, "data", wrap=lambda f: chex.assert_max_traces(f, n=1))
  for seed in (1, 2):
    grads = training.shard(_per_device_normal(seed, jnp.bfloat16), mesh, "data")
    out, state = jax.block_until_ready(step(grads, state))
    chex.assert_trees_all_equal_structs(out, params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(out))
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(out))
    _rows_equal(out)
  chex.assert_trees_all_equal_structs(state, first)
  chex.assert_trees_all_equal_dtypes(state, first)
  chex.assert_trees_all_equal_shapes(state, first)
  if "count" in state._fields:
    np.testing.assert_array_equal(np.asarray(state.count), np.full(8, 2))


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CASES)
def test_same_mean_on_every_device(case, mesh_name):
  run = _run(case, mesh_name)
  _rows_equal(run["out"])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(run["out"]))


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CASES)
def test_bytes_read_from_the_program_equal_the_formula(case, mesh_name):
  run = _run(case, mesh_name)
  shape = MESHES[mesh_name][0]
  read = wire.collective_bytes(run["compiled"])
  formula = wire.expected_bytes(run["tx"], PARAMS, shape)
  assert read.total > 0
  assert read.by_branch == formula.by_branch
  steady = wire.expected_bytes(run["tx"], PARAMS, shape, steps=1) == formula
  if steady:  # no schedule: the program's branch weights are the formula's
    assert read.by_kind == formula.by_kind
    # and every byte is read on the mesh axes it crosses: on a ring, the
    # formula's own axis; on a torus, rows and columns apart.
    sizes, names = MESHES[mesh_name]
    mesh_shape = dict(zip(names, sizes if isinstance(sizes, tuple) else (sizes,)))
    by_axes = wire.collective_bytes(run["compiled"], mesh_shape=mesh_shape).by_axes
    assert by_axes == formula.by_axes
    assert sum(by_axes.values()) == formula.total
    if len(names) == 1:
      assert by_axes == {names: formula.total}
  # Through any chain, the same formula.
  chained = optax.chain(run["tx"], optax.sgd(0.1))
  assert wire.expected_bytes(chained, PARAMS, shape) == formula


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CASES)
def test_non_finite_on_one_device_poisons_every_mean_and_no_state(case, mesh_name):
  run = _run(case, mesh_name)
  for device in range(8):
    assert not all(np.isfinite(np.asarray(x[device])).all()
                   for x in jax.tree.leaves(run["bad_out"])), f"device {device}"
  for got, was in zip(_bits(run["bad_state"]), run["before"]):
    np.testing.assert_array_equal(got, was)


# Where XLA:CPU reduces with its vectorised kernels (whose ``max`` drops a
# NaN): a bucket of 16,384 entries, every method at its papers' defaults.
LARGE = {"kernel": jnp.zeros((128, 128))}
# (device, flat position, value): the first and the last entry, a block's
# last entry and one inside a block, NaN of both signs and both infinities.
STRIKES = ((3, 0, np.nan), (0, 63, -np.inf), (7, 4113, np.inf), (5, 16383, -np.nan))


@pytest.mark.parametrize("name", registry.names())
def test_a_non_finite_entry_anywhere_in_a_large_bucket_skips_the_step(name):
  mesh = training.make_mesh(8)
  tx = registry.build(name, "data")
  update = training.make_update(tx, mesh, "data")
  state = training.init_state(tx, LARGE, mesh, "data")
  # From a state the method made (residuals, momenta, factors): what a skip keeps.
  _, state = jax.block_until_ready(update(training.shard(
      _per_device_normal(1, params=LARGE), mesh, "data"), state))
  before = _bits(state)
  for device, position, value in STRIKES:
    grads = _per_device_normal(2, params=LARGE)
    flat = grads["kernel"].reshape(8, -1).at[device, position].set(value)
    out, after = jax.block_until_ready(update(training.shard(
        {"kernel": flat.reshape(grads["kernel"].shape)}, mesh, "data"), state))
    assert not np.isfinite(np.asarray(out["kernel"])).all(axis=(1, 2)).any(), (device, position)
    for got, was in zip(_bits(after), before):
      np.testing.assert_array_equal(got, was)


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CASES)
def test_huge_finite_gradients_give_a_finite_mean(case, mesh_name):
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(_run(case, mesh_name)["huge_out"])]
  for leaf in leaves:
    assert np.isfinite(leaf).all()
  # Not a silent zero (QSGD at 1e38 entries, before its norms were scaled exactly).
  assert max(np.abs(leaf).max() for leaf in leaves) > 0


@pytest.mark.parametrize("case", CASES)
def test_pmap_gives_the_shard_map_bits(case):
  run = _run(case, "ring")
  tx = run["tx"]
  pmapped = jax.pmap(tx.update, axis_name="data")
  state = jax.tree.map(lambda x: jnp.stack([x] * 8), tx.init(PARAMS))
  out, _ = jax.block_until_ready(pmapped(_per_device_normal(1), state))
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(run["out"])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.05),
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2),
    "multisteps": lambda: None,
}


def _loss_fn(params, batch):
  return sum(jnp.mean(jnp.sum((p[None] - b) ** 2, axis=tuple(range(1, b.ndim))))
             for p, b in zip(jax.tree.leaves(params), jax.tree.leaves(batch)))


def _chain_cases():
  """Every case before plain SGD; every method inside ``optax.MultiSteps`` (its
  update under a ``lax.cond``); the optimizers with state only where a method
  refuses them after it (every method trains before adamw in
  ``tests/test_reliability.py``).
  """
  for case, (name, _) in CASES.items():
    for optimizer in OPTIMIZERS:
      refused = registry.get(name).forbids_after and optimizer in ("sgd_momentum", "adamw")
      if optimizer == "sgd" or (case in registry.names()
                                and (optimizer == "multisteps" or refused)):
        yield case, optimizer


@pytest.mark.parametrize("case,optimizer", list(_chain_cases()))
def test_chains_into_optimizers_or_is_refused_clearly(case, optimizer):
  method = registry.get(CASES[case][0])
  if optimizer == "multisteps":
    tx = optax.MultiSteps(optax.chain(_make(case, "data"), optax.sgd(0.05)), every_k_schedule=2)
  else:
    tx = optax.chain(_make(case, "data"), OPTIMIZERS[optimizer]())
  mesh = training.make_mesh(8)
  forbidden = method.forbids_after and optimizer in ("sgd_momentum", "adamw")
  if forbidden:
    with pytest.raises(ValueError, match=re.escape(method.requirement)):
      training.init_state(tx, PARAMS, mesh, "data")
    return
  params = training.replicate(PARAMS, mesh)
  state = training.init_state(tx, PARAMS, mesh, "data")
  step = training.make_step(_loss_fn, tx, mesh, "data")
  batch = training.shard(_per_device_normal(4, devices=16), mesh, "data")
  losses = []
  for _ in range(4):
    params, state, metrics = jax.block_until_ready(step(params, state, batch))
    assert np.asarray(metrics["finite"]).all()
    losses.append(float(np.mean(np.asarray(metrics["loss"]))))
  assert losses[-1] < losses[0], losses
  # The step donated the replicated copy, never the caller's own arrays.
  assert not any(x.is_deleted() for x in jax.tree.leaves(PARAMS))


# ------------------------------------------------- optax.inject_hyperparams


def _injectable(name):
  """``(factory, config, numbers)``: ``numbers`` names what ``optax.inject_hyperparams``
  turns into arrays: every numeric argument, defaults included."""
  factory = registry.get(name).factory
  config = registry.configuration(name, **_config(name)[1])
  bound = inspect.signature(factory).bind(axis_name="data", **config)
  bound.apply_defaults()
  return factory, config, tuple(k for k, v in bound.arguments.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool))


@pytest.mark.parametrize("name", registry.names())
def test_inject_hyperparams_refuses_arrays_as_static_or_builds_with_static_args(name):
  factory, config, numeric = _injectable(name)
  injected = optax.inject_hyperparams(factory)(axis_name="data", **config)
  if numeric:
    with pytest.raises(TypeError, match=r"must be a Python value, got a JAX array.*"
                       r"hyperparameters are static.*static_args") as refused:
      injected.init(PARAMS)
    assert re.match(r"`(\w+)`", str(refused.value)).group(1) in numeric
  else:  # nothing numeric to inject: the compressor as it is
    injected.init(PARAMS)
  tx = optax.inject_hyperparams(factory, static_args=numeric)(axis_name="data", **config)
  assert type(tx.init(PARAMS).inner_state) is registry.get(name).state


@pytest.mark.parametrize("name", ["dgc", "topk", "powersgd", "qsgd"])
def test_inject_hyperparams_with_static_args_gives_the_compressor_s_mean(name):
  factory, config, numeric = _injectable(name)
  tx = optax.inject_hyperparams(factory, static_args=numeric)(axis_name="data", **config)
  mesh = training.make_mesh(8)
  state = training.init_state(tx, PARAMS, mesh, "data")
  grads = training.shard(_per_device_normal(1), mesh, "data")
  out, state = jax.block_until_ready(training.make_update(tx, mesh, "data")(grads, state))
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(_run(name, "ring")["out"])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(state.inner_state.count), np.ones(8))


@pytest.mark.parametrize("build, argument", [
    (lambda: jaxcomp.powersgd(2, "data", warm_start=jnp.asarray(True)), "warm_start"),
    (lambda: jaxcomp.randomk(0.01, "data", seed=jnp.asarray(3, jnp.uint32)), "seed"),
    (lambda: jax.jit(lambda d: jaxcomp.topk(d, "data").init(PARAMS))(0.1), "density"),
    (lambda: jax.jit(lambda c: jaxcomp.dgc(0.1, "data", clip_norm=c).init(PARAMS))(1.0),
     "clip_norm"),
], ids=["bool", "seed", "traced_density", "traced_optional"])
def test_a_jax_array_hyperparameter_is_refused_as_static(build, argument):
  with pytest.raises(TypeError, match=rf"`{argument}` must be a Python value, got a JAX array"
                     r".*static.*static_args"):
    build()


# ----------------------------------------------------------- odd trees

ODD = {"w": jnp.zeros((6, 4)), "int": jnp.zeros((3,), jnp.int32), "none": jnp.zeros((0, 5)),
       "b": jnp.zeros((4,))}


def _odd_grads(params, devices=8):
  """Gaussian gradients for float leaves, float0 for integer ones, with a device axis."""
  def leaf(i, x):
    if jnp.issubdtype(x.dtype, jnp.integer):
      return np.zeros((devices,) + x.shape, jax.dtypes.float0)
    return jax.random.normal(jax.random.key(i), (devices,) + x.shape)
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [leaf(i, x) for i, x in enumerate(leaves)])


def _update_once(tx, params, grads):
  mesh = training.make_mesh(8)
  state = training.init_state(tx, params, mesh, "data")
  update = training.make_update(tx, mesh, "data")
  return jax.block_until_ready(update(grads, state)), state


@pytest.mark.parametrize("case", CASES)
def test_float0_and_zero_size_leaves_pass_through_untouched(case):
  grads = _odd_grads(ODD)
  (out, state), _ = _update_once(_make(case, "data"), ODD, grads)
  assert out["int"].dtype == jax.dtypes.float0 and out["int"].shape == (8, 3)
  assert out["none"].shape == (8, 0, 5)
  assert np.isfinite(np.asarray(out["w"])).all() and np.abs(np.asarray(out["w"])).sum() > 0
  _rows_equal({"w": out["w"], "b": out["b"]})


@pytest.mark.parametrize("case", CASES)
def test_nothing_to_send_is_a_no_op(case):
  tx = _make(case, "data")
  frozen = optax.masked(tx, {"w": False, "b": False})
  params = {"w": jnp.zeros((6, 4)), "b": jnp.zeros((4,))}
  grads = _per_device_normal(5, params=params)
  (out, state), before = _update_once(frozen, params, grads)
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(grads)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  (out, _), _ = _update_once(tx, {}, {})
  assert out == {}
  empty = {"none": jnp.zeros((0, 3))}
  (out, state), _ = _update_once(tx, empty, {"none": jnp.zeros((8, 0, 3))})
  assert out["none"].shape == (8, 0, 3)
  if "count" in getattr(state, "_fields", ()):
    np.testing.assert_array_equal(np.asarray(state.count), np.ones(8))


@pytest.mark.parametrize("case", CASES)
def test_complex_leaf_is_refused_by_name(case):
  params = {"w": jnp.zeros((6, 4)), "z": jnp.zeros((4,), jnp.complex64)}
  grads = {"w": jnp.ones((8, 6, 4)), "z": jnp.ones((8, 4), jnp.complex64)}
  with pytest.raises(TypeError, match=r"leaf \['z'\] has dtype complex64"):
    _update_once(_make(case, "data"), params, grads)


def test_a_state_without_its_device_axis_names_the_helper():
  tx = optax.chain(jaxcomp.topk(0.5, "data"), optax.sgd(0.1))
  mesh = training.make_mesh(8)
  step = training.make_step(_loss_fn, tx, mesh, "data")
  with pytest.raises(ValueError, match=r"per-device state of 8 devices.*init_state"):
    step(training.replicate(PARAMS, mesh), tx.init(PARAMS),
         training.shard(_per_device_normal(4, devices=16), mesh, "data"))


@pytest.mark.parametrize("case", CASES)
def test_reductions_do_not_grow_with_the_number_of_leaves(case):
  """One finiteness test over the fused bucket, not one per leaf (compile time): as
  many elements in twice the leaves, as many reductions (with buckets, the same
  buckets' sizes)."""

  def reductions(leaves):
    params = {f"w{i}": jnp.zeros((48 // leaves, 6)) for i in range(leaves)}
    mesh = training.make_mesh(8)
    tx = _make(case, "data")
    state = training.init_state(tx, params, mesh, "data")
    grads = training.stack_per_device(params, mesh, "data")
    text = training.make_update(tx, mesh, "data").lower(grads, state).as_text()
    return len(re.findall(r"stablehlo\.reduce[ (]", text))

  assert reductions(24) == reductions(12)
