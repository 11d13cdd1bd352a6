import socket

from kvshare.ports import free_port, free_ports


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16
    listeners = []
    try:
        for port in ports:
            listener = socket.socket()
            listeners.append(listener)
            listener.bind(("127.0.0.1", port))
    finally:
        for listener in listeners:
            listener.close()


def test_free_port_is_not_listening() -> None:
    port = free_port()
    with socket.socket() as client:
        assert client.connect_ex(("127.0.0.1", port)) != 0
