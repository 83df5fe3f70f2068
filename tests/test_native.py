"""The native custom calls: the selections (exact_topk's, sampled_topk's, each row's top
k, the sent mask), SparseLoCo's two-level encoding and error feedback's corrected
gradient, each with the JAX route's bits, and everything in JAX wherever the calls
cannot be built."""

import math
import subprocess
import sys
from unittest import mock

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp import registry
from jaxcomp import training
from jaxcomp.collectives import EMPTY_INDEX
from jaxcomp._src import binade
from jaxcomp._src import demo
from jaxcomp._src import error_feedback
from jaxcomp._src import lowrank
from jaxcomp._src import native
from jaxcomp._src import protocol
from jaxcomp._src import qsgd
from jaxcomp._src import quantized
from jaxcomp._src import selection
from jaxcomp._src import sparseloco
from jaxcomp._src import two_hop
from tests import harness

# Magnitudes with many ties, zeros of both signs, infinities and NaN among them.
_ENTRY = st.one_of(
    st.floats(-4, 4, width=32),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, np.inf, -np.inf, np.nan]),
)


@st.composite
def _cases(draw):
  n = draw(st.integers(1, 300))
  x = np.asarray(draw(st.lists(_ENTRY, min_size=n, max_size=n)), np.float32)
  k = draw(st.integers(1, n))
  capacity = draw(st.integers(k, n))
  return x, capacity, k


def _bits(pair):
  values, indices = (np.asarray(a) for a in pair)
  return values.view(np.uint32), indices


def _bits_any_nan(x) -> np.ndarray:
  """``x``'s bits with every NaN as one: where a sum meets two NaNs (the momentum's and
  the residual's), which it returns is the compiler's choice, which may commute the
  sum, and XLA's; every other value bit for bit."""
  x = np.asarray(x, np.float32)
  return np.where(np.isnan(x), np.float32(np.nan), x).view(np.uint32)


@harness.needs_native
@hypothesis.given(_cases())
def test_the_custom_call_gives_exact_topk_s_bits(case):
  x, capacity, k = case
  by_jax = jax.jit(lambda x, k: selection.exact_topk(x, capacity, k=k))(x, k)
  by_call = jax.jit(lambda x, k: native.topk(x, capacity, k))(x, k)
  np.testing.assert_array_equal(_bits(by_call)[0], _bits(by_jax)[0])
  np.testing.assert_array_equal(_bits(by_call)[1], _bits(by_jax)[1])


@st.composite
def _sampled_cases(draw):
  x, capacity, k = draw(_cases())
  size = x.shape[0]
  tail = np.asarray(draw(st.lists(_ENTRY, max_size=40)), np.float32)
  tuning = selection.Tuning(sampled_min_size=None,
                            min_fraction=draw(st.sampled_from([0.0, 0.5, 0.8, 1.0])),
                            candidate_factor=draw(st.sampled_from([1, 2, 4])))
  ratio = draw(st.sampled_from([0.01, 0.1, 0.5, 0.99]))
  return np.concatenate([x, tail]), size, capacity, k, tuning, ratio, draw(st.integers(0, 7))


@harness.needs_native
@hypothesis.given(_sampled_cases())
def test_the_sampled_call_gives_sampled_topk_s_bits(case):
  # Every path of DGC's selection past its sample: the count above the threshold
  # short of min_fraction * k, past the candidates (both fall back to the exact
  # top k), or within them (the min(k, count) largest); a head shorter than x.
  x, size, capacity, k, tuning, ratio, seed = case

  def select(t):
    return jax.jit(lambda x, k: selection.sampled_topk(
        x, capacity, k, jax.random.key(seed), ratio, t, size=size))(x, k)

  by_jax, by_call = select(tuning._replace(native=False)), select(tuning)
  np.testing.assert_array_equal(_bits(by_call)[0], _bits(by_jax)[0])
  np.testing.assert_array_equal(_bits(by_call)[1], _bits(by_jax)[1])


def _magnitude_keys(x):
  """|x|'s int32 bits, NaN as inf's: the order both calls rank by."""
  return np.minimum(np.abs(x).view(np.int32), np.float32(np.inf).view(np.int32))


def _largest(keys, among, k):
  """The ``k`` largest keys of the positions ``among`` (ties to the lower index), sorted."""
  order = np.lexsort((among, -keys[among].astype(np.int64)))
  return np.sort(among[order[:k]])


def _check_sampled_call(x, size, capacity, k, positions, rank, candidates, min_fraction):
  """``native.sampled_topk`` against its contract, in numpy; the count sent."""
  values, indices = jax.jit(lambda x: native.sampled_topk(
      x, capacity, k, jnp.asarray(positions, jnp.int32), rank, size=size,
      candidates=candidates, min_fraction=min_fraction))(x)
  keys = _magnitude_keys(x[:size])
  threshold = np.sort(keys[positions])[::-1][rank - 1]
  kept = np.flatnonzero(keys >= threshold)
  enough = np.float32(kept.size) >= np.float32(min_fraction) * np.float32(k)
  if enough and kept.size <= candidates:
    chosen = _largest(keys, kept, min(k, kept.size))
  else:
    chosen = _largest(keys, np.arange(size), k)
  want = np.full(capacity, EMPTY_INDEX, np.int32)
  want[:chosen.size] = chosen
  np.testing.assert_array_equal(indices, want)
  want_values = np.zeros(capacity, np.float32)
  want_values[:chosen.size] = x[chosen]
  np.testing.assert_array_equal(np.asarray(values).view(np.uint32), want_values.view(np.uint32))
  return chosen.size


@harness.needs_native
@hypothesis.given(_sampled_cases(), st.data())
def test_the_sampled_call_meets_its_contract(case, data):
  # The sample and the rank given, the candidates about the count above the threshold.
  x, size, capacity, k, tuning, _, _ = case
  positions = data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=20))
  rank = data.draw(st.integers(1, len(positions)))
  keys = _magnitude_keys(x[:size])
  total = int(np.sum(keys >= np.sort(keys[positions])[::-1][rank - 1]))
  candidates = data.draw(st.sampled_from([0, max(total - 1, 0), total, total + 1, size]))
  _check_sampled_call(x, size, capacity, k, positions, rank, candidates, tuning.min_fraction)


@harness.needs_native
@pytest.mark.parametrize("min_fraction, candidates, sent", [
    (0.75, 3, 3),  # 3 above the threshold: exactly min_fraction * k, exactly the candidates
    (0.76, 3, 4),  # short of min_fraction * k: the exact top k
    (0.75, 2, 4),  # past the candidates: the exact top k
    (0.5, 9, 3),
])
def test_the_sampled_call_at_the_edges_of_its_bounds(min_fraction, candidates, sent):
  x = np.array([0.5, 5.0, -4.0, 2.0, 3.0, 1.0, 0.0], np.float32)
  # The sample: 2.0, 5.0, 3.0, 0.5; the threshold its second largest, 3.0.
  assert _check_sampled_call(x, 6, 5, 4, [3, 1, 4, 0], 2, candidates, min_fraction) == sent


@harness.needs_native
@pytest.mark.parametrize("fill", ["normal", "equal", "mostly_zero", "few_above"])
def test_dgc_s_selection_of_a_head_is_one_sampled_call_with_the_jax_route_s_bits(fill):
  # A 6M-entry head of a longer bucket: a count near k; every entry a tie (past the
  # candidates: the exact fallback); a threshold of 0 (past them too); 100 of the
  # sample's entries the largest, so that the threshold is theirs and the count
  # above it falls short of min_fraction * k (the exact fallback again).
  n, size, capacity = 6_000_000 + 999, 6_000_000, 6000
  x = np.array(jax.random.normal(jax.random.key(4), (n,)))
  key = jax.random.key(1)
  if fill == "equal":
    x[:] = 0.5
  elif fill == "mostly_zero":
    x[np.arange(n) % 991 != 0] = 0.0
  elif fill == "few_above":
    positions = selection._sample(size, capacity, key, 0.01, 2 * capacity)[0]
    x[np.asarray(positions)[:100]] = 9.0
  tuning = selection.tuning_for()

  def select(t):
    return jax.jit(lambda x: selection.sampled_topk(x, capacity, capacity, key, 0.01, t,
                                                    size=size)).lower(x).compile()

  program = select(tuning)
  assert program.as_text().count('custom_call_target="jaxcomp_sampled_topk"') == 1
  # No loop or branch is left of the JAX route's compaction and fallback, nor its top_k.
  assert not harness.control_flow(program.as_text())
  assert 'custom_call_target="TopK"' not in program.as_text()
  by_jax, by_call = select(tuning._replace(native=False))(x), program(x)
  np.testing.assert_array_equal(_bits(by_call)[0], _bits(by_jax)[0])
  np.testing.assert_array_equal(_bits(by_call)[1], _bits(by_jax)[1])
  # Every path gives k here: the count near k reaches it, the others fall back.
  assert np.sum(np.asarray(by_call[1]) != EMPTY_INDEX) == capacity


