"""Resolve and plan: samples -> array metadata (resolve) -> per-axis selections (selection)
-> deduplicated read units and one copy table per array (planner, units) -> reads, nearby
ranges merged and cached units taken out (reads). The plan is a value an executor executes."""
