"""Buckets (``bucket_cap_mb``): torch DDP's rule, each bucket its own exchange, in order.

On 8 fake CPU devices: the plan's rule; each bucket's mean, residual and state
those of the method run on that bucket's leaves alone, and the compiled
program's collectives those of the per-bucket programs together (none merged);
the bytes the formula per bucket; in the program of ``make_step`` (and of the
FSDP step, and through the hierarchy), bucket ``b``'s collectives depend on
the gradients of buckets ``0..b`` only (the first layer's gradient, in the last
bucket, is an ancestor of none of the earlier exchanges) and on the exchange of
bucket ``b - 1``; a step with a non-finite value in one bucket skips every
bucket's state; a plan of one bucket gives the bits of no buckets; the order
read off the loss (``training.backward_order``, ``training.with_bucket_order``)
fills the buckets of a tree whose keys run against the layers so that they are
pipelined too. The contract suite (``test_contract.py``) runs bucketed variants
through every other check.
"""

import collections
import functools

import chex
import jax
from jax import lax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxcomp
from jaxcomp import protocol
from jaxcomp import registry
from jaxcomp import training
from jaxcomp import wire
from jaxcomp._src import backward
from jaxcomp._src import selection

import harness

# Four layers; the keys sort in layer order, so the tree's leaves run from the
# first layer to the last.
WIDTHS = (16, 32, 32, 24, 8)
PARAMS = {f"l{i}_{part}": jnp.zeros(shape) for i, (n_in, n_out) in enumerate(zip(WIDTHS, WIDTHS[1:]))
          for part, shape in (("b", (n_out,)), ("w", (n_in, n_out)))}
KEYS = sorted(PARAMS)
# 600 f32 per bucket: three buckets, the first layer's leaves in the last (see
# test_the_plan_is_ddp_s_rule_on_the_model).
CAP_MB = 2400 / 2**20
SMALL_MODEL = {"density": 0.1, "rank": 2, "levels": 4, "bucket_size": 32}
EXTRA = {"dgc": {"clip_norm": 1.0, "warmup_steps": 2}}
# What each bucket computes does not depend on a key: its values are the method's
# on its leaves alone (DGC with its exact selection, PowerSGD with a warm start).
DETERMINISTIC = {"allreduce", "cast", "topk", "gtopk", "signsgd", "powersgd", "acpsgd", "dgc"}
EXACT_SELECTION = {"dgc": {"sample_ratio": 1.0}}
COLLECTIVES = {"psum", "psum_invariant", "all_gather", "all_gather_invariant", "ppermute",
               "all_to_all", "reduce_scatter", "psum_scatter", "pmin", "pmax"}


def _config(name, **extra):
  defaults = registry.get(name).defaults
  small = {k: v for k, v in SMALL_MODEL.items() if k in defaults}
  return {**small, **EXTRA.get(name, {}), **extra}


def _build(name, axis="data", **extra):
  return registry.build(name, axis, **_config(name, **extra))


def _plan(tx, params=PARAMS):
  return protocol.spec(tx).fused.plan(params)


def _keys(bucket):
  return [KEYS[i] for i in bucket.leaves]


# ------------------------------------------------------------------ the plan


def test_the_plan_is_ddp_s_rule_on_the_model():
  buckets = _plan(jaxcomp.allreduce("data", bucket_cap_mb=CAP_MB))
  # In reverse: l3_w, l3_b, l2_w close the first at 968 floats; l2_b, l1_w the
  # second; l1_b, l0_w, l0_b stay below 600.
  assert [_keys(b) for b in buckets] == [["l2_w", "l3_b", "l3_w"], ["l1_w", "l2_b"],
                                         ["l0_b", "l0_w", "l1_b"]]
  assert _plan(jaxcomp.allreduce("data")) == (protocol.Bucket.of(PARAMS),)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
       cap_kib=st.integers(1, 8))