@harness.needs_native
@pytest.mark.parametrize("fill", ["normal", "equal", "mostly_zero", "sample_largest"])
def test_a_large_bucket_selects_in_one_custom_call_with_the_jax_route_s_bits(fill):
  # Above exact_min_size; each fill takes another path of the call: a sample
  # that lands near k; every entry a tie, or a threshold of 0 (the pass keeps
  # all); the sampled entries (every 64th here) the largest, so that fewer than
  # k reach the threshold and the pass is made again with every entry.
  n, capacity, k = (1 << 22) + 5, 4200, 4195
  x = np.array(jax.random.normal(jax.random.key(3), (n,)))
  if fill == "equal":
    x = np.full(n, 0.5, np.float32)
  elif fill == "mostly_zero":
    x[np.arange(n) % 997 != 0] = 0.0
  elif fill == "sample_largest":
    x[::n // 65536] *= 100.0
  program = jax.jit(lambda x: selection.topk(x, capacity, k=k)).lower(x).compile()
  assert program.as_text().count("custom_call_target=\"jaxcomp_topk\"") == 1
  no_native = selection.tuning_for()._replace(native=False)
  by_jax = jax.jit(lambda x: selection.topk(x, capacity, no_native, k=k))(x)
  by_call = program(x)
  np.testing.assert_array_equal(_bits(by_call)[0], _bits(by_jax)[0])
  np.testing.assert_array_equal(_bits(by_call)[1], _bits(by_jax)[1])


@harness.needs_native
@pytest.mark.parametrize("name, target, density", [
    ("topk", "jaxcomp_topk", 0.01), ("gtopk", "jaxcomp_topk", 0.01),
    ("dgc", "jaxcomp_momentum_sampled_topk", 0.01), ("randomk", "jaxcomp_sent_mask", 0.01),
    # 9 of each chunk of 4,096: rows wide enough for the per-row call, whose encoding
    # is then the two-level call's too.
    ("sparseloco", "jaxcomp_two_level", 0.002)])
def test_a_method_s_steps_on_8_devices_keep_their_bits(name, target, density, monkeypatch):
  # The exact route from 2,048 entries on, DGC's threshold from 1,024, so that every
  # bucket of this small tree takes them.
  params = {"a": jnp.zeros((60, 100)), "b": jnp.zeros(5000), "c": jnp.zeros(9)}

  def run(native_route):
    tuning = selection.Tuning(exact_min_size=2048, sampled_min_size=1024, native=native_route)
    monkeypatch.setitem(selection._BY_BACKEND, "cpu", tuning)
    runs = harness.run_two_steps(
        lambda axis: getattr(jaxcomp, name)(density, axis, bucket_cap_mb=0.03), params, 8,
        ("data",))
    assert (target in runs["compiled"].as_text()) == native_route
    return runs["outs"], runs["states"]

  chex.assert_trees_all_equal(run(True), run(False))


@st.composite
def _rows(draw):
  count, width = draw(st.integers(1, 4)), draw(st.sampled_from([1, 7, 64, 640, 1024]))
  entries = draw(st.lists(_ENTRY, min_size=count * width, max_size=count * width))
  return np.asarray(entries, np.float32).reshape(count, width), draw(st.integers(1, 9))


@harness.needs_native
@hypothesis.given(_rows())
def test_the_per_row_call_gives_the_jax_routes_bits(case):
  # Rows of many ties, NaN and infinities; the JAX route by blocks (rows of 640 and
  # 1024 entries, k > 1) and by argmax or lax.top_k (the others).
  rows, k = case
  k = min(k, rows.shape[1])
  by_call = jax.jit(lambda r: native.topk_per_row(r, k))(rows)
  by_jax = jax.jit(lambda r: selection.topk_per_row(r, k, selection.Tuning(native=False)))(rows)
  np.testing.assert_array_equal(_bits(by_call)[0], _bits(by_jax)[0])
  np.testing.assert_array_equal(_bits(by_call)[1], _bits(by_jax)[1])


@harness.needs_native
def test_sparseloco_s_wide_rows_select_in_one_per_row_call():
  # 2 rows of 4,096 at k = 5: the blocks' route in JAX, one call here; the same bits.
  rows = np.array(jax.random.normal(jax.random.key(6), (2, 4096)))
  rows[0, ::3] = 1.5  # ties
  # Row 1: five found in its first block, then one just past the fifth's magnitude in a
  # later block, which must displace it.
  rows[1] = 0.0
  rows[1, :5] = [3.0, -1.0, 1.0, 1.0, 1.0]
  rows[1, 3000] = np.nextafter(np.float32(-1.0), np.float32(-2.0))
  select = jax.jit(lambda r: selection.topk_per_row(r, 5))
  assert select.lower(rows).compile().as_text().count('"jaxcomp_topk_per_row"') == 1
  by_jax = jax.jit(lambda r: selection.topk_per_row(r, 5, selection.Tuning(native=False)))(rows)
  np.testing.assert_array_equal(_bits(select(rows))[0], _bits(by_jax)[0])
  np.testing.assert_array_equal(_bits(select(rows))[1], _bits(by_jax)[1])
  np.testing.assert_array_equal(np.asarray(select(rows)[1][1]), [0, 3000, 1, 2, 3])
  with pytest.raises(ValueError, match="`k`"):
    native.topk_per_row(rows, 4097)


@harness.needs_native
@hypothesis.given(_rows(), st.sampled_from([1.0, 1e-38]))
def test_the_two_level_call_gives_sparseloco_s_encoding_bit_for_bit(case, scale):
  # Codes, uint16 positions, levels, decoded entries and flat positions, against the
  # JAX route (each row's top k by blocks, by argmax or by lax.top_k); at 1e-38 the
  # shares of the levels are subnormal, which both flush.
  rows, k = case
  rows, k = (rows * np.float32(scale)).astype(np.float32), min(k, rows.shape[1])
  by_call = jax.jit(lambda r: native.two_level(r, k))(rows)
  with mock.patch.dict(selection._BY_BACKEND, {"cpu": selection.Tuning(native=False)}):
    by_jax = jax.jit(lambda r: sparseloco.encoded(r.reshape(-1), r.shape[1], k))(rows)
  for got, want in zip(by_call, by_jax):
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == np.float32:
      got, want = got.view(np.uint32), want.view(np.uint32)
    np.testing.assert_array_equal(got, want)


@harness.needs_native
def test_sparseloco_s_encoding_is_one_call_and_bad_rows_are_refused_by_name():
  rows = jax.random.normal(jax.random.key(3), (3, 4096))
  program = jax.jit(lambda r: sparseloco.encoded(r.reshape(-1), 4096, 7)).lower(rows)
  text = program.compile().as_text()
  assert text.count('"jaxcomp_two_level"') == 1 and "jaxcomp_topk_per_row" not in text
  with pytest.raises(ValueError, match="`rows`"):
    native.two_level(jnp.zeros((1, 2 ** 16 + 1)), 1)
  with pytest.raises(ValueError, match="`k`"):
    native.two_level(rows, 4097)


@harness.needs_native
@hypothesis.given(n=st.integers(1, 300), sent_from=st.one_of(st.none(), st.integers(0, 320)),
                  drawn=st.lists(st.integers(-2, 330), max_size=40, unique=True))
def test_the_sent_mask_call_gives_the_jax_route_s_bits(n, sent_from, drawn):
  # Any positions: inside and outside [0, n), below and past sent_from, EMPTY_INDEX.
  indices = np.asarray(drawn + [EMPTY_INDEX], np.int32)
  by_call = jax.jit(lambda i: native.sent_mask(n, i, sent_from))(indices)
  with_jax = selection.Tuning(native=False)
  with mock.patch.dict(selection._BY_BACKEND, {"cpu": with_jax}):
    by_jax = jax.jit(lambda i: error_feedback.sent_mask(n, i, sent_from))(indices)
  np.testing.assert_array_equal(np.asarray(by_call), np.asarray(by_jax))


# Subnormals among _ENTRY's: XLA:CPU's addition flushes them to zero, and so must
# the call's, on its second thread too.
_ADDEND = st.one_of(_ENTRY, st.sampled_from([1e-39, -1e-39, 1.4e-45, 1.1754942e-38]))


@st.composite
def _leaf_sets(draw):
  sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=12))
  leaves = []
  for size in sizes:
    leaf = np.asarray(draw(st.lists(_ADDEND, min_size=size, max_size=size)), np.float32)
    leaves.append(leaf.reshape(2, -1) if size % 2 == 0 and size else leaf)
  n = sum(sizes)
  residual = np.asarray(draw(st.lists(_ADDEND, min_size=n, max_size=n)), np.float32)
  return leaves, residual


def _fused_sum(leaves, residual, length):
  """The JAX route's sum (XLA:CPU's addition flushes subnormals, as the call's does)."""

  def fused(leaves, residual):
    flat = jnp.concatenate([leaf.reshape(-1) for leaf in leaves])
    if residual is not None:
      flat = flat + residual
    return jnp.pad(flat, (0, length - flat.size))

  return np.asarray(jax.jit(fused)(leaves, residual))


@harness.needs_native
@hypothesis.given(_leaf_sets(), st.booleans(), st.integers(0, 40), st.data())
def test_the_corrected_call_gives_the_fused_sum_s_bits(case, with_residual, padding, data):
  # Leaves of 0 to 40 entries, flat and [2, m]; ties, zeros of both signs,
  # infinities, NaN and subnormals; with and without a residual, padded or not;
  # one output, or parts (some empty) cut anywhere.
  leaves, residual = case
  residual = residual if with_residual else None
  length = sum(leaf.size for leaf in leaves) + padding
  cuts = sorted(data.draw(st.lists(st.integers(0, length), max_size=4)))
  parts = None if not cuts else tuple(int(d) for d in np.diff([0, *cuts, length]))
  by_call = jax.jit(lambda ls, r: native.corrected(ls, r, length, parts=parts))(leaves, residual)
  if parts is not None:
    assert tuple(part.shape[0] for part in by_call) == parts
    by_call = jnp.concatenate(by_call)
  assert by_call.shape == (length,)
  np.testing.assert_array_equal(np.asarray(by_call).view(np.uint32),
                                _fused_sum(leaves, residual, length).view(np.uint32))


@harness.needs_native
@pytest.mark.parametrize("sizes, padding, parts", [
    ((700_000, 5, 700_001), 0, None),  # the halves meet inside the 5-entry leaf
    ((600_000, 600_000), 0, None),  # at a boundary between leaves
    ((1_100_000,), 1_300_000, None),  # inside the zeros
    ((600_000, 600_000), 10, (300_000, 600_005, 300_005)),  # inside a part
])
def test_the_corrected_call_s_two_threads_meet_exactly(sizes, padding, parts):
  # Above 2**20 entries the call splits its output in two halves, one per thread.
  rng = np.random.default_rng(7)
  leaves = [rng.standard_normal(size).astype(np.float32) for size in sizes]
  for leaf in leaves:
    leaf[::1001] = 1e-39
  residual = rng.standard_normal(sum(sizes)).astype(np.float32)
  # A subnormal plus 0 is flushed to 0, in either half.
  residual[np.concatenate(leaves) == np.float32(1e-39)] = 0.0
  length = sum(sizes) + padding
  by_call = jax.jit(lambda ls, r: native.corrected(ls, r, length, parts=parts))(
      leaves, residual)
  if parts is not None:
    by_call = jnp.concatenate(by_call)
  expected = _fused_sum(leaves, residual, length)
  np.testing.assert_array_equal(np.asarray(by_call).view(np.uint32), expected.view(np.uint32))


@harness.needs_native
def test_the_corrected_call_refuses_what_it_cannot_sum_by_name():
  with pytest.raises(TypeError, match="f32"):
    native.corrected([jnp.ones(3, jnp.bfloat16)])
  with pytest.raises(ValueError, match="`residual`"):
    native.corrected([jnp.ones(3)], jnp.ones(4))
  with pytest.raises(ValueError, match="`length`"):
    native.corrected([jnp.ones(3)], None, 2)
  with pytest.raises(ValueError, match="`parts`"):
    native.corrected([jnp.ones(3)], None, 5, parts=(2, 2))
  with pytest.raises(ValueError, match="`parts`"):
    native.corrected([jnp.ones(3)], None, parts=(4, -1))


# Twelve leaves: more than XLA:CPU fuses into a concatenation's reader. With
# buckets of 0.02 MiB, the first bucket holds nine of them, the second three (fewer
# than that, which the call sums too).
_TWELVE = {f"w{i:02d}": jnp.zeros((20, 30)) for i in range(12)}


@harness.needs_native
@pytest.mark.parametrize("name, config", [
    ("topk", dict(density=0.05)), ("signsgd", {}),
    # (The integer codes take calls of their own, below.)
    ("sparseloco", dict(density=0.01, chunk_size=256)),
    # Without error feedback (the leaves copied, padded), and DGC's momentum first.
    ("qsgd", dict(levels=8)), ("dgc", dict(density=0.05)),
    # Runs: a batch of 8 matrices, then the rest (and the empty run of dense leaves).
    ("powersgd", dict(rank=2)), ("acpsgd", dict(rank=2))])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.02])
