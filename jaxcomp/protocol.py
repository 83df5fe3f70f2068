"""What a method author needs: the shared path every compressor takes, and its argument checks.

A method is a :class:`Method` (its bucket order, its own state fields and one
``step`` that encodes, exchanges through the :class:`Context` and decodes);
:func:`compressor` turns it into an ``optax.GradientTransformation`` that does
the rest (checks, fusion, error feedback, the finiteness test and the NaN
poison, keeping the old state on a skipped step, the count and the key). The
checks validate a factory's arguments the way every jaxcomp factory does.
:func:`find_compressors` finds the compressors that any transformation runs;
a wrapper written by hand (as :func:`jaxcomp.hierarchical` is) attaches its
:class:`Spec` with :func:`attach_spec` and calls :func:`announce` first in
its ``update``.

Example::

  def step(ctx, corrected, state):
    return protocol.Output(mean=ctx.mean(corrected))

  tx = protocol.compressor(protocol.Method(
      name="mine", config={}, axes=("data",), state=optax.EmptyState, step=step,
      wire=lambda bucket, sizes, steps: jaxcomp.wire.mean(bucket.size, sizes),
      propagates_nonfinite=True))
"""

from jaxcomp._src.protocol import Method as Method
from jaxcomp._src.protocol import FORM as FORM
from jaxcomp._src.protocol import Context as Context
from jaxcomp._src.protocol import Output as Output
from jaxcomp._src.protocol import Zeroed as Zeroed
from jaxcomp._src.protocol import Joint as Joint
from jaxcomp._src.protocol import Later as Later
from jaxcomp._src.protocol import Message as Message
from jaxcomp._src.protocol import Spec as Spec
from jaxcomp._src.protocol import Fused as Fused
from jaxcomp._src.protocol import Mean as Mean
from jaxcomp._src.protocol import compressor as compressor
from jaxcomp._src.protocol import attach_spec as attach_spec
from jaxcomp._src.protocol import spec as spec
from jaxcomp._src.protocol import find_specs as find_specs
from jaxcomp._src.protocol import find_compressors as find_compressors
from jaxcomp._src.protocol import Found as Found
from jaxcomp._src.protocol import announce as announce
from jaxcomp._src.protocol import all_finite as all_finite
from jaxcomp._src.protocol import keep_if as keep_if
from jaxcomp._src.protocol import as_tree as as_tree
from jaxcomp._src.protocol import from_tree as from_tree
from jaxcomp._src.fusion import Bucket as Bucket
from jaxcomp._src.fusion import plan as plan
from jaxcomp._src.fusion import Pieces as Pieces
from jaxcomp._src.checks import AxisName as AxisName
from jaxcomp._src.checks import check_axis_name as check_axis_name
from jaxcomp._src.checks import check_number as check_number
from jaxcomp._src.checks import check_bool as check_bool
from jaxcomp._src.checks import check_density as check_density
from jaxcomp._src.checks import check_bucket_cap_mb as check_bucket_cap_mb
from jaxcomp._src.checks import check_seed as check_seed
from jaxcomp._src.checks import num_selected as num_selected
from jaxcomp._src.checks import raw_key as raw_key

__all__ = (
    "FORM",
    "all_finite",
    "announce",
    "as_tree",
    "attach_spec",
    "AxisName",
    "Bucket",
    "check_axis_name",
    "check_bool",
    "check_bucket_cap_mb",
    "check_density",
    "check_number",
    "check_seed",
    "compressor",
    "Context",
    "find_compressors",
    "find_specs",
    "from_tree",
    "Found",
    "Fused",
    "Joint",
    "keep_if",
    "Later",
    "Mean",
    "Message",
    "Method",
    "num_selected",
    "Output",
    "Pieces",
    "plan",
    "raw_key",
    "Spec",
    "spec",
    "Zeroed",
)