def test_the_plan_partitions_in_reverse_order_and_closes_at_the_cap(sizes, cap_kib):
  """Every leaf once; the buckets run from the last leaves to the first; each
  closes with the leaf that brings it to its limit (the first's is 1 MiB, here
  scaled down with the cap), so a leaf past the cap closes the bucket it joins."""
  tree = [jax.ShapeDtypeStruct((n,), jnp.float32 if n % 3 else jnp.bfloat16) for n in sizes]
  bucket = protocol.Bucket.of(tree)
  cap_mb = cap_kib / 1024
  buckets = protocol.plan(bucket, cap_mb)
  order = [i for b in buckets for i in sorted(b.leaves, reverse=True)]
  assert order == list(range(len(sizes)))[::-1]
  for index, b in enumerate(buckets):
    assert list(b.leaves) == sorted(b.leaves)  # the layout's order within a bucket
    nbytes = [n * (4 if n % 3 else 2) for n in (sizes[i] for i in b.leaves)]
    limit = min(1.0, cap_mb) * 2**20 if index == 0 else cap_mb * 2**20
    if index + 1 < len(buckets):
      assert sum(nbytes) >= limit > sum(nbytes) - nbytes[0]  # closed by its first-layer leaf
    else:
      assert sum(nbytes) - nbytes[0] < limit


def test_the_first_bucket_closes_at_one_mib():
  tree = [jax.ShapeDtypeStruct((2**18,), jnp.float32)] * 4  # 1 MiB each
  buckets = protocol.plan(protocol.Bucket.of(tree), 25.0)
  assert [b.leaves for b in buckets] == [(3,), (0, 1, 2)]


def test_a_method_s_own_order_is_kept_within_a_bucket():
  tx = jaxcomp.powersgd(2, "data", bucket_cap_mb=CAP_MB)
  layout = protocol.spec(tx).fused.layout(PARAMS)
  for b in _plan(tx):
    positions = [layout.leaves.index(i) for i in b.leaves]
    assert positions == sorted(positions)
  # the matrices first, then the biases: the layout's order, not the tree's
  assert _keys(_plan(tx)[0]) == ["l3_w", "l2_w", "l3_b"]


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "25", True])
def test_a_bad_cap_is_refused_by_name(name, bad):
  with pytest.raises((ValueError, TypeError), match="bucket_cap_mb"):
    _build(name, bucket_cap_mb=bad)


@pytest.mark.parametrize("name", registry.names())
def test_the_cap_is_in_the_configuration(name):
  spec = protocol.spec(_build(name, bucket_cap_mb=25))
  assert spec.config["bucket_cap_mb"] == 25.0


# ------------------------------------------------- each bucket on its own


def _sub(tree, keys):
  return {k: tree[k] for k in keys}


@functools.lru_cache(maxsize=None)
def _bucket_runs(name):
  """Two steps of the bucketed method on the model and of the plain method on each
  bucket's leaves alone: outputs, states and compiled programs."""
  mesh = training.make_mesh(8)
  extra = EXACT_SELECTION.get(name, {})
  tx = _build(name, bucket_cap_mb=CAP_MB, **extra)
  grads = [harness.per_device_normal(PARAMS, seed) for seed in (1, 2)]

  def two_steps(tx, params, keys):
    update = training.make_update(tx, mesh, "data")
    state = training.init_state(tx, params, mesh, "data")
    sharded = [training.shard(_sub(g, keys), mesh, "data") for g in grads]
    compiled = update.lower(sharded[0], state).compile()
    outs = []
    for g in sharded:
      out, state = jax.block_until_ready(update(g, state))
      outs.append(out)
    return dict(outs=outs, state=state, compiled=compiled)

  whole = two_steps(tx, PARAMS, KEYS)
  parts = [two_steps(_build(name, **extra), _sub(PARAMS, _keys(b)), _keys(b))
           for b in _plan(tx)]
  return tx, whole, parts


@pytest.mark.parametrize("name", registry.names())
def test_the_program_holds_each_bucket_s_collectives_apart(name):
  """The bucketed program's collectives are the per-bucket programs' together, kind
  and buffer alike: no combiner merged two buckets (on CPU every independent
  all-reduce of a program would be merged into one)."""
  tx, whole, parts = _bucket_runs(name)
  assert len(parts) == 3

  def ops(compiled):
    return sorted((op.kind, op.buffer_bytes, op.branch) for op in
                  wire.collective_bytes(compiled).ops)

  assert ops(whole["compiled"]) == sorted(sum((ops(p["compiled"]) for p in parts), []))


