"""cmfdeploy's own floors: `ground/` (CMF library, reference model, bundle format, errors,
the Backend protocol), `stages/` (bundle, gates, survey, scoring, release) and `cli/`.
The runtimes, `coreml/` and `mlx_runtime/`, sit between ground and stages."""
