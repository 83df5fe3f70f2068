"""The one list of methods: what it builds, and the chains it refuses."""

import jax.numpy as jnp
import optax
import pytest

import jaxcomp
from jaxcomp import protocol
from jaxcomp import registry

PARAMS = {"conv": jnp.zeros((3, 3, 4, 8)), "w": jnp.zeros((16, 12)), "b": jnp.zeros((12,))}


@pytest.mark.parametrize("name", registry.names())
def test_each_entry_builds_its_public_factory_with_its_defaults(name):
  method = registry.get(name)
  assert getattr(jaxcomp, name) is method.factory
  tx = registry.build(name, "data")
  spec = protocol.spec(tx)
  assert spec.name == name
  assert {k: spec.config[k] for k in method.defaults} == dict(method.defaults)
  assert type(tx.init(PARAMS)) is method.state


def test_every_public_compressor_is_registered_and_unknown_names_are_refused():
  # A factory exported without an entry would escape the contract suite, which
  # runs over the registry.
  wrappers = {"hierarchical", "check_chain"}
  factories = {n for n in jaxcomp.__all__ if n.islower() and n not in wrappers
               and callable(getattr(jaxcomp, n))}
  assert factories == set(registry.names())
  with pytest.raises(ValueError, match="`name` must be one of"):
    registry.build("zip", "data")
  assert registry.configuration("gtopk", density=0.5) == {"density": 0.5}


@pytest.mark.parametrize("tx", [
    optax.chain(jaxcomp.dgc(0.01, "data"), optax.sgd(0.1, momentum=0.9)),
    optax.chain(jaxcomp.dgc(0.01, "data"), optax.adamw(1e-3)),
    optax.MultiSteps(optax.chain(jaxcomp.dgc(0.01, "data"), optax.lion(1e-4)), 2),
    optax.chain(optax.clip(1.0), jaxcomp.dgc(0.01, "data"), optax.chain(optax.trace(0.5))),
], ids=["sgd_momentum", "adamw", "multisteps_lion", "nested_trace"])
def test_momentum_after_dgc_is_refused_with_what_to_do(tx):
  with pytest.raises(ValueError, match=r"`dgc` is followed by .*plain SGD after it"):
    registry.check_chain(tx, PARAMS)


@pytest.mark.parametrize("tx", [
    optax.chain(jaxcomp.dgc(0.01, "data"), optax.sgd(0.1)),
    optax.chain(optax.trace(0.9), jaxcomp.dgc(0.01, "data"), optax.sgd(0.1)),
    optax.chain(jaxcomp.topk(0.01, "data"), optax.adamw(1e-3)),
    optax.adamw(1e-3),
], ids=["dgc_sgd", "momentum_before_dgc", "topk_adamw", "no_compressor"])
def test_chains_that_keep_the_requirements_pass(tx):
  registry.check_chain(tx, PARAMS)
