"""The conformance corpus: real Zarr v3 stores by other writers, with expected values.

For every store damacy must return exactly the expected values or refuse with an error that
names the unsupported feature: :class:`damacy.DtypeMismatch` for a data type it does not read,
:class:`damacy.UnsupportedOperation` for a codec.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import damacy

#: features damacy refuses on purpose, and the words its error must contain for each
REFUSED = [
    (re.compile(r"^complex"), "complex"),
    (re.compile(r"^string$"), "string"),
]


#: numcodecs' codecs damacy reads (the rest are refused naming the codec)
READ_NUMCODECS = {"zlib", "lz4", "bz2", "delta", "fixedscaleoffset", "astype"}


def _manifest(root):
    return json.loads((root / "EXPECTED.json").read_text())


def _expected_refusal(entry) -> tuple[str, type] | None:
    """The word a refusal must contain and its error class, or None when damacy must read
    the store."""
    for pattern, word in REFUSED:
        if pattern.match(str(entry["data_type"])):
            return word, damacy.DtypeMismatch
    for name in re.findall(r"numcodecs\.(\w+)", entry["codecs"]):
        if name not in READ_NUMCODECS:
            return f"numcodecs.{name}", damacy.UnsupportedOperation
    return None


def read_corpus(root, uri_of=str, read=None, workers=1):
    """Read every store of the corpus at ``root`` (store ``s`` at ``uri_of(root / s)``, read
    with ``read``, by default :func:`damacy.read`; ``workers`` stores at a time: a server's
    round trips overlap); returns (matched, refused, failures, must_read)."""
    from concurrent.futures import ThreadPoolExecutor

    read = read or damacy.read
    manifest = _manifest(root)

    def one(item):
        """(outcome, store, message): outcome "matched", "refused" or "failed"."""
        store, entry = item
        uri = uri_of(root / store)
        must_refuse = _expected_refusal(entry)
        try:
            if entry.get("expected_file") is None:
                # metadata-only arrays: every element is the fill value
                got = read(uri, tuple(slice(0, min(s, 64)) for s in entry["shape"]))
                fill = np.nan if entry["fill_value"] == "NaN" else entry["fill_value"]
                expected = np.full(got.shape, fill, dtype=got.dtype)
            else:
                got = read(uri)
                expected = np.load(root / entry["expected_file"], allow_pickle=False)
        except (damacy.UnsupportedOperation, damacy.DtypeMismatch) as e:
            if must_refuse is not None and must_refuse[0] in str(e) and isinstance(e, must_refuse[1]):
                return "refused", store, None
            return "failed", store, f"{store}: refused unexpectedly: {e}"
        except Exception as e:  # noqa: BLE001 - collect every failure, report them together
            return "failed", store, f"{store}: {type(e).__name__}: {e}"
        if must_refuse is not None:
            return "failed", store, f"{store}: read although it uses {must_refuse[0]}"
        tol = entry.get("tolerance")
        ok = got.shape == expected.shape and got.dtype == expected.dtype
        if ok:
            if tol is not None:
                ok = bool(np.allclose(got, expected, atol=float(tol), equal_nan=True))
            elif got.dtype.kind == "f":
                ok = bool(np.array_equal(got, expected, equal_nan=True))
            else:
                ok = bool(np.array_equal(got, expected))
        if ok:
            return "matched", store, None
        return "failed", store, f"{store}: values differ (got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape})"

    matched, refused, failures = [], [], []
    with ThreadPoolExecutor(workers) as pool:
        for outcome, store, message in pool.map(one, sorted(manifest.items())):
            if outcome == "matched":
                matched.append(store)
            elif outcome == "refused":
                refused.append(store)
            else:
                failures.append(message)
    must_read = [s for s, e in manifest.items() if _expected_refusal(e) is None]
    return matched, refused, failures, must_read


def test_conformance_corpus(conformance_dir):
    matched, refused, failures, must_read = read_corpus(conformance_dir)
    print(f"\nconformance: {len(matched)} match, {len(refused)} refused clearly, {len(failures)} fail")
    assert not failures, "\n".join(failures)
    assert len(matched) + len(refused) >= 200 and sorted(matched) == sorted(must_read)


def test_ngff_image_resolves_to_level_zero(conformance_dir):
    image = conformance_dir / "neuroglancer/testdata/datasource/zarr/ome_zarr/simple_0.5"
    if not image.is_dir():
        pytest.skip("the NGFF example is not in this corpus")
    assert np.array_equal(damacy.read(str(image)), np.arange(100, dtype="uint16").reshape(10, 10))
    level1 = damacy.read(str(image / "scale1" / "image"))
    assert level1.shape == (5, 5)
