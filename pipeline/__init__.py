"""cmfdeploy pipeline: the CMF library, the reference model, bundle, scoring and the CLI."""
