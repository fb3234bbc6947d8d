"""Artifact identity: sha256 inventories, canonical manifests, schemas and safe paths."""
