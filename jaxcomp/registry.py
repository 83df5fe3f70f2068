"""The one list of methods: each name's factory, defaults and what it requires after it.

The cost model, the experiments, the benchmarks and the test suites read
:data:`METHODS`; adding a method to jaxcomp is one module on the shared path
(:mod:`jaxcomp.protocol`) and one entry here.
"""

from jaxcomp._src.registry import METHODS as METHODS
from jaxcomp._src.registry import Entry as Entry
from jaxcomp._src.registry import names as names
from jaxcomp._src.registry import get as get
from jaxcomp._src.registry import build as build
from jaxcomp._src.registry import configuration as configuration
from jaxcomp._src.registry import wire_cost as wire_cost
from jaxcomp._src.registry import check_chain as check_chain

__all__ = (
    "build",
    "check_chain",
    "configuration",
    "Entry",
    "get",
    "METHODS",
    "names",
    "wire_cost",
)
