"""The README's example runs as written, and CI reads the README's test command."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _block_after(marker: str) -> str:
  match = re.search(re.escape(marker) + r"\s*```\w*\n(.*?)```", README, re.S)
  assert match, f"no fenced block after {marker} in README.md"
  return match.group(1)


def test_example_runs_in_a_fresh_process():
  code = _block_after("<!-- ci:example -->")
  code += (
      "\nimport numpy as np"
      "\nassert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(params))"
      "\nassert float(jnp.abs(params['w']).sum()) > 0"
      "\nprint('example ok')\n"
  )
  done = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "example ok" in done.stdout


def _run_block(marker: str, checks: str) -> None:
  """Runs the README's block after ``marker``, then ``checks``, in a fresh process."""
  done = subprocess.run(
      [sys.executable, "-c", _block_after(marker) + checks + "\nprint('block ok')\n"],
      capture_output=True, text=True, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "block ok" in done.stdout


def test_flax_nnx_section_runs_and_keeps_replicas_one():
  assert "check_vma" not in _block_after("<!-- ci:flax -->")
  _run_block("<!-- ci:flax -->", (
      "\nfrom jaxcomp import training"
      "\ntraining.check_replicas(nnx.state(model))"
      "\nstate = nnx.state(optimizer)"
      "\nimport numpy as np"
      "\nrows = [np.asarray(v.get_value()).reshape(8, -1)  # device d's block on row d"
      "\n        for p, v in nnx.to_flat_state(state) if 'residual' in p]"
      "\nassert rows and any(not np.array_equal(r[0], r[1]) for r in rows)  # each its own"
      "\nassert np.isfinite(float(loss))"))


def test_pmap_section_runs_and_keeps_replicas_one():
  _run_block("<!-- ci:pmap -->", (
      "\nimport numpy as np"
      "\nw = np.asarray(params_d['w'])"
      "\nassert w.shape[0] == 8 and all(np.array_equal(w[0], w[i]) for i in range(8))"
      "\nassert float(np.abs(w).sum()) > 0"))


def test_ci_runs_the_readmes_test_command():
  command = _block_after("<!-- ci:test-command -->").strip()
  assert "pip install" in command and "pytest" in command
  script = (ROOT / ".ci" / "run").read_text()
  assert "<!-- ci:test-command -->" in script
  # .ci/run extracts the block with awk: the same text must come out.
  extracted = subprocess.run(
      ["awk", re.search(r"awk '(.*?)' README.md", script, re.S).group(1), "README.md"],
      capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()
  assert extracted == command
