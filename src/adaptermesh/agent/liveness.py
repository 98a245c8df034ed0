"""Datapath liveness: is the classifier still where the agent attached it?

A CNI or an operator can delete and recreate the agent's interface (the filter goes with the
interface), delete the filter, or unpin a map, and nothing tells the agent. The monitor looks
after every netlink link or traffic-control event and at least every ``interval_s``:

- while anything is missing, ``/healthz`` fails and names it, and the applier holds every new
  Assignment (it is reported as not applied, with the reason, never as applied);
- when the interface is there again, the held (or the current) Assignment is written to the
  maps first, then the unpinned maps are pinned again and the filter attached, so the first
  packet on the new interface already meets the current pins and weights.

The decision (:func:`decide`, :func:`missing`) is pure; :class:`DatapathMonitor` does the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Literal

from adaptermesh.agent.applier import Applier
from adaptermesh.agent.metrics import AgentMetrics
from adaptermesh.bpf.table import Attachable, Attachment

__all__ = ["Action", "DatapathMonitor", "decide", "missing"]

_log = logging.getLogger(__name__)

# "none": all in place; "wait": the interface is gone, nothing to attach to; "reattach": the
# interface is there but the filter or a pin is not.
Action = Literal["none", "wait", "reattach"]


def decide(attachment: Attachment) -> Action:
    if attachment.ok:
        return "none"
    return "reattach" if attachment.interface else "wait"


def missing(attachment: Attachment, iface: str, pin_dir: str) -> list[str]:
    """What is gone, in words an operator can check (empty: nothing)."""
    out: list[str] = []
    if not attachment.interface:
        out.append(f"interface {iface}")  # its filter went with it
    elif not attachment.filter:
        out.append(f"tc filter on {iface} ingress")
    out.extend(f"pinned map {pin_dir.rstrip('/')}/{name}" for name in attachment.unpinned)
    return out


class DatapathMonitor:
    def __init__(
        self,
        datapath: Attachable,
        applier: Applier,
        metrics: AgentMetrics,
        iface: str,
        pin_dir: str,
        interval_s: float = 1.0,
    ) -> None:
        self._datapath = datapath
        self._applier = applier
        self._metrics = metrics
        self.iface = iface
        self.pin_dir = pin_dir
        self.interval_s = interval_s
        self.missing: list[str] = []
        self.detaches = 0
        self.reattaches = 0
        self.last_error = ""  # the last failed inspect or re-attach
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    @property
    def attached(self) -> bool:
        return not self.missing

    def wake(self) -> None:
        """Look now (thread-safe: the netlink watcher calls it on every event)."""
        loop, event = self._loop, self._wake
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)

    def step(self) -> Action:
        """One look and, when needed, one repair (blocking: run it off the event loop)."""
        try:
            attachment = self._datapath.inspect()
        except Exception as exc:
            self.last_error = f"inspect: {exc}"
            _log.exception("could not inspect the datapath")
            return "none"
        action = decide(attachment)
        if action == "none":
            if self.missing:  # put back by someone else: replay so the maps are current
                self._restored(replay=True)
            return action
        gone = missing(attachment, self.iface, self.pin_dir)
        if not self.missing:
            self.detaches += 1
            self._metrics.datapath_detaches.inc()
            _log.error("datapath lost: %s missing", ", ".join(gone))
        self.missing = gone
        self._metrics.datapath_attached.set(0)
        self._applier.hold(f"{', '.join(gone)} missing")
        if action == "reattach":
            self._reattach()
        return action

    def _reattach(self) -> None:
        # The maps live on in this process: write the held Assignment first, then attach.
        result = self._applier.replay()
        if result is not None and not result.ok:
            _log.error("replay before re-attaching: %s", result.error)
        try:
            self._datapath.reattach()
            attachment = self._datapath.inspect()
        except Exception as exc:
            self.last_error = f"re-attach: {exc}"
            _log.exception("could not re-attach the datapath")
            return
        if attachment.ok:
            self._restored(replay=False)
        else:
            self.missing = missing(attachment, self.iface, self.pin_dir)

    def _restored(self, *, replay: bool) -> None:
        if replay:
            self._applier.replay()
        self._applier.release()
        self.reattaches += 1
        self._metrics.datapath_reattaches.inc()
        self._metrics.datapath_attached.set(1)
        _log.info(
            "datapath attached again on %s (serving version %d)",
            self.iface,
            self._applier.applied_version,
        )
        self.missing = []
        self.last_error = ""

    async def run(self) -> None:
        """Step after every wake() and at least every ``interval_s``, until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._wake = wake = asyncio.Event()
        while True:
            wake.clear()
            await asyncio.to_thread(self.step)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.interval_s)
