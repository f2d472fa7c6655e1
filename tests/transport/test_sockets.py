"""Address helpers of transport.sockets."""

from rollfleet.transport.sockets import join_host_port, split_host_port


def test_host_port_is_split_and_joined_with_ipv6_hosts_in_brackets():
    assert split_host_port("node-a:29500") == ("node-a", 29500)
    assert split_host_port("[::1]:0") == ("::1", 0)
    assert split_host_port(" 10.0.0.1:7 ") == ("10.0.0.1", 7)
    for text in ("node-a", ":5", "[]:5", "h:65536", "h:-1", "h:x", "h:*"):
        assert split_host_port(text) is None, text
    assert split_host_port("h:*", any_port=True) == ("h", 0)  # zmq's "any free port"
    assert join_host_port("::1", 5) == "[::1]:5" and join_host_port("node-a", "*") == "node-a:*"
    for host, port in (("::1", 5), ("node-a", 0)):
        assert split_host_port(join_host_port(host, port)) == (host, port)
