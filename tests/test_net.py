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
    caplog.clear()
    spans = {"MASTER_ADDR": "localhost", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert net.bind_gloo_to_route(spans) is None and net.GLOO_IFNAME_ENV not in spans
    assert "spans several nodes" in caplog.text  # loopback master, ranks elsewhere: said, not guessed
