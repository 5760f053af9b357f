"""Is a damacyd answering at an endpoint? (a hello-less ping, for tools and the daemon itself)"""

from __future__ import annotations

import zmq

from damacy_protocol import messages as m


def ping(endpoint: str, timeout_s: float = 1.0, curve_server_key: bytes | None = None) -> bool:
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_server_key is not None:
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve_server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    try:
        sock.connect(endpoint)
        sock.send(m.encode(m.Ping(id=0)))
        return bool(sock.poll(int(timeout_s * 1000)))
    except zmq.ZMQError:
        return False
    finally:
        sock.close(0)