@pytest.mark.parametrize("name", registry.names())
def test_bytes_are_the_formula_per_bucket(name):
  tx, whole, parts = _bucket_runs(name)
  read = wire.collective_bytes(whole["compiled"])
  formula = wire.expected_bytes(tx, PARAMS, 8)
  per_bucket = [wire.expected_bytes(_build(name), _sub(PARAMS, _keys(b)), 8)
                for b in _plan(tx)]
  assert formula.by_branch == read.by_branch
  for kind in set(formula.by_kind) | set(read.by_kind):
    assert formula.by_kind.get(kind, 0) == sum(p.by_kind.get(kind, 0) for p in per_bucket)
  assert formula.total == sum(p.total for p in per_bucket)
  if wire.expected_bytes(tx, PARAMS, 8, steps=1) == formula:
    assert read.by_kind == formula.by_kind


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_each_bucket_is_the_method_on_its_leaves_alone(name):
  """Means, residuals and the method's own state, over two steps (ACP-SGD's two
  kinds): k, scales, clipping and factors are each bucket's own. Within float
  rounding: the programs differ, so XLA may fuse a reduction differently."""
  tx, whole, parts = _bucket_runs(name)
  close = functools.partial(chex.assert_trees_all_close, rtol=1e-5, atol=1e-6)
  for index, (bucket, part) in enumerate(zip(_plan(tx), parts)):
    keys = _keys(bucket)
    for got, want in zip(whole["outs"], part["outs"]):
      close(_sub(got, keys), want)
    state, want = whole["state"], part["state"]
    for field in state._fields:
      value = getattr(state, field)
      if field in ("residual", "momentum", "p", "q") and value != ():
        close(value[index], getattr(want, field))  # one per bucket
      else:
        chex.assert_trees_all_equal(value, getattr(want, field))


@pytest.mark.parametrize("name", registry.names())
def test_one_bucket_is_the_path_without_buckets_bit_for_bit(name):
  """A cap the model fits in: the same state layout and the same bits as none."""
  mesh = training.make_mesh(8)
  results = []
  for cap in (None, 1.0):
    tx = _build(name, bucket_cap_mb=cap)
    assert len(_plan(tx)) == 1
    update = training.make_update(tx, mesh, "data")
    state = training.init_state(tx, PARAMS, mesh, "data")
    outs = []
    for seed in (1, 2):
      out, state = jax.block_until_ready(
          update(training.shard(harness.per_device_normal(PARAMS, seed), mesh, "data"), state))
      outs.append(out)
    results.append((outs, state))
  assert jax.tree.structure(results[0]) == jax.tree.structure(results[1])
  for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
    harness.assert_bitwise_equal(got, want)


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_low_rank_factors_are_one_buffer_per_bucket(name):
  tx = _build(name, bucket_cap_mb=CAP_MB)
  state = tx.init(PARAMS)
  for field in ("p", "q"):
    if field in state._fields:
      factors = getattr(state, field)
      assert isinstance(factors, tuple) and len(factors) == 3
      for factor, bucket in zip(factors, _plan(tx)):
        assert factor.shape == getattr(_build(name).init(_sub(PARAMS, _keys(bucket))),
                                       field).shape


# --------------------------------------------- a non-finite value in one bucket


@pytest.mark.parametrize("name", [n for n in registry.names() if n not in ("allreduce", "cast")])
def test_a_nan_in_one_bucket_skips_every_bucket_s_state(name):
  mesh = training.make_mesh(8)
  tx = _build(name, bucket_cap_mb=CAP_MB)
  update = training.make_update(tx, mesh, "data")
  state = training.init_state(tx, PARAMS, mesh, "data")
  _, state = update(training.shard(harness.per_device_normal(PARAMS, 1), mesh, "data"), state)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
  bad = harness.per_device_normal(PARAMS, 2)
  bad["l3_w"] = bad["l3_w"].at[5, 0, 0].set(jnp.nan)  # the first bucket, device 5
  out, state = jax.block_until_ready(update(training.shard(bad, mesh, "data"), state))
  for got, was in zip(jax.tree.leaves(state), before):
    harness.assert_bitwise_equal(got, was)
  first = _keys(_plan(tx)[0])
  assert not all(np.isfinite(np.asarray(out[key])).all() for key in first)


def test_a_dense_nan_stays_in_its_bucket():
  """The order token reads a non-finite value as 0: the later buckets' means stay
  those of the finite gradients."""
  mesh = training.make_mesh(8)
  update = training.make_update(jaxcomp.allreduce("data", bucket_cap_mb=CAP_MB), mesh, "data")
  grads = harness.per_device_normal(PARAMS, 1)
  clean, _ = update(training.shard(grads, mesh, "data"), optax.EmptyState())
  grads["l3_w"] = grads["l3_w"].at[5, 0, 0].set(jnp.nan)
  out, _ = update(training.shard(grads, mesh, "data"), optax.EmptyState())
  assert np.isnan(np.asarray(out["l3_w"][:, 0, 0])).all()
  for key in ("l0_w", "l1_w", "l0_b"):
    harness.assert_bitwise_equal(out[key], clean[key])


