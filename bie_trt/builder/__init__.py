"""The build side, beside the runtime: checkpoint reading and quantising, key centering, the build
pipeline and the engine directory's README and CI workflow. Only the CLI imports it."""
