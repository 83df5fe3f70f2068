"""The models of the comparison, in Flax NNX, used as pure functions of their parameters.

Each builder returns a :class:`Model`: the parameters as a plain dict pytree
(what the compressors and the training step see), a loss function
``loss(params, batch)`` over this device's part of the batch, and an
evaluation function ``evaluate(params, x, y) -> (loss, accuracy)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax


class DigitsCNN(nnx.Module):
  """Two 3x3 convolutions (16 and 32 channels), a 2x2 average pool, two dense layers."""

  def __init__(self, num_classes: int, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
    self.hidden = nnx.Linear(4 * 4 * 32, 128, rngs=rngs)
    self.out = nnx.Linear(128, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.conv1(x))
    x = nnx.relu(self.conv2(x))
    x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    return self.out(nnx.relu(self.hidden(x)))


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention and an MLP."""

  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=heads, in_features=width, decode=False, rngs=rngs
    )
    self.ln2 = nnx.LayerNorm(width, rngs=rngs)
    self.mlp_in = nnx.Linear(width, 4 * width, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.ln1(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x))))


class CharTransformer(nnx.Module):
  """A small causal character-level transformer (learned positions)."""

  def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int,
               rngs: nnx.Rngs):
    self.token = nnx.Embed(vocab, width, rngs=rngs)
    self.position = nnx.Embed(context, width, rngs=rngs)
    self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(layers)])
    self.ln = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    length = tokens.shape[-1]
    x = self.token(tokens) + self.position(jnp.arange(length))
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln(x))


@dataclasses.dataclass(frozen=True)
class Model:
  """A model as pure functions of a dict of parameters."""
  params: dict
  loss: Callable[[Any, tuple], jax.Array]
  evaluate: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
  description: str


def _functional(module: nnx.Module, description: str) -> Model:
  graphdef, state = nnx.split(module)
  # Host copies: every run places (and donates) its own device buffers.
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(state))

  def logits_of(p, x):
    return nnx.merge(graphdef, p)(x)

  def loss(p, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(p, x), y).mean()

  def evaluate(p, x, y):
    logits = logits_of(p, x)
    loss_value = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss_value, jnp.mean(jnp.argmax(logits, -1) == y)

  return Model(params, loss, evaluate, description)


def digits_cnn(seed: int = 0, num_classes: int = 10) -> Model:
  """The digits CNN (71,754 parameters in 8 leaves)."""
  return _functional(
      DigitsCNN(num_classes, nnx.Rngs(seed)),
      "CNN: conv3x3x16, conv3x3x32, avgpool2, dense128, dense10",
  )


def char_transformer(
    seed: int = 0, vocab: int = 256, context: int = 64, width: int = 64,
    layers: int = 2, heads: int = 4,
) -> Model:
  """The character-level transformer (137,216 parameters with the defaults)."""
  return _functional(
      CharTransformer(vocab, context, width, layers, heads, nnx.Rngs(seed)),
      f"transformer: {layers} layers, width {width}, {heads} heads, context {context}",
  )


def num_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