# ------------------------------------ the dependencies in the step's program


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def tag(x, bits):
  return x


def _fwd(x, bits):
  return x, None


def _bwd(bits, _, g):
  # A primitive nothing else in the step uses, on each parameter's gradient:
  # its mantissa width names the leaf in the jaxpr.
  return (lax.reduce_precision(g, exponent_bits=8, mantissa_bits=bits),)


tag.defvjp(_fwd, _bwd)
FIRST_BITS = 4  # leaf i's gradient is reduced to FIRST_BITS + i mantissa bits


def loss_fn(params, batch):
  """An MLP whose every parameter's gradient passes one tagged op."""
  x, y = batch
  params = {k: tag(v, FIRST_BITS + KEYS.index(k)) for k, v in params.items()}
  for i in range(len(WIDTHS) - 1):
    x = x @ params[f"l{i}_w"] + params[f"l{i}_b"]
    if i + 2 < len(WIDTHS):
      x = jnp.tanh(x)
  return jnp.mean((x - y) ** 2)


def collective_ancestors(closed):
  """Every collective of a (closed) jaxpr, nested ones included, with its ancestors:
  ``[(id, primitive, leaves, collectives)]``, ``leaves`` the positions (in
  :data:`KEYS`) of the tagged gradients it depends on, ``collectives`` the ids of
  the collectives before it on which it depends. A higher-order primitive whose
  inputs cannot be matched to its body's (a loop) is taken as joining every input
  to every output: an over-approximation, which can only add ancestors."""
  found = []

  def walk(jaxpr, in_sets):
    env = {}

    def read(v):
      return env.get(v, frozenset()) if isinstance(v, jex_core.Var) else frozenset()

    for v, s in zip(jaxpr.invars, in_sets):
      env[v] = s
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      joined = frozenset().union(*ins)
      name = eqn.primitive.name
      subs = backward.sub_jaxprs(eqn)
      if name == "reduce_precision" and eqn.params["mantissa_bits"] >= FIRST_BITS:
        out = joined | {eqn.params["mantissa_bits"] - FIRST_BITS}
        outs = [out] * len(eqn.outvars)
      elif name in COLLECTIVES:
        ident = -(len(found) + 1)
        found.append((ident, name, joined))
        outs = [joined | {ident}] * len(eqn.outvars)
      elif name == "cond":
        branch_outs = [walk(b, ins[1:]) for b in subs]
        outs = [frozenset().union(ins[0], *column) for column in zip(*branch_outs)]
      elif len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
        outs = walk(subs[0], ins)
      elif subs:
        for sub in subs:
          walk(sub, [joined] * len(sub.invars))
        outs = [joined] * len(eqn.outvars)
      else:
        outs = [joined] * len(eqn.outvars)
      for v, s in zip(eqn.outvars, outs):
        env[v] = s
    return [read(v) for v in jaxpr.outvars]

  walk(closed.jaxpr, [frozenset()] * len(closed.jaxpr.invars))
  return [(ident, name, frozenset(a for a in s if a >= 0), frozenset(a for a in s if a < 0))
          for ident, name, s in found]


def _batch(devices):
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.normal(size=(4 * devices, WIDTHS[0])), jnp.float32),
          jnp.asarray(rng.normal(size=(4 * devices, WIDTHS[-1])), jnp.float32))


def _assert_pipelined(closed, buckets, every=True):
  """Bucket b's exchange: the collectives whose latest tagged gradient is in bucket
  b. Each bucket has one; none reads the first layer's gradient (in the last bucket)
  but the last; each collective of bucket b follows every one of bucket b - 1 (the
  order token reads them all; with ``every=False``, one of bucket b's follows one
  of bucket b - 1's: the FSDP step's per-leaf reduce-scatters are autodiff's, not
  the compressor's)."""
  bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket.leaves}
  groups = collections.defaultdict(list)
  for ident, name, leaves, before in collective_ancestors(closed):
    if leaves:
      groups[max(bucket_of[i] for i in leaves)].append((ident, name, leaves, before))
  assert sorted(groups) == list(range(len(buckets))), sorted(groups)
  first_layer = {KEYS.index("l0_w"), KEYS.index("l0_b")}
  last = len(buckets) - 1
  assert all(bucket_of[i] == last for i in first_layer)
  for b in range(last):
    for _, _, leaves, _ in groups[b]:
      assert not leaves & first_layer
  for b in range(1, len(buckets)):
    earlier = {ident for ident, *_ in groups[b - 1]}
    if every:
      assert all(earlier <= before for *_, before in groups[b]), f"bucket {b} not after {b - 1}"
    else:
      assert any(before & earlier for *_, before in groups[b]), f"bucket {b} not after {b - 1}"


