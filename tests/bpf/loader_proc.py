"""A stand-alone loader process for the restart test: load, attach, apply, then wait.

usage: loader_proc.py IFNAME PIN_DIR NETNS VXLAN_DEV ASSIGNMENT_FILE
"""

from __future__ import annotations

import sys
import time

from adaptermesh.bpf.loader import BpfShardTable
from adaptermesh.proto import assignment_pb2


def main() -> None:
    ifname, pin_dir, netns, vxlan_dev, path = sys.argv[1:6]
    table = BpfShardTable(ifname, pin_dir=pin_dir, vxlan_dev=vxlan_dev, netns=netns)
    packets = sum(s.packets for s in table.read_stats().values())
    print(f"resumed version={table.applied_version} packets={packets}", flush=True)
    table.attach()
    a = assignment_pb2.Assignment()
    with open(path, "rb") as f:
        a.ParseFromString(f.read())
    table.apply(a)
    print("ready", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
