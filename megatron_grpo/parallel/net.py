"""Which address and network interface this node's gloo binds to: the ones on the route to the peer.

Left to itself gloo binds the address the hostname resolves to: ``127.0.0.1`` in a container or a
network namespace, ``127.0.1.1`` on many Debian/Ubuntu hosts. A rank on another node then cannot
connect (``Gloo connectFullMesh failed ... remote=[127.0.0.1]``). The address a peer can reach back
is this node's address on the route to that peer; gloo takes an interface *name*
(``GLOO_SOCKET_IFNAME``, read whenever a gloo group is made, Megatron's included), so the trainer
sets it to the interface holding that address before ``init_process_group``.

The head node (the one ``MASTER_ADDR`` names) has no route to itself but through loopback: torchrun's
c10d rendezvous sets ``MASTER_ADDR`` to the head's FQDN, which a Debian/Ubuntu head resolves to
``127.0.1.1`` (``/etc/hosts``). There the interface is the one the other nodes reach: the default
route's (else the only non-loopback interface with an address).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from typing import Dict, List, Mapping, MutableMapping, Optional, Tuple

logger = logging.getLogger(__name__)

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""gloo's own interface variable: a user's setting always wins."""
SIOCGIFADDR = 0x8915
"""Linux ioctl: an interface's (primary) IPv4 address."""
IF_INET6 = "/proc/net/if_inet6"
"""Linux: one line per IPv6 address: hex address, index, prefix, scope, flags, interface name."""
ROUTE_TABLE = "/proc/net/route"
"""Linux: the IPv4 routes: interface, destination, gateway, flags, ..., metric, mask (hex, host order)."""
IPV6_ROUTE_TABLE = "/proc/net/ipv6_route"
"""Linux: the IPv6 routes: destination, prefix length, source, prefix, next hop, metric, ..., flags, interface."""
RTF_UP, RTF_REJECT = 0x1, 0x200
_DISCARD_PORT = 9  # any port: connecting a UDP socket only picks the route, nothing is sent


def local_address_on_route(host: str) -> Optional[str]:
    """This process's source address on the route to ``host`` (IPv4 first, then IPv6), or None when
    ``host`` does not resolve or has no route."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((host, _DISCARD_PORT))
                return s.getsockname()[0].split("%")[0]
        except OSError:  # socket.gaierror included: no address of this family, or no route
            continue
    return None


def route_address(host: str) -> str:
    """This process's address on the route to ``host`` (a UDP connect picks the route and sends
    nothing): what a peer that reaches ``host`` can reach back. Not ``gethostbyname(hostname)``: on a
    multi-homed node, or in another network namespace, that address may be unreachable from ``host``.
    Falls back to the FQDN when there is no route."""
    return local_address_on_route(host) or socket.getfqdn()


def _ipv4_address(sock: socket.socket, name: str) -> Optional[str]:
    try:
        reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:  # an interface without an IPv4 address
        return None
    return socket.inet_ntoa(reply[20:24])  # struct ifreq: 16-byte name, then sockaddr_in (family, port, addr)


def _ipv6_addresses(path: str = IF_INET6) -> Dict[str, List[str]]:
    found: Dict[str, List[str]] = {}
    try:
        with open(path) as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6:
                    found.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:  # no IPv6 here
        pass
    return found


def interface_addresses() -> Dict[str, List[str]]:
    """``{interface name: its addresses}``: each interface's primary IPv4 address (ioctl
    ``SIOCGIFADDR``) and its IPv6 addresses (``/proc/net/if_inet6``)."""
    ipv6 = _ipv6_addresses()
    found: Dict[str, List[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            ipv4 = _ipv4_address(sock, name)
            found[name] = ([ipv4] if ipv4 else []) + ipv6.get(name, [])
    return found


def interface_of(address: str, interfaces: Mapping[str, List[str]]) -> Optional[str]:
    """The interface in ``interfaces`` (``{name: addresses}``) that holds ``address``, or None."""
    wanted = ipaddress.ip_address(address)
    for name, addresses in interfaces.items():
        if any(ipaddress.ip_address(a) == wanted for a in addresses):
            return name
    return None


def _read_rows(path: str) -> List[List[str]]:
    try:
        with open(path) as f:
            return [line.split() for line in f]
    except OSError:  # not Linux, or no IPv6
        return []


def default_route_interfaces(route_table: str = ROUTE_TABLE, ipv6_route_table: str = IPV6_ROUTE_TABLE) -> List[str]:
    """The interfaces of this node's default routes that are up: IPv4 ones first, each family by metric."""
    ipv4 = [(int(r[6]), r[0]) for r in _read_rows(route_table)[1:]
            if len(r) >= 8 and r[1] == r[7] == "00000000" and int(r[3], 16) & RTF_UP]
    ipv6 = [(int(r[5], 16), r[9]) for r in _read_rows(ipv6_route_table)
            if len(r) == 10 and int(r[0], 16) == 0 and r[1] == "00" and r[9] != "lo"
            and int(r[8], 16) & RTF_UP and not int(r[8], 16) & RTF_REJECT]
    names = [name for _, name in sorted(ipv4)] + [name for _, name in sorted(ipv6)]
    return list(dict.fromkeys(names))


