"""The alpha-beta cost of one gradient exchange, and which compressor to pick."""

from jaxcomp._src.costmodel import NumDevices as NumDevices
from jaxcomp._src.costmodel import Network as Network
from jaxcomp._src.costmodel import Recommendation as Recommendation
from jaxcomp._src.costmodel import LAYOUTS as LAYOUTS
from jaxcomp._src.costmodel import steps as steps
from jaxcomp._src.costmodel import exchange_time as exchange_time
from jaxcomp._src.costmodel import predict as predict
from jaxcomp._src.costmodel import predict_diloco as predict_diloco
from jaxcomp._src.costmodel import recommend as recommend

__all__ = (
    "exchange_time",
    "LAYOUTS",
    "Network",
    "NumDevices",
    "predict",
    "predict_diloco",
    "recommend",
    "Recommendation",
    "steps",
)
