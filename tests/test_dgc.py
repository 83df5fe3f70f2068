"""Deep Gradient Compression on 8 fake CPU devices: each of its five parts."""

from fractions import Fraction
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import hlo_counts
from jaxcomp._src import checks
from jaxcomp._src import dense
from jaxcomp._src import dgc
from jaxcomp._src import selection
from jaxcomp import training
from jaxcomp import wire
import harness

SHAPES = {"b": (12,), "c": (3, 4, 5), "w": (16, 12)}  # sparse (rank > 1): c, w
N_SPARSE = 60 + 192
SPARSE = {"c": slice(12, 72), "w": slice(72, 264)}  # positions in jax.tree.leaves order


def params_like():
  return {k: jnp.zeros(s) for k, s in SHAPES.items()}


def device_grads(num, seed=0, scale=1.0):
  return jax.tree.map(lambda g: scale * g, harness.per_device_normal(params_like(), seed, num))


def dgc_oracle(grads, state, *, k, m, nesterov=False, clip=None):
  """numpy DGC step on flat vectors: (output, [(residual, momentum)] per device).

  ``grads``: per-device flat f32 vectors; ``state``: per-device (residual,
  momentum) flat vectors. Exact top-k selection (sample_ratio=1).
  """
  num = len(grads)
  sparse = np.zeros(grads[0].shape, bool)
  for s in SPARSE.values():
    sparse[s] = True
  out = np.zeros_like(grads[0])
  new = []
  clipped = []
  for g in grads:
    if clip is not None:
      g = g * min(1.0, clip / math.sqrt(num) / np.linalg.norm(g))
    clipped.append(g)
  for g, (e, u) in zip(clipped, state):
    u = u.copy()
    e = e.copy()
    if nesterov:
      u[sparse] = m * (u[sparse] + g[sparse])
      acc = u[sparse] + g[sparse]
    else:
      u[sparse] = m * u[sparse] + g[sparse]
      acc = u[sparse]
    v = acc + e[sparse]
    if clip is not None and k < v.size:
      # The clip's scale is an f32 norm, summed in an order XLA picks per CPU: a few
      # ulps of the velocity. These data keep the k-th and the next magnitude apart
      # by far more, so the library selects what the oracle does on any CPU.
      top = np.sort(np.abs(v))[::-1]
      assert top[k - 1] - top[k] > 1e-5 * top[k - 1]
    idx = harness.np_topk(v, k)
    sent = np.zeros_like(v)
    sent[idx] = v[idx]
    out[sparse] += sent / num
    v[idx] = 0
    us = u[sparse]
    us[idx] = 0
    u[sparse] = us
    e[sparse] = v
    new.append([e, u])
  mean_dense = np.mean([g[~sparse] for g in clipped], axis=0)
  u_dense = state[0][1][~sparse]
  if nesterov:
    u_dense = m * (u_dense + mean_dense)
    out[~sparse] = u_dense + mean_dense
  else:
    u_dense = m * u_dense + mean_dense
    out[~sparse] = u_dense
  for pair in new:
    pair[1][~sparse] = u_dense
  return out, new


@pytest.fixture(scope="module")
def mesh8():
  return training.make_mesh(8)


# ------------------------------------------------------------------ contract


@pytest.mark.parametrize("num", [2, 4, 8])
@pytest.mark.parametrize("sparse_leaves", ["rank>1", "all"])
def test_compiled_bytes_equal_formula(sparse_leaves, num):
  tx = dgc.dgc(0.05, "data", sample_ratio=0.5, sparse_leaves=sparse_leaves)
  got = harness.compiled_bytes_on_a_ring(tx, params_like(), device_grads(num), num)
  n_sparse = 264 if sparse_leaves == "all" else N_SPARSE
  sparse_bytes = (num - 1) * 8 * math.ceil(0.05 * n_sparse)
  dense_bytes = 0 if sparse_leaves == "all" else 2 * (num - 1) * 4 * 12 / num
  assert got.total == sparse_bytes + dense_bytes


# The warm-up's k per form on the sparse leaves (252 entries) at density 0.02:
# 25%, 6.25%, then the density (1.5625% and 0.4% raised to it, and after the warm-up).
WARMUP_KS = (63, 16, 6)