def reachable_interface(interfaces: Optional[Mapping[str, List[str]]] = None,
                        defaults: Optional[List[str]] = None) -> Tuple[Optional[str], Optional[str]]:
    """``(interface, address)`` other nodes reach this node on, for a node whose own name is loopback:
    the first default route's interface (``defaults``; default: this node's) with a non-loopback address,
    else the only non-loopback interface with an address; (None, None) when there is neither."""
    interfaces = interface_addresses() if interfaces is None else interfaces
    routable = {name: [a for a in addresses if not is_loopback(a)] for name, addresses in interfaces.items()}
    routable = {name: addresses for name, addresses in routable.items() if addresses}
    for name in default_route_interfaces() if defaults is None else defaults:
        if name in routable:
            return name, routable[name][0]
    if len(routable) == 1:
        (name, addresses), = routable.items()
        return name, addresses[0]
    return None, None


def node_address(env: Mapping[str, str] = os.environ,
                 interfaces: Optional[Mapping[str, List[str]]] = None) -> Optional[str]:
    """The address other nodes reach this node at: the first non-loopback address of the interface gloo is
    bound to (``GLOO_SOCKET_IFNAME``: ``bind_gloo_to_route`` sets it on every node of a multi-node world), else
    the default route's (``reachable_interface``); None when there is none."""
    interfaces = interface_addresses() if interfaces is None else interfaces
    bound = [a for a in interfaces.get(env.get(GLOO_IFNAME_ENV, ""), []) if not is_loopback(a)]
    return bound[0] if bound else reachable_interface(interfaces)[1]


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _spans_nodes(env: Mapping[str, str]) -> bool:
    """torchrun's world has ranks on other nodes (more ranks than this node runs)."""
    try:
        return int(env.get("WORLD_SIZE", "1")) > int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    except ValueError:
        return False


def route_interface(host: str, interfaces: Optional[Mapping[str, List[str]]] = None
                    ) -> Tuple[Optional[str], Optional[str]]:
    """``(address, interface)``: this node's address on the route to ``host`` and the interface in
    ``interfaces`` (``{name: addresses}``; default: this node's) holding it. The address is None when
    ``host`` does not resolve or has no route; the interface is None when the address is loopback
    (``host`` is this node: gloo's default works) or no interface holds it (a secondary IPv4 address)."""
    local = local_address_on_route(host)
    if local is None or is_loopback(local):
        return local, None
    return local, interface_of(local, interface_addresses() if interfaces is None else interfaces)


def bind_gloo_to_route(env: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """Sets ``GLOO_SOCKET_IFNAME`` in ``env`` (this process's environment) to the interface on the
    route to ``MASTER_ADDR`` unless the user set it, so every gloo group of this process binds an
    address the other nodes reach; on the head node of a multi-node world (``MASTER_ADDR`` is this
    node's loopback address here), to the default route's interface. Call before
    ``init_process_group``. Returns the interface gloo will use (None: gloo's default, the hostname's
    address); logs the choice."""
    if env.get(GLOO_IFNAME_ENV):
        logger.info("gloo binds to %s=%s (set by the user)", GLOO_IFNAME_ENV, env[GLOO_IFNAME_ENV])
        return env[GLOO_IFNAME_ENV]
    master = env.get("MASTER_ADDR")
    if not master:
        return None
    local, name = route_interface(master)
    if local is None or is_loopback(local):
        return _bind_head(env, master, local) if _spans_nodes(env) else None
    if name is None:
        logger.warning("no network interface holds %s (this node's address on the route to MASTER_ADDR=%s): gloo "
                       "binds the hostname's address; set %s if other nodes cannot reach it", local, master,
                       GLOO_IFNAME_ENV)
        return None
    env[GLOO_IFNAME_ENV] = name
    logger.info("gloo binds to %s (%s, this node's address on the route to MASTER_ADDR=%s)", name, local, master)
    return name


def _bind_head(env: MutableMapping[str, str], master: str, local: Optional[str]) -> Optional[str]:
    """``MASTER_ADDR`` is loopback (``local``) or unroutable (None) from this node while the world spans
    nodes. On the head (torchrun's ``GROUP_RANK`` 0, the node ``MASTER_ADDR`` names): the interface the
    other nodes reach. Elsewhere, or with no such interface, a warning: this node's setup is wrong."""
    head = local is not None and env.get("GROUP_RANK", "0") == "0"
    name, address = reachable_interface() if head else (None, None)
    if name is not None:
        env[GLOO_IFNAME_ENV] = name
        logger.info("gloo binds to %s (%s, this node's address on its default route: MASTER_ADDR=%s is loopback "
                    "here, the head node)", name, address, master)
        return name
    logger.warning("MASTER_ADDR=%s is %s from this node but the world spans several nodes: gloo binds the "
                   "hostname's address, which other nodes may not reach; set %s to the interface they reach this "
                   "node on", master, "unroutable" if local is None else
                   ("loopback, and no default route names this node's interface" if head else
                    f"loopback on node {env.get('GROUP_RANK')}, not the head"), GLOO_IFNAME_ENV)
    return None