def test_the_corrected_gradient_is_one_call_with_the_jax_route_s_bits(
    name, config, bucket_cap_mb, monkeypatch):
  # quantized and sparseloco pad the bucket (to whole blocks, to whole chunks). One
  # call per bucket.
  # The low-rank products, orthonormalisations and residual by XLA on both routes
  # (their calls sum in another order: tests/test_lowrank.py compares them), and so
  # are QSGD's norms (tests/test_qsgd.py compares them).
  monkeypatch.setattr(lowrank, "_native", lambda view: False)
  monkeypatch.setattr(qsgd, "_native_norms", lambda: False)

  def run(native_route):
    monkeypatch.setitem(selection._BY_BACKEND, "cpu", selection.Tuning(native=native_route))
    runs = harness.run_two_steps(
        lambda axis: registry.build(name, axis, bucket_cap_mb=bucket_cap_mb, **config),
        _TWELVE, 8, ("data",))
    text = runs["compiled"].as_text()
    # DGC's calls also form the momentum correction (no clipping here): its selection
    # forms the sum of a bucket of 4,096 sparse entries or more in its pass, and one
    # call writes the state.
    targets = (("jaxcomp_momentum_corrected", "jaxcomp_momentum_masked") if name == "dgc"
               else ("jaxcomp_corrected",))
    buckets = 1 if bucket_cap_mb is None else 2
    calls = sum(text.count(f'custom_call_target="{target}"') for target in targets)
    assert calls == buckets * int(native_route)
    return runs["outs"], runs["states"]

  chex.assert_trees_all_equal(run(True), run(False))


@harness.needs_native
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.02])
def test_the_integer_calls_give_the_jax_route_s_mean_and_its_residual_to_a_rounding(
    bits, bucket_cap_mb, monkeypatch):
  # Two steps on 8 devices, the first hop encoded from the leaves and the residual
  # where they lie and the residual written by a call, one each per bucket: the JAX
  # route's mean bit for bit (the same first hop's bytes and scales); each residual
  # entry c - s l within a rounding of s l, which XLA:CPU may fuse into one rounding.
  def run(native_route):
    monkeypatch.setitem(selection._BY_BACKEND, "cpu", selection.Tuning(native=native_route))
    runs = harness.run_two_steps(
        lambda axis: jaxcomp.quantized(bits, axis, bucket_cap_mb=bucket_cap_mb), _TWELVE, 8,
        ("data",))
    text = runs["compiled"].as_text()
    buckets = 1 if bucket_cap_mb is None else 2
    for target in ("jaxcomp_integer_encode", "jaxcomp_integer_residual"):
      assert text.count(f'custom_call_target="{target}"') == buckets * int(native_route)
    return runs

  by_calls, by_jax = run(True), run(False)
  chex.assert_trees_all_equal(by_calls["outs"], by_jax["outs"])
  for got, want in zip(by_calls["rows"][1:], by_jax["rows"][1:]):
    np.testing.assert_array_equal(got.count, want.count)
    for name in got.residual:
      g, w = np.asarray(got.residual[name]), np.asarray(want.residual[name])
      # A step s l of the mean's first encoding is at most the block's largest |c|.
      bound = np.finfo(np.float32).eps * np.max(np.abs(np.asarray(
          by_jax["grads"][0][name])), initial=0.0) * 4
      assert np.max(np.abs(g - w), initial=0.0) <= bound, name
      assert np.abs(w).max() > 0


@harness.needs_native
@pytest.mark.parametrize("native_route", [True, False])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_the_integer_codes_take_their_first_hop_from_a_call_where_it_runs(
    native_route, error_feedback, monkeypatch):
  # The first hop is the encoding call's (from the leaves, and the residual with error
  # feedback), whose residual is a call too.
  monkeypatch.setitem(selection._BY_BACKEND, "cpu", selection.Tuning(native=native_route))
  given = []
  mean = two_hop.mean

  def recorded(*args, **kwargs):
    given.append(kwargs.get("encoded") is not None)
    return mean(*args, **kwargs)

  monkeypatch.setattr(two_hop, "mean", recorded)
  runs = harness.run_two_steps(
      lambda axis: jaxcomp.quantized(8, axis, error_feedback=error_feedback), _TWELVE, 8,
      ("data",))
  assert given and all(g == native_route for g in given)
  text = runs["compiled"].as_text()
  assert ("jaxcomp_integer_encode" in text) == native_route
  assert ("jaxcomp_integer_residual" in text) == (native_route and error_feedback)


@harness.needs_native
def test_the_hierarchical_path_sums_its_fused_shard_in_jax(monkeypatch):
  # Its bucket's leaves are slices of one shard, which XLA's concatenation folds
  # back into it: the call would copy each slice into an operand of its own. The
  # native route is on (the shard's top-k is a call).
  monkeypatch.setitem(selection._BY_BACKEND, "cpu", selection.Tuning(exact_min_size=256))
  mesh = training.make_mesh((2, 4), ("dcn", "ici"))
  tx = jaxcomp.hierarchical(jaxcomp.topk(0.05, "dcn"), "ici", 4)
  state = training.init_state(tx, _TWELVE, mesh, ("dcn", "ici"))
  grads = training.shard(harness.per_device_normal(_TWELVE, 1), mesh, ("dcn", "ici"))
  text = training.make_update(tx, mesh, ("dcn", "ici")).lower(grads, state).compile().as_text()
  assert "jaxcomp_topk" in text and "jaxcomp_corrected" not in text


def _fresh(code: str, **env) -> str:
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, env={**harness.fresh_process_env(), **env})
  assert done.returncode == 0, done.stdout + done.stderr
  return done.stdout


_ROUTE = """
import jax, jax.numpy as jnp
from jaxcomp._src import native, selection
print(native.unavailable_reason())
x = jnp.linspace(-1.0, 1.0, 1 << 22)
text = jax.jit(lambda x: selection.topk(x, 100)).lower(x).compile().as_text()
print("jaxcomp_topk" in text)
try:
  native.topk(x, 100)
except RuntimeError as error:
  print("refused:", error)
"""


def test_without_a_compiler_the_selection_stays_in_jax(tmp_path):
  out = _fresh(_ROUTE, CXX=str(tmp_path / "no-compiler"), JAXCOMP_CACHE_DIR=str(tmp_path))
  reason, routed, refused = out.strip().splitlines()
  assert reason.startswith("FileNotFoundError") and routed == "False", out
  assert "not available" in refused, out


def test_jaxcomp_native_0_turns_the_custom_call_off(tmp_path):
  out = _fresh(_ROUTE, JAXCOMP_NATIVE="0", JAXCOMP_CACHE_DIR=str(tmp_path))
  assert out.splitlines()[:2] == ["JAXCOMP_NATIVE=0", "False"], out
  assert not list(tmp_path.iterdir())  # nothing built


@harness.needs_native
def test_a_second_process_loads_the_library_the_first_built(tmp_path):
  code = "from jaxcomp._src import native; print(native.unavailable_reason())"
  assert _fresh(code, JAXCOMP_CACHE_DIR=str(tmp_path)).strip() == "None"
  (library,) = tmp_path.glob("topk-*.so")
  built = library.stat().st_mtime_ns
  assert _fresh(code, JAXCOMP_CACHE_DIR=str(tmp_path), CXX=str(tmp_path / "none")).strip() == "None"
  assert library.stat().st_mtime_ns == built and len(list(tmp_path.iterdir())) == 1


@harness.needs_native
def test_a_capacity_or_k_outside_its_range_is_refused_by_name():
  with pytest.raises(ValueError, match="capacity"):
    native.topk(jnp.ones(10), 11)
  with pytest.raises(ValueError, match="`k`"):
    native.topk(jnp.ones(10), 4, 5)
  with pytest.raises(ValueError, match="`size`"):
    native.sampled_topk(jnp.ones(10), 4, 4, jnp.zeros(3, jnp.int32), 1, size=11, candidates=8,
                        min_fraction=0.8)
  with pytest.raises(ValueError, match="capacity"):
    native.sampled_topk(jnp.ones(10), 7, 4, jnp.zeros(3, jnp.int32), 1, size=6, candidates=8,
                        min_fraction=0.8)
  with pytest.raises(ValueError, match="`rank`"):
    native.sampled_topk(jnp.ones(10), 4, 4, jnp.zeros(3, jnp.int32), 4, size=6, candidates=8,
                        min_fraction=0.8)


@harness.needs_native
def test_under_vmap_each_row_selects_its_own():
  rows = np.asarray(jax.random.normal(jax.random.key(5), (3, 200)))
  by_call = jax.jit(jax.vmap(lambda x: native.topk(x, 12)))(rows)
  for row, values, indices in zip(rows, *by_call):
    np.testing.assert_array_equal(indices, np.sort(harness.np_topk(row, 12)))
    np.testing.assert_array_equal(values, row[indices])


# ------------------------------------------------------------------- integer codes

def _flushed(x: np.ndarray) -> np.ndarray:
  """``x`` with its subnormals as zeros of their sign, as XLA:CPU's arithmetic (and the
  calls', on its threads) writes them."""
  return np.where(np.abs(x) < np.finfo(np.float32).tiny, x * np.float32(0), x)


@harness.needs_native
@hypothesis.given(_leaf_sets(), st.sampled_from([8, 4]), st.integers(1, 8), st.integers(0, 3),
                  st.booleans())
