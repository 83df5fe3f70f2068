"""experiments.hlo_counts: kernels and passes of small compiled programs whose traffic is known."""

import chex
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from experiments import hlo_counts

N = 1 << 16


def _counts(fn, *args, donate=()):
  text = jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()
  return hlo_counts.count(text, N)


@pytest.fixture
def x():
  return jnp.asarray(np.random.default_rng(0).normal(size=N).astype(np.float32))


def test_one_elementwise_pass_reads_and_writes_once(x):
  counts = _counts(lambda v: v * 2 + 1, x)
  assert counts.kernels == 1
  chex.assert_trees_all_close(counts.passes, 2.0)


def test_a_reduction_reads_once(x):
  # Within 1%: XLA may add a small kernel of partial sums (0.2% of a pass on jax 0.10.0
  # and 0.10.1), still one read of ``x``.
  chex.assert_trees_all_close(_counts(jnp.sum, x).passes, 1.0, atol=1e-2)


def test_a_slice_reads_only_the_slice(x):
  counts = _counts(lambda v: v[: N // 4] * 3, x)
  chex.assert_trees_all_close(counts.passes, 0.5)


def test_one_element_taken_from_a_slice_reads_that_element(x):
  """What follows a slice is computed on it, down to the next slice: a scalar taken
  from a decoded part of ``m`` (the token that orders one bucket after the one
  before) reads one element of it, not the part; ``v`` is read and written whole."""

  def fn(v, m):
    token = (m[: N // 2].astype(jnp.float32) * 3)[0] * 0
    return v * 2 + token

  message = jnp.ones(N, jnp.int8)
  text = jax.jit(fn).lower(x, message).compile().as_text()
  counts = hlo_counts.count(text, N)
  assert counts.kernels == 1, text
  chex.assert_trees_all_close(counts.passes, 2.0, atol=1e-3)


def test_a_row_reduction_reads_every_row(x):
  # Packing a mask into words (as the selection's compaction does) is a loop
  # fusion whose 1/32-sized output reads the whole input.
  def pack(v):
    bits = (jnp.abs(v) > 1.0).reshape(-1, 32).astype(jnp.uint32)
    return jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)
  chex.assert_trees_all_close(_counts(pack, x).passes, 1.0 + 1 / 32, atol=1e-3)


def test_splitting_into_parts_is_one_read_and_one_write(x):
  counts = _counts(lambda v: [p * 2 for p in jnp.split(v, 4)], x)
  assert counts.kernels == 4
  chex.assert_trees_all_close(counts.passes, 2.0)


def test_a_slice_of_a_concatenation_reads_at_most_the_slice(x):
  """A slice of a concatenation inside a fusion is computed on the slice: each operand
  reads at most the slice (here a's eighth is read; b's bound, another eighth, is
  counted too), not all of it. The slice is written in place into a buffer of n, so
  the fusion's output does not bound what it reads."""
  a, b = x[: N // 2] + 0, x[N // 2:] + 0

  def fn(buffer, a, b):
    span = (jnp.concatenate([a, b]) + 1)[N // 8: N // 4] * 3
    return lax.dynamic_update_slice(buffer, span, (N // 2,))

  text = jax.jit(fn, donate_argnums=0).lower(jnp.zeros(N), a, b).compile().as_text()
  assert "concatenate(" in text  # the slice was not moved onto an operand
  chex.assert_trees_all_close(hlo_counts.count(text, N).passes, 3 / 8, atol=1e-3)


def test_a_block_scale_read_through_slices_counts_its_share(x):
  # Decoding blocks of 64 int8 levels with one f32 scale each, straight into
  # 16 leaves: every leaf's kernel reads its own blocks' scales, not all.
  levels = jnp.round(x * 10).astype(jnp.int8)
  scales = jnp.abs(x[: N // 64]) + 1.0

  def decode(q, s):
    decoded = (q.astype(jnp.float32).reshape(-1, 64) * s[:, None]).reshape(-1)
    return jnp.split(decoded, 16)
  counts = _counts(decode, levels, scales)
  assert counts.kernels == 16
  chex.assert_trees_all_close(counts.passes, 1.0 + 1 / 4 + 1 / 64, rtol=1e-3)


def test_an_in_place_scatter_moves_the_update_only(x):
  indices = jnp.arange(16) * 7
  counts = _counts(lambda v: v.at[indices].set(0.0), x, donate=(0,))
  assert counts.passes < 0.01, counts


# A bare dynamic-update-slice of a small update into a donated buffer, the form
# XLA:CPU of jax 0.10 leaves after a sort (jax 0.12's fuses it): written as text, so
# that the rule for a bare update is tested whatever the installed XLA makes.
_BARE_UPDATE = """
HloModule update, input_output_alias={ {}: (0, {}, may-alias) }

%negate_computation (param_0: f32[65536]) -> f32[16] {
  %param_0 = f32[65536]{0} parameter(0)
  %slice.0 = f32[16]{0} slice(%param_0), slice={[0:16]}
  ROOT %negate.0 = f32[16]{0} negate(%slice.0)
}

ENTRY %main (v: f32[65536]) -> f32[65536] {
  %v = f32[65536]{0} parameter(0)
  %start = s32[] constant(5)
  %update = f32[16]{0} fusion(%v), kind=kLoop, calls=%negate_computation
  ROOT %dynamic_update_slice = f32[65536]{0} dynamic-update-slice(%v, %update, %start)
}
"""


def test_an_in_place_update_outside_a_fusion_moves_the_update_only(x):
  counts = hlo_counts.count(_BARE_UPDATE, N)
  assert counts.by_op == {"fusion": 1, "dynamic-update-slice": 1}, counts
  # The fusion reads 16 entries and writes 16; the update reads them and its start
  # (4 bytes) and writes 16, not the buffer of N.
  chex.assert_trees_all_close(counts.passes, (16 + 16 + 16 + 1 + 16) / N)
  # Compiled here, bare or fused, a sorted span written over the donated buffer.
  counts = _counts(lambda v: lax.dynamic_update_slice(v, jnp.sort(v[:16]), (5,)), x,
                   donate=(0,))
  assert counts.passes < 0.01, counts


def test_an_update_into_a_buffer_the_fusion_computes_writes_all_of_it(x):
  """A fusion whose root writes a span over a buffer it computes itself (``2 v + w``,
  not one of its operands) is a loop over the whole output: it reads ``v`` and ``w``
  and writes all ``N`` entries, not the span alone."""
  w = x[::-1]
  update = jnp.ones(16)
  counts = _counts(lambda v, w, u: lax.dynamic_update_slice(2 * v + w, u, (5,)), x, w, update)
  assert counts.by_op == {"fusion": 1}, counts
  chex.assert_trees_all_close(counts.passes, 3.0, atol=1e-3)


def _update_of_read_span(start):
  """A span of ``v`` replaced by ``where(keep, 2 v + 1, v)`` over it, read and written at
  ``start``."""
  def fn(v, keep):
    at = (start(),)
    old = lax.dynamic_slice(v, at, (N // 8,))
    return lax.dynamic_update_slice(v, jnp.where(keep, 2 * old + 1, old), at)
  return fn


def test_a_span_read_where_it_is_written_is_in_place_on_gpu_only(x):
  """XLA:GPU writes a fusion's buffer in place when the buffer is read only by a
  dynamic slice at the write's own start; XLA:CPU only when the write alone reads it.
  A start that XLA folds to a constant turns the read into a static slice: the whole
  buffer moves on both."""
  keep = jnp.bool_(True)
  hidden = _update_of_read_span(lambda: lax.optimization_barrier(jnp.int32(N // 4)))
  text = jax.jit(hidden, donate_argnums=0).lower(x, keep).compile().as_text()
  assert "dynamic-slice(" in text
  span = 1 / 8  # of f32[N]: the span read, and written
  chex.assert_trees_all_close(hlo_counts.count(text, N, "gpu").passes, 2 * span, atol=1e-3)
  assert hlo_counts.count(text, N, "cpu").passes > 1.0
  folded = _update_of_read_span(lambda: N // 4)
  text = jax.jit(folded, donate_argnums=0).lower(x, keep).compile().as_text()
  assert "dynamic-slice(" not in text
  assert hlo_counts.count(text, N, "gpu").passes > 1.0
  with pytest.raises(ValueError, match="backend"):
    hlo_counts.count(text, N, "tpu")


def test_a_conditional_counts_its_lightest_branch(x):
  def fn(v):
    return lax.cond(v[0] > 0, lambda: v + 1, lambda: jnp.sort(v) + jnp.cumsum(v))
  light = _counts(lambda v: v + 1, x)
  counts = _counts(fn, x)
  assert counts.passes < light.passes + 0.1, (counts, light)
  assert "sort" not in counts.by_op


def test_a_loop_body_counts_once(x):
  def fn(v):
    return lax.fori_loop(0, 10, lambda i, a: a * 1.5 + i, v)
  assert _counts(fn, x).passes < 6.0


def test_heaviest_names_the_source_op(x):
  counts = _counts(lambda v: (jnp.concatenate([v, v]), jnp.sum(v)), x)
  assert counts.heaviest[0][2] == "concatenate" or "concatenate" in counts.heaviest[0][3]
  assert sum(row[1] for row in counts.heaviest) <= counts.kernels
  chex.assert_trees_all_close(sum(row[0] for row in counts.heaviest), counts.passes, rtol=1e-6)


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="n"):
    hlo_counts.count("HloModule m\n\nENTRY %main () -> f32[] {\n}\n", 0)
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_counts.count("not a program", 10)
