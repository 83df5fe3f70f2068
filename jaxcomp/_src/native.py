"""Top-k selections, error feedback's sum and the low-rank methods' products as XLA:CPU
custom calls, compiled from ``topk.cc`` on first use.

On CPU the selection in JAX (:func:`jaxcomp._src.selection.exact_topk`) is
about 43 kernels: a sample's threshold, a compaction, prefix sums and a
fallback under a ``lax.cond``; each is a kernel to launch and to compile
(about 1.5 s of a step's compile time per bucket shape on 2 cores). The same
selection in C++ (``topk.cc``: a sampled threshold, one pass on two threads
that tests 64 entries at a time in a vectorized loop, then the k-th largest
among the entries kept) is one kernel that compiles with the step in no time
and gives the same values and indices bit for bit. The other calls of the
library do the same for Deep Gradient Compression's selection from its
sampled threshold (:func:`sampled_topk`), for each row's top k
(:func:`topk_per_row`, SparseLoCo's chunks: about seven kernels by blocks in
JAX) and SparseLoCo's encoding of them (:func:`two_level`: about ten small
kernels a bucket in JAX), for error feedback's packed mask of what was sent
(:func:`sent_mask`: four kernels of a scatter in JAX) and for its corrected gradient
(:func:`corrected`: the leaves and the residual read once, where XLA:CPU
copies the concatenation of more than 8 leaves into a buffer of its own and
reads it back, and fuses fewer into a loop that can be 100 times slower), and for
PowerSGD's and ACP-SGD's products, factor columns and residual
(:func:`lowrank_product`, :func:`factor_columns`, :func:`lowrank_residual`: one
call a bucket each, where XLA:CPU makes a few kernels per group of equal-shaped
matrices; not XLA's order of sums, so those two routes agree to rounding, not
bit for bit; from the leaves and the residual where they lie, no corrected
gradient written), and for a sparsifier's mean, written into its bucket's leaves
(:func:`densify_leaves`: one kernel that writes each leaf once, where XLA:CPU
writes the whole vector's zeros, scatters into it and copies each leaf out), for
DGC's momentum correction (:func:`momentum_corrected`: the leaves read where they
lie, no fused copy of them first), for DeMo's transform and selection of each
chunk (:func:`dct_topk`: Lee's fast DCT of a few chunks at a time in cache, none of
the corrected gradient written, where XLA:CPU wrote it and multiplied each chunk by
the DCT's matrix; to rounding, as the low-rank products) and its residual
(:func:`dct_residual`), for QSGD's levels and the norms of its blocks
(:func:`qsgd_levels`, :func:`qsgd_encode`: its draws and rounding on two threads,
where XLA:CPU's fusion ran on one; the norms in the same pass: one kernel where
XLA:CPU made five and a branch per hop and bucket; its squares summed in a fixed
order, not XLA's, so the routes agree to rounding), and for the first encoding and
the residual of QSGD and of the integer codes (:func:`qsgd_encode_leaves`,
:func:`qsgd_residual`, :func:`integer_encode`, :func:`integer_residual`: from the
leaves and the residual where they lie, a few blocks at a time in cache).
Paired in one process on 2 cores of an AMD EPYC, the call against the JAX
route: the exact top-k of ResNet-50's 25.6M
entries at density 0.001 in 8.1-8.7 ms against 21-22, of a 25 MiB bucket of
6.5M in 3.3-4.4 against 6.3-7.0; DGC's selection in such a bucket in 3.2-3.9
against 3.7-5.1; 6,240 rows of 4,096 at k = 5 in 11.4-12.0 against 17-22.
Compiled with the compiler's default target, not for this CPU alone, so that
machines that share the cache can all load it (with GCC on x86-64 the low-rank
loops also in an AVX2 clone that a CPU with AVX2 picks at load time: the same
operations in the same order, no product and sum fused into one rounding).

It needs a C++17 compiler (``$CXX``, else ``c++``) and the XLA FFI headers
that jaxlib ships (``jax.ffi.include_dir()``). The library is built once per
source and jaxlib version, into ``$JAXCOMP_CACHE_DIR`` (by default
``jaxcomp`` under ``$XDG_CACHE_HOME`` or ``~/.cache``), and loaded from there by
every later process. Where it cannot be built or loaded, or where
``JAXCOMP_NATIVE=0`` is set, :func:`available` is false and the selection
stays in JAX: the same results, in more kernels (the low-rank methods' and
DeMo's to rounding).
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
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import jaxlib
import numpy as np

from jaxcomp._src import checks
from jaxcomp._src import collectives

_SOURCE = pathlib.Path(__file__).with_name("topk.cc")
# Each custom call's name, and its handler's symbol in the library.
_TARGETS = {"jaxcomp_topk": "JaxcompTopk", "jaxcomp_sampled_topk": "JaxcompSampledTopk",
            "jaxcomp_topk_per_row": "JaxcompTopkPerRow", "jaxcomp_sent_mask": "JaxcompSentMask",
            "jaxcomp_corrected": "JaxcompCorrected", "jaxcomp_two_level": "JaxcompTwoLevel",
            "jaxcomp_lowrank_product": "JaxcompLowrankProduct",
            "jaxcomp_factor_columns": "JaxcompFactorColumns",
            "jaxcomp_lowrank_residual": "JaxcompLowrankResidual",
            "jaxcomp_densify_leaves": "JaxcompDensifyLeaves",
            "jaxcomp_momentum_corrected": "JaxcompMomentumCorrected",
            "jaxcomp_momentum_sampled_topk": "JaxcompMomentumSampledTopk",
            "jaxcomp_momentum_masked": "JaxcompMomentumMasked",
            "jaxcomp_dct_topk": "JaxcompDctTopk", "jaxcomp_dct_residual": "JaxcompDctResidual",
            "jaxcomp_qsgd_levels": "JaxcompQsgdLevels",
            "jaxcomp_qsgd_encode": "JaxcompQsgdEncode",
            "jaxcomp_integer_encode": "JaxcompIntegerEncode",
            "jaxcomp_integer_residual": "JaxcompIntegerResidual",
            "jaxcomp_qsgd_encode_leaves": "JaxcompQsgdEncodeLeaves",
            "jaxcomp_qsgd_residual": "JaxcompQsgdResidual"}
# -ffp-contract=off: no product and sum fused into one rounding where the target has
# such an instruction, so that the low-rank products round alike on every machine.
# -fno-trapping-math: no floating-point exception is looked at, so that loops that
# compare floats or take their floor are vectorized (QSGD's levels); the same values.
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off",
          "-fno-trapping-math", "-w")


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
    for target, symbol in _TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(loaded, symbol)),
                                  platform="cpu")
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


def _check_available() -> None:
  reason = _load()
  if reason is not None:
    raise RuntimeError(f"jaxcomp's native top-k is not available: {reason}")


def _check(capacity: int, k, n: int):
  """``(capacity, k)`` checked against ``n`` entries (a traced ``k`` as it is);
  raises :class:`RuntimeError` where the custom calls are not :func:`available`."""
  _check_available()
  capacity = checks.check_number(capacity, "capacity", integer=True, low=1, high=n)
  if k is None or isinstance(k, int):
    k = checks.check_number(capacity if k is None else k, "k", integer=True, low=1,
                            high=capacity)
  return capacity, k


def _call(target: str, capacity: int, *operands, **attributes):
  return jax.ffi.ffi_call(
      target,
      (jax.ShapeDtypeStruct((capacity,), jnp.float32), jax.ShapeDtypeStruct((capacity,), jnp.int32)),
      vmap_method="sequential",
  )(*operands, empty_index=np.int32(collectives.EMPTY_INDEX), **attributes)


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
  capacity, k = _check(capacity, k, x.shape[0])
  return _call("jaxcomp_topk", capacity, x.astype(jnp.float32), jnp.asarray(k, jnp.int32))


def _checked_sample(positions: jax.Array, rank, candidates: int) -> int:
  """The checks of a sampled selection's sample (:func:`sampled_topk`); its ``candidates``."""
  if positions.ndim != 1 or positions.shape[0] < 1:
    raise ValueError(f"`positions` must be a non-empty vector, got shape {positions.shape}")
  if isinstance(rank, int):
    checks.check_number(rank, "rank", integer=True, low=1, high=positions.shape[0])
  return checks.check_number(candidates, "candidates", integer=True, low=0)


