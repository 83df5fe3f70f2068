"""The built wheel holds the library only: no top-level `experiments` package."""

import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_wheel_ships_jaxcomp_and_not_experiments(tmp_path):
  # Built from a copy, so that no build/ or egg-info lands in the clone. experiments/ is
  # copied too: a package search that picked it up again would find it.
  src = tmp_path / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  for package in ("jaxcomp", "experiments"):
    shutil.copytree(ROOT / package, src / package,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
  done = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(tmp_path / "dist")],
      cwd=src, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  (wheel,) = (tmp_path / "dist").glob("jaxcomp-*.whl")
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert archive.read(top_level).decode().split() == ["jaxcomp"]
  assert "jaxcomp/__init__.py" in names and "jaxcomp/nnx.py" in names
  assert not [n for n in names if n.startswith("experiments/")], names
  assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"jaxcomp"}
