"""DeMo's compressor against a numpy oracle of its rule (8 fake CPU devices)."""

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp._src import demo
from jaxcomp._src import fusion
from jaxcomp._src import protocol
from jaxcomp._src import selection

import harness

PARAMS = {"w": jnp.zeros((8, 6)), "b": jnp.zeros((5,))}  # 53 entries: a partial last chunk
# 199 entries: four chunks of 64, the last partial; at density 1/64 each device
# sends one coefficient per chunk, and the 8 devices' 8 terms are summed as rows.
WIDE = {"w": jnp.zeros((16, 12)), "b": jnp.zeros((7,))}


def _dct(size):
  k, j = np.arange(size)[:, None], np.arange(size)[None, :]
  d = np.sqrt(2.0 / size) * np.cos(np.pi * (2 * j + 1) * k / (2 * size))
  d[0] /= np.sqrt(2.0)
  return d


def test_the_dct_matrix_is_orthonormal_and_its_first_row_averages():
  d = np.asarray(demo.dct_matrix(16), np.float64)
  np.testing.assert_allclose(d @ d.T, np.eye(16), atol=1e-6)
  np.testing.assert_allclose(d, _dct(16), atol=1e-7)
  x = np.arange(16.0)
  np.testing.assert_allclose((d @ x)[0] / np.sqrt(16), x.mean(), rtol=1e-6)


@pytest.mark.parametrize("params,chunk_size,density", [
    (PARAMS, 16, 0.25), (PARAMS, 8, 0.125), (PARAMS, 53, 0.05), (WIDE, 64, 1 / 64)])
def test_mean_and_residual_equal_the_numpy_oracle(params, chunk_size, density):
  decay = 0.9
  tx = jaxcomp.demo(density, "data", chunk_size=chunk_size, error_decay=decay)
  grads, mean, residuals = harness.one_step_of_normal_gradients(tx, params, chunk_size)
  n = grads.shape[1]
  chunk, chunks, k = selection.chunks(n, chunk_size, density)
  d = _dct(chunk)
  total = np.zeros((chunks, chunk))
  for device in range(8):
    coefficients = np.pad(grads[device], (0, chunks * chunk - n)).reshape(chunks, chunk) @ d.T
    order = np.argsort(-np.abs(coefficients), axis=1, kind="stable")[:, :k]
    kept = np.zeros_like(coefficients)
    np.put_along_axis(kept, order, np.take_along_axis(coefficients, order, 1), axis=1)
    total += kept / 8
    sent = (kept @ d).reshape(-1)[:n]
    np.testing.assert_allclose(residuals[device], decay * (grads[device] - sent),
                               rtol=1e-4, atol=1e-5)
  # f32 products and XLA's summation order against float64.
  np.testing.assert_allclose(mean, (total @ d).reshape(-1)[:n], rtol=1e-4, atol=1e-5)


def test_the_transform_selected_block_by_block_gives_the_same_step(monkeypatch):
  """The DCT and its selection by blocks of rows (:func:`selection.topk_per_row_of_product`,
  here 2 rows of chunks at a time) against the whole product: mean and residuals
  over 25 chunks of 8, the last one partial, with the padding that comes with the
  fused gradient (``flat_length``). Within a float tolerance: the matrix product of
  a block may sum in another order than the whole one's (the same bits on XLA:CPU
  here); a position chosen differently would be far outside it."""
  # The matrix product's route: not the native calls, which take no blocks.
  monkeypatch.setattr(protocol, "_native_sum", lambda bucket, leaves_apart: False)
  tx = jaxcomp.demo(1 / 8, "data", chunk_size=8, error_decay=0.9)
  assert fusion.Bucket.of(WIDE).size == 199
  whole = harness.one_step_of_normal_gradients(tx, WIDE, 3)
  cpu = selection.tuning_for("cpu")
  monkeypatch.setitem(selection._BY_BACKEND, "cpu", cpu._replace(product_rows=2))
  by_blocks = harness.one_step_of_normal_gradients(
      jaxcomp.demo(1 / 8, "data", chunk_size=8, error_decay=0.9), WIDE, 3)
  for got, want in zip(by_blocks, whole):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


_TWELVE = {f"w{i:02d}": jnp.zeros((20, 30)) for i in range(12)}


