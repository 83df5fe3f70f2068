"""The exact top-k as one XLA:CPU custom call, compiled from ``topk.cc`` on first use.

On CPU the selection in JAX (:func:`jaxcomp._src.selection.exact_topk`) is
about 43 kernels: a sample's threshold, a compaction, prefix sums and a
fallback under a ``lax.cond``; each is a kernel to launch and to compile
(about 1.5 s of a step's compile time per bucket shape on 2 cores). The same
selection in C++ (``topk.cc``: a sampled threshold, one pass on two threads,
then the k-th largest among the entries kept) is one kernel that compiles
with the step in no time and gives the same values and indices bit for bit,
in about the time of the JAX route (2 cores of an AMD EPYC, one process: 19
against 23 ms for ResNet-50's 25.6M entries at density 0.001, 6.0 against 5.2
for a 25 MiB bucket of 6.5M). Compiled with the compiler's default target, not
for this CPU alone, so that machines that share the cache can all load it.

It needs a C++17 compiler (``$CXX``, else ``c++``) and the XLA FFI headers
that jaxlib ships (``jax.ffi.include_dir()``). The library is built once per
source and jaxlib version, into ``$JAXCOMP_CACHE_DIR`` (by default
``jaxcomp`` under ``$XDG_CACHE_HOME`` or ``~/.cache``), and loaded from there by
every later process. Where it cannot be built or loaded, or where
``JAXCOMP_NATIVE=0`` is set, :func:`available` is false and the selection
stays in JAX: the same results, in more kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxcomp._src import checks
from jaxcomp._src import collectives

_SOURCE = pathlib.Path(__file__).with_name("topk.cc")
_TARGET = "jaxcomp_topk"
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")


def _cache_dir() -> pathlib.Path:
  explicit = os.environ.get("JAXCOMP_CACHE_DIR")
  if explicit:
    return pathlib.Path(explicit)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "jaxcomp"


def _library() -> pathlib.Path:
  """Where the library of this source, jaxlib version and flags is cached."""
  tag = hashlib.sha256(b"\0".join(
      [_SOURCE.read_bytes(), jaxlib.__version__.encode(), " ".join(_FLAGS).encode()]))
  return _cache_dir() / f"topk-{tag.hexdigest()[:16]}.so"


def _build(library: pathlib.Path, compiler: str) -> None:
  """Compiles ``topk.cc`` into ``library``."""
  library.parent.mkdir(parents=True, exist_ok=True)
  # Written aside and renamed: processes that build at once each rename a whole file.
  handle, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
  os.close(handle)
  try:
    subprocess.run([compiler, *_FLAGS, "-I", jax.ffi.include_dir(), str(_SOURCE), "-o", partial],
                   check=True, capture_output=True, timeout=300)
    os.replace(partial, library)
  finally:
    if os.path.exists(partial):
      os.remove(partial)


def _register() -> Optional[str]:
  """Builds (unless cached), loads and registers the custom call; why not, else ``None``."""
  if os.environ.get("JAXCOMP_NATIVE", "1") == "0":
    return "JAXCOMP_NATIVE=0"
  try:
    library = _library()
    if not library.exists():
      compiler = os.environ.get("CXX") or shutil.which("c++")
      if not compiler:
        return "no C++ compiler ($CXX, or c++ on the PATH)"
      _build(library, compiler)
    loaded = ctypes.CDLL(str(library))
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(loaded.JaxcompTopk), platform="cpu")
  # Any of these leaves the selection in JAX: a build or a load that failed, a library
  # without the symbol, a registration jaxlib refused.
  except (OSError, subprocess.SubprocessError, AttributeError, RuntimeError,
          ValueError) as error:
    return f"{type(error).__name__}: {error}"
  return None


# XLA's registry of custom calls is the process's: registered once, by the first
# caller, whatever thread traces first.
_LOCK = threading.Lock()
_REASON: list = []


def _load() -> Optional[str]:
  """:func:`_register`'s answer, asked once per process."""
  with _LOCK:
    if not _REASON:
      _REASON.append(_register())
    return _REASON[0]


def available() -> bool:
  """The custom call is registered (built or loaded on the first call)."""
  return _load() is None


def unavailable_reason() -> Optional[str]:
  """Why :func:`available` is false (``None`` where it is true)."""
  return _load()


def topk(x: jax.Array, capacity: int, k=None) -> tuple[jax.Array, jax.Array]:
  """The entries ``lax.top_k(|x|, k)`` selects, by the custom call (CPU only).

  Args:
    x: ``f32[n]``.
    capacity: static count of slots, ``1 <= capacity <= n``.
    k: how many to select, ``1 <= k <= capacity`` (static or traced; by
      default ``capacity``).

  Returns:
    ``(values [capacity], int32 indices [capacity])``: the values and indices
    of :func:`jaxcomp._src.selection.exact_topk`, bit for bit (NaN ranked as
    ``inf``, ties to the lower index, increasing index order; slots past
    ``k`` hold 0 and ``EMPTY_INDEX``).

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  reason = _load()
  if reason is not None:
    raise RuntimeError(f"jaxcomp's native top-k is not available: {reason}")
  capacity = checks.check_number(capacity, "capacity", integer=True, low=1, high=x.shape[0])
  if k is None or isinstance(k, int):
    k = checks.check_number(capacity if k is None else k, "k", integer=True, low=1,
                            high=capacity)
  return jax.ffi.ffi_call(
      _TARGET,
      (jax.ShapeDtypeStruct((capacity,), jnp.float32), jax.ShapeDtypeStruct((capacity,), jnp.int32)),
      vmap_method="sequential",
  )(x.astype(jnp.float32), jnp.asarray(k, jnp.int32),
    empty_index=np.int32(collectives.EMPTY_INDEX))
