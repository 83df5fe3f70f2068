"""The native top-k: one custom call that gives exact_topk's values and indices bit for bit,
and a selection that stays in JAX wherever the call cannot be built."""

import subprocess
import sys

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp._src import native
from jaxcomp._src import selection
from tests import harness

needs_native = pytest.mark.skipif(
    not native.available(), reason=f"no native top-k here: {native.unavailable_reason()}")

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


@needs_native
@hypothesis.given(_cases())
def test_the_custom_call_gives_exact_topk_s_bits(case):
  x, capacity, k = case
  by_jax = jax.jit(lambda x, k: selection.exact_topk(x, capacity, k=k))(x, k)
  by_call = jax.jit(lambda x, k: native.topk(x, capacity, k))(x, k)
  np.testing.assert_array_equal(_bits(by_call)[0], _bits(by_jax)[0])
  np.testing.assert_array_equal(_bits(by_call)[1], _bits(by_jax)[1])


@needs_native
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


@needs_native
@pytest.mark.parametrize("name", ["topk", "gtopk"])
def test_a_method_s_steps_on_8_devices_keep_their_bits(name, monkeypatch):
  # The exact route from 2,048 entries on, so that every bucket of this small tree takes it.
  params = {"a": jnp.zeros((60, 100)), "b": jnp.zeros(5000), "c": jnp.zeros(9)}

  def run(native_route):
    tuning = selection.Tuning(exact_min_size=2048, native=native_route)
    monkeypatch.setitem(selection._BY_BACKEND, "cpu", tuning)
    runs = harness.run_two_steps(
        lambda axis: getattr(jaxcomp, name)(0.01, axis, bucket_cap_mb=0.03), params, 8, ("data",))
    assert ("jaxcomp_topk" in runs["compiled"].as_text()) == native_route
    return runs["outs"], runs["states"]

  chex.assert_trees_all_equal(run(True), run(False))


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


@needs_native
def test_a_second_process_loads_the_library_the_first_built(tmp_path):
  code = "from jaxcomp._src import native; print(native.unavailable_reason())"
  assert _fresh(code, JAXCOMP_CACHE_DIR=str(tmp_path)).strip() == "None"
  (library,) = tmp_path.glob("topk-*.so")
  built = library.stat().st_mtime_ns
  assert _fresh(code, JAXCOMP_CACHE_DIR=str(tmp_path), CXX=str(tmp_path / "none")).strip() == "None"
  assert library.stat().st_mtime_ns == built and len(list(tmp_path.iterdir())) == 1


@needs_native
def test_a_capacity_or_k_outside_its_range_is_refused_by_name():
  with pytest.raises(ValueError, match="capacity"):
    native.topk(jnp.ones(10), 11)
  with pytest.raises(ValueError, match="`k`"):
    native.topk(jnp.ones(10), 4, 5)


@needs_native
def test_under_vmap_each_row_selects_its_own():
  rows = np.asarray(jax.random.normal(jax.random.key(5), (3, 200)))
  by_call = jax.jit(jax.vmap(lambda x: native.topk(x, 12)))(rows)
  for row, values, indices in zip(rows, *by_call):
    np.testing.assert_array_equal(indices, np.sort(harness.np_topk(row, 12)))
    np.testing.assert_array_equal(values, row[indices])
