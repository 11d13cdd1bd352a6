"""Overwrite one object of a Mooncake store with wrong bytes, from a process of its own
(two Mooncake clients in one process copy memory directly, unlike two hosts).

    python -m tests.kvpool.remote_corrupt mooncake://HOST:PORT NAME BYTE_OFFSET
"""

from __future__ import annotations

import sys

from kvshare.kvpool.remote import parse_remote_url


def main(url: str, name: str, offset: int) -> int:
    from mooncake.store import MooncakeDistributedStore

    host, port = parse_remote_url(url)
    store = MooncakeDistributedStore()
    status = store.setup(
        {
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "master_server_addr": f"{host}:{port}",
            "global_segment_size": 0,
            "local_buffer_size": 16 << 20,
        }
    )
    if status != 0:
        return 1
    data = bytearray(store.get(name))
    if len(data) <= offset:
        return 2
    data[offset] ^= 0xFF
    if store.upsert(name, bytes(data)) != 0:
        return 3
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
