"""The quickstart notebook runs top to bottom, in a fresh kernel, in under two minutes."""

import pathlib

import nbclient
import nbformat

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_executes():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(
      notebook, timeout=110, kernel_name="python3",
      resources={"metadata": {"path": str(NOTEBOOK.parent)}},
  )
  client.execute()
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "allreduce: test accuracy" in text and "gtopk: test accuracy" in text
  assert "bytes/step" in text
  assert any("image/png" in o.get("data", {}) for o in outputs)
