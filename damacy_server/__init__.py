"""The damacy engine (resolve, plan, read, decode, assemble) and the damacyd daemon."""