def test_the_integer_calls_give_the_integer_codes_of_the_corrected_gradient(
    case, bits, half_block, extra_blocks, donated):
  # Ties, zeros of both signs, infinities, NaN and subnormals in the leaves and the
  # residual; a partial last block and whole blocks of padding past them.
  leaves, residual = case
  n = residual.size
  hypothesis.assume(n >= 1)
  block = 2 * half_block if bits == 4 else 2 * half_block - 1
  length = (-(-n // block) + extra_blocks) * block
  payload, scales = jax.jit(lambda ls, e: native.integer_encode(ls, e, length, block, bits))(
      leaves, residual)
  corrected = _fused_sum(leaves, residual, length)
  want_payload, want_scales = jax.jit(lambda c: quantized.encode(c, bits, block))(corrected)
  np.testing.assert_array_equal(np.asarray(payload), np.asarray(want_payload))
  np.testing.assert_array_equal(np.asarray(scales).view(np.uint32),
                                np.asarray(want_scales).view(np.uint32))
  # The residual: c less its level times its scale, two roundings (no fused multiply-add
  # in the call), subnormals flushed; every level the payload's.
  got = jax.jit(lambda b, s, ls: native.integer_residual(b, s, ls, block, bits),
                donate_argnums=0 if donated else ())(jnp.asarray(residual), scales, leaves)
  levels = np.asarray(jax.jit(lambda c, s: quantized._levels(c, bits, block, s)[0])(
      corrected, want_scales)).astype(np.float32)
  with np.errstate(invalid="ignore"):  # inf times a level of 0
    steps = _flushed(np.repeat(np.asarray(want_scales), block) * levels)
    want = _flushed(corrected - steps)[:n]
  np.testing.assert_array_equal(_bits_any_nan(got), _bits_any_nan(want))


@harness.needs_native
def test_the_integer_calls_two_threads_meet_exactly_and_refuse_what_does_not_fit():
  rng = np.random.default_rng(0)
  leaves = [rng.standard_normal(size).astype(np.float32) for size in (700_001, 500_003)]
  residual = rng.standard_normal(1_200_004).astype(np.float32)
  length = 18_751 * 64
  payload, scales = native.integer_encode(leaves, jnp.asarray(residual), length, 64, 8)
  corrected = _fused_sum(leaves, residual, length)
  want_payload, want_scales = quantized.encode(jnp.asarray(corrected), 8, 64)
  np.testing.assert_array_equal(np.asarray(payload), np.asarray(want_payload))
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
  got = native.integer_residual(jnp.asarray(residual), scales, leaves, 64, 8)
  levels = np.asarray(quantized._levels(jnp.asarray(corrected), 8, 64, want_scales)[0])
  want = corrected - _flushed(np.repeat(np.asarray(want_scales), 64) * levels)
  np.testing.assert_array_equal(np.asarray(got), want[:residual.size])
  with pytest.raises(ValueError, match="`bits`"):
    native.integer_encode(leaves, jnp.asarray(residual), length, 64, 6)
  with pytest.raises(ValueError, match="`block` must be even"):
    native.integer_encode(leaves, jnp.asarray(residual), length, 63, 4)
  with pytest.raises(ValueError, match="`length`"):
    native.integer_encode(leaves, jnp.asarray(residual), length + 1, 64, 8)
  with pytest.raises(ValueError, match="`residual`"):
    native.integer_encode(leaves, jnp.asarray(residual[1:]), length, 64, 8)
  with pytest.raises(ValueError, match="`buffer`"):
    native.integer_residual(jnp.asarray(residual), scales[:10], leaves, 64, 8)


# ------------------------------------------------------------------- low rank

@st.composite
def _lowrank_cases(draw):
  groups = draw(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40)),
                         min_size=1, max_size=3))
  rank = draw(st.integers(1, 5))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

  def entries(n):
    # Magnitudes in [0.25, 4) of either sign, a tenth of them zero: far from the
    # subnormals, whose products XLA:CPU's calls flush.
    x = rng.uniform(0.25, 4, n) * rng.choice([-1.0, 1.0], n) * (rng.random(n) > 0.1)
    return x.astype(np.float32)

  runs = [entries(g * m * n).astype(np.float32) for g, m, n in groups]
  matrices = [m for run, (g, rows, cols) in zip(runs, groups)
              for m in run.reshape(g, rows, cols)]
  return groups, rank, runs, matrices, entries


def _unit_factor(column):
  top = np.max(np.abs(column).view(np.int32), initial=0)
  return np.int32(np.clip(254 - (top >> 23), 1, 254) << 23).view(np.float32)


def _left_reference(m, f):
  """``m f`` summed as the call sums: 8 interleaved f32 sums joined pairwise, then the tail."""
  rows, cols = m.shape
  products = m[:, None, :] * f.T[None, :, :]
  whole = cols - cols % 8
  lanes = np.zeros((rows, f.shape[1], 8), np.float32)
  for k in range(0, whole, 8):
    lanes += products[:, :, k:k + 8]
  tail = np.zeros((rows, f.shape[1]), np.float32)
  for k in range(whole, cols):
    tail += products[:, :, k]
  joined = (((lanes[..., 0] + lanes[..., 1]) + (lanes[..., 2] + lanes[..., 3]))
            + ((lanes[..., 4] + lanes[..., 5]) + (lanes[..., 6] + lanes[..., 7])))
  return joined + tail


def _right_reference(m, f):
  """``m^T f`` summed over the rows in order, in f32."""
  total = np.zeros((m.shape[1], f.shape[1]), np.float32)
  for i in range(m.shape[0]):
    total += m[i][:, None] * f[i][None, :]
  return total


def _product_reference(matrices, factor, scales, rank, transposed, unit):
  out, offset = [], 0
  for m, scale in zip(matrices, scales):
    n = m.shape[0] if transposed else m.shape[1]
    f = factor[offset:offset + n * rank].reshape(n, rank).copy()
    offset += n * rank
    if unit:
      f = f * np.asarray([_unit_factor(f[:, j]) for j in range(rank)], np.float32)
    f = f * np.float32(scale)
    out.append((_right_reference(m, f) if transposed else _left_reference(m, f)).reshape(-1))
  return np.concatenate(out)


@harness.needs_native
@hypothesis.given(_lowrank_cases(), st.booleans(), st.booleans())
def test_the_lowrank_product_call_sums_in_its_stated_order(case, transposed, unit):
  groups, rank, runs, matrices, entries = case
  inner = sum(m.shape[0] if transposed else m.shape[1] for m in matrices) * rank
  factor = entries(inner) * np.float32(1e20 if unit else 1.0)  # `unit` brings it back
  scales = [2.0 ** (i % 3 - 1) for i in range(len(matrices))]
  dense = entries(5)
  got = jax.jit(lambda runs, factor, dense: native.lowrank_product(
      runs, factor, scales, dense, groups, rank, transposed=transposed, unit=unit))(
          runs, factor, dense)
  want = np.concatenate([_product_reference(matrices, factor, scales, rank, transposed, unit),
                         dense])
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


def _columns_reference(factor, lengths, rank, old, scales, orthonormalize):
  """The factor column by column as the call takes it: scaled where finite, refilled,
  then modified Gram-Schmidt in float64, each sum in order."""
  out, offset = factor.copy(), 0
  for a, n in enumerate(lengths):
    done = []
    for j in range(rank):
      column = factor[offset + j:offset + n * rank:rank].copy()
      if scales is not None and np.all(np.isfinite(column * np.float32(scales[a]))):
        column = column * np.float32(scales[a])
      if old is not None and np.all(column == 0):
        column = old[offset + j:offset + n * rank:rank].copy()
      if orthonormalize:
        values = [float(x) for x in column]
        for before in done:
          dot = 0.0
          for b, v in zip(before, values):
            dot += b * v
          values = [v - dot * b for v, b in zip(values, before)]
        square = 0.0
        for v in values:
          square += v * v
        norm = math.sqrt(square)
        values = [v / (1.0 if norm == 0.0 else norm) for v in values]
        done.append(values)
        column = np.asarray(values, np.float64).astype(np.float32)
      out[offset + j:offset + n * rank:rank] = column
    offset += n * rank
  return out


@harness.needs_native
@hypothesis.given(_lowrank_cases(), st.booleans(), st.booleans(), st.booleans(), st.data())
def test_the_factor_columns_call_follows_its_stated_steps(case, refill, scaled, orthonormalize,
                                                          data):
  groups, rank, _, matrices, entries = case
  lengths = [m.shape[data.draw(st.integers(0, 1))] for m in matrices]
  size = sum(lengths) * rank
  factor = entries(size)
  zero = data.draw(st.integers(0, rank - 1))  # one column of the first factor all zero
  factor[zero:lengths[0] * rank:rank] = 0.0
  factor[-1] = data.draw(st.sampled_from([1.0, np.inf, np.nan, 3e38]))
  old = entries(size) if refill else None
  scales = [2.0 ** (i % 5 - 2) for i in range(len(lengths))] if scaled else None
  got = jax.jit(lambda f, o: native.factor_columns(
      f, lengths, rank, old=o, scales=scales, orthonormalize=orthonormalize))(factor, old)
  want = _columns_reference(factor, lengths, rank, old, scales, orthonormalize)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


@harness.needs_native
@hypothesis.given(_lowrank_cases(), st.integers(0, 7))
def test_the_lowrank_residual_call_writes_m_minus_p_q_t_over_the_buffer_s_start(case, tail):
  groups, rank, runs, matrices, entries = case
  p = entries(sum(m.shape[0] for m in matrices) * rank)
  q = entries(sum(m.shape[1] for m in matrices) * rank)
  buffer = entries(sum(m.size for m in matrices) + tail)
  got = jax.jit(lambda b, runs, p, q: native.lowrank_residual(b, runs, p, q, groups, rank),
                donate_argnums=0)(jnp.asarray(buffer), runs, p, q)
  want, p_at, q_at = [], 0, 0
  for m in matrices:
    rows, cols = m.shape
    pm = p[p_at:p_at + rows * rank].reshape(rows, rank)
    qm = q[q_at:q_at + cols * rank].reshape(cols, rank)
    p_at, q_at = p_at + rows * rank, q_at + cols * rank
    total = pm[:, None, 0] * qm[None, :, 0]
    for j in range(1, rank):
      total = total + pm[:, None, j] * qm[None, :, j]
    want.append((m - total).reshape(-1))
  want = np.concatenate(want + [buffer[buffer.size - tail:]])
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


@harness.needs_native
@hypothesis.given(_lowrank_cases(), st.booleans(), st.integers(0, 7), st.data())
def test_the_lowrank_calls_from_the_leaves_give_the_bits_of_the_corrected_runs(
    case, transposed, tail, data):
  # Each matrix a leaf of its own plus its span of the residual, formed a row at a
  # time in the calls: the bits of the calls on the runs error feedback writes.
  groups, rank, runs, matrices, entries = case
  residual = entries(sum(m.size for m in matrices) + tail)
  residual[data.draw(st.integers(0, residual.size - 1))] = data.draw(
      st.sampled_from([0.0, -0.0, 1e-40, np.inf, np.nan]))
  leaves = [m * np.float32(-1.0) if i % 2 else m for i, m in enumerate(matrices)]
  flat = np.concatenate([leaf.reshape(-1) for leaf in leaves])
  corrected = flat + residual[:flat.size]
  corrected_runs = np.split(corrected, np.cumsum([g * m * n for g, m, n in groups])[:-1])
  inner = sum(m.shape[0] if transposed else m.shape[1] for m in matrices) * rank
  factor, dense = entries(inner), entries(3)
  scales = [2.0 ** (i % 3 - 1) for i in range(len(matrices))]

  def product(runs, residual):
    return jax.jit(lambda runs, factor, dense: native.lowrank_product(
        runs, factor, scales, dense, groups, rank, transposed=transposed, residual=residual))(
            runs, factor, dense)

  np.testing.assert_array_equal(
      _bits_any_nan(product(leaves, jnp.asarray(residual))),
      _bits_any_nan(product(corrected_runs, None)))
  p = entries(sum(m.shape[0] for m in matrices) * rank)
  q = entries(sum(m.shape[1] for m in matrices) * rank)

  def residual_of(runs, from_leaves):
    return jax.jit(lambda b, runs: native.lowrank_residual(
        b, runs, p, q, groups, rank, from_leaves=from_leaves), donate_argnums=0)(
            jnp.asarray(residual), runs)

  np.testing.assert_array_equal(_bits_any_nan(residual_of(leaves, True)),
                                _bits_any_nan(residual_of(corrected_runs, False)))