@pytest.mark.parametrize("name", registry.names())
def test_each_bucket_s_exchange_waits_only_for_its_own_and_earlier_gradients(name):
  mesh = training.make_mesh(8)
  tx = _build(name, bucket_cap_mb=CAP_MB)
  chain = optax.chain(tx, optax.sgd(0.1))
  step = training.make_step(loss_fn, chain, mesh, "data", donate=False)
  state = training.init_state(chain, PARAMS, mesh, "data")
  batch = training.shard(_batch(8), mesh, "data")
  # The program of every form (a switch among them), and each form's own.
  form = protocol.spec(tx).form
  forms = sorted({form(count) for count in range(8)}) if form else []
  for program in [step] + [step.program(f) for f in forms]:
    _assert_pipelined(jax.make_jaxpr(program)(PARAMS, state, batch), _plan(tx))


@pytest.mark.parametrize("name", ["allreduce", "gtopk"])
def test_without_buckets_every_exchange_waits_for_the_first_layer(name):
  """The walk sees the dependency it must: one bucket, so the first layer's gradient
  is an ancestor of every exchange of a gradient."""
  mesh = training.make_mesh(8)
  chain = optax.chain(_build(name), optax.sgd(0.1))
  step = training.make_step(loss_fn, chain, mesh, "data", donate=False)
  state = training.init_state(chain, PARAMS, mesh, "data")
  closed = jax.make_jaxpr(step)(PARAMS, state, training.shard(_batch(8), mesh, "data"))
  first = KEYS.index("l0_w")
  exchanges = [c for c in collective_ancestors(closed) if c[2]]
  assert exchanges and all(first in leaves for _, _, leaves, _ in exchanges)


@pytest.mark.parametrize("name", ["gtopk", "powersgd", "acpsgd"])
def test_the_hierarchy_s_buckets_are_pipelined_too(name):
  """On (dcn 2, ici 4): each bucket's fast reduce-scatter, slow exchange and fast
  all-gather wait only for its own and earlier gradients, and its bytes per axis
  are the formula's."""
  shape, axes = (2, 4), ("dcn", "ici")
  mesh = training.make_mesh(shape, axes)
  tx = jaxcomp.hierarchical(_build(name, "dcn", bucket_cap_mb=CAP_MB / 4), "ici", 4)
  chain = optax.chain(tx, optax.sgd(0.1))
  step = training.make_step(loss_fn, chain, mesh, axes, donate=False)
  state = training.init_state(chain, PARAMS, mesh, axes)
  batch = training.shard(_batch(8), mesh, axes)
  closed = jax.make_jaxpr(step)(PARAMS, state, batch)
  inner = protocol.spec(_build(name, "dcn", bucket_cap_mb=CAP_MB / 4)).fused
  buckets = inner.plan(training.shard_shapes(PARAMS, 4))
  assert len(buckets) == 3
  _assert_pipelined(closed, buckets)
  compiled = step.lower(PARAMS, state, batch).compile()
  read = wire.collective_bytes(compiled, mesh_shape=dict(mesh.shape)).by_axes
  assert read == wire.expected_bytes(tx, PARAMS, dict(mesh.shape)).by_axes


@pytest.mark.parametrize("name", ["gtopk", "powersgd"])
def test_the_fsdp_step_s_buckets_are_pipelined_too(name):
  mesh = training.make_mesh((2, 4), ("dcn", "ici"))
  tx = _build(name, "dcn", bucket_cap_mb=CAP_MB / 4)
  chain = optax.chain(tx, optax.sgd(0.1))
  step = training.make_fsdp_step(loss_fn, chain, mesh, "dcn", "ici", PARAMS, donate=False)
  params = training.shard_params(PARAMS, mesh, "ici")
  state = training.init_fsdp_state(chain, PARAMS, mesh, "dcn", "ici")
  batch = training.shard(_batch(8), mesh, ("dcn", "ici"))
  closed = jax.make_jaxpr(step)(params, state, batch)
  buckets = protocol.spec(tx).fused.plan(training.shard_shapes(PARAMS, 4))
  assert len(buckets) == 3
  _assert_pipelined(closed, buckets, every=False)
  compiled = step.lower(params, state, batch).compile()
  read = wire.collective_bytes(compiled, mesh_shape=dict(mesh.shape)).by_axes
  assert read == wire.tally(training.fsdp_transfers(tx, PARAMS, dict(mesh.shape),
                                                    "dcn", "ici")).by_axes


