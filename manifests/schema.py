"""JSON Schemas of every manifest format, picked by the manifest's own `format` field.

The schemas live in `manifests/schemas/`; `common.schema.json` holds what all of them share
(file inventory, source chain, environment), referenced as `cmfdeploy:common#/$defs/...`.
A new stage adds its schema file and one row to `SCHEMA_FILES`.
"""

import json
from functools import cache
from importlib import resources

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from pipeline.ground.errors import IdentityError

SCHEMA_FILES = {
    "cmfdeploy.bundle/1": "bundle.schema.json",
    "cmfdeploy.coreml/1": "coreml.schema.json",
    "cmfdeploy.compressed/1": "compressed.schema.json",
    "cmfdeploy.alignment/1": "alignment.schema.json",
    "cmfdeploy.survey/1": "survey.schema.json",
    "cmfdeploy.survey_folder/1": "survey_folder.schema.json",
    "cmfdeploy.scores/1": "scores.schema.json",
    "cmfdeploy.release/1": "release.schema.json",
    "cmfdeploy.app_release/1": "app_release.schema.json",
    "cmfdeploy.preflight/1": "preflight.schema.json",
    "cmfdeploy.deployment/1": "deployment.schema.json",
}
COMMON_FILE = "common.schema.json"


def load_schema(file_name: str) -> dict:
    return json.loads(resources.files("manifests").joinpath("schemas", file_name).read_text())


# Schemas are package data that never change while the process runs; parsing them once
# keeps validate() cheap for stages that check many manifests.
@cache
def _validator(format_name: str) -> Draft202012Validator:
    schemas = [load_schema(COMMON_FILE)] + [load_schema(name) for name in SCHEMA_FILES.values()]
    registry = Registry().with_resources((s["$id"], Resource.from_contents(s)) for s in schemas)
    schema = load_schema(SCHEMA_FILES[format_name])
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, registry=registry)


def validate(manifest: dict, where: str = "manifest") -> None:
    """Check `manifest` against the schema its `format` names.

    Raises IdentityError naming `where` (usually the manifest's path), the JSON path of the
    first offending field and what is wrong with it. An unknown format is refused, never
    passed through.
    """
    if not isinstance(manifest, dict):
        raise IdentityError(f"{where}: a manifest must be a JSON object, got {type(manifest).__name__}")
    format_name = manifest.get("format")
    if format_name not in SCHEMA_FILES:
        raise IdentityError(f"{where}: field 'format' is {format_name!r}; known formats: {sorted(SCHEMA_FILES)}")
    errors = sorted(_validator(format_name).iter_errors(manifest), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        field = "/".join(str(p) for p in first.absolute_path) or "(top level)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise IdentityError(f"{where}: field {field!r}: {first.message}{more}")
