"""NGFF plates at scale: a plate of 10,000 fields (100,000 in the slow set) written by
zarr-python, listed from the plate's and wells' metadata alone, sampled with every image's
metadata read only when first drawn, in bounded metadata caches."""

from __future__ import annotations

import os
import shutil
import string

import numpy as np
import pytest
import zarr

import damacy

from conftest import random_data


def _plate(root, rows: int, columns: int, fields: int):
    """A plate written by zarr-python: its group, each well's group and one field image per
    distinct data (field k holds the data of image k % 4); the other fields' files copied
    from those zarr-python wrote (a plate of 10^5 images in seconds)."""
    g = zarr.open_group(root, mode="w", zarr_format=3)
    row_names = list(string.ascii_uppercase[:rows])
    col_names = [str(c + 1) for c in range(columns)]
    wells = [{"path": f"{r}/{c}", "rowIndex": i, "columnIndex": j} for i, r in enumerate(row_names) for j, c in enumerate(col_names)]
    g.attrs["ome"] = {"version": "0.5", "plate": {"name": "screen", "rows": [{"name": r} for r in row_names], "columns": [{"name": c} for c in col_names], "wells": wells, "field_count": fields}}
    templates = []
    for k in range(4):
        img = g.create_group(f"_template{k}")
        img.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": [{"name": n, "type": "space"} for n in "zyx"], "datasets": [{"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1, 1, 1]}]}]}]}
        arr = img.create_array("0", shape=(4, 12 + k, 16), chunks=(4, 16, 16), dtype="uint16")
        arr[:] = random_data((4, 12 + k, 16), "uint16", seed=k)
        templates.append(root / f"_template{k}")
    for w in wells:
        well = g.create_group(w["path"])
        well.attrs["ome"] = {"version": "0.5", "well": {"images": [{"path": str(f)} for f in range(fields)]}}
        for f in range(fields):
            shutil.copytree(templates[(len(w["path"]) + f) % 4], root / w["path"] / str(f), copy_function=os.link)
    for t in templates:
        shutil.rmtree(t)
    return root


@pytest.mark.parametrize("rows, columns, fields", [pytest.param(10, 10, 100, id="10k"), pytest.param(20, 50, 100, id="100k", marks=pytest.mark.slow)])
def test_a_plate_of_many_images_is_listed_and_sampled_lazily(tmp_path, rows, columns, fields):
    uri = str(_plate(tmp_path / "plate.zarr", rows, columns, fields))
    from damacy_server.plan.resolve import Resolver

    md = Resolver()  # metadata with caches of its own, to count what it opens
    plate = damacy.open_plate(uri, metadata=md)
    assert plate.rows == tuple(string.ascii_uppercase[:rows]) and len(plate.columns) == columns
    images = plate.images
    assert len(images) == rows * columns * fields and images[0] == f"{uri}/A/1/0"
    assert plate.wells[-1].fields[-1] == f"{uri}/{plate.wells[-1].path}/{fields - 1}"
    assert md.cache.arrays.misses == 0  # no image opened to list them

    from damacy_server.read import default_metadata

    before = default_metadata().cache.arrays.misses
    sampler = damacy.RandomBoxes(images, (4, 8, 8), seed=1, samples_per_epoch=10**6, level=0)
    assert default_metadata().cache.arrays.misses == before  # a sampler over the plate reads no image yet
    cfg = damacy.Config(samples_per_batch=8, sample_shape=(4, 8, 8), dtype="u16", n_array_meta_cache=64)
    with damacy.Pipeline(cfg) as pipe:
        pipe.push(sampler)
        batch = pipe.pop()
        with batch:
            got = batch.numpy().copy()
            samples = batch.info.samples
        stats = pipe.stats_dict()["cache"]["arrays"]
    # the first batch opened what the first block of samples draws (64 at most), not the plate
    opened = default_metadata().cache.arrays.misses - before
    assert 0 < opened <= 2 * 64, opened  # an image and its level
    assert stats["entries"] <= 64  # the pipeline's metadata cache keeps its bound
    for x, s in zip(got, samples):
        assert s.level == 0 and np.array_equal(x, zarr.open_array(f"{s.uri}/0", mode="r")[s.selection]), s


def _fresh():
    """Metadata settings of a fresh cache (nothing read before)."""
    return damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache())


def _small_plate(root, wells):
    g = zarr.open_group(root, mode="w", zarr_format=3)
    g.attrs["ome"] = {"version": "0.5", "plate": {"rows": [{"name": "A"}, {"name": "B"}], "columns": [{"name": "1"}, {"name": "2"}], "wells": wells}}
    for w in wells:
        g.create_group(w["path"]).attrs["ome"] = {"version": "0.5", "well": {"images": [{"path": "0"}]}}
    return str(root)


def test_plate_wells_take_their_row_and_column_from_the_indices(tmp_path):
    uri = _small_plate(tmp_path / "p.zarr", [{"path": "x/y", "rowIndex": 1, "columnIndex": 0}, {"path": "A/2"}])
    plate = damacy.open_plate(uri, metadata=_fresh())
    assert [(w.path, w.row, w.column) for w in plate.wells] == [("x/y", "B", "1"), ("A/2", "A", "2")]  # the second: 0.4's row/column path


@pytest.mark.parametrize("row, column", [(True, 0), (0, 2), (-1, 0), (1.0, 0), (0, None)])
def test_a_plate_well_index_that_is_no_index_into_its_rows_or_columns_is_a_metadata_error(tmp_path, row, column):
    uri = _small_plate(tmp_path / "p.zarr", [{"path": "A/1", "rowIndex": row, "columnIndex": column}])
    with pytest.raises(damacy.MetadataError, match=r"NGFF plate well 'A/1': (rowIndex|columnIndex) .* is not an index into the plate's 2 (rows|columns)"):
        damacy.open_plate(uri, metadata=_fresh())
