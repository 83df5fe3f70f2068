"""A step with several forms (ACP-SGD's P and Q, DGC's warm-up stages): one program each.

On 8 fake CPU devices: the step builders' programs of one form hold no
collective inside a conditional, send the formula's bytes of that form, and
give, step after step, the bits of the program that holds every form (a
``lax.switch`` on the count), through skipped steps and restores alike (the
count is read from the state each step); a transformation that cannot be
handed the form keeps the one program.
"""

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
from jaxcomp._src import selection

import harness

PARAMS = {"l0_b": jnp.zeros((32,)), "l0_w": jnp.zeros((16, 32)),
          "l1_b": jnp.zeros((8,)), "l1_w": jnp.zeros((32, 8))}
CASES = {
    "acpsgd": ("acpsgd", {"rank": 2}, 2),
    "acpsgd_buckets": ("acpsgd", {"rank": 2, "bucket_cap_mb": 1e-3}, 2),
    # Two stages above 5% (25% and 6.25%), then 5%, which the last two stages are raised to.
    "dgc_warmup": ("dgc", {"density": 0.05, "warmup_steps": 4, "clip_norm": 1.0}, 3),
}


def loss_fn(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["l0_w"] + params["l0_b"])
  return jnp.mean((h @ params["l1_w"] + params["l1_b"] - y) ** 2)


def _batch(step, devices=8, bad=False):
  rng = np.random.default_rng(step)
  x = rng.normal(size=(4 * devices, 16)).astype(np.float32)
  if bad:
    x[5, 0] = np.nan
  return jnp.asarray(x), jnp.asarray(rng.normal(size=(4 * devices, 8)), jnp.float32)


def _setup(case, mesh_shape=8, names=("data",), layout="replicated"):
  name, config, forms = CASES[case]
  mesh = training.make_mesh(mesh_shape, names)
  axis = harness.axis_of(names)
  if layout == "hierarchical":
    compressor = jaxcomp.hierarchical(registry.build(name, "dcn", **config), "ici", 4)
  else:
    compressor = registry.build(name, "dcn" if layout == "fsdp" else axis, **config)
  tx = optax.chain(compressor, optax.sgd(0.1))
  params = training.replicate(jax.tree.map(jnp.ones_like, PARAMS), mesh)
  if layout == "fsdp":
    step = training.make_fsdp_step(loss_fn, tx, mesh, "dcn", "ici", PARAMS, donate=False)
    params = training.shard_params(jax.tree.map(jnp.ones_like, PARAMS), mesh, "ici")
    state = training.init_fsdp_state(tx, PARAMS, mesh, "dcn", "ici")
  else:
    step = training.make_step(loss_fn, tx, mesh, axis, donate=False)
    state = training.init_state(tx, params, mesh, axis)
  return mesh, axis, tx, step, params, state, forms


def _train(step, params, state, mesh, axis, steps, first=0, bad=()):
  outs = []
  for i in range(first, first + steps):
    batch = training.shard(_batch(i, bad=i in bad), mesh, axis)
    params, state, metrics = jax.block_until_ready(step(params, state, batch))
    outs.append((params, state, metrics))
  return outs


