"""The golden file: every method's mean gradient and per-device state, as values.

``tests/golden.npz.xz`` holds, for each case (a compressor configuration of
:func:`cases` on a ring of 8 devices or a 2x4 torus), the state ``init``
lays out and, for steps 0 and 1, the mean gradient and every device's state
after the step. ``tests/test_golden.py`` runs each step from the recorded
state before it and compares what comes out with what was recorded.

Why from the recorded state, not a free-running trajectory: XLA picks the
summation order of a reduction (a ``psum``, a matrix product, a norm) per
host CPU and per release, so the last bits of a result differ between
machines. Run from its own state, a case would compound them: PowerSGD's
warm-started power iteration amplifies a one-bit difference over the steps,
and EF-signSGD's next sign can flip where the corrected gradient is within
a few ulps of 0. Run from the recorded state, every step sees bit-identical
inputs (the gradients come from numpy's generator), so the only differences
are the step's own rounding, and every discrete choice made before a
reduction (a top-k of the corrected gradient, a sign, the random-k indices)
is made on the same bits. The one elementwise exception is DGC's momentum
(``m * u + g``, Nesterov's ``m * (u + g) + g``), which XLA contracts to a
fused multiply-add where the CPU has one: one rounding of the velocity,
which would have to carry a magnitude across the top-k's cut (or a sampled
threshold's 16-bit truncation) to change a selection; the recorded
velocities keep the k-th and the next magnitude over 2000 ulps apart on
every device (at step 0 the momentum is zero and the sum exact).

Why two steps: the first runs from the initial state (zero residuals, the
seeded factors), the second from a state the method made (error feedback
carried, PowerSGD's warm start, ACP-SGD's other factor, split keys, DGC's
momentum). A later step runs the same program on another state, and each
step costs its states, eight devices' residuals: the bulk of the file.

What is stored: the mean once (it is the same on every device; the test
checks that it is, bit for bit), a state leaf once when every device holds
the same (counts, keys, low-rank factors), every device's row otherwise, in
the layout of ``training.device_rows`` (device ``d``'s state on row ``d``).
The ``.npz`` is compressed whole with xz, deterministically: ring and torus
share most arrays (they differ only where a dense mean is reduced, as a ring
``psum`` or as the torus all-reduce), which only a compressor seeing the
whole file finds.

How values are compared (:func:`compare`), per case, step and leaf:

* Integer leaves (counts, raw keys) exactly.
* Sparse methods (``Rule.sparse``): which entries are zero, exactly, in every
  float leaf: the support of the mean, the residual entries zeroed because
  they were sent (the selected indices), DGC's masked momentum.
* ``cast``: the mean is exactly on the bfloat16 grid it travelled in, and
  each element within one bfloat16 ulp of the recorded one (its f32 sum may
  round to the neighbouring bfloat16 value when summed in another order).
* Every other float: ``|got - want| <= k * eps * max|want|`` over the leaf,
  ``eps`` float32's (``2**-23``), ``k`` per method (:data:`RULES`). A sum
  of ``n`` terms in two orders differs by at most ``(n - 1) eps sum|terms|``;
  the methods' ``k`` follow from their longest reductions (see ``RULES``).
  An all-zero leaf (the residual of a leaf sent dense) is compared exactly.

  python tests/golden.py     # rewrite tests/golden.npz.xz (a deliberate change only)
"""

from __future__ import annotations

import dataclasses
import io
import lzma
import pathlib
import sys
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

PATH = pathlib.Path(__file__).with_name("golden.npz.xz")
STEPS = 2
MESHES = {"ring": (8, ("data",)), "torus": ((2, 4), ("x", "y"))}

# A conv kernel and two equal dense kernels (low rank pays, one batch), a
# bias, and a small matrix (sent dense by the low-rank methods and by DGC's
# default rule).
SHAPES = {
    "conv": (3, 3, 4, 8),
    "dense": {"kernel": (16, 12), "bias": (12,)},
    "dense2": (16, 12),
    "small": (2, 3),
}

EPS = float(np.finfo(np.float32).eps)
BF16_BITS = 8  # bfloat16's significand bits, the implicit one included


