"""What a user installs: the wheel holds the library only, and Flax is optional."""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_wheel_ships_jaxcomp_and_not_experiments(tmp_path):
  # Built from a copy, so that no build/ or egg-info lands in the clone. experiments/ is
  # copied too: a package search that picked it up again would find it. Built with the
  # environment's setuptools and no package index (the test extra installs setuptools).
  src = tmp_path / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  for package in ("jaxcomp", "experiments"):
    shutil.copytree(ROOT / package, src / package,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
  done = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
       "--no-index", "-q", "-w", str(tmp_path / "dist")],
      cwd=src, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  (wheel,) = (tmp_path / "dist").glob("jaxcomp-*.whl")
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert archive.read(top_level).decode().split() == ["jaxcomp"]
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [line for line in archive.read(metadata).decode().splitlines()
                if line.startswith("Requires-Dist:")]
  assert "jaxcomp/__init__.py" in names and "jaxcomp/nnx.py" in names
  assert "jaxcomp/_src/protocol.py" in names
  assert "jaxcomp/_src/topk.cc" in names  # the native top-k builds from it where it is used
  assert not [n for n in names if n.startswith("experiments/")], names
  assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"jaxcomp"}
  # Flax comes with an extra only.
  flax = [line for line in requires if "flax" in line]
  assert flax and all("extra ==" in line for line in flax), flax


def test_import_jaxcomp_works_without_flax_and_nnx_says_what_to_install():
  # `import flax` fails in this process as it does where Flax is not installed.
  code = (
      "import sys\n"
      "sys.modules['flax'] = None\n"
      "import jax, optax, jaxcomp\n"
      "from jaxcomp import training\n"
      "assert not any(m == 'flax' or m.startswith('flax.') for m in sys.modules if sys.modules[m])\n"
      "tx = optax.chain(jaxcomp.gtopk(0.1, 'data'), optax.sgd(0.1))\n"
      "state = training.init_state(tx, {'w': jax.numpy.zeros(4)}, training.make_mesh(1), 'data')\n"
      "try:\n"
      "  jaxcomp.nnx\n"
      "except ImportError as e:\n"
      "  print('refused:', e)\n"
  )
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "refused: jaxcomp.nnx needs Flax" in done.stdout
  assert "pip install 'jaxcomp[flax]'" in done.stdout
