"""A static file server for the object-store benchmark: HTTP/1.1 keep-alive, Range GETs and
HEAD answered with ``sendfile`` (the kernel copies the bytes), each request answered after
a fixed delay, the round trip of a cloud region.

Run as ``python -m bench.http_server ROOT --port 0 --latency-ms 10``; it prints its port on
the first line. A separate process, so its work is not counted as a reader's.
"""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import os
import re
import sys

_RANGE = re.compile(rb"bytes=(\d*)-(\d*)")


class Server:
    def __init__(self, root: str, latency_s: float) -> None:
        self.root = os.path.realpath(root)
        self.latency_s = latency_s
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, target, _ = lines[0].split(b" ", 2)
                headers = {}
                for line in lines[1:]:
                    if b":" in line:
                        k, v = line.split(b":", 1)
                        headers[k.strip().lower()] = v.strip()
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                self.requests += 1
                await self.answer(writer, sock, method, target.split(b"?", 1)[0].decode(), headers)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def answer(self, writer, sock, method: bytes, target: str, headers: dict) -> None:
        path = os.path.realpath(os.path.join(self.root, target.lstrip("/")))
        if not path.startswith(self.root + os.sep) or not os.path.isfile(path):
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            return
        size = os.path.getsize(path)
        start, end, status = 0, size, b"200 OK"
        ranged = headers.get(b"range")
        if ranged:
            m = _RANGE.fullmatch(ranged)
            if m and (m.group(1) or m.group(2)):
                if m.group(1):
                    start = int(m.group(1))
                    end = min(size, int(m.group(2)) + 1) if m.group(2) else size
                else:
                    start = max(0, size - int(m.group(2)))
                if start >= size:
                    writer.write(b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    return
                status = b"206 Partial Content"
        head = [
            b"HTTP/1.1 " + status,
            b"Content-Length: %d" % (end - start),
            b"Accept-Ranges: bytes",
            b"Last-Modified: " + email.utils.formatdate(os.path.getmtime(path), usegmt=True).encode(),
        ]
        if status.startswith(b"206"):
            head.append(b"Content-Range: bytes %d-%d/%d" % (start, end - 1, size))
        writer.write(b"\r\n".join(head) + b"\r\n\r\n")
        await writer.drain()
        if method == b"GET" and end > start:
            loop = asyncio.get_running_loop()
            with open(path, "rb") as f:
                await loop.sendfile(writer.transport, f, start, end - start)


async def serve(root: str, port: int, latency_s: float) -> None:
    server = Server(root, latency_s)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", port, backlog=1024, limit=1 << 16)
    print(srv.sockets[0].getsockname()[1], flush=True)
    async with srv:
        await srv.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.http_server")
    ap.add_argument("root")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency-ms", type=float, default=10.0)
    args = ap.parse_args(argv)
    try:
        import uvloop  # noqa: F401 - faster where installed

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ModuleNotFoundError:
        pass
    asyncio.run(serve(args.root, args.port, args.latency_ms / 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
