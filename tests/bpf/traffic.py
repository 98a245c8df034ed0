"""Real traffic in the test topology (the helpers live in adaptermesh_testkit.netns)."""

from __future__ import annotations

from adaptermesh_testkit.netns import (
    HttpServer,
    http_get,
    inject,
    raw_udp_frames,
    send_udp,
    settle,
)
from adaptermesh_testkit.netns import udp_receivers as receivers

__all__ = ["HttpServer", "http_get", "inject", "raw_udp_frames", "receivers", "send_udp", "settle"]