@pytest.mark.parametrize("layout", ["hierarchical", "fsdp"])
def test_shared_selection_lengths_keep_the_bits_in_every_layout(layout, monkeypatch):
  """gTop-k's buckets zero-padded for the exact search (here from 100 entries on,
  to multiples of 9: the shards' buckets of 242 and 262 entries to 243 and 270)
  train as through lax.top_k unpadded, bit for bit over two steps, in the
  hierarchy and in the FSDP step."""
  mesh = training.make_mesh((2, 4), ("dcn", "ici"))
  batch = training.shard(_batch(8), mesh, ("dcn", "ici"))
  results = []
  for exact_min_size in (100, None):
    monkeypatch.setattr(selection, "tuning_for",
                        lambda backend=None, size=exact_min_size: selection.Tuning(
                            exact_min_size=size, native=False))
    # At density 0.5 the padded length's capacity exceeds k (122 against 121 slots).
    inner = _build("gtopk", "dcn", bucket_cap_mb=CAP_MB / 4, density=0.5)
    spec = protocol.spec(inner)
    lengths = [spec.method.flat_length(b, 2)
               for b in spec.fused.plan(training.shard_shapes(PARAMS, 4))]
    tx = jaxcomp.hierarchical(inner, "ici", 4) if layout == "hierarchical" else inner
    chain = optax.chain(tx, optax.sgd(0.1))
    if layout == "fsdp":
      step = training.make_fsdp_step(loss_fn, chain, mesh, "dcn", "ici", PARAMS, donate=False)
      params = training.shard_params(PARAMS, mesh, "ici")
      state = training.init_fsdp_state(chain, PARAMS, mesh, "dcn", "ici")
    else:
      step = training.make_step(loss_fn, chain, mesh, ("dcn", "ici"), donate=False)
      params, state = PARAMS, training.init_state(chain, PARAMS, mesh, ("dcn", "ici"))
    for _ in range(2):
      params, state = jax.block_until_ready(step(params, state, batch))[:2]
    results.append((lengths, jax.tree.leaves((params, state))))
  assert results[0][0] == [243, 270, 144] and results[1][0] == [242, 262, 144]
  for got, want in zip(results[0][1], results[1][1]):
    harness.assert_bitwise_equal(got, want)


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_a_checkpoint_carries_each_bucket_s_factors(name, tmp_path):
  """Saved after three steps and restored onto the same 8 devices, the run goes on bit
  for bit (ACP-SGD in the form its count says); onto 4, each bucket's factors (equal on
  every device) come back as they were and the residuals keep their mean."""
  mesh = training.make_mesh(8)
  chain = optax.chain(_build(name, bucket_cap_mb=CAP_MB), optax.sgd(0.1))
  step = training.make_step(loss_fn, chain, mesh, "data", donate=False)
  params = training.replicate(jax.tree.map(jnp.ones_like, PARAMS), mesh)
  state = training.init_state(chain, params, mesh, "data")
  batches = [training.shard(_batch(8), mesh, "data")] * 5
  for batch in batches[:3]:
    params, state, _ = jax.block_until_ready(step(params, state, batch))
  training.save_checkpoint(tmp_path / "saved", params, state, 3)
  going_on = (params, state)
  for batch in batches[3:]:
    going_on = jax.block_until_ready(step(*going_on, batch))[:2]
  restored = training.restore_checkpoint(tmp_path / "saved", params, state, mesh, "data")[:2]
  for batch in batches[3:]:
    restored = jax.block_until_ready(step(*restored, batch))[:2]
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(going_on)):
    harness.assert_bitwise_equal(got, want)

  four = training.make_mesh(4)
  like = jax.tree.map(jnp.ones_like, PARAMS)
  params4, state4, _ = training.restore_checkpoint(
      tmp_path / "saved", training.replicate(like, four),
      training.init_state(chain, like, four, "data"), four, "data")
  saved = state[0]
  for field in ("p", "q"):
    if field in saved._fields:
      assert len(getattr(saved, field)) == 3
      for got, want in zip(getattr(state4[0], field), getattr(saved, field)):
        harness.assert_bitwise_equal(np.asarray(got).reshape(4, -1)[0],
                                     np.asarray(want).reshape(8, -1)[0])
  assert len(saved.residual) == 3
  for got, want in zip(state4[0].residual, saved.residual):  # one per bucket
    np.testing.assert_allclose(np.asarray(got).reshape(4, -1).mean(axis=0),
                               np.asarray(want).reshape(8, -1).mean(axis=0),
                               rtol=1e-5, atol=1e-7)