def _allgathers_by_branch(sent):
  """``{branch: [gathered buffer bytes, ...]}`` of the compiled all-gathers."""
  found = {}
  for op in sent.ops:
    if op.kind == "all-gather":
      found.setdefault(op.branch, []).append(op.buffer_bytes)
  return found


@pytest.mark.parametrize("mesh_shape, names", [(8, ("data",)), ((2, 4), ("x", "y"))],
                         ids=["ring", "torus"])
def test_warmup_bytes_per_branch_equal_the_formula(mesh_shape, names):
  """One branch per form, each all-gathering its own k; the formula agrees branch by branch."""
  axis = harness.axis_of(names)
  mesh = training.make_mesh(mesh_shape, names)
  tx = dgc.dgc(0.02, axis, warmup_steps=8, sample_ratio=0.5)
  params = params_like()
  state = training.init_state(tx, params, mesh, axis)
  step = harness.step_fn(tx, mesh, axis=axis)
  sent = wire.collective_bytes(step.lower(device_grads(8), state).compile())
  out, _ = step(device_grads(8), state)
  harness.assert_same_on_devices(out)
  want = wire.expected_bytes(tx, params, mesh_shape)
  assert sent.by_branch == want.by_branch
  # Each form gathers its k values and k indices from 8 devices (4 bytes each).
  gathers = _allgathers_by_branch(sent)
  assert sorted(b for b in gathers if b is not None) == list(range(len(WARMUP_KS)))
  for form, k in enumerate(WARMUP_KS):
    assert gathers[form] == [8 * 4 * k, 8 * 4 * k]
    assert sent.by_branch[form] == 7 * 8 * k
  assert WARMUP_KS[0] > WARMUP_KS[-1]
  # The 12 dense elements: outside the switch, the ring or torus mean of 12 f32.
  sizes = (8,) if len(names) == 1 else mesh_shape
  assert sent.by_branch[None] == sum(t.bytes for t in wire.mean(12, sizes))
  # Over 6 steps each of the three forms takes 2: the program's 1/3 per branch.
  assert sent.by_kind == wire.expected_bytes(tx, params, mesh_shape, steps=6).by_kind
  # Over 10, the last form takes 6 (two stages and two steps after the warm-up).
  assert wire.expected_bytes(tx, params, mesh_shape, steps=10).by_branch == sent.by_branch
  assert wire.expected_bytes(tx, params, mesh_shape, steps=10).total == (
      7 * 8 * Fraction(2 * 63 + 2 * 16 + 6 * 6, 10) + sent.by_branch[None])


def test_warmup_formula_weights_the_stages():
  params = {"w": jnp.zeros((100, 100))}
  tx = dgc.dgc(0.001, "data", warmup_steps=100)
  ks = (2500, 625, 157, 40, 10)  # ceil(d * 10_000) for 25%, 6.25%, 1.5625%, 0.4%, 0.1%
  steady = wire.expected_bytes(tx, params, 8)
  assert steady.by_branch == {i: 7 * 8 * k for i, k in enumerate(ks)}
  assert steady.total == 7 * 8 * ks[-1]
  early = wire.expected_bytes(tx, params, 8, steps=50)  # the first two stages, 25 steps each
  assert early.total == 7 * 8 * Fraction(ks[0] + ks[1], 2)
  later = wire.expected_bytes(tx, params, 8, steps=200)  # 25 steps per stage, then 100
  assert later.total == 7 * 8 * Fraction(25 * sum(ks[:4]) + 100 * ks[4], 200)
  no_warmup = wire.expected_bytes(dgc.dgc(0.001, "data"), params, 8)
  assert no_warmup.by_branch == {None: 7 * 8 * 10}