@harness.needs_native
def test_the_lowrank_calls_two_threads_meet_exactly():
  # 1.2M entries: each call splits its rows (columns) between two threads at the
  # half of its work; the sums are the one-thread order's.
  groups, rank = [(1, 5, 7), (2, 600, 1000)], 3
  rng = np.random.default_rng(0)
  runs = [rng.standard_normal(g * m * n).astype(np.float32) for g, m, n in groups]
  matrices = [m for run, (g, rows, cols) in zip(runs, groups)
              for m in run.reshape(g, rows, cols)]
  for transposed in (False, True):
    inner = sum(m.shape[0] if transposed else m.shape[1] for m in matrices) * rank
    factor = rng.standard_normal(inner).astype(np.float32)
    got = native.lowrank_product(runs, jnp.asarray(factor), [1.0] * 3, jnp.zeros(0), groups,
                                 rank, transposed=transposed)
    want = _product_reference(matrices, factor, [1.0] * 3, rank, transposed, False)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
  p = rng.standard_normal(sum(m.shape[0] for m in matrices) * rank).astype(np.float32)
  q = rng.standard_normal(sum(m.shape[1] for m in matrices) * rank).astype(np.float32)
  got = np.asarray(native.lowrank_residual(jnp.zeros(sum(m.size for m in matrices)), runs,
                                           jnp.asarray(p), jnp.asarray(q), groups, rank))
  at, p_at, q_at = 0, 0, 0
  for m in matrices:
    rows, cols = m.shape
    pm = p[p_at:p_at + rows * rank].reshape(rows, rank)
    qm = q[q_at:q_at + cols * rank].reshape(cols, rank)
    total = pm[:, None, 0] * qm[None, :, 0]
    for j in range(1, rank):
      total = total + pm[:, None, j] * qm[None, :, j]
    np.testing.assert_array_equal(got[at:at + m.size].view(np.uint32),
                                  (m - total).reshape(-1).view(np.uint32))
    at, p_at, q_at = at + m.size, p_at + rows * rank, q_at + cols * rank
  # From the leaves and a residual of ones: the bits of the calls on their sums.
  leaves = [jnp.asarray(m) for m in matrices]
  ones = jnp.ones(sum(m.size for m in matrices), jnp.float32)
  runs = [run + np.float32(1.0) for run in runs]
  for transposed in (False, True):
    inner = sum(m.shape[0] if transposed else m.shape[1] for m in matrices) * rank
    factor = rng.standard_normal(inner).astype(np.float32)
    got = native.lowrank_product(leaves, jnp.asarray(factor), [1.0] * 3, jnp.zeros(0), groups,
                                 rank, transposed=transposed, residual=ones)
    want = native.lowrank_product([jnp.asarray(run) for run in runs], jnp.asarray(factor),
                                  [1.0] * 3, jnp.zeros(0), groups, rank, transposed=transposed)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))
  got = native.lowrank_residual(ones, leaves, jnp.asarray(p), jnp.asarray(q), groups, rank,
                                from_leaves=True)
  want = native.lowrank_residual(jnp.zeros(ones.size), [jnp.asarray(run) for run in runs],
                                 jnp.asarray(p), jnp.asarray(q), groups, rank)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


@harness.needs_native
def test_the_lowrank_calls_refuse_what_does_not_fit_by_name():
  runs, groups = [jnp.zeros(12)], [(1, 3, 4)]
  with pytest.raises(ValueError, match="`groups`"):
    native.lowrank_product(runs, jnp.zeros(8), [1.0], jnp.zeros(0), [(1, 3)], 2)
  with pytest.raises(ValueError, match="`rank`"):
    native.lowrank_product(runs, jnp.zeros(8), [1.0], jnp.zeros(0), groups, 0)
  with pytest.raises(ValueError, match="one run per group"):
    native.lowrank_product(runs * 2, jnp.zeros(8), [1.0], jnp.zeros(0), groups, 2)
  with pytest.raises(ValueError, match="`factor`"):
    native.lowrank_product(runs, jnp.zeros(6), [1.0], jnp.zeros(0), groups, 2)
  with pytest.raises(ValueError, match="`scales`"):
    native.lowrank_product(runs, jnp.zeros(8), [1.0, 2.0], jnp.zeros(0), groups, 2)
  with pytest.raises(ValueError, match="one f32 leaf per matrix"):
    native.lowrank_product(runs * 2, jnp.zeros(8), [1.0], jnp.zeros(0), groups, 2,
                           residual=jnp.zeros(12))
  with pytest.raises(ValueError, match="`residual`"):
    native.lowrank_product(runs, jnp.zeros(8), [1.0], jnp.zeros(0), groups, 2,
                           residual=jnp.zeros(11))
  with pytest.raises(ValueError, match="one f32 leaf per matrix"):
    native.lowrank_residual(jnp.zeros(12), [jnp.zeros(12, jnp.int32)], jnp.zeros(6),
                            jnp.zeros(8), groups, 2, from_leaves=True)
  with pytest.raises(ValueError, match="`lengths`"):
    native.factor_columns(jnp.zeros(8), [4, 0], 2)
  with pytest.raises(ValueError, match="`factor`"):
    native.factor_columns(jnp.zeros(7), [4], 2)
  with pytest.raises(ValueError, match="`scales`"):
    native.factor_columns(jnp.zeros(8), [4], 2, scales=[1.0, 1.0])
  with pytest.raises(ValueError, match="`buffer`"):
    native.lowrank_residual(jnp.zeros(11), runs, jnp.zeros(6), jnp.zeros(8), groups, 2)


# --------------------------------------------------------- a sparse mean's leaves


@st.composite
def _sparse_entries(draw):
  sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
  n = sum(sizes)
  k = draw(st.integers(0, 60))
  # Positions in range (many repeated), EMPTY_INDEX, negatives and past the end.
  position = st.one_of(st.integers(0, max(n - 1, 0)), st.integers(0, 3),
                       st.sampled_from([EMPTY_INDEX, -1, -7, n, n + 5]))
  indices = np.asarray(draw(st.lists(position, min_size=k, max_size=k)), np.int32)
  values = np.asarray(draw(st.lists(_ENTRY, min_size=k, max_size=k)), np.float32)
  return sizes, values, indices


@harness.needs_native
@hypothesis.given(_sparse_entries())
def test_the_densify_call_writes_densify_s_bits_into_the_leaves(case):
  # Repeated positions add in the entries' order, as XLA:CPU's scatter adds them; NaN,
  # infinities and both zeros among the values.
  sizes, values, indices = case
  from jaxcomp import collectives
  want = np.asarray(jax.jit(lambda v, i: collectives.densify(v, i, sum(sizes)))(values, indices))
  got = jax.jit(lambda v, i: native.densify_leaves(v, i, sizes, jnp.float32(0)))(values, indices)
  assert [g.shape for g in got] == [(s,) for s in sizes]
  flat = np.concatenate([np.asarray(g) for g in got]) if got else np.zeros(0, np.float32)
  np.testing.assert_array_equal(flat.view(np.uint32), want.view(np.uint32))


@harness.needs_native
def test_the_densify_call_refuses_unpaired_indices_by_name():
  with pytest.raises(ValueError, match="`indices`"):
    native.densify_leaves(jnp.zeros(3), jnp.zeros(4, jnp.int32), [7])
  with pytest.raises(ValueError, match="`sizes`"):
    native.densify_leaves(jnp.zeros(3), jnp.zeros(3, jnp.int32), [7, -1])


@harness.needs_native
@pytest.mark.parametrize("name, config", [
    ("topk", dict(density=0.05)), ("gtopk", dict(density=0.05)),
    ("randomk", dict(density=0.05)), ("dgc", dict(density=0.05)),
    ("dgc", dict(density=0.05, sparse_leaves="all")),
    # the warm-up's forms: the sparse mean is made in the branch, whole
    ("dgc", dict(density=0.05, warmup_steps=4))])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.02])
def test_a_sparse_mean_is_written_into_its_leaves_by_one_call_with_xla_s_bits(
    name, config, bucket_cap_mb, monkeypatch):
  """The mean's sparse leaves from one call per bucket (each written once), against
  the whole vector's zeros, scatter and per-leaf copies: the same outputs and states,
  bit for bit (every other call native in both)."""
  params = {**_TWELVE, "bias": jnp.zeros(30)}
  buckets = 1 if bucket_cap_mb is None else 2

  def run(leaves):
    if not leaves:
      monkeypatch.setattr(native, "densify_leaves", _densified_flat)
    runs = harness.run_two_steps(
        lambda axis: registry.build(name, axis, bucket_cap_mb=bucket_cap_mb, **config),
        params, 8, ("data",))
    calls = runs["compiled"].as_text().count('custom_call_target="jaxcomp_densify_leaves"')
    return calls, runs["outs"], runs["states"]

  calls, *by_call = run(True)
  assert calls == (0 if "warmup_steps" in config else buckets)
  flat_calls, *by_xla = run(False)
  assert flat_calls == 0
  chex.assert_trees_all_equal(by_call, by_xla)


def _densified_flat(values, indices, sizes, after=None):
  """:func:`native.densify_leaves` by XLA: the whole vector, then each leaf's slice."""
  from jaxcomp import collectives
  flat = collectives.densify(values, indices, sum(sizes), after)
  offsets = np.cumsum((0,) + tuple(sizes))
  return tuple(flat[a:b] for a, b in zip(offsets[:-1], offsets[1:]))


@st.composite
def _norm_blocks(draw):
  """``f32[m * block]``: blocks of 1 to 40 entries (tails past the eight lanes), each of
  one scale (tiny, ordinary, or past 1.8e19, whose squares overflow), zeros among
  them, and at times a NaN or an infinity. Scales whose squares stay normal: numpy
  keeps subnormals, the call (in XLA:CPU's thread) flushes them."""
  m, block = draw(st.integers(1, 6)), draw(st.integers(1, 40))
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  scales = np.asarray(draw(st.lists(st.sampled_from([0.0, 1e-15, 1.0, 3e4, 1e20, 4e37]),
                                    min_size=m, max_size=m)), np.float32)
  x = (rng.uniform(0.5, 1.0, (m, block)) * rng.choice([-1.0, 1.0], (m, block))
       * scales[:, None]).astype(np.float32)
  x[rng.random((m, block)) < 0.2] = 0.0
  special = draw(st.sampled_from([None, np.nan, np.inf, -np.inf]))
  if special is not None:
    x.reshape(-1)[draw(st.integers(0, m * block - 1))] = special
  return x.reshape(-1), block


def _encoded_norms(x, block):
  """``(norms, inverses)`` of :func:`native.qsgd_encode` (its levels compared apart)."""
  return native.qsgd_encode(x, block, 8, (jnp.uint32(1), jnp.uint32(2)))[1:]