def cases() -> dict[str, Callable[[Any], Any]]:
  """name -> compressor for an axis (configurations the golden file records)."""
  import jaxcomp  # after the device count is set by the caller

  return {
      "allreduce": lambda axis: jaxcomp.allreduce(axis),
      "cast": lambda axis: jaxcomp.cast(jnp.bfloat16, axis),
      "topk": lambda axis: jaxcomp.topk(0.2, axis),
      "topk_no_error_feedback": lambda axis: jaxcomp.topk(0.2, axis, error_feedback=False),
      "gtopk": lambda axis: jaxcomp.gtopk(0.2, axis),
      "randomk": lambda axis: jaxcomp.randomk(0.2, axis, seed=3),
      # The clipping threshold is set above every device's gradient norm (25 to
      # 27 here, against 1e3 / sqrt(8)): the clip runs and scales by exactly 1.
      # An active clip's scale comes out of an f32 reduction, and the top-k after
      # it would see inputs whose last bits depend on the host CPU (its values
      # are checked against numpy with a tolerance in test_dgc.py).
      "dgc": lambda axis: jaxcomp.dgc(0.1, axis, clip_norm=1e3, sample_ratio=0.5),
      "dgc_nesterov_all": lambda axis: jaxcomp.dgc(
          0.05, axis, momentum=0.8, nesterov=True, sparse_leaves="all", sample_ratio=1.0),
      "signsgd": lambda axis: jaxcomp.signsgd(axis),
      "signsgd_majority": lambda axis: jaxcomp.signsgd(axis, majority_vote=True),
      "powersgd": lambda axis: jaxcomp.powersgd(2, axis),
      "powersgd_cold": lambda axis: jaxcomp.powersgd(2, axis, warm_start=False),
      "acpsgd": lambda axis: jaxcomp.acpsgd(2, axis),
  }


@dataclasses.dataclass(frozen=True)
class Rule:
  """How one method's floats are compared.

  Attributes:
    k: the tolerance of a float leaf is ``k * EPS * max|want|`` over the leaf.
    sparse: zeros are exact (the support of the mean, the zeroed residual).
    wire_bits: the mean travelled in a float of this many significand bits:
      it lies on that grid exactly and may move one of its ulps.
  """

  k: int
  sparse: bool = False
  wire_bits: Optional[int] = None


# The gradients are N(0, 1) per device and element; each state holds values
# of the same size (residuals, momenta) or orthonormal factors. Per method, the
# reductions of one step whose order XLA picks, and the bound that sets k:
#
# * Sums over the 8 devices: a psum (allreduce, randomk's values, DGC's dense
#   leaves, the torus's reduce-scatter) or a scatter-add of the entries that
#   several devices sent (topk, DGC). 8 terms differ by at most 7 eps
#   sum|terms|, and sum|terms| is within 2.3 max|mean| for these gradients;
#   DGC adds the one rounding of its fused multiply-add: 17 eps. k = 64, 4x.
#   gTop-k's butterfly adds in a fixed order; it shares the sparse bound.
# * EF-signSGD's scale, mean |c| over the 690 entries of the bucket: positive
#   terms, so 689 eps of the scale, which every value of the mean and of the
#   residual carries; then the 8 scales' sum. k = 1024.
# * PowerSGD and ACP-SGD: products over at most 36 rows and 12 columns, a psum
#   of 8, Gram-Schmidt's norms and projections over 36 entries, the second
#   product and psum. The bounds add to about 130 eps of sum|terms|, which for
#   dot products of random vectors is about 6 times the result: k = 1024.
RULES = {
    "allreduce": Rule(64),
    "cast": Rule(64, wire_bits=BF16_BITS),
    "topk": Rule(64, sparse=True),
    "topk_no_error_feedback": Rule(64, sparse=True),
    "gtopk": Rule(64, sparse=True),
    "randomk": Rule(64, sparse=True),
    "dgc": Rule(64, sparse=True),
    "dgc_nesterov_all": Rule(64, sparse=True),
    "signsgd": Rule(1024),
    "signsgd_majority": Rule(1024),
    "powersgd": Rule(1024),
    "powersgd_cold": Rule(1024),
    "acpsgd": Rule(1024),
}


def case_names() -> list[str]:
  """Every case, ``{method}/{mesh}``."""
  return [f"{name}/{mesh}" for name in cases() for mesh in MESHES]


def _gradients(step: int, devices: int):
  """Every device's gradients of ``step``, from numpy's generator (stable across JAX releases)."""
  rng = np.random.default_rng(1000 + step)
  leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  return jax.tree.unflatten(
      treedef, [rng.normal(size=(devices,) + s).astype(np.float32) for s in leaves])


# ------------------------------------------------------------------ running