def _assert_same_bits(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    harness.assert_bitwise_equal(g, w)


def _forms_give_the_bits_of_the_switch(case, layout):
  shape, names = (8, ("data",)) if layout == "replicated" else ((2, 4), ("dcn", "ici"))
  mesh, axis, tx, step, params, state, forms = _setup(case, shape, names, layout)
  axis = ("dcn", "ici") if layout == "fsdp" else axis
  steps = 7 if forms > 2 else 4
  formed = _train(step, params, state, mesh, axis, steps)
  switched = _train(step.program(None), params, state, mesh, axis, steps)
  _assert_same_bits(formed, switched)
  assert step.cache_size() == min(forms, steps) + 1
  return step, params, state, mesh, axis


@pytest.mark.parametrize("case,layout", [(case, "replicated") for case in CASES]
                         + [("acpsgd", "hierarchical"), ("acpsgd", "fsdp")])
def test_one_program_per_form_gives_the_bits_of_the_switch(case, layout):
  _forms_give_the_bits_of_the_switch(case, layout)


@pytest.mark.parametrize("native_route", harness.NATIVE_ROUTES)
def test_forms_of_the_sampled_threshold_give_the_bits_of_the_switch(monkeypatch, native_route):
  """DGC's 768 sparse entries select by lax.top_k on CPU; here by the sampled
  threshold (in JAX, or past its sample in the native custom call), whose loops
  and fallback, or whose call, then sit in each form and in the switch's
  branches alike."""
  every_size = selection.Tuning(sampled_min_size=None, native=native_route)
  monkeypatch.setattr(selection, "tuning_for", lambda backend=None: every_size)
  step, params, state, mesh, axis = _forms_give_the_bits_of_the_switch(
      "dgc_warmup", "replicated")
  batch = training.shard(_batch(0), mesh, axis)
  text = step.lower(params, state, batch, form=0).compile().as_text()
  if native_route:
    assert "jaxcomp_sampled_topk" in text
  else:
    assert harness.control_flow(text)["while"]  # the threshold's loops: lax.top_k has none


@pytest.mark.parametrize("case", CASES)
def test_no_collective_of_a_form_sits_in_a_conditional(case):
  mesh, axis, tx, step, params, state, forms = _setup(case)
  batch = training.shard(_batch(0), mesh, axis)
  conditional = wire.collective_bytes(step.lower(params, state, batch).compile())
  assert {op.branch for op in conditional.ops} >= set(range(forms))
  formula = wire.expected_bytes(tx, PARAMS, 8)
  for form in range(forms):
    read = wire.collective_bytes(step.lower(params, state, batch, form=form).compile())
    assert read.ops and all(op.branch is None for op in read.ops)
    assert read.total == formula.by_branch.get(None, 0) + formula.by_branch[form]


def test_a_restored_state_goes_on_in_its_own_form():
  """Restored after an odd number of steps, onto the same step and onto a fresh one:
  the next step is a Q step (the bits of the switch say so)."""
  mesh, axis, tx, step, params, state, _ = _setup("acpsgd")
  params, state, _ = _train(step, params, state, mesh, axis, 3)[-1]
  restored = jax.tree.map(jnp.array, (params, state))
  want = _train(step.program(None), *restored, mesh, axis, 2, first=3)
  _assert_same_bits(_train(step, *restored, mesh, axis, 2, first=3), want)
  fresh = _setup("acpsgd")[3]
  _assert_same_bits(_train(fresh, *restored, mesh, axis, 2, first=3), want)


@pytest.mark.parametrize("case", ["acpsgd", "dgc_warmup"])
def test_a_skipped_step_keeps_the_form_the_count_says(case):
  """A non-finite step advances nothing; the step after it takes the form of the
  count it finds, as the switch does."""
  mesh, axis, tx, step, params, state, forms = _setup(case)
  bad = {1, 2}
  formed = _train(step, params, state, mesh, axis, 5, bad=bad)
  switched = _train(step.program(None), params, state, mesh, axis, 5, bad=bad)
  _assert_same_bits(formed, switched)
  (p1, s1, _), (p2, s2, m2) = formed[0], formed[1]
  assert not np.asarray(m2["finite"]).any()
  _assert_same_bits((p2, s2), (p1, s1))
  np.testing.assert_array_equal(np.asarray(formed[3][1][0].count), np.full(8, 2))


def test_a_transformation_that_drops_the_form_keeps_one_program():
  """A user's class with no optax extra arguments: the one program, a switch."""
  mesh = training.make_mesh(8)
  tx = harness.Clipped(optax.chain(jaxcomp.acpsgd(2, "data"), optax.sgd(0.1)), 10.0)
  step = training.make_step(loss_fn, tx, mesh, "data", donate=False)
  params = training.replicate(jax.tree.map(jnp.ones_like, PARAMS), mesh)
  state = training.init_state(tx, params, mesh, "data")
  _train(step, params, state, mesh, "data", 3)
  assert step.cache_size() == 1


@pytest.mark.parametrize("form", [2, -1, 1.5])
def test_a_bad_form_is_refused_by_name(form):
  mesh = training.make_mesh(8)
  tx = jaxcomp.acpsgd(2, "data")
  spec = jax.sharding.PartitionSpec("data")

  def per_device(grads):
    grads = jax.tree.map(lambda x: x[0], grads)
    return tx.update(grads, tx.init(grads), compressor_form=form)[0]

  sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec,
                                  check_vma=False))
  with pytest.raises((ValueError, TypeError), match="compressor_form"):
    sharded.lower(training.shard(harness.per_device_normal(PARAMS, 0), mesh, "data"))


def test_the_form_reaches_the_compressor_through_the_spec():
  assert protocol.spec(jaxcomp.acpsgd(2, "data")).form(3) == 1
  assert protocol.spec(jaxcomp.dgc(0.01, "data", warmup_steps=8)).form(5) == 2
  # 0.4% is raised to the density: the last stage is the steady state's form.
  assert protocol.spec(jaxcomp.dgc(0.01, "data", warmup_steps=8)).form(7) == 3
  assert protocol.spec(jaxcomp.dgc(0.01, "data", warmup_steps=8)).form(9) == 3
  assert protocol.spec(jaxcomp.dgc(0.001, "data", warmup_steps=8)).form(7) == 3
  assert protocol.spec(jaxcomp.dgc(0.001, "data", warmup_steps=8)).form(9) == 4
  assert protocol.spec(jaxcomp.dgc(0.25, "data", warmup_steps=8)).form is None
  assert protocol.spec(jaxcomp.dgc(0.01, "data")).form is None
  assert protocol.spec(jaxcomp.gtopk(0.01, "data")).form is None
