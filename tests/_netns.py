"""Hosts as a cluster has them, on one machine: network namespaces joined by a veth pair (as root).

Each end of the pair is a "host" with its own address, route and loopback; an end is either a new
network namespace (processes are launched there with ``ip netns exec``) or this namespace. Only the
network is separate: the file system (a cluster's shared one) is common to both. With ``named=True``
each namespace is a host as a Debian/Ubuntu cluster node is one: its own hostname (``unshare --uts``),
resolved to 127.0.1.1 on itself and to its address on the other (``/etc/netns/<ns>/hosts``, which
``ip netns exec`` mounts over ``/etc/hosts``), and a default route through the other.
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
    name: Optional[str] = None
    """Its hostname (``named``), else None."""

    @property
    def reach(self) -> str:
        """How the other host names this one: its hostname, else its address."""
        return self.name or self.address


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


def _write_hosts_files(names: Sequence[str], hostnames: Sequence[str], subnet: str) -> None:
    """Each namespace's hosts file: its own name on 127.0.1.1, the other's on its address."""
    for i, ns in enumerate(names):
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n127.0.1.1 {hostnames[i]}\n{subnet}.{2 - i} {hostnames[1 - i]}\n")


def _host(ns: Optional[str], address: str, hostname: Optional[str]) -> Host:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    if hostname:  # sh's $0 is the name, "$@" the command appended to the prefix
        prefix += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
    return Host(prefix, address, hostname)


@contextlib.contextmanager
def veth_hosts(tag: str, subnet: str, isolated: Sequence[bool] = (True, True),
               named: bool = False) -> Iterator[Optional[List[Host]]]:
    """Two hosts joined by a veth pair on ``subnet`` (the first three octets, e.g. ``"10.232.0"``):
    host i at ``subnet.(i+1)``, in a new network namespace ``<tag><pid>n<i>`` where ``isolated[i]``
    (else in this one: then pick a subnet no other run uses); ``named`` (both isolated): host i is
    ``<tag><pid>h<i>`` (see the module's docstring). Yields the two hosts, or None after a warning
    where network namespaces cannot be made (not root, no iproute2): the caller falls back to
    loopback. Everything made is deleted on exit, also on failure."""
    pid = os.getpid()
    names = [f"{tag}{pid}n{i}" for i in range(2)]
    links = [f"{tag}{pid}v{i}"[:15] for i in range(2)]
    hostnames = [f"{tag}{pid}h{i}" for i in range(2)] if named else [None, None]
    assert not named or all(isolated), "a hostname needs its own namespace"
    try:
        cmds = _setup_commands(names, links, subnet, isolated)
        if named:  # a default route through the other host
            cmds += [["ip", "-n", ns, "route", "add", "default", "via", f"{subnet}.{2 - i}"]
                     for i, ns in enumerate(names)]
        for cmd in cmds:
            if not _run(cmd):
                warnings.warn(f"no network namespace here ({' '.join(cmd)} failed or no iproute2)")
                yield None
                return
        if named:
            _write_hosts_files(names, hostnames, subnet)
        yield [_host(ns if own else None, f"{subnet}.{i + 1}", hostnames[i])
               for i, (ns, own) in enumerate(zip(names, isolated))]
    finally:
        for link in links:  # a pair left here (a failed set-up, or an end in this namespace)
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns, own in zip(names, isolated):
            if own:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir("/etc/netns")  # when no other run's namespace has a folder there