def _norms_reference(x, block):
  """:func:`native.qsgd_encode`'s norms by their stated steps in numpy: each block's squares (times its
  unit factor, on the scaled route) summed in eight interleaved lanes joined pairwise,
  then the tail; the scaled route for every block where any plain norm is not finite."""
  blocks = x.reshape(-1, block)

  def sums(f):
    squares = (blocks * f) * (blocks * f)
    whole = block - block % 8
    lanes = np.zeros((len(blocks), 8), np.float32)
    for k in range(0, whole, 8):
      lanes += squares[:, k:k + 8]
    tail = np.zeros(len(blocks), np.float32)
    for k in range(whole, block):
      tail += squares[:, k]
    l = lanes.T
    return (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) + tail

  with np.errstate(over="ignore", invalid="ignore"):
    norms = np.sqrt(sums(np.float32(1)))
    if not np.isfinite(norms).all():
      keys = np.minimum(np.abs(blocks).view(np.int32), np.int32(0x7F800000))
      f = np.array([_unit_factor(row) for row in keys.view(np.float32)], np.float32)[:, None]
      norms = np.sqrt(sums(f)) / f[:, 0]
    divisor = np.where(norms == 0, np.float32(1), norms)
    inverses = np.float32(1) / (divisor * np.array([_unit_factor(d) for d in divisor[:, None]],
                                                  np.float32))
  return norms, inverses


@harness.needs_native
@hypothesis.given(_norm_blocks())
def test_the_encode_call_s_norms_follow_their_stated_steps(case):
  x, block = case
  norms, inverses = jax.jit(lambda x: _encoded_norms(x, block))(x)
  want_norms, want_inverses = _norms_reference(x, block)
  np.testing.assert_array_equal(np.asarray(norms).view(np.uint32), want_norms.view(np.uint32))
  np.testing.assert_array_equal(np.asarray(inverses).view(np.uint32),
                                want_inverses.view(np.uint32))


@harness.needs_native
def test_the_block_norms_of_two_threads_meet_exactly():
  # 2.4M entries: two threads, each half's plain norms, then (one block of 1e37) every
  # block's scaled norm, again on two threads.
  x = np.random.default_rng(5).normal(size=4800 * 512).astype(np.float32)
  for overflowing in (False, True):
    if overflowing:
      x[1000 * 512:1001 * 512] = np.float32(1e37)
    got = jax.jit(lambda x: _encoded_norms(x, 512))(x)
    for got_part, want_part in zip(got, _norms_reference(x, 512)):
      np.testing.assert_array_equal(np.asarray(got_part).view(np.uint32), want_part.view(np.uint32))


@harness.needs_native
def test_the_block_norms_calls_refuse_what_is_not_whole_blocks_by_name():
  words = (jnp.uint32(1), jnp.uint32(2))
  with pytest.raises(ValueError, match="`x` must be f32 of whole blocks of 4"):
    native.qsgd_encode(jnp.ones(6), 4, 8, words)
  with pytest.raises(ValueError, match="`x` must be f32"):
    native.qsgd_encode(jnp.ones(8, jnp.bfloat16), 4, 8, words)
  with pytest.raises(ValueError, match="`block`"):
    native.qsgd_encode(jnp.ones(8), 0, 8, words)


def _momentum_corrected_by_jax(leaves, momentum, residual, head, coefficient, nesterov):
  """DGC's prepare and the residual's addition as its JAX route writes them."""

  def prepared(leaves, u, e):
    g = jnp.concatenate([leaf.reshape(-1) for leaf in leaves])
    if nesterov:
      whole = coefficient * (u + g)
      velocity = whole + g
    else:
      whole = coefficient * u + g
      velocity = whole
    return jnp.where(jnp.arange(g.size) < head, velocity, g) + e, whole

  return jax.jit(prepared)(leaves, momentum, residual)


@harness.needs_native
@hypothesis.given(_leaf_sets(), st.data(), st.sampled_from([0.0, 0.9, 0.5, 1 / 3]),
                  st.booleans())
def test_the_momentum_call_gives_dgc_s_jax_bits(case, data, coefficient, nesterov):
  # Ties, zeros of both signs, infinities, NaN and subnormals in the leaves, the
  # momentum and the residual; the head anywhere, inside a leaf or past them all.
  leaves, residual = case
  n = residual.size
  momentum = np.asarray(data.draw(st.lists(_ADDEND, min_size=n, max_size=n)), np.float32)
  head = data.draw(st.integers(0, n))
  by_call = jax.jit(lambda ls, u, e: native.momentum_corrected(
      ls, u, e, head, coefficient, nesterov))(leaves, momentum, residual)
  by_jax = _momentum_corrected_by_jax(leaves, momentum, residual, head, coefficient, nesterov)
  for got, want in zip(by_call, by_jax):
    np.testing.assert_array_equal(_bits_any_nan(got), _bits_any_nan(want))


@harness.needs_native
def test_the_momentum_call_s_two_threads_meet_exactly():
  # 2.4M entries in three leaves: the halves meet inside the second; the head ends in
  # the third.
  rng = np.random.default_rng(7)
  leaves = [rng.standard_normal(size).astype(np.float32) for size in (700_000, 1_000_001, 700_000)]
  momentum, residual = (rng.standard_normal(2_400_001).astype(np.float32) for _ in range(2))
  for nesterov in (False, True):
    by_call = jax.jit(lambda ls, u, e: native.momentum_corrected(
        ls, u, e, 2_000_000, 0.9, nesterov))(leaves, momentum, residual)
    by_jax = _momentum_corrected_by_jax(leaves, momentum, residual, 2_000_000, 0.9, nesterov)
    chex.assert_trees_all_equal(by_call, by_jax)


@harness.needs_native
def test_the_momentum_call_refuses_what_does_not_fit_by_name():
  ones = jnp.ones(6)
  with pytest.raises(TypeError, match="f32"):
    native.momentum_corrected([jnp.ones(6, jnp.bfloat16)], ones, ones, 2, 0.9, False)
  with pytest.raises(ValueError, match="`momentum` must be f32\\[6\\]"):
    native.momentum_corrected([ones], jnp.ones(5), ones, 2, 0.9, False)
  with pytest.raises(ValueError, match="`residual` must be f32\\[6\\]"):
    native.momentum_corrected([ones], ones, jnp.ones(6, jnp.int32), 2, 0.9, False)
  with pytest.raises(ValueError, match="`head`"):
    native.momentum_corrected([ones], ones, ones, 7, 0.9, False)
  with pytest.raises(TypeError, match="`nesterov`"):
    native.momentum_corrected([ones], ones, ones, 2, 0.9, 1)


@st.composite
def _momentum_selections(draw):
  """A leaf set with a momentum, a head of at least one entry, and a sample of it."""
  leaves, residual = draw(_leaf_sets())
  n = residual.size
  hypothesis.assume(n >= 1)
  momentum = np.asarray(draw(st.lists(_ADDEND, min_size=n, max_size=n)), np.float32)
  head = draw(st.integers(1, n))
  capacity = draw(st.integers(1, head))
  positions = draw(st.lists(st.integers(0, head - 1), min_size=1, max_size=24))
  return dict(leaves=leaves, residual=residual, momentum=momentum, head=head,
              capacity=capacity, k=draw(st.integers(1, capacity)), positions=positions,
              rank=draw(st.integers(1, len(positions))),
              candidates=draw(st.integers(0, head)),
              min_fraction=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
              coefficient=draw(st.sampled_from([0.0, 0.9, 1 / 3])), nesterov=draw(st.booleans()))


def _select_momentum(case, select):
  """``select`` (the fused call, or the plain one of the JAX-formed sum) of ``case``."""
  c = case
  positions = jnp.asarray(c["positions"], jnp.int32)
  if select == "fused":
    return jax.jit(lambda ls, u, e: native.momentum_sampled_topk(
        ls, u, e, c["coefficient"], c["nesterov"], c["capacity"], c["k"], positions, c["rank"],
        size=c["head"], candidates=c["candidates"], min_fraction=c["min_fraction"]))(
            c["leaves"], c["momentum"], c["residual"])
  corrected, _ = _momentum_corrected_by_jax(c["leaves"], c["momentum"], c["residual"],
                                            c["head"], c["coefficient"], c["nesterov"])
  return jax.jit(lambda x: native.sampled_topk(
      x, c["capacity"], c["k"], positions, c["rank"], size=c["head"],
      candidates=c["candidates"], min_fraction=c["min_fraction"]))(corrected)


@harness.needs_native
@hypothesis.given(_momentum_selections())
def test_the_momentum_selection_call_selects_from_dgc_s_corrected_gradient(case):
  # Every path past the sample (a count short of min_fraction * k, past the
  # candidates, or within them), on sums with NaN, infinities and subnormals: the
  # call that forms the sum in its pass selects what the plain call selects from it.
  by_call, by_sum = _select_momentum(case, "fused"), _select_momentum(case, "plain")
  np.testing.assert_array_equal(_bits(by_call)[0], _bits(by_sum)[0])
  np.testing.assert_array_equal(_bits(by_call)[1], _bits(by_sum)[1])


def _kept_state_by_jax(leaves, residual, momentum, sent, dense_momentum, head, coefficient,
                       nesterov):
  """DGC's kept residual and momentum as its JAX route writes them."""
  corrected, whole = _momentum_corrected_by_jax(leaves, momentum, residual, head, coefficient,
                                                nesterov)
  return jax.jit(lambda c, w, s, d: (
      error_feedback.zero_sent(s, c),
      jnp.concatenate([error_feedback.zero_sent(s, w)[:head], d])))(
          corrected, whole, sent, dense_momentum)


@harness.needs_native
@hypothesis.given(_leaf_sets(), st.data(), st.sampled_from([0.0, 0.9, 1 / 3]), st.booleans())
def test_the_masked_call_writes_dgc_s_kept_state(case, data, coefficient, nesterov):
  leaves, residual = case
  n = residual.size
  hypothesis.assume(n >= 1)
  momentum = np.asarray(data.draw(st.lists(_ADDEND, min_size=n, max_size=n)), np.float32)
  dense_momentum = np.asarray(data.draw(st.lists(_ADDEND, min_size=n, max_size=n)), np.float32)
  head = data.draw(st.integers(0, n))
  sent_at = data.draw(st.lists(st.integers(0, max(head - 1, 0)), unique=True, max_size=head))
  sent = error_feedback.sent_mask(n, jnp.asarray(sent_at, jnp.int32), head)
  dense_momentum = dense_momentum[head:]
  by_call = jax.jit(lambda ls, e, u: native.momentum_masked(
      ls, e, u, sent, dense_momentum, head, coefficient, nesterov))(leaves, residual, momentum)
  by_jax = _kept_state_by_jax(leaves, residual, momentum, sent, dense_momentum, head,
                              coefficient, nesterov)
  for got, want in zip(by_call, by_jax):
    np.testing.assert_array_equal(_bits_any_nan(got), _bits_any_nan(want))