def test_compression_ratio_on_a_small_cnn():
  """4 n / bytes of one device's message (the wire at P = 2 is one message)."""
  cnn = {
      "conv1": {"kernel": jnp.zeros((3, 3, 1, 16)), "bias": jnp.zeros(16)},
      "conv2": {"kernel": jnp.zeros((3, 3, 16, 32)), "bias": jnp.zeros(32)},
      "dense1": {"kernel": jnp.zeros((800, 64)), "bias": jnp.zeros(64)},
      "dense2": {"kernel": jnp.zeros((64, 10)), "bias": jnp.zeros(10)},
  }
  n = sum(x.size for x in jax.tree.leaves(cnn))
  ratio = lambda rule: 4 * n / wire.expected_bytes(
      dgc.dgc(0.001, "data", sparse_leaves=rule), cnn, 2).total
  assert ratio("all") == Fraction(4 * n, 8 * math.ceil(0.001 * n))
  assert ratio("all") >= 300
  biases = 16 + 32 + 64 + 10
  kernels = n - biases
  assert ratio("rank>1") == Fraction(4 * n, 8 * math.ceil(0.001 * kernels) + 4 * biases)
  # The paper's rule sends the biases dense: about 240x here.
  assert 200 < ratio("rank>1") < 300


# ------------------------------------------------------------------ semantics


def test_full_density_equals_allreduce(mesh8):
  tx = dgc.dgc(1.0, "data", momentum=0.0)
  base_tx = dense.allreduce("data")
  step = harness.step_fn(tx, mesh8)
  base_step = harness.step_fn(base_tx, mesh8)
  state = training.init_state(tx, params_like(), mesh8, "data")
  base_state = training.init_state(base_tx, params_like(), mesh8, "data")
  for seed in (0, 1):
    grads = device_grads(8, seed=seed)
    out, state = step(grads, state)
    want, _ = base_step(grads, base_state)
    chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)


def _rows(tx, state):
  """``state`` with each device's on its own row (``training.device_rows``)."""
  return harness.state_rows(tx, state, params_like())


