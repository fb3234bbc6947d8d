"""The ground floor: the CMF library, the reference model with its tokenizer, the bundle
format, errors and the Backend protocol (with `manifests/` beside it). It imports nothing
above it: not the runtimes (coreml/, mlx_runtime/), the stages or the CLI."""