@harness.needs_native
@pytest.mark.parametrize("min_fraction", [0.8, 2.0])  # the candidates, or the exact fallback
def test_the_fused_momentum_calls_two_threads_meet_exactly(min_fraction):
  # 2.4M entries in three leaves, the head ending in the third: both halves of the
  # selection's pass and of the masked write, and the fallback's formed sum.
  rng = np.random.default_rng(8)
  leaves = [rng.standard_normal(size).astype(np.float32) for size in (700_000, 1_000_001, 700_000)]
  momentum, residual = (rng.standard_normal(2_400_001).astype(np.float32) for _ in range(2))
  head, k = 2_000_000, 2_000
  for nesterov in (False, True):
    corrected, _ = _momentum_corrected_by_jax(leaves, momentum, residual, head, 0.9, nesterov)
    candidates = selection.candidate_capacity(head, k)
    positions, rank, _ = selection._sample(head, k, jax.random.key(3), 0.01, candidates)
    case = dict(leaves=leaves, residual=residual, momentum=momentum, head=head, capacity=k,
                k=k, positions=np.asarray(positions), rank=int(rank), candidates=candidates,
                min_fraction=min_fraction, coefficient=0.9, nesterov=nesterov)
    by_call = _select_momentum(case, "fused")
    chex.assert_trees_all_equal(by_call, _select_momentum(case, "plain"))
    sent = error_feedback.sent_mask(2_400_001, by_call[1], head)
    dense_momentum = rng.standard_normal(400_001).astype(np.float32)
    chex.assert_trees_all_equal(
        jax.jit(lambda ls, e, u: native.momentum_masked(
            ls, e, u, sent, dense_momentum, head, 0.9, nesterov))(leaves, residual, momentum),
        _kept_state_by_jax(leaves, residual, momentum, sent, dense_momentum, head, 0.9,
                           nesterov))


@harness.needs_native
def test_the_fused_momentum_calls_refuse_what_does_not_fit_by_name():
  ones, at = jnp.ones(6), jnp.zeros(3, jnp.int32)
  with pytest.raises(ValueError, match="`momentum` must be f32\\[6\\]"):
    native.momentum_sampled_topk([ones], jnp.ones(5), ones, 0.9, False, 2, 2, at, 1, size=4,
                                 candidates=4, min_fraction=0.8)
  with pytest.raises(ValueError, match="`size`"):
    native.momentum_sampled_topk([ones], ones, ones, 0.9, False, 2, 2, at, 1, size=7,
                                 candidates=4, min_fraction=0.8)
  with pytest.raises(ValueError, match="`positions`"):
    native.momentum_sampled_topk([ones], ones, ones, 0.9, False, 2, 2, jnp.zeros(0, jnp.int32),
                                 1, size=4, candidates=4, min_fraction=0.8)
  sent = jnp.zeros(1, jnp.uint32)
  with pytest.raises(ValueError, match="`residual` must be f32\\[6\\]"):
    native.momentum_masked([ones], jnp.ones(7), ones, sent, jnp.ones(2), 4, 0.9, False)
  with pytest.raises(ValueError, match="`sent` must be uint32"):
    native.momentum_masked([ones], ones, ones, jnp.zeros(1, jnp.int32), jnp.ones(2), 4, 0.9,
                           False)
  with pytest.raises(ValueError, match="`dense_momentum` must be f32\\[2\\]"):
    native.momentum_masked([ones], ones, ones, sent, jnp.ones(3), 4, 0.9, False)
  with pytest.raises(ValueError, match="`head`"):
    native.momentum_masked([ones], ones, ones, sent, jnp.ones(2), 7, 0.9, False)


@harness.needs_native
@pytest.mark.parametrize("config", [
    {}, dict(nesterov=True), dict(sparse_leaves="all"), dict(warmup_steps=4),
    # Clipping reads the fused gradient's norm: prepare stays in JAX.
    dict(clip_norm=0.5)])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.02])
def test_dgc_s_momentum_call_gives_the_jax_route_s_bits(config, bucket_cap_mb, monkeypatch):
  """DGC with the momentum calls against its JAX route on the fused gradient (the
  buckets' leaves fused in XLA), two steps on 8 devices, every other call native in
  both: the same outputs and states, bit for bit. A bucket of 4,096 sparse entries or
  more selects in the momentum's pass and writes its state in one masked call (one
  bucket of 7,200 here; with buckets, the first of 4,800), a smaller one takes the
  momentum call (the second bucket's 2,400); none where DGC clips."""

  def run():
    runs = harness.run_two_steps(
        lambda axis: registry.build("dgc", axis, density=0.05, bucket_cap_mb=bucket_cap_mb,
                                    **config), _TWELVE, 8, ("data",))
    text = runs["compiled"].as_text()
    calls = [text.count(f'custom_call_target="jaxcomp_momentum_{kind}"')
             for kind in ("corrected", "masked")]
    return calls, runs["outs"], runs["states"]

  calls, *by_call = run()
  assert calls == ([0, 0] if "clip_norm" in config else [0, 1] if bucket_cap_mb is None
                   else [1, 1])
  monkeypatch.setattr(protocol, "_native_sum", lambda bucket, leaves_apart: False)
  jax_calls, *by_jax = run()
  assert jax_calls == [0, 0]
  chex.assert_trees_all_equal(by_call, by_jax)


def _lee_by_numpy(x):
  """The call's Lee's DCT of the columns of ``x`` (``f32[m, chunks]``), step by step."""
  m = x.shape[0]
  if m == 1:
    return x
  half = m // 2
  f = (0.5 / np.cos(np.pi * (np.arange(half) + 0.5) / m)).astype(np.float32)[:, None]
  low, high = x[:half], x[::-1][:half]
  a, b = _lee_by_numpy(low + high), _lee_by_numpy((low - high) * f)
  out = np.empty_like(x)
  out[0::2] = a
  out[1:-1:2] = b[:-1] + b[1:]
  out[-1] = b[-1]
  return out


def _dct_topk_by_numpy(leaves, residual, chunk, k):
  """:func:`native.dct_topk` by its stated steps: the sum, Lee's transform, the scale, and
  each chunk's ``k`` largest magnitudes (the lower position first on a tie)."""
  flat = np.concatenate([np.ravel(leaf) for leaf in leaves]) + residual
  chunks = -(-flat.size // chunk)
  rows = np.pad(flat, (0, chunks * chunk - flat.size)).reshape(chunks, chunk)
  scales = np.float32(np.where(np.arange(chunk) == 0, 1.0, np.sqrt(2.0)) / chunk)
  # A chunk whose largest magnitude is 2 or more brought below 2, and back after.
  down = np.minimum(np.asarray(binade.unit_factor(np.abs(rows).max(axis=1))), np.float32(1))
  coefficients = (_lee_by_numpy((rows * down[:, None]).T).T * scales) * (1 / down)[:, None]
  order = np.argsort(-np.abs(coefficients), axis=1, kind="stable")[:, :k]
  return np.take_along_axis(coefficients, order, 1), order.astype(np.int32)


@st.composite
def _chunked_leaf_sets(draw):
  """Normal leaves and a residual (no subnormal sums: numpy does not flush them), a chunk
  of a power of two and a ``k`` within it."""
  sizes = draw(st.lists(st.integers(0, 300), min_size=1, max_size=6))
  hypothesis.assume(sum(sizes) >= 1)
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  scale = draw(st.sampled_from([1.0, 1e-3, 1e4]))
  leaves = [(scale * rng.standard_normal(size)).astype(np.float32) for size in sizes]
  residual = (scale * rng.standard_normal(sum(sizes))).astype(np.float32)
  chunk = 2 ** draw(st.integers(0, 8))
  return leaves, residual, chunk, draw(st.integers(1, chunk))


@harness.needs_native
@hypothesis.given(_chunked_leaf_sets())
def test_the_dct_call_follows_lee_s_stated_steps(case):
  leaves, residual, chunk, k = case
  by_call = jax.jit(lambda ls, e: native.dct_topk(ls, e, chunk, k))(leaves, residual)
  values, positions = _dct_topk_by_numpy(leaves, residual, chunk, k)
  np.testing.assert_array_equal(np.asarray(by_call[0]).view(np.uint32), values.view(np.uint32))
  np.testing.assert_array_equal(by_call[1], positions)


@harness.needs_native
@pytest.mark.parametrize("chunk", [8, 64, 256])
def test_the_dct_call_meets_demo_s_transform_to_rounding_on_two_threads(chunk):
  """2.1M entries (two threads, meeting inside a leaf): the same positions as the float64
  product with DeMo's matrix, each coefficient within 4e-6 of its chunk's largest
  (Lee's sums against the matrix's), and the stated steps' bits."""
  rng = np.random.default_rng(chunk)
  leaves = [rng.standard_normal(size).astype(np.float32) for size in (1_000_003, 1_100_000)]
  residual = rng.standard_normal(2_100_003).astype(np.float32)
  values, positions = jax.jit(lambda ls, e: native.dct_topk(ls, e, chunk, 3))(leaves, residual)
  flat = np.concatenate(leaves).astype(np.float64) + residual
  rows = np.pad(flat, (0, -flat.size % chunk)).reshape(-1, chunk)
  exact = rows @ (np.asarray(demo.dct_matrix(chunk), np.float64) / np.sqrt(chunk)).T
  order = np.argsort(-np.abs(exact), axis=1, kind="stable")[:, :3]
  np.testing.assert_array_equal(positions, order)
  largest = np.abs(exact).max(axis=1, keepdims=True)
  error = np.abs(np.asarray(values) - np.take_along_axis(exact, order, 1)) / largest
  assert error.max() < 4e-6, error.max()
  want = _dct_topk_by_numpy(leaves, residual, chunk, 3)
  np.testing.assert_array_equal(np.asarray(values).view(np.uint32), want[0].view(np.uint32))


@harness.needs_native
def test_the_dct_call_keeps_the_coefficients_of_huge_chunks_finite():
  """Chunks of entries up to f32's largest: Lee's unscaled sums would overflow (the first
  coefficient's is the chunk's sum); every coefficient is finite and within rounding of
  the float64 transform's."""
  rng = np.random.default_rng(5)
  x = (rng.uniform(-1, 1, 256) * np.float32(3.4e38)).astype(np.float32)
  x[:64] = np.float32(3.4e38)
  x[64:128] = np.float32(1e38) * np.sign(rng.standard_normal(64)).astype(np.float32)
  values, positions = jax.jit(lambda ls, e: native.dct_topk(ls, e, 64, 4))(
      [x[:100], x[100:]], np.zeros(256, np.float32))
  assert np.isfinite(np.asarray(values)).all()
  rows = x.astype(np.float64).reshape(4, 64)
  exact = rows @ (np.asarray(demo.dct_matrix(64), np.float64) / 8).T
  np.testing.assert_allclose(np.asarray(values), np.take_along_axis(exact, positions, 1),
                             rtol=0, atol=4e-6 * np.abs(exact).max())


@harness.needs_native
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_chunk_that_is_not_finite_sends_a_coefficient_that_is_not(bad):
  x = np.random.default_rng(0).standard_normal(200).astype(np.float32)
  x[70] = bad
  x[75] = -bad  # inf - inf: NaN
  values, _ = jax.jit(lambda ls, e: native.dct_topk(ls, e, 64, 2))([x[:90], x[90:]],
                                                                 np.zeros(200, np.float32))
  finite = np.isfinite(np.asarray(values))
  assert not finite[1].any() and finite[[0, 2, 3]].all()


def _dct_residual_by_numpy(leaves, residual, values, positions, inverse, decay):
  flat = np.concatenate([np.ravel(leaf) for leaf in leaves]) + residual
  chunk = inverse.shape[0]
  sent = values[:, :1] * inverse[positions[:, 0]]
  for j in range(1, values.shape[1]):
    sent = sent + values[:, j:j + 1] * inverse[positions[:, j]]
  return np.float32(decay) * (flat - sent.reshape(-1)[:flat.size])


@harness.needs_native
@hypothesis.given(_chunked_leaf_sets(), st.sampled_from([0.0, 0.999, 1 / 3]))
def test_the_dct_residual_call_follows_its_stated_steps_and_writes_in_place(case, decay):
  leaves, residual, chunk, k = case
  values, positions = jax.jit(lambda ls, e: native.dct_topk(ls, e, chunk, k))(leaves, residual)
  inverse = np.asarray(demo.dct_matrix(chunk) * np.sqrt(chunk))
  call = jax.jit(lambda e, ls: native.dct_residual(ls, e, values, positions, inverse, decay),
                 donate_argnums=0)
  want = _dct_residual_by_numpy(leaves, residual, np.asarray(values), np.asarray(positions),
                                inverse, decay)
  got = call(jnp.asarray(residual), leaves)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
  if k * 8 <= chunk:  # DeMo's route sums the basis rows: its bits
    chunks = values.shape[0]
    flat = jnp.pad(jnp.concatenate([jnp.ravel(leaf) for leaf in leaves]) + residual,
                   (0, chunks * chunk - residual.size))
    by_demo = jax.jit(lambda f, v, p: decay * (f - demo.inverse_of_sparse(
        v, p, jnp.asarray(inverse)))[:residual.size])(flat, values, positions)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(by_demo).view(np.uint32))


