"""Every method gives the bits of the golden file (``tests/golden.py``) over 20 steps."""

import json

import pytest

import golden

RECORDED = json.loads(golden.PATH.read_text())


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_bits_match_the_golden_file(case):
  name, mesh = case.split("/")
  got = golden.run(name, mesh)
  for step, (want, have) in enumerate(zip(RECORDED[case], got)):
    assert have[0] == want[0], f"{case}: mean gradient differs at step {step}"
    assert have[1] == want[1], f"{case}: state differs at step {step}"
