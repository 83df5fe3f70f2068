"""Every method matches the golden file (``tests/golden.py``), step by step, leaf by leaf."""

import numpy as np
import pytest

import golden

RECORDED = golden.load()


def test_the_file_holds_every_case_and_nothing_else():
  cases = {key.split("/")[0] + "/" + key.split("/")[1] for key in RECORDED}
  assert cases == set(golden.case_names())
  assert set(golden.RULES) == set(golden.cases())


@pytest.mark.parametrize("case", golden.case_names())
def test_matches_the_golden_file(case):
  failures = golden.check(case, RECORDED)
  assert not failures, "\n".join(failures)


# The comparison itself, on the recorded arrays: each kind of change it must see.

_WANT = RECORDED["topk/ring/1/state.residual['conv']"]
_RULE = golden.RULES["topk"]


def test_values_within_the_tolerance_pass():
  got = _WANT.copy()
  index = tuple(np.argwhere(_WANT != 0)[0])
  got[index] = np.nextafter(got[index], np.float32(np.inf))
  assert golden.compare("topk/ring step 1 state.residual['conv']", got, _WANT, _RULE) is None


def test_a_value_past_the_tolerance_is_named_with_its_place_and_the_tolerance():
  got = _WANT.copy()
  index = np.unravel_index(np.argmax(np.abs(_WANT)), _WANT.shape)
  got[index] *= np.float32(1 + 1e-4)
  message = golden.compare("topk/ring step 1 state.residual['conv']", got, _WANT, _RULE)
  assert message is not None
  assert message.startswith(
      f"topk/ring step 1 state.residual['conv']: worst element {tuple(map(int, index))}")
  assert f"want {float(_WANT[index])!r}" in message
  assert "> tolerance" in message and "64 eps x max|want|" in message


def test_a_zero_that_moved_is_caught_whatever_its_size():
  got = _WANT.copy()
  zeros = np.argwhere(_WANT == 0)
  assert len(zeros), "a sparse method's residual holds the entries it sent as zeros"
  got[tuple(zeros[0])] = np.float32(1e-30)  # far inside any float tolerance
  message = golden.compare("topk/ring step 1 state.residual['conv']", got, _WANT, _RULE)
  assert message is not None and "which entries are zero" in message


def test_integers_are_exact():
  want = RECORDED["randomk/ring/1/state.rng_key"]
  got = want.copy()
  got[..., 1] ^= 1
  assert golden.compare("randomk/ring step 1 state.rng_key", got, want, golden.RULES["randomk"])


def test_a_cast_mean_off_the_bfloat16_grid_is_caught():
  want = RECORDED["cast/ring/0/mean['conv']"]
  got = want.copy()
  got.reshape(-1)[7] = np.nextafter(got.reshape(-1)[7], np.float32(np.inf))
  message = golden.compare("cast/ring step 0 mean['conv']", got, want, golden.RULES["cast"],
                           mean=True)
  assert message is not None and "grid" in message
