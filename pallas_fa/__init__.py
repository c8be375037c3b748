"""pallas_fa: exact, memory-linear flash attention for JAX, in Pallas."""

from pallas_fa.api import flash_attention
from pallas_fa.api import implementations
from pallas_fa.masking import SegmentIds

__all__ = ["flash_attention", "implementations", "SegmentIds"]
__version__ = "0.1.0"
