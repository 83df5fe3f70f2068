"""Eight fake CPU devices for every test, set before any backend starts, one
compilation cache for the whole run, and the slowest modules first.

Many tests compile the same program (a method's step on the same mesh, the
step a fresh process compiles again to resume a checkpoint). The run's first
process makes a temporary cache directory and exports it, so that the xdist
workers and every process a test spawns read and write it; it is removed when
the run ends. A ``JAX_COMPILATION_CACHE_DIR`` set by the user is used as it is. The
native top-k's library (``jaxcomp._src.native``) is built into the same directory,
once for the run.

The suite is bound by compiling many small programs, so the CPU backend
compiles them at LLVM's lowest optimization level: the whole run takes about
a third less time. XLA's own passes (fusion, the collective combiners,
scheduling), which the byte, kernel and ordering tests read, run as always.
An ``--xla_backend_optimization_level`` in the user's ``XLA_FLAGS`` is kept.
"""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix="jaxcomp-tests-xla-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  # Small test programs compile in well under the one-second default.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

  os.environ.setdefault("JAXCOMP_CACHE_DIR", _OWN_CACHE)

if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "jaxcomp",
    derandomize=True,
    deadline=None,
    max_examples=15,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile("jaxcomp")


# The modules that take longest, in seconds of one worker on 2 cores (one full run),
# heaviest first. Under ``-n`` xdist hands each worker whole modules in collection
# order (``--dist loadfile --no-loadscope-reorder``); by default it would order them
# by their number of tests, which left a few slow modules of few tests (the
# notebook's, the language model's) to the end of one worker while the other sat
# idle (974 against 932 s). Heaviest first, the workers end within a small module of
# each other. Modules not named follow in their usual order.
_SECONDS = {
    "test_contract.py": 223, "test_reliability.py": 197, "test_buckets.py": 175,
    "test_hierarchical.py": 111, "test_checkpoint.py": 109, "test_compare.py": 106,
    "test_selection.py": 92, "test_native.py": 79, "test_netbench.py": 74,
    "test_sparsify.py": 69, "test_lm.py": 67, "test_properties.py": 67,
    "test_lowrank.py": 53, "test_notebook.py": 48, "test_dgc.py": 45,
    "test_forms.py": 42, "test_large_batch.py": 39, "test_nnx.py": 39,
    "test_demo.py": 33, "test_bench_compression.py": 31, "test_diloco.py": 30,
    "test_sparseloco.py": 27, "test_fsdp.py": 26, "test_protocol.py": 25,
    "test_signsgd.py": 22,
}


def pytest_collection_modifyitems(session, config, items):
  del session, config
  items.sort(key=lambda item: -_SECONDS.get(item.path.name, 0))  # stable: in-module order kept


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
