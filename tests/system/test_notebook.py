"""scripts/colab_quickstart.ipynb runs top to bottom (nbclient) with its smoke settings
(SAGE_JAX_NOTEBOOK_SMOKE=1: the shrunken toy job of test_toy_job.py), and shows the summary plot,
the summary table and the sampled completions with their hints."""

import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

NOTEBOOK = Path(__file__).resolve().parents[2] / "scripts" / "colab_quickstart.ipynb"
KERNEL = "sage_jax_test"


def kernel_manager(tmp_path: Path) -> KernelManager:
    """A kernel of this interpreter (sys.executable), from a kernel spec written under tmp_path:
    no installed kernel spec is needed or consulted (a fresh venv with ipykernel suffices)."""
    kernels = tmp_path / "kernels"
    write_kernel_spec(kernels / KERNEL, overrides={"display_name": "sage_jax test"})
    return KernelManager(kernel_name=KERNEL,
                         kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))


def test_colab_quickstart_runs_top_to_bottom(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in nb.cells if c.cell_type == "code"), "commit the notebook with no outputs"
    monkeypatch.setenv("SAGE_JAX_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # one CPU device, as on Colab (conftest sets 8)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))  # connection file
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # the kernel's profile
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    km = kernel_manager(tmp_path)
    assert km.kernel_spec.argv[0] == sys.executable
    client = NotebookClient(nb, km=km, timeout=900, allow_errors=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()  # raises CellExecutionError naming the cell on the first error

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, "the summary plot is shown"
    markdown = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert any("| steps (k) | SFT start |" in m for m in markdown), "the summary table is shown"
    (samples,) = [m for m in markdown if m.startswith("**Sampled completions**")]
    assert "| step | problem | answer | hint level | hint | best completion |" in samples
    assert len(samples.splitlines()) >= 5  # header, rule and at least one record
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "finished in" in text and "the prompt the policy saw" in text
    # the run happened in the notebook's working folder; the warm start went to the given cache
    (run,) = (cwd / "runs").iterdir()
    assert (run / "summary.png").is_file() and (run / "samples.jsonl").is_file()
    assert any((tmp_path / "cache").iterdir())
    # the real-model sections only checked their configs: they downloaded and trained nothing
    assert "devices: [CpuDevice(id=0)]" in text
    assert ("recipe colab_qwen2.5-0.5b: Qwen/Qwen2.5-0.5B-Instruct (full fine-tuning, bfloat16 "
            "weights)") in text
    assert ("recipe colab_qwen2.5-1.5b_lora: Qwen/Qwen2.5-1.5B-Instruct (LoRA rank 16, alpha 32, "
            "bfloat16 base frozen)") in text
    assert "mesh MeshConfig(data=1, fsdp=-1, tensor=1)" in text
    assert not (cwd / "runs" / "qwen-sage").exists()