@harness.needs_native
def test_the_dct_calls_refuse_what_does_not_fit_by_name():
  ones = jnp.ones(6)
  with pytest.raises(ValueError, match="`chunk` must be a power of two"):
    native.dct_topk([ones], ones, 6, 1)
  with pytest.raises(ValueError, match="`k`"):
    native.dct_topk([ones], ones, 4, 5)
  with pytest.raises(ValueError, match="`residual` must be f32\\[6\\]"):
    native.dct_topk([ones], jnp.ones(5), 4, 1)
  with pytest.raises(TypeError, match="f32"):
    native.dct_topk([jnp.ones(6, jnp.bfloat16)], ones, 4, 1)
  values, positions = jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32)
  with pytest.raises(ValueError, match="`inverse` must be f32\\[C, C\\]"):
    native.dct_residual([ones], ones, values, positions, jnp.ones((4, 2)), 0.9)
  with pytest.raises(ValueError, match="`values` must be f32\\[2, k\\]"):
    native.dct_residual([ones], ones, jnp.ones((3, 1)), positions, jnp.ones((4, 4)), 0.9)
  with pytest.raises(ValueError, match="`positions`"):
    native.dct_residual([ones], ones, values, jnp.zeros((2, 2), jnp.int32), jnp.ones((4, 4)),
                        0.9)


@harness.needs_native
@hypothesis.given(st.data(), st.sampled_from([1, 4, 64]), st.sampled_from([1, 8, 127]),
                  st.integers(0, 2**31 - 1), st.integers(0, 3))
def test_the_qsgd_levels_call_gives_quantize_s_bits(data, block, levels, seed, stream):
  # Ties, zeros of both signs, infinities, NaN and subnormals; the norms given (their
  # own call is compared apart), the draws of one key and stream on both routes.
  m = data.draw(st.integers(1, 12))
  x = np.asarray(data.draw(st.lists(_ADDEND, min_size=m * block, max_size=m * block)),
                 np.float32)
  norms = jax.jit(lambda x: qsgd._norms(x.reshape(m, block)))(x)
  key = jax.random.key(seed)

  def levels_of():
    # A function of its own for each route: jit keeps one trace per function.
    return jax.jit(lambda x: qsgd.quantize(x, levels, block, key, stream, norms)[0])

  with mock.patch.dict(selection._BY_BACKEND, {"cpu": selection.Tuning(native=False)}):
    program = levels_of()
    assert "jaxcomp_qsgd_levels" not in program.lower(x).as_text()
    by_jax = program(x)
  program = levels_of()
  assert "jaxcomp_qsgd_levels" in program.lower(x).as_text()
  np.testing.assert_array_equal(program(x), by_jax)


@harness.needs_native
def test_the_qsgd_levels_call_s_two_threads_meet_exactly():
  rng = np.random.default_rng(11)
  x = (rng.standard_normal(2_097_152) * rng.uniform(0, 3, 2_097_152)).astype(np.float32)
  norms = jax.jit(lambda x: qsgd._norms(x.reshape(-1, 512)))(x)
  key = jax.random.key(4)

  def levels_of():
    return jax.jit(lambda x: qsgd.quantize(x, 8, 512, key, 1, norms)[0])

  with mock.patch.dict(selection._BY_BACKEND, {"cpu": selection.Tuning(native=False)}):
    by_jax = levels_of()(x)
  np.testing.assert_array_equal(levels_of()(x), by_jax)


@harness.needs_native
@pytest.mark.parametrize("fill", ["normal", "huge", "not_finite"])
@pytest.mark.parametrize("n", [64, 2_097_152])  # one thread, two
def test_the_qsgd_encode_call_s_levels_are_the_levels_call_s_of_its_norms(fill, n):
  """Norms, inverses and levels in one pass: the levels call's bits from those norms,
  the norms the stated steps', also where a block's squares overflow (every norm taken
  again, scaled, and every block's levels after it) and where a block holds NaN and
  infinities."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal(n).astype(np.float32)
  if fill == "huge":
    x[5] = np.float32(3e38)
  elif fill == "not_finite":
    x[5], x[40] = np.nan, -np.inf
  words = (jnp.uint32(0x1234), jnp.uint32(0xABCD))
  levels, norms, inverses = jax.jit(lambda x: native.qsgd_encode(x, 32, 8, words))(x)
  want_norms, want_inverses = _norms_reference(x, 32)
  np.testing.assert_array_equal(np.asarray(norms).view(np.uint32), want_norms.view(np.uint32))
  np.testing.assert_array_equal(np.asarray(inverses).view(np.uint32),
                                want_inverses.view(np.uint32))
  apart = jax.jit(lambda x, v, i: native.qsgd_levels(x, v, i, 8, words))(x, norms, inverses)
  np.testing.assert_array_equal(levels, apart)
  assert np.isfinite(np.asarray(norms)).all() == (fill != "not_finite")


@harness.needs_native
@pytest.mark.parametrize("fill", ["normal", "huge", "not_finite"])
@pytest.mark.parametrize("sizes", [(40, 7, 3), (1_000_003, 1_097_149)])  # one thread, two
@pytest.mark.parametrize("error_feedback", [True, False])
def test_the_qsgd_calls_from_the_leaves_give_the_encoding_of_their_sum(fill, sizes,
                                                                       error_feedback):
  """The encoding of the leaves plus the residual, a few blocks at a time: the bits of
  the encoding call on their sum (padded with a whole block and more of zeros), also
  where a block's squares overflow (the sum formed whole, the norms taken again) and
  where a block holds NaN and infinities; the residual, the sum less each level times
  its block's step, in two roundings."""
  rng = np.random.default_rng(4)
  leaves = [rng.standard_normal(size).astype(np.float32) for size in sizes]
  n = sum(sizes)
  residual = rng.standard_normal(n).astype(np.float32) if error_feedback else None
  if fill == "huge":
    leaves[0][5] = np.float32(3e38)
  elif fill == "not_finite":
    leaves[0][5], leaves[-1][-1] = np.nan, -np.inf
  block = 32
  length = (-(-n // block) + 2) * block
  words = (jnp.uint32(0x1234), jnp.uint32(0xABCD))
  got = jax.jit(lambda ls, e: native.qsgd_encode_leaves(ls, e, length, block, 8, words))(
      leaves, residual)
  corrected = _fused_sum(leaves, residual, length)
  want = jax.jit(lambda x: native.qsgd_encode(x, block, 8, words))(corrected)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits_any_nan(g) if g.dtype == jnp.float32 else g,
                                  _bits_any_nan(w) if w.dtype == jnp.float32 else w)
  if not error_feedback:
    return
  levels, norms = np.asarray(got[0]), np.asarray(got[1])
  steps = np.asarray(jax.jit(lambda v: v / 8)(got[1]))
  kept = jax.jit(lambda b, l, t, ls: native.qsgd_residual(b, l, t, ls, block))(
      jnp.asarray(residual), got[0], steps, leaves)
  with np.errstate(invalid="ignore", over="ignore"):
    decoded = _flushed(np.repeat(steps, block) * levels.astype(np.float32))
    want_kept = _flushed(corrected - decoded)[:n]
  np.testing.assert_array_equal(_bits_any_nan(kept), _bits_any_nan(want_kept))
  assert np.isfinite(norms).all() == (fill != "not_finite")


@harness.needs_native
def test_the_qsgd_levels_call_refuses_what_does_not_fit_by_name():
  words = (jnp.uint32(1), jnp.uint32(2))
  with pytest.raises(ValueError, match="`x` must be f32 of whole blocks"):
    native.qsgd_levels(jnp.ones(6), jnp.ones(4), jnp.ones(4), 8, words)
  with pytest.raises(ValueError, match="`x` must be f32 of whole blocks"):
    native.qsgd_levels(jnp.ones(8), jnp.ones(4), jnp.ones(2), 8, words)
  with pytest.raises(ValueError, match="`levels`"):
    native.qsgd_levels(jnp.ones(8), jnp.ones(4), jnp.ones(4), 0, words)
  with pytest.raises(ValueError, match="`x` must be f32 of whole blocks of 4"):
    native.qsgd_encode(jnp.ones(6), 4, 8, words)
  with pytest.raises(ValueError, match="`levels`"):
    native.qsgd_encode(jnp.ones(8), 4, 128, words)
  leaves = [jnp.ones(5), jnp.ones(3)]
  with pytest.raises(ValueError, match="`length` 10 must be whole blocks of 4"):
    native.qsgd_encode_leaves(leaves, None, 10, 4, 8, words)
  with pytest.raises(ValueError, match="`residual` must be f32\\[8\\]"):
    native.qsgd_encode_leaves(leaves, jnp.ones(7), 8, 4, 8, words)
  with pytest.raises(ValueError, match="`steps` one per block of 4"):
    native.qsgd_residual(jnp.ones(8), jnp.ones(8, jnp.int8), jnp.ones(1), leaves, 4)
