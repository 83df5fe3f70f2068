"""The data of the comparison: scikit-learn's digits, and text from Python's own sources.

Nothing is downloaded. ``digits`` ships with scikit-learn (1797 images of 8x8
pixels, 10 classes); the split into train and test is fixed (stratified, seed
0) and a validation split for tuning is carved from the training part only,
so no choice is ever made on the test split. The text is the source of a few
fixed modules of the Python standard library, read as bytes at run time; its
last tenth is the test split.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
from typing import Iterator

import numpy as np

SEED = 0
TEST_FRACTION = 0.2
VALIDATION_FRACTION = 0.2

# Fixed modules of the standard library (plain Python, present in every
# CPython 3.10+), concatenated in this order.
TEXT_MODULES = (
    "textwrap.py", "string.py", "heapq.py", "bisect.py", "fnmatch.py",
    "colorsys.py", "shlex.py", "queue.py", "calendar.py", "difflib.py",
)
VOCAB_SIZE = 256  # bytes: the sources are ASCII, so a byte is a character


@dataclasses.dataclass(frozen=True)
class Split:
  """Inputs and targets of one split."""
  x: np.ndarray
  y: np.ndarray

  def __len__(self) -> int:
    return len(self.x)


@dataclasses.dataclass(frozen=True)
class Digits:
  """``train`` to train on, ``eval`` to report (test, or validation when tuning)."""
  train: Split
  eval: Split
  eval_name: str
  num_classes: int = 10


def digits(evaluate_on: str = "test") -> Digits:
  """The digits images as ``f32[N, 8, 8, 1]`` in [0, 1] and int32 labels.

  Args:
    evaluate_on: ``"test"`` trains on the whole training split and reports on
      the test split; ``"validation"`` trains on the training split less a
      fixed stratified fifth of it and reports on that fifth (for tuning).
  """
  from sklearn import datasets, model_selection

  if evaluate_on not in ("test", "validation"):
    raise ValueError(f"`evaluate_on` must be 'test' or 'validation', got {evaluate_on!r}")
  bunch = datasets.load_digits()
  x = (bunch.images / 16.0).astype(np.float32)[..., None]
  y = bunch.target.astype(np.int32)
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      x, y, test_size=TEST_FRACTION, random_state=SEED, stratify=y
  )
  if evaluate_on == "validation":
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x_train, y_train, test_size=VALIDATION_FRACTION, random_state=SEED,
        stratify=y_train,
    )
  return Digits(Split(x_train, y_train), Split(x_test, y_test), evaluate_on)


@dataclasses.dataclass(frozen=True)
class Text:
  """Byte streams: ``train`` and ``eval`` (test, or validation when tuning)."""
  train: np.ndarray
  eval: np.ndarray
  eval_name: str
  vocab_size: int = VOCAB_SIZE


def text(evaluate_on: str = "test") -> Text:
  """The fixed standard-library modules as one ``uint8`` stream, split 80/10/10.

  The first 80% trains, the next 10% is the validation split and the last 10%
  the test split (contiguous, so no window crosses from train into test).
  """
  if evaluate_on not in ("test", "validation"):
    raise ValueError(f"`evaluate_on` must be 'test' or 'validation', got {evaluate_on!r}")
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  raw = b"\n".join((root / name).read_bytes() for name in TEXT_MODULES)
  stream = np.frombuffer(raw, dtype=np.uint8)
  train_end, val_end = int(0.8 * len(stream)), int(0.9 * len(stream))
  if evaluate_on == "validation":
    return Text(stream[:train_end], stream[train_end:val_end], evaluate_on)
  return Text(stream[:val_end], stream[val_end:], evaluate_on)


def image_batches(split: Split, batch_size: int, seed: int = SEED) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless ``(x, y)`` batches drawn without replacement, reshuffled every epoch."""
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(split))
  position = 0
  while True:
    if position + batch_size > len(order):
      order = rng.permutation(len(split))
      position = 0
    chosen = order[position:position + batch_size]
    position += batch_size
    yield split.x[chosen], split.y[chosen]


def text_batches(stream: np.ndarray, batch_size: int, context: int, seed: int = SEED) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless ``(inputs, targets)`` windows of ``context`` bytes at random offsets."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(stream) - context - 1, size=batch_size)
    windows = np.stack([stream[s:s + context + 1] for s in starts]).astype(np.int32)
    yield windows[:, :-1], windows[:, 1:]


def text_eval_windows(stream: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
  """The whole stream as consecutive non-overlapping windows (inputs, targets)."""
  count = (len(stream) - 1) // context
  inputs = stream[:count * context].reshape(count, context).astype(np.int32)
  targets = stream[1:count * context + 1].reshape(count, context).astype(np.int32)
  return inputs, targets