@pytest.mark.parametrize("nesterov", [False, True])
def test_matches_numpy_over_three_steps(nesterov, mesh8):
  """Momentum correction, clipping, masking: all against the numpy spec."""
  k = math.ceil(0.05 * N_SPARSE)
  tx = dgc.dgc(0.05, "data", momentum=0.9, nesterov=nesterov, clip_norm=20.0,
               sample_ratio=1.0)
  step = harness.step_fn(tx, mesh8)
  state = training.init_state(tx, params_like(), mesh8, "data")
  ref = [(np.zeros(264, np.float32), np.zeros(264, np.float32)) for _ in range(8)]
  for seed, scale in ((0, 1.0), (1, 3.0), (2, 0.5)):
    grads = device_grads(8, seed=seed, scale=scale)
    out, state = step(grads, state)
    want, ref = dgc_oracle([harness.flat(grads, d) for d in range(8)], ref, k=k, m=0.9,
                           nesterov=nesterov, clip=20.0)
    harness.assert_same_on_devices(out)
    np.testing.assert_allclose(harness.flat(out, 0), want, rtol=1e-5, atol=1e-5)
    rows = _rows(tx, state)
    for d in range(8):
      np.testing.assert_allclose(harness.flat(rows.residual, d), ref[d][0], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(harness.flat(rows.momentum, d), ref[d][1], rtol=1e-5, atol=1e-5)


def test_momentum_correction_accumulates_velocity(mesh8):
  """With a constant gradient, unsent coordinates hold v = g + (m + 1) g + ..."""
  tx = dgc.dgc(0.01, "data", momentum=0.5, sample_ratio=1.0)
  step = harness.step_fn(tx, mesh8)
  state = training.init_state(tx, params_like(), mesh8, "data")
  grads = device_grads(8, seed=3)
  for _ in range(2):
    _, state = step(grads, state)
  sparse = lambda t: np.concatenate([harness.flat(t, 4)[s] for s in SPARSE.values()])
  rows = _rows(tx, state)
  g, e, u = sparse(grads), sparse(rows.residual), sparse(rows.momentum)
  k = math.ceil(0.01 * N_SPARSE)
  first = harness.np_topk(g, k)
  unsent = np.ones(N_SPARSE, bool)
  unsent[first] = False
  unsent &= e != 0  # not sent at step 2 either
  assert unsent.sum() == N_SPARSE - 2 * k
  # u1 = g, v1 = g; u2 = 0.5 g + g, v2 = g + 1.5 g (gradient accumulation would give 2 g).
  np.testing.assert_allclose(u[unsent], 1.5 * g[unsent], rtol=1e-6)
  np.testing.assert_allclose(e[unsent], 2.5 * g[unsent], rtol=1e-6)


def test_masking_zeroes_velocity_and_momentum_where_sent(mesh8):
  k = math.ceil(0.02 * N_SPARSE)
  tx = dgc.dgc(0.02, "data", momentum=0.9, sample_ratio=1.0)
  state = training.init_state(tx, params_like(), mesh8, "data")
  grads = device_grads(8, seed=4)
  _, state = harness.step_fn(tx, mesh8)(grads, state)
  rows = _rows(tx, state)
  for d in (0, 5):
    g = np.concatenate([harness.flat(grads, d)[s] for s in SPARSE.values()])
    e = np.concatenate([harness.flat(rows.residual, d)[s] for s in SPARSE.values()])
    u = np.concatenate([harness.flat(rows.momentum, d)[s] for s in SPARSE.values()])
    sent = harness.np_topk(g, k)
    assert not np.any(u[sent]) and not np.any(e[sent])
    rest = np.setdiff1d(np.arange(N_SPARSE), sent)
    np.testing.assert_array_equal(u[rest], g[rest])
    # Mass conservation, bit for bit: sent + new residual == velocity.
    np.testing.assert_array_equal(e[rest], g[rest])


# 1e30: the squares' f32 sum overflows; the gradient is still clipped, not zeroed.
@pytest.mark.parametrize("scale", [100.0, 1e30])
def test_clipping_bounds_each_device_norm(mesh8, scale):
  clip = 2.0
  tx = dgc.dgc(0.01, "data", momentum=0.0, clip_norm=clip, sample_ratio=1.0,
               sparse_leaves="all")
  state = training.init_state(tx, params_like(), mesh8, "data")
  grads = device_grads(8, seed=6, scale=scale)
  out, state = harness.step_fn(tx, mesh8)(grads, state)
  rows = _rows(tx, state)
  for d in range(8):
    g = harness.flat(grads, d).astype(np.float64)
    velocity = harness.flat(rows.residual, d).astype(np.float64)
    sent = velocity == 0
    # Only the k entries sent are 0 (a gradient clipped to 0 would be all of them).
    assert np.count_nonzero(sent) <= checks.num_selected(0.01, g.size)
    velocity[sent] = g[sent] * clip / math.sqrt(8) / np.linalg.norm(g)
    # The velocity is the clipped gradient: its norm is clip / sqrt(P).
    np.testing.assert_allclose(np.linalg.norm(velocity), clip / math.sqrt(8), rtol=1e-5)
  assert np.abs(harness.flat(out, 0)).max() <= clip / math.sqrt(8)


def test_warmup_density_schedule():
  ramp = [dgc.warmup_density(0.001, 8, t) for t in range(10)]
  assert ramp == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.004, 0.004, 0.001, 0.001]
  assert dgc.warmup_density(0.01, 8, 7) == 0.01  # never below the target
  assert dgc.warmup_density(0.001, 0, 0) == 0.001


def test_stage_weights():
  f = Fraction
  # Steps 0..7 of an 8-step warm-up in stages 0,0,1,1,2,2,3,3; then the last stage.
  assert dgc.stage_weights(8, 10) == (f(1, 5),) * 5
  assert dgc.stage_weights(8, 5) == (f(2, 5), f(2, 5), f(1, 5), 0, 0)
  assert dgc.stage_weights(8, 1) == (1, 0, 0, 0, 0)
  # A 6-step warm-up: steps 0..5 in stages 0,0,1,2,2,3.
  assert dgc.stage_weights(6, 4) == (f(1, 2), f(1, 4), f(1, 4), 0, 0)
  assert dgc.stage_weights(6, 12) == (f(2, 12), f(1, 12), f(2, 12), f(1, 12), f(6, 12))
  # Fewer warm-up steps than stages: stage 3 is never reached.
  assert dgc.stage_weights(3, 4) == (f(1, 4), f(1, 4), f(1, 4), 0, f(1, 4))
  assert dgc.stage_weights(8, None) == (0, 0, 0, 0, 1)
  assert dgc.stage_weights(0, 7) == (1,)
  assert dgc.stage_weights(0, None) == (1,)
  with pytest.raises(ValueError, match="`steps`"):
    dgc.stage_weights(8, 0)