# ------------------------------- buckets in the order the loss makes gradients

# The same MLP with its layers named last to first (l0 <-> l3, l1 <-> l2): the
# tree runs from the last layer to the first, so its reverse, torch DDP's
# order, starts with the first layer, whose gradient is made last.
RENAMED = {k: f"l{len(WIDTHS) - 2 - int(k[1])}{k[2:]}" for k in KEYS}
RENAMED_PARAMS = {RENAMED[k]: v for k, v in PARAMS.items()}
RENAMED_KEYS = sorted(RENAMED_PARAMS)


def renamed_loss_fn(params, batch):
  return loss_fn({k: params[RENAMED[k]] for k in KEYS}, batch)


def _in_original_positions(buckets):
  """The buckets of a plan of :data:`RENAMED_PARAMS`, their leaves as positions in :data:`KEYS`."""
  original = {v: k for k, v in RENAMED.items()}
  return [protocol.Bucket(tuple(KEYS.index(original[RENAMED_KEYS[i]]) for i in b.leaves),
                          b.shapes, b.dtypes) for b in buckets]


def test_backward_order_reads_the_layers_not_the_keys():
  """The MLP's gradients come last layer first, however the keys sort; through a
  jitted loss, a rematerialised layer and an auxiliary output alike."""
  want = tuple(RENAMED_KEYS.index(RENAMED[f"l{i}_{part}"])
               for i in reversed(range(len(WIDTHS) - 1)) for part in ("b", "w"))
  rewritten = {
      "plain": (renamed_loss_fn, False),
      "jit": (jax.jit(renamed_loss_fn), False),
      "remat": (jax.checkpoint(renamed_loss_fn), False),
      "aux": (lambda p, b: (renamed_loss_fn(p, b), {"x": b[0]}), True),
  }
  for what, (fn, has_aux) in rewritten.items():
    got = training.backward_order(fn, RENAMED_PARAMS, _batch(1), has_aux=has_aux)
    # Within a layer the bias's gradient and the weight's are both made from the
    # layer's output gradient: either may come first, the layers may not.
    assert [RENAMED_KEYS[i][:2] for i in got] == [RENAMED_KEYS[i][:2] for i in want], what
    assert sorted(got) == list(range(len(KEYS))), what


def test_backward_order_of_a_flax_transformer_runs_from_the_head_to_the_embeddings():
  """Keys sorted by name put the blocks first and the embeddings last; the backward
  pass makes the head's gradients first, then each block's, last block first, and
  the embeddings' last."""
  from experiments import models
  model = models.char_transformer(layers=2, width=16, heads=2, context=8, vocab=32)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(model.params)]
  tokens = jnp.zeros((2, 8), jnp.int32)
  order = [paths[i] for i in training.backward_order(model.loss, model.params, (tokens, tokens))]
  assert sorted(order) == sorted(paths)
  assert paths[0].startswith("['blocks'][0]") and paths[-1] == "['token']['embedding']"
  assert {p.split("]")[0] for p in order[:2]} == {"['head'"}
  blocks = [int(p[len("['blocks']["):].split("]")[0]) for p in order if p.startswith("['blocks']")]
  assert blocks == sorted(blocks, reverse=True)
  assert set(order[-2:]) == {"['position']['embedding']", "['token']['embedding']"}


