"""The order in which a loss's backward pass makes its parameters' gradients.

Buckets (``bucket_cap_mb``) are filled in that order, so that the first
bucket's exchange waits only for the first gradients made and overlaps the
rest of the backward pass (torch DDP fills them in reverse parameter order,
the order of registration, which follows the layers). A pytree's order is its
keys' sorted order, which follows the layers only where the names do: a
ResNet's ``fc`` sorts first and its ``stem`` last, a transformer's
``token`` embedding after its ``head``. :func:`backward_order` reads the
order off the program of the loss's gradient instead.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.extend import core as jex_core
import optax


def sub_jaxprs(eqn) -> list:
  """The jaxprs an equation's parameters hold (a call's body, a branch, a loop's
  condition and body), each as a ``Jaxpr``."""
  found = []
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jex_core.ClosedJaxpr):
        found.append(item.jaxpr)
      elif isinstance(item, jex_core.Jaxpr):
        found.append(item)
  return found


def _sub_jaxpr(eqn) -> Any:
  """The one jaxpr an equation calls with its operands and results one for one
  (``pjit``, ``closed_call``, ``remat``...), or ``None`` (a loop, a branch, none)."""
  found = sub_jaxprs(eqn)
  if len(found) == 1 and len(found[0].outvars) == len(eqn.outvars) \
      and len(found[0].invars) == len(eqn.invars):
    return found[0]
  return None


def _places(jaxpr, outer: tuple, inputs: list) -> dict:
  """``{var: place}`` of every variable ``jaxpr`` defines: the index path of the
  equation that makes it (nested calls followed), ``inputs`` the places of its
  input variables; a variable handed through a call keeps its own place."""
  places = dict(zip(jaxpr.invars, inputs))

  def place(v, default):
    return places.get(v, default) if isinstance(v, jex_core.Var) else default

  for index, eqn in enumerate(jaxpr.eqns):
    here = outer + (index,)
    sub = _sub_jaxpr(eqn)
    if not any(isinstance(v, jex_core.Var) for v in eqn.invars):
      here = ()  # made of constants (a zero gradient): ready from the start
    if sub is None:
      for v in eqn.outvars:
        places[v] = here
      continue
    inner = _places(sub, here, [place(v, here) for v in eqn.invars])
    for v, made in zip(eqn.outvars, sub.outvars):
      places[v] = inner.get(made, here) if isinstance(made, jex_core.Var) else here
  return places


def backward_order(loss_fn: Callable[..., Any], params: optax.Params, *args: Any,
                   has_aux: bool = False) -> tuple[int, ...]:
  """The tree positions of ``params``' leaves in the order ``jax.grad(loss_fn)`` makes them.

  Traced once (``jax.make_jaxpr``, nothing runs): each gradient's place is
  the equation of the program that makes it, nested calls (``jit``,
  ``remat``) followed; a gradient made of constants alone (the zero of an
  unused parameter) comes first; gradients made by one equation (a loop, a
  branch) come in reverse tree order, torch DDP's. Hand the result to
  :func:`jaxcomp.training.with_bucket_order`::

    order = training.backward_order(loss_fn, params, batch)
    tx = optax.chain(training.with_bucket_order(
        jaxcomp.gtopk(1e-3, "data", bucket_cap_mb=25), order), optax.sgd(0.1))

  Args:
    loss_fn: ``loss_fn(params, *args)``, a scalar (``(loss, aux)`` with
      ``has_aux``), as :func:`jaxcomp.training.make_step` takes it.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
    *args: the loss's other arguments (one device's batch; only their
      shapes matter).
    has_aux: ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    Every position ``0 .. len(jax.tree.leaves(params)) - 1`` once, first made first.
  """
  closed = jax.make_jaxpr(jax.grad(loss_fn, has_aux=has_aux))(params, *args)
  jaxpr = closed.jaxpr
  count = len(jax.tree.leaves(params))
  places = _places(jaxpr, (), [()] * len(jaxpr.invars))
  made = [places.get(v, ()) if isinstance(v, jex_core.Var) else () for v in jaxpr.outvars[:count]]
  return tuple(sorted(range(count), key=lambda i: (made[i], -i)))
