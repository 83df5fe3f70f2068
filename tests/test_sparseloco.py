"""SparseLoCo's compressor against a numpy oracle of its rule (8 fake CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp._src import selection
from jaxcomp._src import sparseloco
from jaxcomp import training

import harness

PARAMS = {"w": jnp.zeros((8, 6)), "b": jnp.zeros((5,))}  # 53 entries: a partial last chunk
# More leaves than XLA:CPU fuses in one concatenation: error feedback corrects the
# padded buffer in place (protocol._corrected); 157 entries, a partial last chunk.
MANY_LEAVES = {f"w{i}": jnp.zeros((2, 3 + i)) for i in range(10)} | {"b": jnp.zeros((7,))}


def _encoded(x, chunk, k):
  """numpy: the decoded entries ``[chunks, k]`` and their positions of a flat ``x``."""
  blocks = x.reshape(-1, chunk).astype(np.float32)
  # The k largest magnitudes, the lowest position first on a tie.
  positions = np.argsort(-np.abs(blocks), axis=1, kind="stable")[:, :k]
  picked = np.take_along_axis(blocks, positions, axis=1)
  magnitude = np.abs(picked)
  middle = magnitude.min(axis=1, keepdims=True) / 2 + magnitude.max(axis=1, keepdims=True) / 2
  high = magnitude >= middle
  values = np.zeros_like(picked)
  for row in range(blocks.shape[0]):
    hi = magnitude[row][high[row]].mean()
    lo = magnitude[row][~high[row]].mean() if (~high[row]).any() else hi
    values[row] = np.where(high[row], hi, lo) * np.sign(picked[row])
  return values, positions


def _dense(values, positions, chunk):
  out = np.zeros((values.shape[0], chunk), np.float32)
  np.put_along_axis(out, positions, values, axis=1)
  return out.reshape(-1)


@pytest.mark.parametrize("params", [PARAMS, MANY_LEAVES], ids=["2 leaves", "11 leaves"])
@pytest.mark.parametrize("chunk_size,density", [(16, 0.25), (53, 0.1), (7, 0.5)])
def test_mean_and_residual_equal_the_numpy_oracle(chunk_size, density, params):
  decay = 0.9
  tx = jaxcomp.sparseloco(density, "data", chunk_size=chunk_size, error_decay=decay)
  grads, mean, residuals = harness.one_step_of_normal_gradients(tx, params, chunk_size)
  n = grads.shape[1]
  chunk, chunks, k = selection.chunks(n, chunk_size, density)
  total = np.zeros(chunks * chunk, np.float32)
  for device in range(8):
    values, positions = _encoded(np.pad(grads[device], (0, chunks * chunk - n)), chunk, k)
    sent = _dense(values, positions, chunk)
    total += sent / 8
    np.testing.assert_allclose(residuals[device], decay * (grads[device] - sent[:n]),
                               rtol=1e-6, atol=1e-6)
  # XLA sums the eight devices' entries in an order it picks.
  np.testing.assert_allclose(mean, total[:n], rtol=1e-5, atol=1e-6)


def test_two_bit_codes_round_trip_and_keep_each_side_s_sum_of_magnitudes():
  x = jax.random.normal(jax.random.key(0), (4 * 64,)) * jnp.repeat(jnp.arange(1.0, 5.0), 64)
  codes, positions, levels, values = sparseloco.encode(x, 64, 10)
  assert codes.dtype == jnp.uint8 and codes.shape == (4, 3)
  assert positions.dtype == jnp.uint16 and levels.shape == (4, 2)
  np.testing.assert_array_equal(sparseloco.decode(codes, levels, 10), values)
  picked = np.take_along_axis(np.asarray(x).reshape(4, 64), np.asarray(positions, np.int64), 1)
  np.testing.assert_array_equal(np.sign(values), np.sign(picked))
  np.testing.assert_allclose(np.abs(values).sum(axis=1), np.abs(picked).sum(axis=1), rtol=1e-5)


def test_a_chunk_s_sums_are_pairwise_in_a_fixed_order():
  # Pairwise, 1e8 and -1e8 meet first and the two ones survive; left to right, the
  # first one is lost to 1e8's rounding. An odd last column is carried to the next round.
  columns = jnp.array([[1e8, 1.0, -1e8, 1.0], [1e8, 1.0, -1e8, 1.0]], jnp.float32)
  np.testing.assert_array_equal(sparseloco._fold_columns(columns, jnp.add), [2.0, 2.0])
  odd = jnp.array([[1e8, -1e8, 1.0, 0.5, 0.25]], jnp.float32)
  # (1e8 + 1, -1e8 + 0.5, 0.25) -> (1e8 - 1e8, 0.25) -> 0.25, where left to right
  # (and the exact sum) gives 1.75.
  np.testing.assert_array_equal(sparseloco._fold_columns(odd, jnp.add), [0.25])
  np.testing.assert_array_equal(
      sparseloco._fold_columns(jnp.array([[3.0, jnp.nan, 1.0]]), jnp.minimum), [jnp.nan])


def test_message_bytes_follow_the_formula():
  # 53 entries in chunks of 16: 4 chunks, k = 4 each: 1 code byte, 8 position bytes, 8 level bytes.
  assert sparseloco.message_bytes(53, 16, 0.25) == 4 * (1 + 8 + 8)
  assert sparseloco.message_bytes(10, 4096, 0.5) == 1 * (2 + 10 + 8)  # one chunk of all 10


def test_no_decay_keeps_nothing_and_bad_arguments_are_named():
  mesh = training.make_mesh(8)
  tx = jaxcomp.sparseloco(0.25, "data", chunk_size=16, error_decay=0.0)
  state = training.init_state(tx, PARAMS, mesh, "data")
  grads = harness.per_device_normal(PARAMS, 3)
  _, new_state = training.make_update(tx, mesh, "data")(grads, state)
  assert not np.asarray(jax.tree.leaves(new_state.residual)[0]).any()
  with pytest.raises(ValueError, match="chunk_size"):
    jaxcomp.sparseloco(0.1, "data", chunk_size=2 ** 16 + 1)
  with pytest.raises(ValueError, match="error_decay"):
    jaxcomp.sparseloco(0.1, "data", error_decay=1.5)
  with pytest.raises(ValueError, match="density"):
    jaxcomp.sparseloco(0.0, "data")


def test_the_last_chunk_s_padding_is_corrected_in_place():
  """The fused gradient comes padded to whole chunks, and error feedback's addition
  writes over it: no second buffer of the bucket (on XLA:CPU new memory on every
  step, whose pages fault in), as when the padding was fused into the addition."""
  params = {f"w{i}": jnp.zeros((500, 333 + i)) for i in range(12)}  # 12 leaves, a partial chunk
  n = sum(x.size for x in jax.tree.leaves(params))
  tx = jaxcomp.sparseloco(0.001, "data")
  mesh = training.make_mesh(1)
  state = training.init_state(tx, params, mesh, "data")
  grads = training.stack_per_device(params, mesh, "data")
  memory = training.make_update(tx, mesh, "data", donate=True).lower(
      grads, state).compile().memory_analysis()
  if memory is None:
    pytest.skip("this backend reports no memory analysis")
  assert memory.temp_size_in_bytes < 1.5 * 4 * n  # one gradient's worth, not two
