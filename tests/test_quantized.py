"""The 8- and 4-bit quantized mean against a numpy oracle of its rule (8 fake CPU devices)."""

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import hlo_counts
import jaxcomp
from jaxcomp._src import quantized
from jaxcomp import training
from jaxcomp import wire

import harness

PARAMS = {"w": jnp.zeros((8, 6)), "b": jnp.zeros((5,))}  # 53 elements: a partial last chunk

# How close ``x / scale`` may come to a rounding tie (``k + 1/2``) in the
# oracle's data: XLA's quotient and the chunk of the mean may differ from the
# oracle's by a few ulps, about 1e-6 of a level.
_MARGIN = 1e-4


def _encoded(x, bits, block):
  """numpy: ``(levels, scales)`` of a flat f32 ``x`` (a multiple of ``block``)."""
  top = 2 ** (bits - 1) - 1
  blocks = x.reshape(-1, block).astype(np.float32)
  scales = np.abs(blocks).max(axis=1) / np.float32(top)
  ratio = blocks / np.where(scales == 0, 1, scales)[:, None]
  distance = np.abs(ratio - np.floor(ratio) - 0.5)[blocks != 0]
  assert not distance.size or distance.min() > _MARGIN
  return np.clip(np.round(ratio), -top, top), scales


def _decoded(levels, scales):
  return (scales[:, None] * levels).reshape(-1).astype(np.float32)


@pytest.mark.parametrize("bits,block", [(8, 7), (4, 8)])  # 4 bits: an even block
@pytest.mark.parametrize("error_feedback", [False, True])
def test_mean_and_residual_equal_the_numpy_oracle(bits, block, error_feedback):
  mesh = training.make_mesh(8)
  tx = jaxcomp.quantized(bits, "data", error_feedback=error_feedback)
  state = training.init_state(tx, PARAMS, mesh, "data")
  rng = np.random.default_rng(bits)
  grads = {"w": rng.normal(size=(8, 8, 6)).astype(np.float32),
           "b": rng.normal(size=(8, 5)).astype(np.float32)}
  out, new_state = jax.block_until_ready(training.make_update(tx, mesh, "data")(
      training.shard(grads, mesh, "data"), state))
  new_state = harness.state_rows(tx, new_state, PARAMS)
  n, chunk = 53, block  # a block is at most a device's chunk: ceil(53 / 8) entries
  chunk_sums = np.zeros((8, chunk), np.float32)
  for device in range(8):
    corrected = np.concatenate([grads["b"][device], grads["w"][device].reshape(-1)])
    levels, scales = _encoded(np.pad(corrected, (0, 8 * chunk - n)), bits, block)
    chunk_sums += _decoded(levels, scales / np.float32(8)).reshape(8, chunk)
    if error_feedback:
      residual = np.concatenate([np.asarray(new_state.residual["b"][device]),
                                 np.asarray(new_state.residual["w"][device]).reshape(-1)])
      np.testing.assert_allclose(residual, corrected - _decoded(levels, scales)[:n],
                                 rtol=1e-6, atol=1e-6)
  mean = np.concatenate([_decoded(*_encoded(chunk_sums[j], bits, block))
                         for j in range(8)])[:n]
  got = np.concatenate([np.asarray(out["b"][0]), np.asarray(out["w"][0]).reshape(-1)])
  np.testing.assert_allclose(got, mean, rtol=1e-5, atol=1e-6)
  if not error_feedback:
    assert new_state.residual == ()


