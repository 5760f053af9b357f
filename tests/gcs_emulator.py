"""gcp-storage-emulator (PyPI) on loopback, with what Google Cloud Storage answers to object
reads and the emulator leaves out, that every GCS client built on Rust's object_store
(obstore, so damacy) needs: the ``ETag`` and ``Last-Modified`` headers, suffix ranges
(``Range: bytes=-n``, the last n bytes: how a shard index at an object's end is read), and
a percent-encoded bucket name in the path (object_store encodes ``-`` as ``%2D``); and a
listen backlog for many clients at once (it answers one request at a time, and refused
connections past the socket's default 5 waiting). In memory, its state file (read only when
a server starts on a data folder) is not rewritten whole after every upload: that made
uploading n objects take O(n^2).

Run as ``python tests/gcs_emulator.py PORT`` (tests/object_servers.GcsServer does); the rest
is the emulator's own server, in memory."""

from __future__ import annotations

import datetime
import email.utils
import re
import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download
_SUFFIX = re.compile(r"\s*bytes=-([0-9]+)\s*")


def download(request, response, storage, *args, **kwargs):
    bucket, name = request.params["bucket_name"], request.params["object_id"]
    headers = request._request_handler.headers
    suffix = _SUFFIX.fullmatch(headers.get("range") or "")
    if suffix:  # the last n bytes, as the range from the object's size less n that the emulator reads
        try:
            size = len(storage.get_file(bucket, name))
        except Exception:  # noqa: BLE001 - a missing object: the emulator's own answer (404)
            size = None
        if size is not None:
            headers.replace_header("range", f"bytes={max(0, size - int(suffix.group(1)))}-")
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(bucket, name)
    except Exception:  # noqa: BLE001 - a missing object: no headers to add
        return
    response["ETag"] = f'"{obj.get("etag") or obj.get("md5Hash")}"'
    updated = datetime.datetime.fromisoformat(obj["updated"].replace("Z", "+00:00"))
    response["Last-Modified"] = email.utils.format_datetime(updated, usegmt=True)


objects.download = download  # before the server's routes are built from the handlers

if __name__ == "__main__":
    from urllib.parse import unquote

    from gcp_storage_emulator import server

    _handle = server.Router.handle

    def handle(self, method):
        head, sep, rest = self._request_handler.path.partition("?")
        parts = head.split("/", 2)  # "", bucket (or an API's first segment), the rest
        if len(parts) > 1:
            parts[1] = unquote(parts[1])
        self._request_handler.path = "/".join(parts) + sep + rest
        return _handle(self, method)

    server.Router.handle = handle
    server.server.HTTPServer.request_queue_size = 256  # (http.server's)
    from gcp_storage_emulator.storage import Storage

    Storage._write_config_to_file = lambda self: None
    create_server = server.create_server

    create_server("127.0.0.1", int(sys.argv[1]), in_memory=True).run()
