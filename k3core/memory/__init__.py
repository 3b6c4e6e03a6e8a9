"""Device memory for sequence state: KDA slots and MLA pages in one arena (`UnifiedPool`), and the static
two-partition baseline it replaces (`StaticDualPool`). Both have the same interface (`ArenaPool`)."""
from k3core.memory.arena import ArenaPool
from k3core.memory.layout import (ALIGN_BYTES, PageHandle, PoolError, PoolLayout, PoolUsage, SlotHandle,
                                  free_device_bytes)
from k3core.memory.static import StaticDualPool
from k3core.memory.unified import UnifiedPool

__all__ = [
    "ALIGN_BYTES", "ArenaPool", "PageHandle", "PoolError", "PoolLayout", "PoolUsage", "SlotHandle",
    "StaticDualPool", "UnifiedPool", "free_device_bytes",
]