@hypothesis.given(st.sampled_from([4, 8]), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_the_residual_s_levels_are_the_decoded_bytes_bit_for_bit(bits, blocks, seed):
  """The residual's ``x`` quantized again from its levels (no bytes) is the bytes
  decoded, over 40 binades and with a non-finite block."""
  rng = np.random.default_rng(seed)
  block = 8
  x = (rng.normal(size=blocks * block)
       * 2.0 ** rng.integers(-20, 20, size=blocks * block)).astype(np.float32)
  if rng.integers(2):
    x[0] = np.inf  # the first block's scale is inf
  payload, scales = quantized.encode(jnp.asarray(x), bits, block)
  harness.assert_bitwise_equal(
      jax.jit(quantized._dequantized, static_argnums=(2, 3))(jnp.asarray(x), scales, bits, block),
      quantized.decode(payload, scales, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_every_level_survives_the_bytes_and_rounding_is_to_the_nearest(bits):
  top = 2 ** (bits - 1) - 1
  block = 2 * top + 1  # one block holding every level once, then one of zeros
  x = np.concatenate([np.arange(-top, top + 1), np.zeros(block)]).astype(np.float32)
  x = np.pad(x, (0, -len(x) % 2))
  block += block % 2
  x = np.pad(x, (0, -len(x) % block))
  payload, scales = quantized.encode(jnp.asarray(x), bits, block)
  assert payload.dtype == jnp.uint8 and payload.size == x.size * bits // 8
  np.testing.assert_array_equal(np.asarray(quantized.decode(payload, scales, bits)), x)
  noisy = jnp.asarray(np.random.default_rng(0).normal(size=4 * block).astype(np.float32))
  payload, scales = quantized.encode(noisy, bits, block)
  error = np.abs(np.asarray(quantized.decode(payload, scales, bits)) - np.asarray(noisy))
  assert (error <= np.repeat(np.asarray(scales), block) / 2 * (1 + 1e-6)).all()


def test_bytes_follow_the_bits():
  # 53 elements on 8 devices, 8 bits: chunks of 7 levels and one f32 scale,
  # 11 bytes, sent to 7 devices in the all-to-all and again in the all-gather;
  # 4 bits: 8 entries in 4 bytes and a scale, 8 bytes.
  assert wire.expected_bytes(jaxcomp.quantized(8, "data"), PARAMS, 8).total == 2 * 7 * 11
  assert wire.expected_bytes(jaxcomp.quantized(4, "data"), PARAMS, 8).total == 2 * 7 * 8
  big = {"w": jax.ShapeDtypeStruct((1 << 20,), jnp.float32)}
  dense = wire.expected_bytes(jaxcomp.allreduce("data"), big, 8).total
  for bits, ratio in ((8, 4 / (1 + 4 / 64)), (4, 4 / (0.5 + 4 / 64))):
    got = dense / wire.expected_bytes(jaxcomp.quantized(bits, "data"), big, 8).total
    assert got == pytest.approx(ratio, rel=1e-3)


@pytest.mark.parametrize("kwargs,error,name", [
    ({"bits": 3}, ValueError, "bits"), ({"bits": 16}, ValueError, "bits"),
    ({"bits": 6}, ValueError, "bits"), ({"bits": 8.5}, TypeError, "bits"),
    ({"bits": 8, "block_size": 1}, ValueError, "block_size"),
    ({"bits": 8, "error_feedback": 1}, TypeError, "error_feedback"),
])
def test_bad_arguments(kwargs, error, name):
  with pytest.raises(error, match=name):
    jaxcomp.quantized(axis_name="data", **kwargs)


@pytest.mark.parametrize("factory, payloads", [
    (lambda: jaxcomp.quantized(8, "data"), 0),
    # QSGD's first hop all-gathers its payload on one device (two_hop.mean): that one,
    # a bitcast's fusion where XLA encodes it (the call that encodes it on the native
    # route writes it with the norms).
    (lambda: jaxcomp.qsgd(8, "data", error_feedback=True), 0),
])
def test_error_feedback_reads_the_old_residual_once(factory, payloads):
  """The old residual is read by one kernel outside the branch that keeps the step (the
  call that encodes the leaves on the native route, else error feedback's addition): the new
  one is formed from the corrected gradient and the scales inside the branch that
  keeps the step, not chosen between old and new after it (a second pass over the
  old one), nor decoded from a payload written out before it for that."""
  params = {f"w{i}": jnp.zeros((512, 512)) for i in range(4)}
  mesh = training.make_mesh(1)
  tx = factory()
  state = training.init_state(tx, params, mesh, "data")
  grads = training.stack_per_device(params, mesh, "data")
  text = training.make_update(tx, mesh, "data", donate=True).lower(
      grads, state).compile().as_text()
  entry = hlo_counts.computations(text)["ENTRY"]
  residual = [i.name for i in entry if i.op == "parameter" and "residual" in i.name]
  readers = [i for i in entry if i.op not in ("tuple", "conditional")
             and set(i.operands) & set(residual)]
  assert len(residual) == 1 and len(readers) == 1, [(i.op, i.name) for i in readers]
  assert len([i for i in entry if i.shape.startswith("u8") and (
      i.op == "custom-call" or i.op == "fusion"
      and hlo_counts.source(i).endswith("bitcast_convert_type"))]) == payloads
