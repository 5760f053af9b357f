"""Servers the object-store tests read from: moto's S3 API server, Azurite (Azure's blob
storage emulator), gcp-storage-emulator (Google Cloud Storage's), and an HTTP server that answers Range requests and can fail or stall on
purpose."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: the credentials moto accepts (any) and the region the tests use
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # a free port for the server (it cannot say which it took)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(proc, port: int, name: str) -> None:
    import socket
    import time

    deadline = time.monotonic() + 60
    while True:  # until it accepts connections (or has died)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{name} did not start (exit code {proc.poll()})") from None
            time.sleep(0.05)


def _upload_all(folder: Path, put) -> int:
    """``put(relative path, bytes)`` of every file below ``folder``, 32 at a time."""
    from concurrent.futures import ThreadPoolExecutor

    files = [path for path in sorted(Path(folder).rglob("*")) if path.is_file()]
    with ThreadPoolExecutor(32) as pool:  # the servers answer requests concurrently: a corpus goes up in parallel
        list(pool.map(lambda path: put(path.relative_to(folder).as_posix(), path.read_bytes()), files))
    return len(files)


#: Azurite's well-known development account (its documented key, not a secret)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_command() -> str | None:
    """Azurite's blob server as installed: ``DAMACY_AZURITE`` (a path to ``azurite-blob``),
    ``node_modules/.bin/azurite-blob`` under the checkout (``npm install azurite``, as .ci/run
    does), or ``azurite-blob`` on the PATH; None when none is there."""
    import os
    import shutil

    given = os.environ.get("DAMACY_AZURITE")
    if given:
        return given
    local = Path(__file__).resolve().parent.parent / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return str(local)
    return shutil.which("azurite-blob")


class AzuriteServer:
    """Azurite's blob service on 127.0.0.1, started as users start it (``azurite-blob``,
    Node.js), its data in a temporary folder; ``env`` holds what obstore (and so damacy)
    reads to reach it: the development account, ``AZURE_STORAGE_USE_EMULATOR`` and the
    emulator's address."""

    scheme = "az"

    def __init__(self, command: str) -> None:
        import subprocess
        import tempfile

        port = _free_port()
        self._data = tempfile.TemporaryDirectory(prefix="azurite-")
        self._proc = subprocess.Popen(
            [command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", self._data.name, "--silent", "--skipApiVersionCheck", "--loose"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_for_port(self._proc, port, "Azurite")
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {
            "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
            "AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": self.endpoint, "AZURE_ALLOW_HTTP": "true",
        }
        from azure.storage.blob import BlobServiceClient

        self.client = BlobServiceClient.from_connection_string(
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};"
        )

    def bucket(self, name: str) -> str:
        self.client.create_container(name)
        return name

    def upload(self, folder: Path, bucket: str, prefix: str) -> int:
        """Every file below ``folder`` to ``az://bucket/prefix/<relative path>``."""
        container = self.client.get_container_client(bucket)
        return _upload_all(folder, lambda rel, data: container.upload_blob(f"{prefix}/{rel}".lstrip("/"), data, overwrite=True))

    def stop(self) -> None:
        self._proc.kill()  # its data is a temporary folder: nothing to flush
        self._proc.wait()
        self._data.cleanup()


class GcsServer:
    """gcp-storage-emulator on 127.0.0.1, a process of its own (``tests/gcs_emulator.py``: the
    emulator with the answers of GCS it lacks), in memory; ``env`` points obstore at it
    (``GOOGLE_BASE_URL``, unsigned requests, plain HTTP)."""

    scheme = "gs"

    def __init__(self) -> None:
        import subprocess
        import sys

        port = _free_port()
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("gcs_emulator.py")), str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_for_port(self._proc, port, "gcp-storage-emulator")
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {"GOOGLE_BASE_URL": self.endpoint, "GOOGLE_SKIP_SIGNATURE": "true", "GOOGLE_ALLOW_HTTP": "true"}

    def _call(self, path: str, data: bytes, content_type: str) -> None:
        import urllib.request

        req = urllib.request.Request(f"{self.endpoint}{path}", data=data, headers={"Content-Type": content_type}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as answer:
            answer.read()

    def bucket(self, name: str) -> str:
        import json

        self._call("/storage/v1/b?project=damacy", json.dumps({"name": name}).encode(), "application/json")
        return name

    def upload(self, folder: Path, bucket: str, prefix: str) -> int:
        """Every file below ``folder`` to ``gs://bucket/prefix/<relative path>``."""
        from urllib.parse import quote

        def put(rel: str, data: bytes) -> None:
            name = quote(f"{prefix}/{rel}".lstrip("/"), safe="")
            self._call(f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}", data, "application/octet-stream")

        return _upload_all(folder, put)

    def stop(self) -> None:
        self._proc.kill()  # in memory: nothing to flush
        self._proc.wait()


class S3Server:
    """moto's S3 API server on 127.0.0.1 (a real HTTP server answering the S3 API), started as
    users start it: ``python -m moto.server``, a process of its own."""

    scheme = "s3"

    def __init__(self) -> None:
        import subprocess
        import sys

        port = _free_port()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {**S3_ENV, "AWS_ENDPOINT_URL": self.endpoint}
        _wait_for_port(self._proc, port, "moto's S3 server")
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def bucket(self, name: str) -> str:
        self.client.create_bucket(Bucket=name)
        return name

    def upload(self, folder: Path, bucket: str, prefix: str) -> int:
        """Every file below ``folder`` to ``s3://bucket/prefix/<relative path>``."""
        return _upload_all(folder, lambda rel, data: self.client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}".lstrip("/"), Body=data))

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except Exception:
            self._proc.kill()
            self._proc.wait()


class RangeServer:
    """Serves a folder over HTTP/1.1 with Range requests (``bytes=a-b``, ``a-``, ``-n``).

    ``fail[path] = [500, 500]`` answers the next requests for ``path`` with those statuses
    first; a path in ``stall`` is answered only once ``release`` is set. ``requests`` logs
    (method, path, status) of every request answered (before its answer goes) or stalled, ``ranges`` (path, Range
    header) of every GET; ``suffix_peak`` is the most suffix-range requests (``bytes=-n``: shard indexes at the end) in flight at once."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.fail: dict[str, list[int]] = {}
        self.stall: set[str] = set()
        self.release = threading.Event()
        self.stalled = threading.Event()
        self.requests: list[tuple[str, str, int]] = []
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of every GET
        self.lock = threading.Lock()
        self.suffix_inflight = self.suffix_peak = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._suffix = False
                self._answer(body=False)

            def do_GET(self) -> None:
                self._suffix = (self.headers.get("Range") or "").strip().startswith("bytes=-")
                with server.lock:
                    server.ranges.append((unquote(urlsplit(self.path).path), (self.headers.get("Range") or "").strip()))
                    server.suffix_inflight += self._suffix
                    server.suffix_peak = max(server.suffix_peak, server.suffix_inflight)
                try:
                    self._answer(body=True)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout under test)
                finally:
                    self._log(None, None)  # no longer in flight, if not said already

            def _log(self, path: str | None, status: int | None) -> None:
                # logged, and out of flight, before the answer goes: a client that holds the
                # answer finds it in ``requests``, and its next request never counts this one
                with server.lock:
                    if path is not None:
                        server.requests.append((self.command, path, status))
                    server.suffix_inflight -= self._suffix
                    self._suffix = False

            def _answer(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                with server.lock:
                    queued = server.fail.get(path)
                    status = queued.pop(0) if queued else None
                if path in server.stall:
                    with server.lock:
                        server.requests.append((self.command, path, 0))
                    server.stalled.set()
                    server.release.wait(60)
                if status is not None:
                    return self._status(status, path)
                file = (server.root / path.lstrip("/")).resolve()
                if not file.is_file() or server.root.resolve() not in file.parents:
                    return self._status(404, path)
                data = file.read_bytes()
                start, end, code = 0, len(data), 200
                ranged = self.headers.get("Range")
                if ranged:
                    m = re.fullmatch(r"bytes=(\d*)-(\d*)", ranged.strip())
                    if not m or (not m.group(1) and not m.group(2)):
                        return self._status(416, path)
                    if m.group(1):
                        start = int(m.group(1))
                        end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
                    else:
                        start = max(0, len(data) - int(m.group(2)))
                    if start >= len(data):
                        return self._status(416, path)
                    code = 206
                self._log(path, code)
                self.send_response(code)
                self.send_header("Content-Length", str(end - start))
                self.send_header("Accept-Ranges", "bytes")
                if code == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.end_headers()
                if body:
                    self.wfile.write(data[start:end])

            def _status(self, status: int, path: str) -> None:
                self._log(path, status)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def statuses(self, path: str) -> list[int]:
        with self.lock:
            return [s for _, p, s in self.requests if p == path]

    def stop(self) -> None:
        self.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()