@harness.needs_native
@pytest.mark.parametrize("chunk_size, density", [(64, 1 / 64), (8, 1 / 4), (48, 1 / 16)])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.02])
def test_the_native_transform_meets_the_matrix_product_to_rounding(chunk_size, density,
                                                                   bucket_cap_mb, monkeypatch):
  """DeMo whose selection and residual are the native calls (the leaves read where they
  lie, the transform Lee's fast DCT) against the route of the matrix product on the
  fused gradient: two steps on 8 devices, the same positions, the means and states
  within 1e-5 of each leaf's largest (the transforms' sums differ in order). One call of
  each kind per bucket; none where the chunk is not a power of two (48)."""

  def run():
    runs = harness.run_two_steps(
        lambda axis: jaxcomp.demo(density, axis, chunk_size=chunk_size, error_decay=0.9,
                                  bucket_cap_mb=bucket_cap_mb), _TWELVE, 8, ("data",))
    text = runs["compiled"].as_text()
    calls = [text.count(f'custom_call_target="jaxcomp_dct_{kind}"')
             for kind in ("topk", "residual")]
    return calls, runs["outs"], runs["rows"]

  calls, *by_call = run()
  buckets = 1 if bucket_cap_mb is None else 2
  assert calls == ([0, 0] if chunk_size == 48 else [buckets, buckets])
  monkeypatch.setattr(protocol, "_native_sum", lambda bucket, leaves_apart: False)
  product_calls, *by_product = run()
  assert product_calls == [0, 0]
  for got, want in zip(jax.tree.leaves(by_call), jax.tree.leaves(by_product)):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(got == 0, want == 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.example(devices=1, chunks=3, chunk=40, share=0.0, seed=0)  # 1 term: rows
@hypothesis.example(devices=3, chunks=2, chunk=8, share=0.5, seed=1)  # 12 terms: product
@hypothesis.given(devices=st.integers(1, 3), chunks=st.integers(1, 9), chunk=st.integers(1, 40),
                  share=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_inverse_of_sparse_coefficients_sums_their_basis_rows(devices, chunks, chunk, share,
                                                              seed):
  # Both forms: few terms are summed as rows, many are densified and multiplied.
  k = max(1, round(share * chunk))
  rng = np.random.default_rng(seed)
  values = rng.normal(size=(devices, chunks, k)).astype(np.float32)
  positions = np.stack([np.stack([rng.permutation(chunk)[:k] for _ in range(chunks)])
                        for _ in range(devices)]).astype(np.uint8)
  inverse = rng.normal(size=(chunk, chunk)).astype(np.float32)
  want = np.zeros((chunks, chunk))
  for d in range(devices):
    for c in range(chunks):
      for j in range(k):
        want[c] += float(values[d, c, j]) * inverse[positions[d, c, j]].astype(np.float64)
  got = jax.jit(demo.inverse_of_sparse)(jnp.asarray(values), jnp.asarray(positions),
                                         jnp.asarray(inverse))
  # f32 sums of at most 3 * 40 products against float64.
  np.testing.assert_allclose(np.asarray(got).reshape(chunks, chunk), want, rtol=1e-4, atol=1e-4)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.example(devices=2, chunk=8, share=0.0, cuts=[3, 5, 8, 21], seed=0)  # rows
@hypothesis.example(devices=3, chunk=8, share=0.5, cuts=[7, 9], seed=1)  # product
@hypothesis.given(devices=st.integers(1, 3), chunk=st.integers(1, 40), share=st.floats(0.0, 1.0),
                  cuts=st.lists(st.integers(1, 200), min_size=1, max_size=6),
                  seed=st.integers(0, 2**16))
def test_inverse_per_leaf_cuts_the_inverse_into_the_leaves(devices, chunk, share, cuts, seed):
  """Leaves of any sizes, across chunk boundaries or inside one chunk: each its own
  piece of the whole inverse (the last chunk's padding left out)."""
  k = max(1, round(share * chunk))
  n = sum(cuts)
  chunks = -(-n // chunk)
  rng = np.random.default_rng(seed)
  values = rng.normal(size=(devices, chunks, k)).astype(np.float32)
  positions = np.stack([np.stack([rng.permutation(chunk)[:k] for _ in range(chunks)])
                        for _ in range(devices)]).astype(np.uint8)
  inverse = rng.normal(size=(chunk, chunk)).astype(np.float32)
  args = jnp.asarray(values), jnp.asarray(positions), jnp.asarray(inverse)
  bucket = fusion.Bucket.of([jnp.zeros(c) for c in cuts])
  pieces = jax.jit(demo.inverse_per_leaf, static_argnums=3)(*args, bucket)
  assert [p.shape for p in pieces] == [(c,) for c in cuts]
  # The same products summed in the same order (up to XLA's contraction into FMAs).
  np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in pieces]),
                             np.asarray(jax.jit(demo.inverse_of_sparse)(*args))[:n],
                             rtol=1e-6, atol=1e-6)


def test_message_bytes_follow_the_formula():
  # 53 entries in chunks of 16: 4 chunks, k = 4 each, 5 bytes per coefficient.
  assert demo.message_bytes(53, 16, 0.25) == 4 * 4 * 5
  assert demo.message_bytes(10, 64, 0.5) == 5 * 5  # one chunk of all 10


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="chunk_size"):
    jaxcomp.demo(0.1, "data", chunk_size=257)
  with pytest.raises(ValueError, match="error_decay"):
    jaxcomp.demo(0.1, "data", error_decay=-0.1)
  with pytest.raises(ValueError, match="density"):
    jaxcomp.demo(1.5, "data")
