"""The stages floor: bundle, gates, survey, scoring, release, importers, and the backend
dispatch that reaches the runtimes below. The CLI (`pipeline.cli`) is the only floor above."""
