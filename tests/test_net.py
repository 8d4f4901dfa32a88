"""parallel/net.py: the interface gloo binds to, on the route to MASTER_ADDR (the two-host run is
tests/test_multinode.py)."""

import logging

import pytest

from megatron_grpo.parallel import net


def _non_loopback():
    """(interface, address) of one of this machine's non-loopback IPv4 addresses, or skip."""
    for name, addresses in net.interface_addresses().items():
        for address in addresses:
            if ":" not in address and not net.is_loopback(address):
                return name, address
    pytest.skip("no non-loopback IPv4 interface here")


def test_interface_addresses_lists_loopback_and_route_finds_its_interface():
    found = net.interface_addresses()
    assert "127.0.0.1" in found["lo"]
    name, address = _non_loopback()
    # this node's own address routes to itself, through the interface that holds it
    assert net.route_interface(address) == (address, name)
    assert net.route_address(address) == address


def test_loopback_and_unresolvable_hosts_pick_no_interface():
    assert net.route_interface("127.0.0.1") == ("127.0.0.1", None)
    assert net.route_interface("localhost")[1] is None
    assert net.route_interface("no-such-host.invalid") == (None, None)
    assert net.route_address("no-such-host.invalid")  # the FQDN: what the transfer group fell back to


def test_interface_of_matches_ipv4_and_ipv6_spellings():
    interfaces = {"lo": ["127.0.0.1", "::1"], "veth0": ["10.232.0.1"], "ib0": ["fd00::2"]}
    assert net.interface_of("10.232.0.1", interfaces) == "veth0"
    assert net.interface_of("fd00:0:0::2", interfaces) == "ib0"
    assert net.interface_of("10.232.0.2", interfaces) is None
    _, address = _non_loopback()
    assert net.route_interface(address, {"fake0": [address]}) == (address, "fake0")
    assert net.route_interface(address, {"fake0": ["10.9.9.9"]}) == (address, None)


def test_ipv6_table_parsed(tmp_path):
    table = tmp_path / "if_inet6"
    table.write_text("fd000000000000000000000000000002 04 40 00 82     eth0\n"
                     "00000000000000000000000000000001 01 80 10 80       lo\n")
    assert net._ipv6_addresses(str(table)) == {"eth0": ["fd00::2"], "lo": ["::1"]}
    assert net._ipv6_addresses(str(tmp_path / "missing")) == {}


def test_bind_sets_gloo_ifname_only_when_unset_and_master_not_loopback(caplog):
    name, address = _non_loopback()
    caplog.set_level(logging.INFO, logger="megatron_grpo")
    env = {"MASTER_ADDR": address, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    assert net.bind_gloo_to_route(env) == name and env[net.GLOO_IFNAME_ENV] == name
    assert f"gloo binds to {name} ({address}" in caplog.text
    user = {"MASTER_ADDR": address, net.GLOO_IFNAME_ENV: "ib0"}
    assert net.bind_gloo_to_route(user) == "ib0" and user[net.GLOO_IFNAME_ENV] == "ib0"  # the user's wins
    one_node = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert net.bind_gloo_to_route(one_node) is None and net.GLOO_IFNAME_ENV not in one_node
    assert net.bind_gloo_to_route({}) is None  # not under torchrun


def test_default_routes_parsed_from_the_route_tables(tmp_path):
    ipv4, ipv6 = tmp_path / "route", tmp_path / "ipv6_route"
    ipv4.write_text("Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n"
                    "eth1\t00000000\t0101A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0\n"  # default, metric 200
                    "eth0\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"  # default, metric 100
                    "eth2\t00000000\t010300C0\t0002\t0\t0\t0\t00000000\t0\t0\t0\n"  # not up
                    "ib0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n")  # a subnet, not default
    zero = "0" * 32
    ipv6.write_text(f"{zero} 00 {zero} 00 fe800000000000000000000000000001 00000400 1 0 00000003 ib1\n"
                    f"{zero} 00 {zero} 00 {zero} ffffffff 1 0 00200200 lo\n"  # the unreachable default
                    f"fd000000000000000000000000000000 40 {zero} 00 {zero} 00000100 1 0 00000001 eth3\n")
    assert net.default_route_interfaces(str(ipv4), str(ipv6)) == ["eth0", "eth1", "ib1"]
    assert net.default_route_interfaces(str(tmp_path / "none"), str(tmp_path / "none")) == []
    interfaces = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5", "fd00::5"], "eth1": ["192.168.1.7"], "ib0": []}
    assert net.reachable_interface(interfaces, ["eth9", "eth1"]) == ("eth1", "192.168.1.7")  # eth9: no address
    assert net.reachable_interface(interfaces, []) == (None, None)  # two candidates, no default route: no guess
    assert net.reachable_interface({"lo": ["127.0.0.1"], "veth0": ["10.232.0.1"]}, []) == ("veth0", "10.232.0.1")


def test_the_head_binds_the_default_routes_interface_when_its_name_is_loopback(caplog, monkeypatch):
    """torchrun's c10d rendezvous: MASTER_ADDR is the head's FQDN, 127.0.1.1 on a Debian/Ubuntu head. The head
    (GROUP_RANK 0) binds the default route's interface and says so; another node that finds the master on
    loopback (a wrong setup: MASTER_ADDR=localhost) and a head with no candidate interface only warn."""
    caplog.set_level(logging.INFO, logger="megatron_grpo")
    monkeypatch.setattr(net, "interface_addresses", lambda: {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"],
                                                             "ib0": ["10.1.0.5"]})
    monkeypatch.setattr(net, "default_route_interfaces", lambda: ["eth0"])
    head = {"MASTER_ADDR": "127.0.1.1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    assert net.bind_gloo_to_route(head) == "eth0" and head[net.GLOO_IFNAME_ENV] == "eth0"
    assert "gloo binds to eth0 (10.0.0.5, this node's address on its default route: MASTER_ADDR=127.0.1.1 is " \
           "loopback here, the head node)" in caplog.text
    one_node = {"MASTER_ADDR": "127.0.1.1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    assert net.bind_gloo_to_route(one_node) is None and net.GLOO_IFNAME_ENV not in one_node  # loopback is right
    caplog.clear()
    other = {"MASTER_ADDR": "localhost", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert net.bind_gloo_to_route(other) is None and net.GLOO_IFNAME_ENV not in other
    assert "is loopback on node 1, not the head" in caplog.text and "spans several nodes" in caplog.text
    monkeypatch.setattr(net, "default_route_interfaces", lambda: [])
    caplog.clear()
    head = {"MASTER_ADDR": "127.0.1.1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    assert net.bind_gloo_to_route(head) is None and net.GLOO_IFNAME_ENV not in head  # eth0 or ib0: not guessed
    assert "no default route names this node's interface" in caplog.text
