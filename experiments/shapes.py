"""Gradient shapes of well-known models, generated (nothing is downloaded).

Each function returns a dict pytree of ``jax.ShapeDtypeStruct`` leaves; use
:func:`zeros` or :func:`normal` to make arrays of them. Convolution kernels are
HWIO, dense kernels (in, out), as Flax lays them out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _leaf(*shape: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), jnp.float32)


def _conv_bn(kernel: int, cin: int, cout: int) -> dict:
  return {
      "kernel": _leaf(kernel, kernel, cin, cout),
      "bn_scale": _leaf(cout),
      "bn_bias": _leaf(cout),
  }


def resnet50(num_classes: int = 1000) -> dict:
  """ResNet-50 (He et al., 2016): 25,557,032 parameters in 161 leaves."""
  params = {"stem": _conv_bn(7, 3, 64)}
  cin = 64
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
    for block in range(blocks):
      name = f"stage{stage + 1}_block{block + 1}"
      params[name] = {
          "conv1": _conv_bn(1, cin, width),
          "conv2": _conv_bn(3, width, width),
          "conv3": _conv_bn(1, width, 4 * width),
      }
      if block == 0:
        params[name]["downsample"] = _conv_bn(1, cin, 4 * width)
      cin = 4 * width
  params["fc"] = {"kernel": _leaf(cin, num_classes), "bias": _leaf(num_classes)}
  return params


def transformer(
    layers: int = 12, width: int = 768, vocab: int = 30522, context: int = 512
) -> dict:
  """A BERT-base-sized encoder: 12 layers of width 768, about 109M parameters."""
  params = {
      "token_embedding": _leaf(vocab, width),
      "position_embedding": _leaf(context, width),
  }
  for layer in range(layers):
    params[f"layer{layer + 1}"] = {
        "qkv": {"kernel": _leaf(width, 3 * width), "bias": _leaf(3 * width)},
        "out": {"kernel": _leaf(width, width), "bias": _leaf(width)},
        "ln1": {"scale": _leaf(width), "bias": _leaf(width)},
        "mlp_in": {"kernel": _leaf(width, 4 * width), "bias": _leaf(4 * width)},
        "mlp_out": {"kernel": _leaf(4 * width, width), "bias": _leaf(width)},
        "ln2": {"scale": _leaf(width), "bias": _leaf(width)},
    }
  params["final_ln"] = {"scale": _leaf(width), "bias": _leaf(width)}
  return params


def num_params(shapes) -> int:
  return sum(x.size for x in jax.tree.leaves(shapes))


def zeros(shapes) -> dict:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def normal(shapes, key: jax.Array, scale: float = 1e-2) -> dict:
  """Gaussian arrays of the given shapes (a stand-in gradient)."""
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [
      scale * jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)
  ])