def test_warmup_sends_the_scheduled_k_without_recompiling(mesh8):
  """The step count picks the stage: every device sends the stage's k, from one program."""
  tx = dgc.dgc(0.02, "data", momentum=0.0, warmup_steps=8, sample_ratio=1.0)
  state = training.init_state(tx, params_like(), mesh8, "data")
  chex.clear_trace_counter()
  step = harness.step_fn(tx, mesh8, "data", max_traces=1)
  sent_counts, out_counts = [], []
  for t in range(10):
    grads = device_grads(8, seed=10 + t)
    out, state = jax.block_until_ready(step(grads, state))
    # Momentum 0: the momentum is the gradient, zeroed exactly where sent.
    momentum = _rows(tx, state).momentum
    u = np.stack([np.concatenate([harness.flat(momentum, d)[s] for s in SPARSE.values()])
                  for d in range(8)])
    sent_counts.append(set(np.sum(u == 0, axis=1).tolist()))
    sparse_out = np.concatenate([harness.flat(out, 0)[s] for s in SPARSE.values()])
    out_counts.append(int(np.count_nonzero(sparse_out)))
  want = [math.ceil(dgc.warmup_density(0.02, 8, t) * N_SPARSE) for t in range(10)]
  assert want == [63, 63, 16, 16, 6, 6, 6, 6, 6, 6]
  assert sent_counts == [{k} for k in want]
  # The mean holds the union of the devices' k entries: at least k, at most 8 k.
  assert all(k <= c <= 8 * k for k, c in zip(want, out_counts))
  assert out_counts[0] > out_counts[2] > out_counts[-1]
  np.testing.assert_array_equal(np.asarray(_rows(tx, state).count), np.full(8, 10))


def test_sampled_threshold_selects_within_capacity(mesh8):
  """On the sampled path the payload holds exactly k of the largest entries."""
  k = math.ceil(0.01 * 65536)
  tx = dgc.dgc(0.01, "data", momentum=0.0, sample_ratio=0.05)
  params = {"big": jnp.zeros((256, 256))}
  state = training.init_state(tx, params, mesh8, "data")
  grads = {"big": jax.random.normal(jax.random.key(8), (8, 256, 256))}
  out, state = harness.step_fn(tx, mesh8)(grads, state)
  harness.assert_same_on_devices(out)
  rows = harness.state_rows(tx, state, params)
  for d in (0, 7):
    g = np.asarray(grads["big"][d]).reshape(-1)
    sent = np.asarray(rows.momentum["big"][d]).reshape(-1) == 0
    assert sent.sum() == k
    np.testing.assert_array_equal(np.sort(np.nonzero(sent)[0]), np.sort(harness.np_topk(g, k)))
  assert wire.expected_bytes(tx, params, 8).total == 7 * 8 * k


def test_gpu_tuning_selects_with_top_k_without_a_loop_or_a_branch(mesh8, monkeypatch):
  """With the GPU's tunables (``sampled=False``) a sampled DGC is DGC at
  ``sample_ratio=1``: the same outputs and state bit for bit over two steps,
  from a program with no more ``while`` loops or conditionals than that one's
  (XLA:GPU reads their predicates on the host)."""
  params = {"big": jnp.zeros((64, 64)), "b": jnp.zeros((64,))}
  grads = [{"big": jax.random.normal(jax.random.key(s), (8, 64, 64)),
            "b": jax.random.normal(jax.random.key(s + 10), (8, 64))} for s in (1, 2)]

  def run(tx):
    state = training.init_state(tx, params, mesh8, "data")
    step = harness.step_fn(tx, mesh8)
    control = harness.control_flow(step.lower(grads[0], state).compile().as_text())
    for g in grads:
      out, state = jax.block_until_ready(step(g, state))
    return jax.tree.leaves((out, state)), control

  exact, exact_control = run(dgc.dgc(0.02, "data", sample_ratio=1.0))
  # The foil, the CPU's route in JAX: the threshold's loops and the fallback's branch.
  monkeypatch.setitem(selection._BY_BACKEND, "cpu", selection.Tuning(native=False))
  _, sampled_control = run(dgc.dgc(0.02, "data", sample_ratio=0.25))
  assert sampled_control["while"] > exact_control["while"]
  assert sampled_control["conditional"] > exact_control["conditional"]
  gpu = selection.tuning_for("gpu")
  monkeypatch.setattr(selection, "tuning_for", lambda backend=None: gpu)
  on_gpu, control = run(dgc.dgc(0.02, "data", sample_ratio=0.25))
  # On CPU the residual's write keeps its branch (fusion.overwrite): no more.
  assert control == exact_control, (control, exact_control)
  for a, b in zip(on_gpu, exact):
    harness.assert_bitwise_equal(a, b)


