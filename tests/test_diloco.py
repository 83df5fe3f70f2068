"""DiLoCo (``jaxcomp/_src/diloco.py``): replica groups on the slow axis, inner steps on
their own, the pseudo-gradient through any compressor every H steps; fragments, the
skip, checkpoints, bytes and errors, on 8 fake devices as 2 groups of 4."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import training
from jaxcomp import wire

AXES = ("dcn", "ici")
# The reference below sums gradients in another order than XLA's reductions.
TOLERANCE = dict(rtol=2e-5, atol=2e-6)


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": rng.normal(size=(12, 6)).astype(np.float32),
            "b": np.zeros(6, np.float32),
            "v": rng.normal(size=(6,)).astype(np.float32)}
  batches = [(rng.normal(size=(64, 12)).astype(np.float32),
              rng.normal(size=(64,)).astype(np.float32)) for _ in range(12)]
  return params, batches


def _loss(p, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) @ p["v"] - y) ** 2)


def _mesh():
  return training.make_mesh((2, 4), AXES)


def _step(inner=None, fsdp=False, **kwargs):
  if inner is None:
    inner = (optax.adam(1e-2) if fsdp
             else optax.chain(jaxcomp.allreduce("ici"), optax.adam(1e-2)))
  kwargs.setdefault("sync_period", 4)
  return training.make_diloco_step(_loss, inner, _mesh(), slow_axis="dcn", fast_axis="ici",
                                   fsdp=fsdp, **kwargs)


def _run(step, params, batches, state=None):
  mesh = step.mesh
  state = step.init(params) if state is None else state
  history = []
  for batch in batches:
    state, metrics = step(state, training.shard(batch, mesh, AXES))
    jax.block_until_ready(state)
    history.append((jax.tree.map(np.asarray, state), metrics))
  return state, history


def _rows(tree, like):
  return jax.tree.map(np.asarray, training.device_rows(tree, like))


def _reference(params, batches, sync_period, inner_lr=1e-2, outer_lr=0.7, momentum=0.9):
  """DiLoCo on one device: two groups, each on its half of every batch, dense outer mean."""
  inner = optax.adam(inner_lr)
  outer = optax.sgd(outer_lr, momentum=momentum, nesterov=True)
  anchor = jax.tree.map(jnp.asarray, params)
  groups = [anchor, anchor]
  inner_states = [inner.init(anchor), inner.init(anchor)]
  outer_state = outer.init(anchor)
  grad = jax.jit(jax.grad(_loss))
  for t, (x, y) in enumerate(batches, start=1):
    for g in range(2):
      half = (x[32 * g:32 * (g + 1)], y[32 * g:32 * (g + 1)])
      updates, inner_states[g] = inner.update(grad(groups[g], half), inner_states[g], groups[g])
      groups[g] = optax.apply_updates(groups[g], updates)
    if t % sync_period == 0:
      delta = jax.tree.map(lambda a, p0, p1: ((a - p0) + (a - p1)) / 2, anchor, *groups)
      updates, outer_state = outer.update(delta, outer_state, anchor)
      anchor = optax.apply_updates(anchor, updates)
      groups = [anchor, anchor]
  return anchor, groups


@pytest.mark.parametrize("fsdp", [False, True])
def test_diloco_with_a_dense_outer_mean_follows_the_reference(fsdp):
  params, batches = _problem()
  step = _step(fsdp=fsdp)
  state, history = _run(step, params, batches[:10])
  anchor, groups = _reference(params, batches[:10], 4)
  got = step.global_params(state)
  for k in params:
    np.testing.assert_allclose(got[k], anchor[k], **TOLERANCE)
    for g in range(2):
      np.testing.assert_allclose(step.group_params(state, g)[k], groups[g][k], **TOLERANCE)
  assert [m["synced"] for _, m in history] == [None, None, None, 0] * 2 + [None, None]


def test_one_inner_sgd_step_and_an_outer_sgd_of_rate_one_is_synchronous_sgd():
  params, batches = _problem()
  step = _step(inner=optax.chain(jaxcomp.allreduce("ici"), optax.sgd(0.05)), sync_period=1,
               outer_optimizer=optax.sgd(1.0))
  state, _ = _run(step, params, batches[:3])
  mesh = _mesh()
  tx = optax.chain(jaxcomp.allreduce(AXES), optax.sgd(0.05))
  sync_params, sync_state = training.replicate(params, mesh), training.init_state(
      tx, params, mesh, AXES)
  sync_step = training.make_step(_loss, tx, mesh, AXES)
  for batch in batches[:3]:
    sync_params, sync_state, _ = sync_step(sync_params, sync_state,
                                           training.shard(batch, mesh, AXES))
  for k in params:
    np.testing.assert_allclose(step.global_params(state)[k], np.asarray(sync_params[k]),
                               **TOLERANCE)


@pytest.mark.parametrize("fsdp", [False, True])
def test_replicas_are_identical_inside_groups_and_everywhere_after_each_sync(fsdp):
  params, batches = _problem()
  step = _step(fsdp=fsdp, num_fragments=2, outer_compressor=jaxcomp.topk(0.3, "dcn"))
  _, history = _run(step, params, batches[:8])
  like = step.like
  devices = np.arange(8)
  for snapshot, metrics in history:
    rows = _rows(snapshot.params, like.params)
    anchors = _rows(snapshot.anchor, like.params)
    for name in rows:
      # The anchor is the same on every device (FSDP: on each fast position's
      # devices, which hold the same row blocks); a group's devices hold the
      # same parameters.
      np.testing.assert_array_equal(anchors[name],
                                    anchors[name][devices % 4 if fsdp else devices * 0])
      if not fsdp:
        np.testing.assert_array_equal(rows[name], rows[name][devices // 4 * 4])
    if metrics["synced"] is not None:
      for i in step.fragments[metrics["synced"]]:
        name = sorted(params)[i]
        np.testing.assert_array_equal(rows[name], anchors[name])


def test_streaming_fragments_sync_on_staggered_steps_with_one_program_per_kind():
  params, batches = _problem()
  step = _step(sync_period=4, num_fragments=2)
  _, history = _run(step, params, batches[:8])
  assert [m["synced"] for _, m in history] == [None, 1, None, 0] * 2
  assert step.fragments == ((2,), (0, 1))  # w (72 floats) alone, b and v together
  assert step.cache_size() == 3  # the inner step and one sync per fragment
  with pytest.raises(ValueError, match="never cut"):
    training.diloco_fragments(params, 4)


def test_a_nan_inner_gradient_skips_its_group_only_and_a_nan_sync_skips_everywhere():
  params, batches = _problem()
  step = _step(outer_compressor=jaxcomp.topk(0.3, "dcn"))
  x, y = batches[0]
  bad = x.copy()
  bad[5] = np.nan  # device 0's part: group 0
  state, history = _run(step, params, [batches[1], (bad, y)])
  before, after = history[0][0], history[1][0]
  like = step.like
  rows_before, rows_after = _rows(before.params, like.params), _rows(after.params, like.params)
  finite = np.asarray(history[1][1]["finite"])
  assert not finite[:4].any() and finite[4:].all()
  for name in params:
    np.testing.assert_array_equal(rows_after[name][:4], rows_before[name][:4])
    assert not np.array_equal(rows_after[name][4:], rows_before[name][4:])
  assert np.asarray(after.step).tolist() == [2] * 8  # the schedule does not move

  # Group 0's parameters made non-finite: its pseudo-gradient is, and the sync
  # is skipped on every device, its anchor and outer state untouched.
  poisoned = state._replace(params=jax.tree.map(lambda x: x.at[0:12].set(jnp.nan)
                                                if x.ndim == 2 else x, state.params))
  poisoned_rows = _rows(poisoned, like)
  state, history = _run(step, params, batches[2:4], state=poisoned)
  synced_state, metrics = history[-1]
  assert metrics["synced"] == 0 and not np.asarray(metrics["outer_finite"]).any()
  synced_rows = _rows(synced_state, like)
  for got, want in zip(jax.tree.leaves(synced_rows.anchor),
                       jax.tree.leaves(poisoned_rows.anchor)):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(jax.tree.leaves(synced_rows.outer_state),
                       jax.tree.leaves(poisoned_rows.outer_state)):
    np.testing.assert_array_equal(got, want)
  # Each group goes on from its own parameters, not from the old anchor.
  assert not np.array_equal(synced_rows.params["v"][4:], synced_rows.anchor["v"][4:])


@pytest.mark.parametrize("fsdp", [False, True])
def test_with_skip_scope_all_a_nan_inner_gradient_skips_every_group(fsdp):
  params, batches = _problem()
  step = _step(fsdp=fsdp, skip_scope="all")
  x, y = batches[0]
  bad = x.copy()
  bad[5] = np.nan  # device 0's part: group 0
  _, history = _run(step, params, [batches[1], (bad, y)])
  before, after = history[0][0], history[1][0]
  assert not np.asarray(history[1][1]["finite"]).any()
  for got, want in zip(jax.tree.leaves(after.params), jax.tree.leaves(before.params)):
    np.testing.assert_array_equal(got, want)
  assert np.asarray(after.step).tolist() == [2] * 8


@pytest.mark.parametrize("saved_at", [3, 4])  # mid-period; right after fragment 0's sync
def test_resuming_a_checkpoint_goes_on_bit_for_bit(tmp_path, saved_at):
  params, batches = _problem()
  make = lambda: _step(num_fragments=2, outer_compressor=jaxcomp.quantized(4, "dcn"))
  step = make()
  state, _ = _run(step, params, batches[:saved_at])
  training.save_checkpoint(tmp_path / "ckpt", {}, state, step=saved_at)
  straight, _ = _run(step, params, batches[saved_at:9], state=state)

  resumed_step = make()
  like = resumed_step.init(params)
  _, restored, t = training.restore_checkpoint(tmp_path / "ckpt", {}, like, resumed_step.mesh,
                                               AXES)
  assert t == saved_at
  resumed, history = _run(resumed_step, params, batches[saved_at:9], state=restored)
  # Steps t = 1 .. 9 sync fragment 0 when t % 4 == 0 and fragment 1 when t % 4 == 2.
  schedule = [None, 1, None, 0, None, 1, None, 0, None]
  assert [m["synced"] for _, m in history] == schedule[saved_at:]
  for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("fsdp,outer,scope", [
    (False, lambda: jaxcomp.allreduce("dcn"), "group"),
    (False, lambda: jaxcomp.quantized(4, "dcn"), "all"),
    (False, lambda: jaxcomp.powersgd(1, "dcn"), "group"),
    (True, lambda: jaxcomp.topk(0.2, "dcn"), "group"),
    (True, lambda: jaxcomp.sparseloco(0.2, "dcn"), "all"),
])
def test_bytes_of_every_program_equal_the_formula_per_axis(fsdp, outer, scope):
  params, batches = _problem()
  step = _step(fsdp=fsdp, num_fragments=2, outer_compressor=outer(), skip_scope=scope)
  state = step.init(params)
  batch = training.shard(batches[0], step.mesh, AXES)
  expected = step.transfers(params)
  sizes = dict(step.mesh.shape)
  for fragment in (None, 0, 1):
    program = step.lower(state, batch, fragment=fragment).compile()
    cost = expected.inner if fragment is None else expected.outer[fragment]
    assert wire.collective_bytes(program, mesh_shape=sizes).by_axes == wire.tally(cost).by_axes
  slow = expected.per_inner_step().by_axes[("dcn",)]
  assert slow == (wire.tally(expected.inner).by_axes.get(("dcn",), 0)
                  + sum(wire.tally(c).by_axes[("dcn",)] for c in expected.outer) / 4)
  # With skip_scope="all" each inner step sends its int32 skip flag over the slow links.
  assert (scope == "all") == any("dcn" in t.axes for t in expected.inner)


def test_an_outer_compressor_with_forms_gets_one_program_per_form():
  params, batches = _problem()
  step = _step(sync_period=2, outer_compressor=jaxcomp.acpsgd(1, "dcn"))
  state, history = _run(step, params, batches[:8])
  assert all(np.asarray(m["outer_finite"]).all() for _, m in history if m["synced"] is not None)
  assert step.cache_size() == 3  # the inner step, the P sync and the Q sync
  like = step.like
  anchors = _rows(state.anchor, like.params)
  for name in anchors:
    assert (anchors[name] == anchors[name][0]).all()


def test_bad_arguments_are_named():
  mesh = _mesh()
  inner = optax.chain(jaxcomp.allreduce("ici"), optax.adam(1e-2))
  build = lambda **kw: training.make_diloco_step(
      _loss, kw.pop("inner", inner), kw.pop("mesh", mesh), slow_axis="dcn",
      fast_axis=kw.pop("fast_axis", "ici"), **{"sync_period": 4, **kw})
  with pytest.raises(ValueError, match="sync_period"):
    build(sync_period=0)
  with pytest.raises(ValueError, match="must divide `sync_period`"):
    build(num_fragments=3)
  with pytest.raises(ValueError, match="built over \\('ici',\\)"):
    build(outer_compressor=jaxcomp.topk(0.1, "ici"))
  with pytest.raises(TypeError, match="outer_compressor"):
    build(outer_compressor=optax.sgd(0.1))
  with pytest.raises(ValueError, match="the slow one first"):
    build(mesh=training.make_mesh((4, 2), ("ici", "dcn")))
  params, _ = _problem()
  with pytest.raises(ValueError, match="crosses the slow axis"):
    build(inner=optax.chain(jaxcomp.allreduce(AXES), optax.adam(1e-2))).init(params)
  with pytest.raises(ValueError, match="drift apart"):
    build(inner=optax.adam(1e-2)).init(params)
  with pytest.raises(ValueError, match="reduce-scattered"):
    build(fsdp=True).init(params)
  with pytest.raises(ValueError, match="skip_scope"):
    build(skip_scope="everywhere")
  with pytest.raises(ValueError, match="call `init` first"):
    build()(training.DiLoCoState({}, (), {}, (), jnp.zeros(8, jnp.int32)), None)


def test_the_cost_model_prices_an_inner_step_and_a_sync_spread_over_h():
  from jaxcomp import costmodel

  params, _ = _problem()
  step = _step(num_fragments=2, outer_compressor=jaxcomp.quantized(4, "dcn"))
  expected = step.transfers(params)
  # The formulas need no mesh: the same for a mesh of any size.
  assert training.diloco_transfers(
      params, {"dcn": 2, "ici": 4}, slow_axis="dcn", fast_axis="ici", sync_period=4,
      inner_tx=optax.chain(jaxcomp.allreduce("ici"), optax.adam(1e-2)),
      outer_compressor=jaxcomp.quantized(4, "dcn"), num_fragments=2) == expected
  bandwidth, latency = {"dcn": 1.0, "ici": 100.0}, {"dcn": 50.0, "ici": 2.0}
  seconds = costmodel.predict_diloco(expected, bandwidth, latency, compute_s=0.01)
  sync = sum(costmodel.exchange_time(c, bandwidth, latency) for c in expected.outer)
  assert seconds == pytest.approx(
      0.01 + costmodel.exchange_time(expected.inner, bandwidth, latency) + sync / 4)
  big = training.diloco_transfers(params, {"dcn": 64, "ici": 8}, slow_axis="dcn",
                                  fast_axis="ici", sync_period=30)
  # A dense outer mean over 64 groups of 8: each device all-reduces its 1/8 shard.
  shard = sum(-(-x.shape[0] // 8) * (x.shape[1] if x.ndim == 2 else 1)
              for x in jax.tree.leaves(params))
  assert big.per_inner_step().by_axes[("dcn",)] == pytest.approx(2 * 63 / 64 * 4 * shard / 30)
  with pytest.raises(ValueError, match="must divide"):
    training.diloco_transfers(params, {"dcn": 2}, slow_axis="dcn", sync_period=4,
                              num_fragments=3)


@pytest.mark.parametrize("fsdp", [False, True])
def test_scalar_leaves_come_back_whole(fsdp):
  params = {"w": np.ones((4, 3), np.float32), "s": np.float32(0.5)}
  loss = lambda p, batch: jnp.mean((batch[0] @ p["w"]).sum(-1) * p["s"] - batch[1]) ** 2
  inner = optax.sgd(0.1) if fsdp else optax.chain(jaxcomp.allreduce("ici"), optax.sgd(0.1))
  step = training.make_diloco_step(loss, inner, _mesh(), slow_axis="dcn", fast_axis="ici",
                                   sync_period=2, fsdp=fsdp)
  _, batches = _problem()
  state = step.init(params)
  for x, y in batches[:2]:
    state, _ = step(state, training.shard((x[:, :4], y), step.mesh, AXES))
  synced = step.global_params(state)
  assert synced["s"].shape == () and synced["w"].shape == (4, 3)
  assert synced["s"] != 0.5
  for group in (0, 1):
    np.testing.assert_array_equal(step.group_params(state, group)["w"], synced["w"])
