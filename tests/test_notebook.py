"""The quickstart notebook runs top to bottom in a fresh kernel: pure Flax NNX, no experiments."""

import json
import pathlib
import re

import nbclient
import nbformat

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
METHODS = ("allreduce", "gtopk", "dgc")


def _source() -> str:
  notebook = json.loads(NOTEBOOK.read_text())
  return "\n".join("".join(cell["source"]) for cell in notebook["cells"]
                   if cell["cell_type"] == "code")


def test_quickstart_is_a_flax_nnx_loop_with_nothing_from_the_repository():
  source = _source()
  for needed in ("nnx.Module", "nnx.Optimizer", "@nnx.jit", "jaxcomp.nnx.per_device",
                 "@jaxcomp.nnx.data_parallel(mesh, \"data\")", "jax.block_until_ready",
                 "load_digits"):
    assert needed in source, needed
  assert "check_vma" not in source
  assert not re.search(r"^\s*(from|import)\s+experiments\b", source, re.M)
  first = source.index('jax.config.update("jax_num_cpu_devices", 8)')
  assert first < source.index("jax.devices()") and first < source.index("import jaxcomp")


def test_quickstart_executes():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel starts in notebooks/: nothing but the installed jaxcomp is importable.
  client = nbclient.NotebookClient(
      notebook, timeout=110, kernel_name="python3",
      resources={"metadata": {"path": str(NOTEBOOK.parent)}},
  )
  client.execute()  # raises CellExecutionError on any cell's error
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  accuracy = {m: float(a) for m, a in re.findall(r"(\w+): test accuracy ([\d.]+)", text)}
  assert set(accuracy) == set(METHODS), text
  assert all(a >= 0.9 for a in accuracy.values()), accuracy
  sent = {m: float(b.replace(",", "")) for m, b in re.findall(r"(\w+): +([\d,]+) bytes/step", text)}
  assert set(sent) == set(METHODS), text
  assert sent["gtopk"] * 10 < sent["allreduce"] and sent["dgc"] * 10 < sent["allreduce"], sent
  assert any("image/png" in o.get("data", {}) for o in outputs)