@dataclasses.dataclass
class Runner:
  """One case set up: its compressor on its mesh, and a jitted update."""

  case: str
  tx: Any
  mesh: Any
  axis: Any
  update: Callable
  like: Any
  init: Any  # the per-device state of training.init_state
  devices: int
  params: Any

  @classmethod
  def of(cls, case: str) -> "Runner":
    from jaxcomp import training

    name, mesh_name = case.split("/")
    shape, names = MESHES[mesh_name]
    axis = names[0] if len(names) == 1 else names
    mesh = training.make_mesh(shape, names)
    tx = cases()[name](axis)
    params = jax.tree.map(
        lambda s: jnp.zeros(s, jnp.float32), SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    return cls(case, tx, mesh, axis, training.make_update(tx, mesh, axis),
               jax.eval_shape(tx.init, params), training.init_state(tx, params, mesh, axis),
               training.num_replicas(mesh, axis), params)

  def rows(self, state) -> dict[str, np.ndarray]:
    """A per-device state as ``{leaf path: [devices, *shape]}`` (``device_rows``), its
    fields fused by bucket (`harness.FUSED_FIELDS`) laid out like the parameters."""
    from jaxcomp import training

    return _by_path(self._fields(training.device_rows(state, self.like), "as_tree"))

  def from_rows(self, rows: dict[str, np.ndarray]):
    """The per-device state (sharded as ``init_state`` shards it) of recorded rows."""
    from jaxcomp import training

    template = self._fields(training.device_rows(self.init, self.like), "as_tree")
    paths, treedef = _paths(template)
    leaves = [np.broadcast_to(rows[path], x.shape).astype(x.dtype)
              for path, x in zip(paths, jax.tree.leaves(template))]
    state_rows = self._fields(jax.tree.unflatten(treedef, leaves), "from_tree")
    return jax.tree.map(
        lambda x, ref: jax.device_put(np.asarray(x).reshape(ref.shape).astype(ref.dtype),
                                      ref.sharding),
        state_rows, self.init)

  def _fields(self, state_rows, convert: str):
    """``state_rows`` with its fields held flat per bucket (the residual, DGC's
    momentum) converted by ``protocol.<convert>`` (``as_tree``: recorded leaf by
    leaf; ``from_tree``: back)."""
    import harness
    from jaxcomp import protocol

    return harness.fused_fields(self.tx, state_rows, self.params, getattr(protocol, convert))

  def step(self, step: int, state) -> tuple[dict[str, np.ndarray], Any]:
    """``(mean rows by path, new per-device state)`` of one step from ``state``."""
    from jaxcomp import training

    grads = training.shard(_gradients(step, self.devices), self.mesh, self.axis)
    # Blocked on before anything else runs: no queued collectives on fake devices.
    out, state = jax.block_until_ready(self.update(grads, state))
    return _by_path(out), state


def _paths(tree) -> tuple[list[str], Any]:
  leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(p) for p, _ in leaves_with_paths], treedef


def _by_path(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


# ---------------------------------------------------------------- the file


def _key(case: str, what: str, path: str) -> str:
  return f"{case}/{what}{path}"


def _rows_once(x: np.ndarray) -> np.ndarray:
  """``x`` with one row when every device's row is the same (a broadcast restores it)."""
  return x[:1] if len(x) and (x == x[:1]).all() else x


def record() -> dict[str, np.ndarray]:
  """Every case's initial state and its first :data:`STEPS` steps, keyed by :func:`_key`.

  ``what`` is ``init`` (the state before step 0), ``{step}/mean`` or
  ``{step}/state`` (the state after the step).
  """
  arrays = {}
  for case in case_names():
    runner = Runner.of(case)
    state = runner.init
    for path, x in runner.rows(state).items():
      arrays[_key(case, "init", path)] = _rows_once(x)
    for step in range(STEPS):
      mean, state = runner.step(step, state)
      for path, x in mean.items():
        if not (x == x[:1]).all():
          raise AssertionError(f"{case} step {step}: mean{path} differs between devices")
        arrays[_key(case, f"{step}/mean", path)] = x[:1]
      for path, x in runner.rows(state).items():
        arrays[_key(case, f"{step}/state", path)] = _rows_once(x)
  return arrays


def dumps(arrays: dict[str, np.ndarray]) -> bytes:
  """The file's bytes: an ``.npz`` compressed whole with xz (the same bytes for the same arrays)."""
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  return lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME)


def load(path: pathlib.Path = PATH) -> dict[str, np.ndarray]:
  """The arrays of the file at ``path``, by key (see :func:`record`)."""
  with np.load(io.BytesIO(lzma.decompress(path.read_bytes()))) as npz:
    return {key: npz[key] for key in npz.files}


def recorded(arrays: dict[str, np.ndarray], case: str, what: str) -> dict[str, np.ndarray]:
  """The leaves of one ``case`` and ``what`` (see :func:`record`), by leaf path."""
  prefix = f"{case}/{what}"
  return {key[len(prefix):]: x for key, x in arrays.items()
          if key.startswith(prefix) and key[len(prefix):][:1] in (".", "[")}


# ---------------------------------------------------------------- comparing


def _element(x: np.ndarray, index: tuple[int, ...]) -> str:
  value = x[index]
  if x.dtype.kind == "f":
    return f"{float(value)!r} (bits {int(np.asarray(value).view(np.uint32)):#010x})"
  return repr(value.item())


def _element_message(where: str, which: str, index, got, want, why: str) -> str:
  index = tuple(int(i) for i in index)
  return (f"{where}: {which} element {index}: got {_element(got, index)}, want"
          f" {_element(want, index)}; {why}")


