"""Index tables built on the host, sent to the device in one non-blocking copy (`k3core.transfer`).

KDA prefill used to make several pageable copies per call, each waiting for the stream, and the GPU sat idle while
the host caught up (about 0.9 ms a call at 32K tokens on an H200).
"""
from __future__ import annotations

from k3core.transfer import index_tables

__all__ = ["index_tables"]