def test_mismatched_updates_raise():
  tx = dgc.dgc(0.1, "data")
  state = tx.init(params_like())
  with pytest.raises(ValueError, match="not shaped like the parameters"):
    tx.update({"w": jnp.zeros((16, 12))}, state)


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize("kwargs, match", [
    ({"density": 0.0}, "`density` must be in \\(0, 1\\]"),
    ({"density": float("nan")}, "`density` must be in \\(0, 1\\]"),
    ({"density": 1.01}, "`density` must be in \\(0, 1\\]"),
    ({"momentum": 1.0}, "`momentum` must be in \\[0, 1\\)"),
    ({"momentum": -0.1}, "`momentum` must be in \\[0, 1\\)"),
    ({"momentum": float("nan")}, "`momentum` must be in \\[0, 1\\)"),
    ({"sample_ratio": 0.0}, "`sample_ratio` must be in \\(0, 1\\]"),
    ({"sample_ratio": 1.5}, "`sample_ratio` must be in \\(0, 1\\]"),
    ({"warmup_steps": -1}, "`warmup_steps` must be in \\[0, inf\\)"),
    ({"clip_norm": 0.0}, "`clip_norm` must be None or in \\(0, inf\\)"),
    ({"clip_norm": float("inf")}, "`clip_norm` must be None or in \\(0, inf\\)"),
    ({"axis_name": ""}, "`axis_name`"),
    ({"sparse_leaves": "rank>2"}, "`sparse_leaves` must be"),
    ({"seed": -3}, "`seed` must be in"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
  args = {"density": 0.01, "axis_name": "data", **kwargs}
  with pytest.raises(ValueError, match=match):
    dgc.dgc(**args)


@pytest.mark.parametrize("kwargs, match", [
    ({"momentum": "0.9"}, "`momentum`"),
    ({"nesterov": 1}, "`nesterov`"),
    ({"warmup_steps": 2.5}, "`warmup_steps`"),
    ({"clip_norm": "1"}, "`clip_norm`"),
])
def test_bad_argument_types_raise_type_error(kwargs, match):
  with pytest.raises(TypeError, match=match):
    dgc.dgc(0.01, "data", **kwargs)


@pytest.mark.parametrize("warmup_steps", [0, 8])
def test_the_velocity_is_selected_in_place(warmup_steps):
  """The compiled step copies no head of the corrected gradient out for the
  selection (only the mean is split into leaves: one read, one write) and
  reduces the gradient-sized buffers twice (the finiteness test, the
  threshold's count), not a third time over the mean."""
  params = {f"w{i}": jnp.zeros((512, 512)) for i in range(4)} | {"b": jnp.zeros((512,))}
  n = 4 * 512 * 512 + 512
  mesh = training.make_mesh(1)
  tx = dgc.dgc(0.001, "data", warmup_steps=warmup_steps)
  state = training.init_state(tx, params, mesh, "data")
  grads = training.stack_per_device(params, mesh, "data")
  text = training.make_update(tx, mesh, "data").lower(grads, state).compile().as_text()
  heaviest = hlo_counts.count(text, n).heaviest
  slices = sum(row[0] for row in heaviest if row[3].endswith("/slice"))
  reductions = sum(row[0] for row in heaviest if row[3].endswith("reduce_sum"))
  assert slices < 2.1, heaviest
  assert reductions < 2.1, heaviest