def sampled_topk(
    x: jax.Array, capacity: int, k, positions: jax.Array, rank, *, size: int,
    candidates: int, min_fraction: float,
) -> tuple[jax.Array, jax.Array]:
  """:func:`jaxcomp._src.selection.sampled_topk` from its sample, by the custom call.

  The threshold is the ``rank``-th largest magnitude key among ``x[positions]``
  (NaN as inf); then the entries of ``x[:size]`` whose key is at least it; if
  their count is within ``[min_fraction * k, candidates]`` (compared in f32),
  the ``min(k, count)`` largest of them, else the exact top ``k`` of
  ``x[:size]`` (:func:`topk`). ``x`` is read where it lies, the tail past
  ``size`` never.

  Args:
    x: ``f32[n]``.
    capacity: static count of slots, ``1 <= capacity <= size``.
    k: how many to select, ``1 <= k <= capacity`` (static or traced).
    positions: ``int32[s]``, ``s >= 1``, the sample, each in ``[0, size)``.
    rank: ``1 <= rank <= s`` (static or traced).
    size: static head length, ``1 <= size <= n``.
    candidates: static bound on the count above the threshold.
    min_fraction: the least share of ``k`` the count must reach.

  Returns:
    ``(values [capacity], int32 indices [capacity])``, those of the JAX route
    of :func:`jaxcomp._src.selection.sampled_topk` bit for bit: increasing
    index order, ties to the lower index, slots past the selected hold 0 and
    ``EMPTY_INDEX``.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  size = checks.check_number(size, "size", integer=True, low=1, high=x.shape[0])
  capacity, k = _check(capacity, k, size)
  candidates = _checked_sample(positions, rank, candidates)
  return _call("jaxcomp_sampled_topk", capacity, x.astype(jnp.float32),
               jnp.asarray(k, jnp.int32), jnp.asarray(positions, jnp.int32),
               jnp.asarray(rank, jnp.int32), size=np.int64(size),
               candidates=np.int64(candidates), min_fraction=np.float32(min_fraction))


def topk_per_row(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """:func:`jaxcomp._src.selection.topk_per_row` by the custom call (CPU only), bit for bit.

  Args:
    rows: ``f32[m, w]``.
    k: static, ``1 <= k <= w``.

  Returns:
    ``(values [m, k], int32 positions [m, k])``: each row's ``k`` entries of
    largest magnitude (NaN as ``inf``), largest first, the lower position
    first on a tie (``lax.top_k``'s).

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  if rows.ndim != 2:
    raise ValueError(f"`rows` must be [m, w], got shape {rows.shape}")
  k = checks.check_number(k, "k", integer=True, low=1, high=rows.shape[1])
  shape = (rows.shape[0], k)
  return jax.ffi.ffi_call(
      "jaxcomp_topk_per_row",
      (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32)),
      vmap_method="sequential",
  )(rows.astype(jnp.float32))