def compare(where: str, got: np.ndarray, want: np.ndarray, rule: Rule,
            *, mean: bool = False) -> Optional[str]:
  """``None`` when ``got`` matches ``want`` under ``rule``, else what differs and where.

  Args:
    where: the case, step and leaf path, named in the message.
    got: the leaf computed now (device rows, or the mean's one row).
    want: the recorded leaf (broadcast to ``got``'s shape: one row stands for all).
    rule: the method's :class:`Rule`.
    mean: ``got`` is the mean gradient (the wire grid applies to it).
  """
  if got.dtype != want.dtype:
    return f"{where}: dtype {got.dtype}, recorded {want.dtype}"
  try:
    want = np.broadcast_to(want, got.shape)
  except ValueError:
    return f"{where}: shape {got.shape}, recorded {want.shape}"
  if got.dtype.kind != "f":
    differs = got != want
    if differs.any():
      return _element_message(where, "first differing", np.argwhere(differs)[0], got, want,
                              "integers are compared exactly")
    return None
  if np.isnan(want).any():
    return f"{where}: the recorded leaf holds NaN"
  if not np.isfinite(got).all():
    return _element_message(where, "first non-finite", np.argwhere(~np.isfinite(got))[0], got,
                              want, "not finite")
  if rule.sparse:
    differs = (got == 0) != (want == 0)
    if differs.any():
      return _element_message(
          where, "first differing", np.argwhere(differs)[0], got, want,
          f"{int(differs.sum())} of {got.size} entries are zero in one and not the other;"
          " which entries are zero (the support, the zeroed residual) is exact")
  diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
  if mean and rule.wire_bits is not None:
    low = np.uint32((1 << (24 - rule.wire_bits)) - 1)
    off_grid = (got.view(np.uint32) & low) != 0
    if off_grid.any():
      return _element_message(
          where, "first off-grid", np.argwhere(off_grid)[0], got, want,
          f"{int(off_grid.sum())} of {got.size} elements are off the grid of the"
          f" {rule.wire_bits}-bit float the mean travelled in; it lies on it exactly")
  scale = float(np.abs(want).max()) if want.size else 0.0
  tol = rule.k * EPS * scale
  text = f"{rule.k} eps x max|want| = {rule.k} x {EPS:.3g} x {scale:.6g} = {tol:.3g}"
  if mean and rule.wire_bits is not None:
    # One ulp of the wire's float at each recorded element: [2**(e-1), 2**e) has
    # ulps of 2**(e - bits).
    _, exponent = np.frexp(np.abs(want.astype(np.float64)))
    tol = np.maximum(np.ldexp(1.0, exponent - rule.wire_bits), tol)
    text = f"one {rule.wire_bits}-bit ulp of the recorded element, at least {text}"
  excess = diff - tol
  if want.size and excess.max() > 0:
    index = np.unravel_index(np.argmax(excess), got.shape)
    count = int((excess > 0).sum())
    return _element_message(
        where, "worst", index, got, want,
        f"|diff| {diff[index]:.3g} > tolerance {np.broadcast_to(tol, got.shape)[index]:.3g}"
        f" ({text}); {count} of {got.size} elements outside")
  return None


def check(case: str, arrays: dict[str, np.ndarray]) -> list[str]:
  """What differs from the golden file in ``case``: one line per leaf (empty when all match).

  The initial state is compared, then each step runs from the recorded state
  before it: differences do not compound, and every discrete choice sees the
  recorded bits.
  """
  rule = RULES[case.split("/")[0]]
  runner = Runner.of(case)
  failures = []

  def compare_tree(what: str, got: dict[str, np.ndarray], *, mean: bool = False):
    want = recorded(arrays, case, what)
    when = "init state" if what == "init" else "step {} {}".format(*what.split("/"))
    label = f"{case} {when}"
    if sorted(got) != sorted(want):
      failures.append(f"{label}: leaves {sorted(got)}, recorded {sorted(want)}")
      return
    for path in got:
      failure = compare(f"{label}{path}", got[path], want[path], rule, mean=mean)
      if failure:
        failures.append(failure)

  compare_tree("init", runner.rows(runner.init))
  before = recorded(arrays, case, "init")
  for step in range(STEPS):
    mean, state = runner.step(step, runner.from_rows(before))
    for path, x in mean.items():
      if not (x == x[:1]).all():
        failures.append(f"{case} step {step} mean{path}: the devices' means differ")
    compare_tree(f"{step}/mean", {path: x[:1] for path, x in mean.items()}, mean=True)
    compare_tree(f"{step}/state", runner.rows(state))
    before = recorded(arrays, case, f"{step}/state")
  return failures


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  PATH.write_bytes(dumps(record()))
  print(f"wrote {PATH} ({PATH.stat().st_size} bytes)")
