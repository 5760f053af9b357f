"""The spatial query types where the seed API's package keeps them (``damacy._spatial``);
they live in :mod:`damacy_protocol.spatial` and :mod:`damacy_server.spatial`."""

from damacy_protocol.limits import NgffLimits
from damacy_protocol.samples import ResolvedSpatialQuery
from damacy_protocol.spatial import NgffAxis, NgffLevel, Sampler, SpatialQuery
from damacy_server.spatial import NgffImage

__all__ = ["NgffAxis", "NgffImage", "NgffLevel", "NgffLimits", "ResolvedSpatialQuery", "Sampler", "SpatialQuery"]