def two_level(rows: jax.Array, k: int) -> tuple[jax.Array, ...]:
  """:func:`jaxcomp._src.sparseloco.encode` of each row's top ``k`` by the custom call
  (CPU only), bit for bit, with the picked entries' positions in the flat rows.

  Args:
    rows: ``f32[m, w]``, ``w <= 2**16``.
    k: static, ``1 <= k <= w``.

  Returns:
    ``(codes uint8 [m, ceil(k / 4)], positions uint16 [m, k], levels f32 [m, 2],
    values f32 [m, k], flat int32 [m, k])``: ``encode``'s four and the positions
    as :func:`jaxcomp._src.selection.flat_positions` gives them.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  if rows.ndim != 2 or rows.shape[1] > 2 ** 16:
    raise ValueError(f"`rows` must be [m, w] with w <= 65536, got shape {rows.shape}")
  k = checks.check_number(k, "k", integer=True, low=1, high=rows.shape[1])
  m = rows.shape[0]
  return jax.ffi.ffi_call(
      "jaxcomp_two_level",
      (jax.ShapeDtypeStruct((m, -(-k // 4)), jnp.uint8),
       jax.ShapeDtypeStruct((m, k), jnp.uint16), jax.ShapeDtypeStruct((m, 2), jnp.float32),
       jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((m, k), jnp.int32)),
      vmap_method="sequential",
  )(rows.astype(jnp.float32))


def sent_mask(n: int, indices: jax.Array, sent_from: Optional[int] = None) -> jax.Array:
  """:func:`jaxcomp._src.error_feedback.sent_mask` by the custom call (CPU only), bit for bit.

  Args:
    n: static count of positions, ``>= 1``.
    indices: ``int32`` positions of any shape, distinct; those outside ``[0,
      n)`` (``EMPTY_INDEX``) are dropped.
    sent_from: every position from this one on is set too (``None``: none).

  Returns:
    ``uint32[ceil(n / 32)]``: bit ``i % 32`` of word ``i // 32`` set for each
    position ``i`` sent.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  n = checks.check_number(n, "n", integer=True, low=1)
  sent_from = n if sent_from is None else checks.check_number(
      sent_from, "sent_from", integer=True, low=0)
  return jax.ffi.ffi_call(
      "jaxcomp_sent_mask", jax.ShapeDtypeStruct((-(-n // 32),), jnp.uint32),
      vmap_method="sequential",
  )(jnp.asarray(indices, jnp.int32).reshape(-1), n=np.int64(n), sent_from=np.int64(sent_from))


def _f32_leaves(leaves) -> tuple[list, int]:
  """``leaves`` as a list, each f32 (else a ``TypeError``), and their entries together."""
  leaves = list(leaves)
  for leaf in leaves:
    if leaf.dtype != jnp.float32:
      raise TypeError(f"the leaves must be f32, got {leaf.dtype}")
  return leaves, sum(leaf.size for leaf in leaves)


def _residual_operand(residual: Optional[jax.Array], n: int) -> jax.Array:
  """``residual`` checked to be ``f32[n]`` (the leaves' entries), or ``f32[0]`` for ``None``:
  the calls' operand, none added where it is empty."""
  if residual is None:
    return jnp.zeros((0,), jnp.float32)
  if residual.shape != (n,) or residual.dtype != jnp.float32:
    raise ValueError(f"`residual` must be f32[{n}], the leaves' entries, got"
                     f" {residual.dtype}{list(residual.shape)}")
  return residual


def _whole_blocks(length, block: int, n: int) -> int:
  """``length`` checked to hold the ``n`` entries (at least one) in whole blocks."""
  length = checks.check_number(length, "length", integer=True, low=max(n, 1))
  if length % block:
    raise ValueError(f"`length` {length} must be whole blocks of {block}")
  return length


def corrected(leaves, residual: Optional[jax.Array] = None, length: Optional[int] = None,
              *, parts: Optional[Sequence[int]] = None):
  """Error feedback's corrected gradient by the custom call (CPU only): the
  :func:`jaxcomp._src.protocol` route's bits, in one pass over the leaves.

  Args:
    leaves: f32 arrays of any shapes, read where they lie (none is copied
      into a buffer of its own first).
    residual: ``f32[n]``, ``n`` the leaves' entries together; ``None``: none
      added.
    length: static, at least ``n`` (by default ``n``, or the sum of
      ``parts``).
    parts: static sizes of consecutive outputs, summing to ``length``
      (a method's runs, :attr:`jaxcomp.protocol.Method.runs`); ``None``: one.

  Returns:
    ``f32[length]`` (``parts``: a tuple of ``f32[size]`` that lie end to end
    in it): the leaves raveled end to end, plus ``residual`` element by
    element (one f32 addition each, in the caller's floating-point
    environment, which the call's second thread inherits: XLA:CPU's, which
    flushes subnormals, as its own addition does), then zeros.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  leaves, n = _f32_leaves(leaves)
  if parts is not None:
    parts = tuple(checks.check_number(p, "parts", integer=True, low=0) for p in parts)
    if length is not None and sum(parts) != length:
      raise ValueError(f"`parts` {parts} must sum to `length` {length}")
    length = sum(parts)
  length = n if length is None else checks.check_number(length, "length", integer=True, low=n)
  residual = _residual_operand(residual, n)
  sizes = (length,) if parts is None else parts
  out = jax.ffi.ffi_call(
      "jaxcomp_corrected", tuple(jax.ShapeDtypeStruct((size,), jnp.float32) for size in sizes),
      vmap_method="sequential")(residual, *leaves)
  return out[0] if parts is None else tuple(out)


def _momentum_inputs(leaves, momentum: jax.Array, residual: jax.Array) -> tuple[list, int]:
  """The f32 leaves and their entries ``n``, with ``momentum`` and ``residual`` checked
  to be ``f32[n]``."""
  leaves, n = _f32_leaves(leaves)
  for name, value in (("momentum", momentum), ("residual", residual)):
    if value.shape != (n,) or value.dtype != jnp.float32:
      raise ValueError(f"`{name}` must be f32[{n}], the leaves' entries, got"
                       f" {value.dtype}{list(value.shape)}")
  return leaves, n


def momentum_corrected(leaves, momentum: jax.Array, residual: jax.Array, head: int,
                       coefficient: float, nesterov: bool) -> tuple[jax.Array, jax.Array]:
  """Deep Gradient Compression's momentum correction and error feedback's addition by the
  custom call (CPU only): :func:`jaxcomp._src.dgc.dgc`'s ``prepare`` and the residual
  added, the same bits, in one pass over the leaves where they lie (XLA:CPU copies
  them into a buffer of their own first, which the step's momentum reads again).

  Args:
    leaves: f32 arrays of any shapes, ``n`` entries together, read end to end.
    momentum: ``f32[n]``, the momentum ``u``.
    residual: ``f32[n]``, the residual ``e``.
    head: static, the sparse leaves' entries, in ``[0, n]``: the first ``head``.
    coefficient: the momentum ``m``, as f32.
    nesterov: Nesterov momentum.

  Returns:
    ``(corrected, new_momentum)``, ``f32[n]`` each: ``u' = m u + g`` (Nesterov:
    ``m (u + g)``) at every position; ``corrected`` the velocity (``u'``,
    Nesterov ``u' + g``) on the head and ``g`` on the rest, plus ``e``: one f32
    operation each, in the caller's floating-point environment, which the
    call's second thread inherits (XLA:CPU's, which flushes subnormals).

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  leaves, n = _momentum_inputs(leaves, momentum, residual)
  head = checks.check_number(head, "head", integer=True, low=0, high=n)
  flat = jax.ShapeDtypeStruct((n,), jnp.float32)
  return tuple(jax.ffi.ffi_call("jaxcomp_momentum_corrected", (flat, flat),
                                vmap_method="sequential")(
      momentum, residual, *leaves, head=np.int64(head), coefficient=np.float32(coefficient),
      nesterov=np.int64(checks.check_bool(nesterov, "nesterov"))))


def momentum_sampled_topk(leaves, momentum: jax.Array, residual: jax.Array, coefficient: float,
                          nesterov: bool, capacity: int, k, positions: jax.Array, rank, *,
                          size: int, candidates: int, min_fraction: float
                          ) -> tuple[jax.Array, jax.Array]:
  """:func:`sampled_topk` of the corrected gradient of :func:`momentum_corrected`, by one
  custom call (CPU only) that forms it in its pass, a chunk at a time, and writes none
  of it: the same values and indices bit for bit.

  Args:
    leaves, momentum, residual, coefficient, nesterov: as :func:`momentum_corrected`.
    capacity, k, positions, rank, candidates, min_fraction: as :func:`sampled_topk`.
    size: static, the sparse head the selection reads (:func:`momentum_corrected`'s
      ``head``), ``1 <= size <= n``.

  Returns:
    ``(values [capacity], int32 indices [capacity])``: :func:`sampled_topk` of
    :func:`momentum_corrected`'s ``corrected`` with ``head=size``.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  leaves, n = _momentum_inputs(leaves, momentum, residual)
  size = checks.check_number(size, "size", integer=True, low=1, high=n)
  capacity, k = _check(capacity, k, size)
  candidates = _checked_sample(positions, rank, candidates)
  return _call("jaxcomp_momentum_sampled_topk", capacity, momentum, residual,
               jnp.asarray(k, jnp.int32), jnp.asarray(positions, jnp.int32),
               jnp.asarray(rank, jnp.int32), *leaves, size=np.int64(size),
               coefficient=np.float32(coefficient),
               nesterov=np.int64(checks.check_bool(nesterov, "nesterov")),
               candidates=np.int64(candidates), min_fraction=np.float32(min_fraction))


def momentum_masked(leaves, residual: jax.Array, momentum: jax.Array, sent: jax.Array,
                    dense_momentum: jax.Array, head: int, coefficient: float,
                    nesterov: bool) -> tuple[jax.Array, jax.Array]:
  """DGC's kept state, formed again from the leaves and the old state and written over
  it in place where XLA can give the call the buffers (donated), by one custom call
  (CPU only): the same bits as :func:`jaxcomp._src.dgc.dgc`'s step.

  Args:
    leaves, residual, momentum, head, coefficient, nesterov: as
      :func:`momentum_corrected`.
    sent: ``uint32[>= ceil(n / 32)]``, the packed mask of what was sent
      (:func:`jaxcomp._src.error_feedback.sent_mask`).
    dense_momentum: ``f32[n - head]``, the new momentum of the positions after the head.

  Returns:
    ``(new_residual, new_momentum)``, ``f32[n]`` each: the residual is
    :func:`momentum_corrected`'s ``corrected`` and the momentum its ``new_momentum``
    on the head, ``dense_momentum`` after it, each set to 0 where ``sent`` has the
    position's bit (the momentum on the head only).

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  leaves, n = _momentum_inputs(leaves, momentum, residual)
  head = checks.check_number(head, "head", integer=True, low=0, high=n)
  if sent.dtype != jnp.uint32 or sent.ndim != 1 or 32 * sent.shape[0] < n:
    raise ValueError(f"`sent` must be uint32[>= {-(-n // 32)}], got {sent.dtype}"
                     f"{list(sent.shape)}")
  if dense_momentum.shape != (n - head,) or dense_momentum.dtype != jnp.float32:
    raise ValueError(f"`dense_momentum` must be f32[{n - head}], the entries after the head,"
                     f" got {dense_momentum.dtype}{list(dense_momentum.shape)}")
  flat = jax.ShapeDtypeStruct((n,), jnp.float32)
  return tuple(jax.ffi.ffi_call("jaxcomp_momentum_masked", (flat, flat),
                                vmap_method="sequential", input_output_aliases={0: 0, 1: 1})(
      residual, momentum, sent, dense_momentum, *leaves, head=np.int64(head),
      coefficient=np.float32(coefficient),
      nesterov=np.int64(checks.check_bool(nesterov, "nesterov"))))


def _chunk_inputs(leaves, residual: jax.Array, chunk: int) -> tuple[list, int, int]:
  """The f32 leaves, their entries ``n`` (``residual`` checked to be ``f32[n]``) and the
  chunks of ``chunk`` entries that cover them."""
  leaves, n = _f32_leaves(leaves)
  if n < 1 or residual.shape != (n,) or residual.dtype != jnp.float32:
    raise ValueError(f"`residual` must be f32[{n}], the leaves' entries (at least one), got"
                     f" {residual.dtype}{list(residual.shape)}")
  return leaves, n, -(-n // chunk)


def dct_topk(leaves, residual: jax.Array, chunk: int, k: int) -> tuple[jax.Array, jax.Array]:
  """DeMo's selection (:func:`jaxcomp._src.demo.demo`) by one custom call (CPU only): the
  corrected gradient, each chunk's scaled DCT-II and its ``k`` largest coefficients, a
  few chunks at a time in cache, none of it written.

  The transform is Lee's fast DCT (``n log2(n) / 2`` products a chunk of ``n``, where
  the matrix product takes ``n^2``), summed in its own fixed order, the same on every
  machine: its coefficients agree with the matrix product's to rounding (about
  ``2e-6`` of the chunk's largest for ``n = 64``), not bit for bit.

  Args:
    leaves: f32 arrays of any shapes, ``n`` entries together (at least one), read end
      to end where they lie.
    residual: ``f32[n]``, added to them as :func:`corrected` adds it.
    chunk: static, entries per chunk, a power of two; the last chunk zero-padded.
    k: static, coefficients kept per chunk, in ``[1, chunk]``.

  Returns:
    ``(values [chunks, k], int32 positions [chunks, k])``: each chunk's coefficients
    of :func:`jaxcomp._src.demo.dct_matrix` divided by ``sqrt(chunk)``, picked as
    :func:`topk_per_row` picks them (largest first, NaN as ``inf``, the lower position
    first on a tie).

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  chunk = checks.check_number(chunk, "chunk", integer=True, low=1, high=65536)
  if chunk & (chunk - 1):
    raise ValueError(f"`chunk` must be a power of two, got {chunk}")
  leaves, _, chunks = _chunk_inputs(leaves, residual, chunk)
  k = checks.check_number(k, "k", integer=True, low=1, high=chunk)
  return tuple(jax.ffi.ffi_call(
      "jaxcomp_dct_topk", (jax.ShapeDtypeStruct((chunks, k), jnp.float32),
                           jax.ShapeDtypeStruct((chunks, k), jnp.int32)),
      vmap_method="sequential")(residual, *leaves, chunk=np.int64(chunk)))


def dct_residual(leaves, residual: jax.Array, values: jax.Array, positions: jax.Array,
                 inverse: jax.Array, decay: float) -> jax.Array:
  """DeMo's kept residual by one custom call (CPU only) that forms the corrected gradient
  again from the leaves and the residual and writes over the residual in place where
  XLA can give it the buffer (donated).

  Args:
    leaves, residual: as :func:`dct_topk`.
    values: ``f32[chunks, k]``, the coefficients sent, ``chunks`` covering ``n`` in
      chunks of ``C``.
    positions: ``int[chunks, k]``, theirs in the chunk (clamped to ``[0, C)``).
    inverse: ``f32[C, C]``, the rows of the inverse transform.
    decay: the residual's factor, as f32.

  Returns:
    ``f32[n]``: ``decay * (corrected - sent)`` per entry, ``sent`` each chunk's
    ``values[c, 0] * inverse[positions[c, 0]]`` plus each next term's in order
    (:func:`jaxcomp._src.demo.inverse_of_sparse` with few terms, the same bits).

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  if inverse.ndim != 2 or inverse.shape[0] != inverse.shape[1] or inverse.dtype != jnp.float32:
    raise ValueError(f"`inverse` must be f32[C, C], got {inverse.dtype}{list(inverse.shape)}")
  leaves, n, chunks = _chunk_inputs(leaves, residual, inverse.shape[0])
  if (values.ndim != 2 or values.shape[0] != chunks or values.dtype != jnp.float32
      or positions.shape != values.shape):
    raise ValueError(f"`values` must be f32[{chunks}, k] and `positions` of its shape, got"
                     f" {values.dtype}{list(values.shape)} and {list(positions.shape)}")
  return jax.ffi.ffi_call("jaxcomp_dct_residual", jax.ShapeDtypeStruct((n,), jnp.float32),
                          vmap_method="sequential", input_output_aliases={0: 0})(
      residual, values, jnp.asarray(positions, jnp.int32), inverse, *leaves,
      decay=np.float32(decay))


def qsgd_levels(x: jax.Array, norms: jax.Array, inverses: jax.Array, levels: int,
                words: tuple[jax.Array, jax.Array]) -> jax.Array:
  """QSGD's levels of each block of ``x`` (:func:`jaxcomp._src.qsgd.quantize`, the same
  bits) by one custom call (CPU only) on two threads.

  Args:
    x: ``f32[m * B]``, ``m`` blocks of ``B`` entries.
    norms, inverses: ``f32[m]``, each block's norm and the inverse QSGD multiplies by
      (:func:`qsgd_encode`'s).
    levels: static, QSGD's ``s``, at least 1.
    words: the draws' two uint32 words (:func:`jaxcomp._src.draws.words`).

  Returns:
    ``int8[m * B]``: each entry's level, signed, drawn as
    :func:`jaxcomp._src.draws.uniform` draws at its position.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  levels = checks.check_number(levels, "levels", integer=True, low=1, high=127)
  m = norms.shape[0] if norms.ndim == 1 else 0
  if (x.ndim != 1 or x.dtype != jnp.float32 or m < 1 or x.shape[0] % m
      or inverses.shape != norms.shape):
    raise ValueError(f"`x` must be f32 of whole blocks, one norm and one inverse each, got"
                     f" {x.dtype}{list(x.shape)}, {list(norms.shape)} and"
                     f" {list(inverses.shape)}")
  word_pair = jnp.stack([jnp.asarray(w, jnp.uint32) for w in words])
  # The call writes the levels' bytes (uint8): QSGD's payload is their bitcast back,
  # which XLA folds with this one, where a bitcast of the call's int8 was a copy.
  payload = jax.ffi.ffi_call("jaxcomp_qsgd_levels", jax.ShapeDtypeStruct(x.shape, jnp.uint8),
                             vmap_method="sequential")(
      x, norms.astype(jnp.float32), inverses.astype(jnp.float32), word_pair,
      levels=np.float32(levels))
  return lax.bitcast_convert_type(payload, jnp.int8)


def qsgd_encode(x: jax.Array, block: int, levels: int, words: tuple[jax.Array, jax.Array]
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """QSGD's norm of each block of ``x`` (:func:`jaxcomp._src.qsgd.quantize`), its inverse
  and the block's :func:`qsgd_levels`, by one custom call (CPU only) that takes each
  block's levels while the block is in cache: one kernel and one read of ``x``, where
  XLA:CPU made five kernels and a branch for the norms alone.

  Args:
    x: f32, ``m * block`` entries, read as ``m`` blocks end to end.
    block: static, the entries of a block, ``>= 1``.
    levels, words: as :func:`qsgd_levels`.

  Returns:
    ``(int8 levels [m * block], norms [m], inverses [m])``. ``norms``: each
    block's L2 norm from its squares, or, where any block's is not finite, every
    block's from its entries brought to their largest magnitude's unit binade
    (:func:`jaxcomp._src.binade.unit_norm`, one route for all as the JAX route
    takes; the levels then taken again from them); the squares summed in eight
    interleaved lanes joined pairwise, then the block's tail (not XLA's order:
    the routes agree to rounding). ``inverses``: ``1 / (d u)``, ``d`` the norm
    (1 for 0) and ``u`` its :func:`jaxcomp._src.binade.unit_factor`, what QSGD
    multiplies by. ``levels``: :func:`qsgd_levels` of ``x`` with them.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  block = checks.check_number(block, "block", integer=True, low=1)
  levels = checks.check_number(levels, "levels", integer=True, low=1, high=127)
  if x.dtype != jnp.float32 or x.size % block:
    raise ValueError(f"`x` must be f32 of whole blocks of {block}, got"
                     f" {x.dtype}{list(x.shape)}")
  rows = jax.ShapeDtypeStruct((x.size // block,), jnp.float32)
  word_pair = jnp.stack([jnp.asarray(w, jnp.uint32) for w in words])
  payload, norms, inverses = jax.ffi.ffi_call(
      "jaxcomp_qsgd_encode", (jax.ShapeDtypeStruct((x.size,), jnp.uint8), rows, rows),
      vmap_method="sequential")(x.reshape(-1), word_pair, block=np.int64(block),
                                levels=np.float32(levels))
  return lax.bitcast_convert_type(payload, jnp.int8), norms, inverses


def qsgd_encode_leaves(leaves, residual: Optional[jax.Array], length: int, block: int, levels: int,
                       words: tuple[jax.Array, jax.Array]
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`qsgd_encode` of the leaves plus ``residual``, padded with zeros to ``length``
  (a multiple of ``block``), a few blocks at a time in cache: the same bits, and the
  corrected gradient is never written (where no block's squares overflow).

  Args:
    leaves: f32 arrays, ``n`` entries together, read where they lie.
    residual: ``f32[n]``, added to them entry by entry; ``None``: none.
    length, block, levels, words: static ``length``; as :func:`qsgd_encode`'s.

  Returns:
    :func:`qsgd_encode`'s ``(int8 levels [length], norms, inverses)``.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  leaves, n = _f32_leaves(leaves)
  block = checks.check_number(block, "block", integer=True, low=1)
  levels = checks.check_number(levels, "levels", integer=True, low=1, high=127)
  length, residual = _whole_blocks(length, block, n), _residual_operand(residual, n)
  rows = jax.ShapeDtypeStruct((length // block,), jnp.float32)
  word_pair = jnp.stack([jnp.asarray(w, jnp.uint32) for w in words])
  payload, norms, inverses = jax.ffi.ffi_call(
      "jaxcomp_qsgd_encode_leaves", (jax.ShapeDtypeStruct((length,), jnp.uint8), rows, rows),
      vmap_method="sequential")(residual, word_pair, *leaves, block=np.int64(block),
                                levels=np.float32(levels))
  return lax.bitcast_convert_type(payload, jnp.int8), norms, inverses


def qsgd_residual(buffer: jax.Array, payload: jax.Array, steps: jax.Array, leaves,
                  block: int) -> jax.Array:
  """QSGD's residual ``c - t l`` (``c`` the leaves plus ``buffer``, the old residual; ``l``
  the int8 levels of ``payload``; ``t`` each block's ``steps``, its norm over the levels as
  the JAX route decodes them) written over ``buffer`` in place where XLA can give it
  (donated), by the custom call (CPU only): two roundings, where XLA may fuse the
  product and the difference into one (the routes agree to a rounding of ``t l``).

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  leaves, n = _f32_leaves(leaves)
  block = checks.check_number(block, "block", integer=True, low=1)
  if (buffer.shape != (n,) or payload.ndim != 1 or payload.size < n
      or steps.ndim != 1 or steps.size * block < n):
    raise ValueError(f"`buffer` must be f32[{n}], `payload` hold a level per entry and"
                     f" `steps` one per block of {block}; got {list(buffer.shape)},"
                     f" {list(payload.shape)}, {list(steps.shape)}")
  return jax.ffi.ffi_call(
      "jaxcomp_qsgd_residual", jax.ShapeDtypeStruct((n,), jnp.float32),
      vmap_method="sequential", input_output_aliases={0: 0},
  )(buffer, lax.bitcast_convert_type(payload, jnp.uint8), steps.astype(jnp.float32), *leaves,
    block=np.int64(block))


def _integer_inputs(leaves, block, bits: int) -> tuple[list, int, int, int]:
  """``(f32 leaves, their entries n, block, bits)``, checked, for the integer codes' calls."""
  _check_available()
  leaves, n = _f32_leaves(leaves)
  bits = checks.check_number(bits, "bits", integer=True, low=4, high=8)
  if bits not in (4, 8):
    raise ValueError(f"`bits` must be 8 or 4, got {bits}")
  block = checks.check_number(block, "block", integer=True, low=2 if bits == 4 else 1)
  if bits == 4 and block % 2:
    raise ValueError(f"`block` must be even with 4 bits, got {block}")
  return leaves, n, block, bits


def integer_encode(leaves, residual: Optional[jax.Array], length: int, block: int,
                   bits: int) -> tuple[jax.Array, jax.Array]:
  """:func:`jaxcomp._src.quantized.encode` of the leaves plus ``residual`` (padded with zeros
  to ``length``) by the custom call (CPU only), a few blocks at a time in cache: the
  corrected gradient is never written.

  Args:
    leaves: f32 arrays of any shapes, ``n`` entries together, read where they lie.
    residual: ``f32[n]``, added to them entry by entry; ``None``: none.
    length: static, a multiple of ``block`` of at least ``n``.
    block: static, entries per scale (even with 4 bits).
    bits: static, 8 or 4.

  Returns:
    ``(payload, scales)``: uint8 ``[length * bits / 8]`` and f32 ``[length / block]``,
    the JAX route's bits as XLA:CPU computes it (the scale the largest magnitude, NaN
    as ``inf``, times the f32 reciprocal of the top level; each level the nearest
    integer of the entry times the scale's f32 inverse, NaN as 0).

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  leaves, n, block, bits = _integer_inputs(leaves, block, bits)
  length, residual = _whole_blocks(length, block, n), _residual_operand(residual, n)
  return jax.ffi.ffi_call(
      "jaxcomp_integer_encode",
      (jax.ShapeDtypeStruct((length * bits // 8,), jnp.uint8),
       jax.ShapeDtypeStruct((length // block,), jnp.float32)),
      vmap_method="sequential")(residual, *leaves, block=np.int64(block), bits=np.int64(bits))


def integer_residual(buffer: jax.Array, scales: jax.Array, leaves, block: int,
                     bits: int) -> jax.Array:
  """Error feedback's residual of the integer codes, ``c - s l`` (``c`` the leaves plus
  ``buffer``, the old residual; ``l`` its levels from the scales ``s`` of
  :func:`integer_encode`), written over ``buffer`` in place where XLA can give it
  (donated), by the custom call (CPU only): the JAX route's bits.

  Args:
    buffer: ``f32[n]``, the old residual, read a block at a time before it is written.
    scales: f32, at least ``ceil(n / block)``: each block's.
    leaves: f32 arrays, ``n`` entries together.
    block: static; bits: static, 8 or 4.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  leaves, n, block, bits = _integer_inputs(leaves, block, bits)
  if buffer.shape != (n,) or scales.ndim != 1 or scales.size * block < n:
    raise ValueError(f"`buffer` must be f32[{n}] and `scales` hold ceil({n} / {block}) blocks,"
                     f" got {list(buffer.shape)} and {list(scales.shape)}")
  return jax.ffi.ffi_call(
      "jaxcomp_integer_residual", jax.ShapeDtypeStruct((n,), jnp.float32),
      vmap_method="sequential", input_output_aliases={0: 0},
  )(buffer, scales.astype(jnp.float32), *leaves, block=np.int64(block), bits=np.int64(bits))


def _checked_runs(runs: Sequence[jax.Array], groups: Sequence[tuple[int, int, int]],
                  rank: int, leaves: bool = False) -> tuple[list[jax.Array], np.ndarray, int]:
  """``(runs flat, groups as the calls' flat attribute, rank)``, checked (one run per
  group, or per matrix with ``leaves``); raises :class:`RuntimeError` where the custom
  calls are not :func:`available`."""
  _check_available()
  groups = [tuple(checks.check_number(x, "groups", integer=True, low=1) for x in g)
            for g in groups]
  if not groups or any(len(g) != 3 for g in groups):
    raise ValueError(f"`groups` must be (count, rows, cols) triples, at least one, got {groups}")
  rank = checks.check_number(rank, "rank", integer=True, low=1)
  runs = [run.reshape(-1) for run in runs]
  if leaves:
    if len(runs) != sum(g[0] for g in groups) or any(run.dtype != jnp.float32 for run in runs):
      raise ValueError(f"one f32 leaf per matrix: {len(runs)} leaves for the groups {groups}")
  elif len(runs) != len(groups):
    raise ValueError(f"one run per group: {len(runs)} runs for {len(groups)} groups")
  return runs, np.asarray(groups, np.int64).reshape(-1), rank


def lowrank_product(runs: Sequence[jax.Array], factor: jax.Array, scales: Sequence[float],
                    dense: jax.Array, groups: Sequence[tuple[int, int, int]], rank: int, *,
                    transposed: bool = False, unit: bool = False,
                    residual: Optional[jax.Array] = None) -> jax.Array:
  """The low-rank methods' products of every compressed matrix with its factor, by the
  custom call (CPU only): one call for a bucket, where XLA makes a scaling and a
  product per group of equal shapes.

  Args:
    runs: one f32 array per group, its ``count`` matrices (``rows x cols``,
      row-major) end to end (:attr:`jaxcomp._src.lowrank.MatrixView.groups`);
      with ``residual``, one per matrix (the gradient's leaves where they lie).
    factor: the flat factor buffer, each matrix's ``cols x rank`` (``rows x rank``
      with ``transposed``) row-major, matrix after matrix.
    scales: static, one per matrix: its factor columns' multiplier.
    dense: f32, copied after the products (the leaves a method sends dense).
    groups: static ``(count, rows, cols)`` per run.
    rank: static, the factors' columns.
    transposed: ``M^T F`` where ``False`` gives ``M F``.
    unit: each column is first multiplied by
      :func:`jaxcomp._src.binade.unit_factor` of its largest magnitude.
    residual: ``f32[>= the matrices' entries]``, laid out as the runs end to end:
      each matrix is then its leaf plus its span of it, formed a row at a time in
      cache (the same bits as the sum written first), so that the corrected
      gradient is never written.

  Returns:
    ``f32[products + dense.size]``: each matrix's product (``rows x rank``,
    ``cols x rank`` with ``transposed``), matrix after matrix, then ``dense``.
    Each entry is summed in a fixed order (a row times a column in 8
    interleaved sums joined pairwise; ``M^T F`` over the rows in order), the
    same on every machine, not XLA's: the two routes agree to rounding.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  runs, flat_groups, rank = _checked_runs(runs, groups, rank, leaves=residual is not None)
  matrices = sum(g for g, _, _ in groups)
  inner = sum(g * (rows if transposed else cols) for g, rows, cols in groups) * rank
  outer = sum(g * (cols if transposed else rows) for g, rows, cols in groups) * rank
  scales = np.asarray(scales, np.float32).reshape(-1)
  if factor.shape != (inner,) or scales.shape != (matrices,):
    raise ValueError(f"`factor` must be f32[{inner}] and `scales` {matrices} values,"
                     f" got {list(factor.shape)} and {scales.size}")
  entries = sum(g * rows * cols for g, rows, cols in groups)
  if residual is not None and (residual.ndim != 1 or residual.size < entries
                               or residual.dtype != jnp.float32):
    raise ValueError(f"`residual` must be f32[>= {entries}], got"
                     f" {residual.dtype}{list(residual.shape)}")
  return jax.ffi.ffi_call(
      "jaxcomp_lowrank_product", jax.ShapeDtypeStruct((outer + dense.size,), jnp.float32),
      vmap_method="sequential",
  )(factor, dense.reshape(-1), jnp.zeros((0,), jnp.float32) if residual is None else residual,
    *runs, groups=flat_groups,
    scales=scales, rank=np.int64(rank), transposed=np.int64(transposed), unit=np.int64(unit))


def factor_columns(factor: jax.Array, lengths: Sequence[int], rank: int, *,
                   old: Optional[jax.Array] = None, scales: Optional[Sequence[float]] = None,
                   orthonormalize: bool = True) -> jax.Array:
  """Each matrix's factor, column by column, by the custom call (CPU only).

  Args:
    factor: the flat factor buffer, matrix ``i``'s ``lengths[i] x rank``
      row-major, matrix after matrix.
    lengths: static, each factor's rows.
    rank: static, its columns.
    old: like ``factor``: a column that is all zero is replaced by ``old``'s
      (:func:`jaxcomp._src.lowrank._refill`), after ``scales``.
    scales: static, one per matrix: each column times its matrix's scale where
      all of that column's products are finite, else as it is; first.
    orthonormalize: last, modified Gram-Schmidt on each factor's columns in
      float64 (no column needs rescaling; a column that is exactly zero after
      the projections stays zero, NaN stays NaN), rounded to f32.

  Returns:
    ``factor``'s layout. One fixed order of sums: the same bits on every device.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  lengths = np.asarray([checks.check_number(n, "lengths", integer=True, low=1)
                        for n in lengths], np.int64)
  rank = checks.check_number(rank, "rank", integer=True, low=1)
  size = int(lengths.sum()) * rank
  if factor.shape != (size,) or (old is not None and old.shape != (size,)):
    raise ValueError(f"`factor` (and `old`) must be f32[{size}], got {list(factor.shape)}")
  scales = np.asarray(() if scales is None else scales, np.float32).reshape(-1)
  if scales.size not in (0, lengths.size):
    raise ValueError(f"`scales` must be {lengths.size} values, got {scales.size}")
  return jax.ffi.ffi_call(
      "jaxcomp_factor_columns", jax.ShapeDtypeStruct((size,), jnp.float32),
      vmap_method="sequential",
  )(factor, jnp.zeros((0,), jnp.float32) if old is None else old, lengths=lengths,
    scales=scales, rank=np.int64(rank), orthonormalize=np.int64(orthonormalize))


def lowrank_residual(buffer: jax.Array, runs: Sequence[jax.Array], p: jax.Array, q: jax.Array,
                     groups: Sequence[tuple[int, int, int]], rank: int, *,
                     from_leaves: bool = False) -> jax.Array:
  """Each compressed matrix's ``M - P Q^T`` written over the start of ``buffer``, by the
  custom call (CPU only), in place where XLA can give it ``buffer`` (donated).

  Args:
    buffer: ``f32[n]``, at least the matrices' entries; its entries after them
      stay as they are.
    runs: the matrices ``M``, one f32 array per group (:func:`lowrank_product`);
      with ``from_leaves``, one per matrix, the gradient's leaves, and ``M`` is
      each plus its span of ``buffer`` (the old residual, read a row at a time
      before that row is written: the corrected gradient is never written).
    p: the flat ``P`` buffer, each matrix's ``rows x rank`` row-major.
    q: the flat ``Q`` buffer, each matrix's ``cols x rank`` row-major.
    groups: static ``(count, rows, cols)`` per run.
    rank: static.

  Returns:
    ``f32[n]``: the residuals matrix after matrix, then ``buffer``'s other
    entries. Each product is summed as
    :func:`jaxcomp._src.lowrank._products` writes it (column 0's term, plus
    each next one's in order); XLA may fuse a product and a sum into one
    rounding where the CPU has the instruction, so the routes agree to rounding.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  runs, flat_groups, rank = _checked_runs(runs, groups, rank, leaves=from_leaves)
  size = sum(g * rows * cols for g, rows, cols in groups)
  p_size = sum(g * rows for g, rows, _ in groups) * rank
  q_size = sum(g * cols for g, _, cols in groups) * rank
  if buffer.ndim != 1 or buffer.size < size or p.shape != (p_size,) or q.shape != (q_size,):
    raise ValueError(f"`buffer` must be f32[>= {size}], `p` f32[{p_size}] and `q`"
                     f" f32[{q_size}]; got {list(buffer.shape)}, {list(p.shape)},"
                     f" {list(q.shape)}")
  return jax.ffi.ffi_call(
      "jaxcomp_lowrank_residual", jax.ShapeDtypeStruct(buffer.shape, jnp.float32),
      vmap_method="sequential", input_output_aliases={0: 0},
  )(buffer, p, q, *runs, groups=flat_groups, rank=np.int64(rank),
    from_leaves=np.int64(from_leaves))


def densify_leaves(values: jax.Array, indices: jax.Array, sizes: Sequence[int],
                   after: Optional[jax.Array] = None) -> tuple[jax.Array, ...]:
  """:func:`jaxcomp.collectives.densify` into the leaves of a bucket, by the custom call
  (CPU only): one kernel that writes each leaf once, where XLA:CPU writes the zeros
  of the whole vector, scatters into it, then copies each leaf out of it.

  Args:
    values: f32 entries, any shape.
    indices: int32 positions, shaped like ``values``, in the leaves laid end to
      end; ``EMPTY_INDEX`` and any other outside ``[0, sum(sizes))`` dropped.
    sizes: static, each leaf's entries.
    after: an f32 scalar the call is ordered after (not read), as
      :func:`jaxcomp.collectives.densify`'s.

  Returns:
    ``f32[size]`` per leaf: the zeros plus each value added at its position,
    one after the other in order, as XLA:CPU's scatter adds them: the same bits.

  Raises:
    RuntimeError: the custom call is not :func:`available`.
  """
  _check_available()
  sizes = tuple(checks.check_number(s, "sizes", integer=True, low=0) for s in sizes)
  if values.shape != indices.shape:
    raise ValueError(f"`indices` must be shaped like `values` {list(values.shape)},"
                     f" got {list(indices.shape)}")
  after = jnp.zeros((), jnp.float32) if after is None else jnp.asarray(after, jnp.float32)
  return tuple(jax.ffi.ffi_call(
      "jaxcomp_densify_leaves", tuple(jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes),
      vmap_method="sequential",
  )(values.reshape(-1).astype(jnp.float32), indices.reshape(-1).astype(jnp.int32),
    after.reshape(())))