def test_backward_order_puts_an_unused_parameter_first():
  params = {"a": jnp.ones((3, 2)), "b_unused": jnp.ones((4,)), "c": jnp.ones((5, 3))}

  def loss(p, x):
    return jnp.sum(jnp.tanh(x @ p["c"]) @ p["a"])

  # "a" is the last layer, "c" the first; "b_unused" has a zero gradient, made by none.
  assert training.backward_order(loss, params, jnp.ones((2, 5))) == (1, 0, 2)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
       cap_kib=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_a_bucket_order_fills_the_buckets_in_that_order(sizes, cap_kib, seed):
  """Each bucket is the next run of the order, closed by the leaf that brings it to
  its limit, the layout's order kept within it."""
  tree = [jax.ShapeDtypeStruct((n,), jnp.float32) for n in sizes]
  order = tuple(int(i) for i in np.random.default_rng(seed).permutation(len(sizes)))
  cap_mb = cap_kib / 1024
  buckets = protocol.plan(protocol.Bucket.of(tree), cap_mb, order)
  start = 0
  for index, b in enumerate(buckets):
    run = order[start:start + len(b.leaves)]
    start += len(b.leaves)
    assert list(b.leaves) == sorted(run)
    nbytes = [4 * sizes[i] for i in run]
    limit = min(1.0, cap_mb) * 2**20 if index == 0 else cap_mb * 2**20
    if index + 1 < len(buckets):
      assert sum(nbytes) >= limit > sum(nbytes) - nbytes[-1]
    else:
      assert sum(nbytes) - nbytes[-1] < limit
  assert start == len(sizes)


def test_a_bad_bucket_order_is_refused_by_name():
  tx = _build("topk", bucket_cap_mb=CAP_MB)
  for bad in ([0, 0, 1], [1, 2], [-1, 0]):
    with pytest.raises(ValueError, match="`order` must hold each position"):
      training.with_bucket_order(tx, bad)
  with pytest.raises(TypeError, match="`order` must be a sequence of ints"):
    training.with_bucket_order(tx, [0.0, 1.0])
  for not_a_compressor in (optax.sgd(0.1), optax.chain(tx, optax.sgd(0.1)),
                           jaxcomp.hierarchical(tx, "ici", 2)):
    with pytest.raises(TypeError, match="`tx` must be a compressor"):
      training.with_bucket_order(not_a_compressor, range(len(KEYS)))
  short = training.with_bucket_order(tx, range(len(KEYS) - 1))
  with pytest.raises(ValueError, match=f"not an order of this tree's {len(KEYS)} leaves"):
    short.init(PARAMS)


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_the_reverse_tree_order_given_is_the_default_bit_for_bit(name):
  mesh = training.make_mesh(8)
  results = []
  for tx in (_build(name, bucket_cap_mb=CAP_MB),
             training.with_bucket_order(_build(name, bucket_cap_mb=CAP_MB),
                                        reversed(range(len(KEYS))))):
    assert _plan(tx) == _plan(_build(name, bucket_cap_mb=CAP_MB))
    update = training.make_update(tx, mesh, "data")
    state = training.init_state(tx, PARAMS, mesh, "data")
    out, state = jax.block_until_ready(
        update(training.shard(harness.per_device_normal(PARAMS, 1), mesh, "data"), state))
    results.append((out, state))
  for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
    harness.assert_bitwise_equal(got, want)


@pytest.mark.parametrize("name", ["allreduce", "gtopk", "powersgd", "acpsgd"])
def test_the_loss_s_order_pipelines_a_tree_that_runs_against_the_layers(name):
  """Renamed so that the tree runs from the last layer to the first, DDP's reverse
  order puts the first layer in the first bucket, and every exchange waits for its
  gradient, made last; the order read off the loss gives the buckets of the model
  named in layer order, and they are pipelined."""
  mesh = training.make_mesh(8)
  batch = training.shard(_batch(8), mesh, "data")
  order = training.backward_order(renamed_loss_fn, RENAMED_PARAMS, _batch(1))
  first = KEYS.index("l0_w")
  for tx, pipelined in ((_build(name, bucket_cap_mb=CAP_MB), False),
                        (training.with_bucket_order(_build(name, bucket_cap_mb=CAP_MB), order),
                         True)):
    chain = optax.chain(tx, optax.sgd(0.1))
    step = training.make_step(renamed_loss_fn, chain, mesh, "data", donate=False)
    state = training.init_state(chain, RENAMED_PARAMS, mesh, "data")
    closed = jax.make_jaxpr(step)(RENAMED_PARAMS, state, batch)
    buckets = _in_original_positions(_plan(tx, RENAMED_PARAMS))
    if pipelined:
      assert [sorted(b.leaves) for b in buckets] == [sorted(b.leaves) for b in _plan(
          _build(name, bucket_cap_mb=CAP_MB))]
      _assert_pipelined(closed, buckets)
    else:
      assert first in buckets[0].leaves
      exchanges = [c for c in collective_ancestors(closed) if c[2]]
      assert exchanges and all(first in leaves for _, _, leaves, _ in exchanges)
