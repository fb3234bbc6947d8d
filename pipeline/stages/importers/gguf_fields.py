"""A GGUF file's metadata, read by key: what the importer and the vocabulary rebuild share."""

from pathlib import Path

from gguf import GGUFReader

from pipeline.ground.errors import UnsupportedModel


class GgufFields:
    """Typed access to GGUF metadata; a missing required key is an error naming it."""

    def __init__(self, reader: GGUFReader, path: Path):
        self._fields, self._path = reader.fields, path

    def keys(self) -> list[str]:
        return list(self._fields)

    def optional(self, key: str, default=None):
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def get(self, key: str):
        if key not in self._fields:
            raise UnsupportedModel(f"{self._path}: metadata key {key!r} is missing")
        return self._fields[key].contents()
