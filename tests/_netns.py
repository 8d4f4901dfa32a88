"""Hosts as a cluster has them, on one machine: network namespaces joined by a veth pair (as root).

Each end of the pair is a "host" with its own address, route and loopback; an end is either a new
network namespace (processes are launched there with ``ip netns exec``) or this namespace. Only the
network is separate: the file system (a cluster's shared one) is common to both.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence


@dataclass(frozen=True)
class Host:
    prefix: List[str]
    """Command prefix that runs a process on this host (empty: this namespace)."""
    address: str


def _run(cmd: Sequence[str]) -> bool:
    return shutil.which(cmd[0]) is not None and subprocess.run(list(cmd), capture_output=True).returncode == 0


def _setup_commands(names: Sequence[str], links: Sequence[str], subnet: str, isolated: Sequence[bool]):
    cmds = [["ip", "netns", "add", ns] for ns, own in zip(names, isolated) if own]
    cmds.append(["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]])
    for i in range(2):
        ip = ["ip", "-n", names[i]] if isolated[i] else ["ip"]
        if isolated[i]:
            cmds.append(["ip", "link", "set", links[i], "netns", names[i]])
        cmds += [ip + ["addr", "add", f"{subnet}.{i + 1}/24", "dev", links[i]], ip + ["link", "set", links[i], "up"]]
        if isolated[i]:
            cmds.append(ip + ["link", "set", "lo", "up"])
    return cmds


@contextlib.contextmanager
def veth_hosts(tag: str, subnet: str, isolated: Sequence[bool] = (True, True)) -> Iterator[Optional[List[Host]]]:
    """Two hosts joined by a veth pair on ``subnet`` (the first three octets, e.g. ``"10.232.0"``):
    host i at ``subnet.(i+1)``, in a new network namespace ``<tag><pid>n<i>`` where ``isolated[i]``
    (else in this one: then pick a subnet no other run uses). Yields the two hosts, or None after a
    warning where network namespaces cannot be made (not root, no iproute2): the caller falls back
    to loopback. Everything made is deleted on exit, also on failure."""
    pid = os.getpid()
    names = [f"{tag}{pid}n{i}" for i in range(2)]
    links = [f"{tag}{pid}v{i}"[:15] for i in range(2)]
    try:
        for cmd in _setup_commands(names, links, subnet, isolated):
            if not _run(cmd):
                warnings.warn(f"no network namespace here ({' '.join(cmd)} failed or no iproute2)")
                yield None
                return
        yield [Host(["ip", "netns", "exec", ns] if own else [], f"{subnet}.{i + 1}")
               for i, (ns, own) in enumerate(zip(names, isolated))]
    finally:
        for link in links:  # a pair left here (a failed set-up, or an end in this namespace)
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns, own in zip(names, isolated):
            if own:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
