"""Release: the deployed compressed package, the FP32 packages, their gates and the survey, packed to ship.

    manifest = make_release("out/survey", "dist")        # -> dist/<model>-<recipe>/

    dist/<model>-<recipe>/
      manifest.json            cmfdeploy.release/1: inventory, packages, identity chain
      metadata.json            the descriptor an app reads (kind, assets, compression, context length),
                               after Apple's Core AI export bundles
      RELEASE.md               how to load it on a Mac; interface, tolerances, gate backend, sizes, chain
      tokenizer/               tokenizer.json and tokenizer_config.json (chat template, special ids)
      packages/<recipe>/       the compressed package (model.mlpackage + its manifest)
      packages/fp32-<kind>/    the FP32 package(s) it was made from / shipped beside it
      gates/<same names>/      each package's alignment folder (report, markdown, plot, manifest)
      survey/                  survey.json, survey.md, size_vs_error.png

Every included package must have passed its gate, and each gate must be of exactly that
package (by manifest sha256); anything else is refused before a byte is copied. Nothing in a
release names a path of the machine that built it: artifacts name each other by relative
paths, so a release copied anywhere verifies on its own (its link back to the build tree is
then reported as not available).
`verify_release` (registered for `cmfdeploy verify-artifact`) re-checks all of it offline:
every file's sha256, every package against its own manifest, and every binding of the
chain FP32 package -> compressed package -> its gate, plus the compressed package's
binding to the FP32 gate and the survey's record of both.
"""

import json
import shutil
from pathlib import Path

from coreml import manifest as package_manifest
from coreml.interfaces import package_interface
from coreml.kinds import package_kind
from coreml.layout import enumerated_lengths, logit_outputs
from pipeline.stages.survey import REPORT_NAME as SURVEY_NAME
from pipeline.stages.survey import load_survey, passed_gate_of
from manifests.chain import upstream_path
from manifests.identity import (
    MANIFEST_NAME,
    Manifest,
    artifact_source,
    check_files,
    environment,
    inventory,
    load_manifest,
    read_json,
    sha256_file,
    write_json,
)
from manifests.output import staged_output
from pipeline.stages.signing import sign_manifest
from pipeline.stages import gates
from pipeline.ground.errors import CmfdeployError, IdentityError
from pipeline.stages.backends import shipped_entry
from pipeline.stages.disk import check_disk
from pipeline.stages.release_copies import check_release_copies

FORMAT = "cmfdeploy.release/1"
SURVEY_FILES = (SURVEY_NAME, "survey.md", "size_vs_error.png")
METADATA_NAME = "metadata.json"
TOKENIZER_DIR = "tokenizer"


class ReleaseError(CmfdeployError):
    """What was asked for cannot be released (no passing recipe, an ungated package, a mismatch)."""


def _gated(package_dir: Path, gate_dir: Path) -> tuple[Manifest, Manifest]:
    """The verified package and its passed gate; refuses a gate of another package."""
    package = package_manifest.verify_package(package_dir)
    return package, Manifest(Path(gate_dir), passed_gate_of(package_dir, gate_dir))


def _entry(role: str, name: str, package: Manifest, gate: Manifest) -> dict:
    return {
        "role": role,
        "name": name,
        "path": f"packages/{name}",
        "format": package.format,
        "kind": package["package"]["kind"],
        "manifest_sha256": sha256_file(package.path / MANIFEST_NAME),
        "source_manifest_sha256": package["source"]["manifest_sha256"],
        "size_bytes": package_manifest.programs_bytes(package.path, package.data),
        **({"pieces_sha256": package_manifest.pieces_sha256(package.data)} if "pieces" in package["package"] else {}),
        "gate": {
            "path": f"gates/{name}",
            "manifest_sha256": sha256_file(gate.path / MANIFEST_NAME),
            "report_sha256": sha256_file(gate.path / gates.REPORT_NAME),
            "passed": True,
            "recipe": gate["recipe"],
            "backend": gate["candidate_backend"],
            "tolerance": read_json(gate.path / gates.REPORT_NAME)["tolerance"],
            "summary": gate["summary"],
        },
    }


def model_name(fp32_package: Manifest) -> str:
    """The source CMF's file stem, read from the FP32 package's bundle."""
    bundle = upstream_path(fp32_package.path, fp32_package["source"])
    try:
        return Path(read_json(bundle / MANIFEST_NAME)["source"]["file"]).stem
    except IdentityError as error:
        raise ReleaseError(
            f"{fp32_package.path}: cannot name the model from its bundle ({error}); pass name="
        ) from None


def make_release(
    survey_dir: str | Path,
    out_root: str | Path = "dist",
    *,
    recipe: str | None = None,
    packages: list[tuple[str | Path, str | Path]] = (),
    name: str | None = None,
    force: bool = False,
    sign_key: str | Path | None = None,
    deployment: str | Path | None = None,
) -> Manifest:
    """Pack the survey's deployed recipe (or `recipe`) into `out_root/<model>-<recipe>/`.

    `packages` adds further FP32 packages (e.g. the stateless one), each with its passed
    alignment folder. `deployment` (`pipeline.stages.deploy`) ships its package as the one an
    app loads (role "shipped": the interface, metadata.json and RELEASE.md are its), with the
    surveyed package beside it; the FP32 package it was compressed from must be among
    `packages`. `sign_key` (an Ed25519 private key file) adds a detached signature over the
    release manifest (`pipeline.stages.signing`). Returns the release manifest.
    """
    survey_dir = Path(survey_dir)
    survey = load_survey(survey_dir)
    if deployment is not None:
        deployment = _passed_deployment(Path(deployment), survey_dir, recipe)
        recipe = deployment["recipe"]
    recipe = recipe or survey["deployed"]["recipe"]
    if recipe is None:
        raise ReleaseError(f"{survey_dir / SURVEY_NAME}: field 'deployed.recipe' is null: no recipe passed its gate")
    records = {r["name"]: r for r in survey["recipes"]}
    record = records.get(recipe)
    if record is None or record["status"] != "measured":
        raise ReleaseError(f"{survey_dir / SURVEY_NAME}: recipe {recipe!r} was not measured by this survey "
                           f"(measured: {sorted(n for n, r in records.items() if r['status'] == 'measured')})")

    fp32 = survey["fp32"]
    # The survey names its FP32 package and gate relative to its own folder.
    included = [("fp32", f"fp32-{fp32['package']['kind']}", survey_dir / fp32["package"]["path"],
                 survey_dir / fp32["gate"]["path"]),
                ("deployed" if recipe == survey["deployed"]["recipe"] else "compressed", recipe,
                 survey_dir / record["package"]["path"], survey_dir / "gates" / recipe)]
    for package_dir, gate_dir in packages:
        extra = load_manifest(package_dir)
        included.append(("fp32", f"fp32-{extra['package']['kind']}", Path(package_dir), Path(gate_dir)))
    if deployment is not None:
        deployed_package = deployment.path / deployment["package"]["path"]
        included.append(("shipped", f"{recipe}-{deployment['package']['kind']}", deployed_package,
                          deployment.path / deployment["gate"]["path"]))
        _check_deployment_source(deployed_package, included)
    checked = [(role, label, *_gated(package_dir, gate_dir)) for role, label, package_dir, gate_dir in included]
    labels = [label for _, label, _, _ in checked]
    if len(set(labels)) != len(labels):
        raise ReleaseError(f"{survey_dir}: two included packages would share the folder name {labels}")
    _check_survey_bindings(survey_dir, survey, record, checked)

    fp32_package = checked[0][2]
    name = name or model_name(fp32_package)
    out_dir = Path(out_root) / f"{name}-{recipe}"
    entries = [_entry(role, label, package, gate) for role, label, package, gate in checked]
    check_disk("release", out_dir, survey_dir / fp32["package"]["path"], units=len(checked))
    with staged_output(out_dir, force) as staging:
        for (_, label, package, gate), entry in zip(checked, entries):
            shutil.copytree(package.path, staging / entry["path"])
            shutil.copytree(gate.path, staging / entry["gate"]["path"])
        (staging / "survey").mkdir()
        for file_name in SURVEY_FILES:
            shutil.copy2(survey_dir / file_name, staging / "survey" / file_name)
        shipped = next(package for role, _, package, _ in checked if role == "shipped") if deployment else checked[1][2]
        tokenizer = package_manifest.carry_tokenizer(shipped.path, staging / TOKENIZER_DIR)
        manifest = {
            "format": FORMAT,
            "status": "incomplete",
            "source": artifact_source(survey_dir / record["package"]["path"], relative_to=out_dir),
            "model": name,
            "recipe": recipe,
            "deployed": recipe == survey["deployed"]["recipe"],
            "interface": shipped["package"],
            "special_tokens": shipped["special_tokens"],
            "architecture": shipped["architecture"],
            "packages": entries,
            "survey": {"path": f"survey/{SURVEY_NAME}", "sha256": sha256_file(survey_dir / SURVEY_NAME),
                       "deployed_rule": survey["deployed"]["rule"], "target": _release_target_name(survey, recipe),
                       **({"fallback": survey["deployed"]["fallback"]}
                          if recipe == survey["deployed"]["recipe"] and "fallback" in survey["deployed"] else {})},
            "chain": identity_chain(survey, entries),
            "tokenizer": tokenizer,
        }
        write_json(staging / MANIFEST_NAME, manifest)
        write_json(staging / METADATA_NAME, release_metadata(manifest, record))
        (staging / "RELEASE.md").write_text(release_markdown(manifest, survey))
        files = inventory(staging)
        manifest.update(files=files, environment=environment(package_manifest.ENVIRONMENT_PACKAGES),
                        inventory={"count": len(files), "total_bytes": sum(f["bytes"] for f in files.values())},
                        status="complete")
        write_json(staging / MANIFEST_NAME, manifest)
        verify_release(staging)  # the copies are what the sources were
        if sign_key is not None:
            sign_manifest(staging, sign_key)
    return Manifest(out_dir, manifest)


def _passed_deployment(path: Path, survey_dir: Path, recipe: str | None) -> Manifest:
    """The verified deployment at `path`: passed, of this survey, of `recipe` where one is asked."""
    from pipeline.stages.deploy import verify_deployment

    deployment = verify_deployment(path)
    where = path / MANIFEST_NAME
    if not deployment["gate"]["passed"]:
        raise ReleaseError(f"{where}: field 'gate.passed' is false: its package failed its gate "
                           f"({path / deployment['gate']['path'] / 'alignment.md'})")
    survey_sha = sha256_file(survey_dir / SURVEY_NAME)
    if deployment["survey"]["sha256"] != survey_sha:
        raise ReleaseError(f"{where}: field 'survey.sha256' is {deployment['survey']['sha256']}, but "
                           f"{survey_dir / SURVEY_NAME} has sha256 {survey_sha}: a deployment of another survey")
    if recipe is not None and recipe != deployment["recipe"]:
        raise ReleaseError(f"{where}: field 'recipe' is {deployment['recipe']!r}; the release asked for {recipe!r}")
    return deployment


def _check_deployment_source(deployed_package: Path, included: list) -> None:
    """The deployed package's FP32 source is one of the packages released with it (its chain
    and its fp32_alignment binding then verify inside the release)."""
    source_sha = read_json(deployed_package / MANIFEST_NAME)["source"]["manifest_sha256"]
    if not any(role == "fp32" and sha256_file(Path(p) / MANIFEST_NAME) == source_sha for role, _, p, _ in included):
        raise ReleaseError(f"{deployed_package / MANIFEST_NAME}: field 'source.manifest_sha256' is {source_sha}, the "
                           "manifest of no FP32 package in this release: pass the package it was compressed from "
                           "and its gate with packages= (`--package PACKAGE GATE`)")


def _check_survey_bindings(survey_dir: Path, survey: dict, record: dict, checked: list) -> None:
    """The survey's record names exactly the packages and gates being released."""
    where = survey_dir / SURVEY_NAME
    (_, _, fp32_package, fp32_gate), (_, _, compressed, gate) = checked[:2]
    expected = [
        ("fp32.package.manifest_sha256", survey["fp32"]["package"]["manifest_sha256"],
         fp32_package.path / MANIFEST_NAME),
        ("fp32.gate.manifest_sha256", survey["fp32"]["gate"]["manifest_sha256"], fp32_gate.path / MANIFEST_NAME),
        (f"recipes[{record['name']}].package.manifest_sha256", record["package"]["manifest_sha256"],
         compressed.path / MANIFEST_NAME),
        (f"recipes[{record['name']}].gate.report.sha256", record["gate"]["report"]["sha256"],
         gate.path / gates.REPORT_NAME),
    ]
    for field, recorded, path in expected:
        _expect(where, field, recorded, path)


def identity_chain(survey: dict, entries: list[dict]) -> list[dict]:
    """From the source CMF to the released package, each link by the sha256 that binds it."""
    fp32, compressed = entries[0], entries[1]
    return [
        {"link": "source CMF", "sha256": survey["fixtures"]["checkpoint_sha256"],
         "bound_by": "the reference fixtures every gate compared against were made from it"},
        {"link": "FP32 bundle manifest", "sha256": fp32["source_manifest_sha256"],
         "bound_by": f"{fp32['path']}/manifest.json source.manifest_sha256"},
        {"link": "FP32 package manifest", "sha256": fp32["manifest_sha256"],
         "bound_by": f"{compressed['path']}/manifest.json source.manifest_sha256"},
        {"link": "FP32 gate report", "sha256": fp32["gate"]["report_sha256"],
         "bound_by": f"{compressed['path']}/manifest.json fp32_alignment.report_sha256"},
        {"link": "compressed package manifest", "sha256": compressed["manifest_sha256"],
         "bound_by": f"{compressed['gate']['path']}/manifest.json source.manifest_sha256"},
        {"link": "compressed gate report", "sha256": compressed["gate"]["report_sha256"],
         "bound_by": f"survey/{SURVEY_NAME} recipes[{compressed['name']}].gate.report.sha256"},
    ]


# --- verification -----------------------------------------------------------------------------


def _expect(where: Path, field: str, recorded: str, path: Path) -> None:
    digest = sha256_file(path)
    if digest != recorded:
        raise IdentityError(f"{where}: field {field!r} is {recorded}, but {path} has sha256 {digest}")


def verify_release(path: str | Path, hashes: bool = True) -> Manifest:
    """Offline check of a release folder; IdentityError names the first file or field that differs."""
    path = Path(path)
    manifest = load_manifest(path, FORMAT)
    check_files(path, manifest["files"], hashes=hashes)
    where = path / MANIFEST_NAME
    for index, entry in enumerate(manifest["packages"]):
        package_dir, gate_dir = path / entry["path"], path / entry["gate"]["path"]
        package = package_manifest.verify_package(package_dir, hashes=hashes)
        gate = gates.verify_alignment(gate_dir, hashes=hashes)
        field = f"packages/{index}"
        _expect(where, f"{field}/manifest_sha256", entry["manifest_sha256"], package_dir / MANIFEST_NAME)
        _expect(where, f"{field}/gate/manifest_sha256", entry["gate"]["manifest_sha256"], gate_dir / MANIFEST_NAME)
        _expect(where, f"{field}/gate/report_sha256", entry["gate"]["report_sha256"], gate_dir / gates.REPORT_NAME)
        _expect(gate_dir / MANIFEST_NAME, "source.manifest_sha256", gate["source"]["manifest_sha256"],
                package_dir / MANIFEST_NAME)
        if not gate["passed"]:
            raise IdentityError(
                f"{gate_dir / MANIFEST_NAME}: field 'passed' is false; a release holds passed gates only")
        if package["source"]["manifest_sha256"] != entry["source_manifest_sha256"]:
            raise IdentityError(f"{where}: field '{field}/source_manifest_sha256' differs from "
                                f"{package_dir / MANIFEST_NAME} source.manifest_sha256")
    fp32, compressed = manifest["packages"][0], manifest["packages"][1]
    compressed_manifest = read_json(path / compressed["path"] / MANIFEST_NAME)
    _expect(path / compressed["path"] / MANIFEST_NAME, "source.manifest_sha256",
            compressed_manifest["source"]["manifest_sha256"], path / fp32["path"] / MANIFEST_NAME)
    _expect(path / compressed["path"] / MANIFEST_NAME, "fp32_alignment.report_sha256",
            compressed_manifest["fp32_alignment"]["report_sha256"], path / fp32["gate"]["path"] / gates.REPORT_NAME)
    shipped = shipped_entry(manifest)
    if shipped["role"] == "shipped":
        _check_shipped(path, manifest, shipped)
    _check_tokenizer(path, manifest)
    _check_metadata(path, manifest)
    survey = read_json(path / manifest["survey"]["path"])
    record = next((r for r in survey["recipes"] if r["name"] == manifest["recipe"]), None)
    if record is None or record["status"] != "measured":
        raise IdentityError(f"{path / manifest['survey']['path']}: no measured record of recipe {manifest['recipe']!r}")
    _expect(path / manifest["survey"]["path"], f"recipes[{manifest['recipe']}].package.manifest_sha256",
            record["package"]["manifest_sha256"], path / compressed["path"] / MANIFEST_NAME)
    _expect(path / manifest["survey"]["path"], f"recipes[{manifest['recipe']}].gate.report.sha256",
            record["gate"]["report"]["sha256"], path / compressed["gate"]["path"] / gates.REPORT_NAME)
    check_release_copies(path, manifest, survey, record)
    return Manifest(path, manifest)


def _check_shipped(path: Path, manifest: dict, shipped: dict) -> None:
    """The shipped package is bound to an FP32 package and gate of this release, as the surveyed
    one is, its gate judged the release's recipe, and it carries the surveyed package's codes."""
    from coreml.recipes.compress import code_digests

    where, package_dir = path / MANIFEST_NAME, path / shipped["path"]
    compressed_manifest = read_json(package_dir / MANIFEST_NAME)
    source = next((e for e in manifest["packages"] if e["role"] == "fp32"
                   and e["manifest_sha256"] == compressed_manifest["source"]["manifest_sha256"]), None)
    if source is None:
        raise IdentityError(f"{package_dir / MANIFEST_NAME}: field 'source.manifest_sha256' is the manifest of no FP32 "
                            "package of this release")
    _expect(package_dir / MANIFEST_NAME, "fp32_alignment.report_sha256",
            compressed_manifest["fp32_alignment"]["report_sha256"], path / source["gate"]["path"] / gates.REPORT_NAME)
    if shipped["gate"]["recipe"] != manifest["recipe"]:
        raise IdentityError(f"{where}: the shipped package's gate judged recipe {shipped['gate']['recipe']!r}, "
                            f"the release's is {manifest['recipe']!r}")
    surveyed = manifest["packages"][1]
    ours, theirs = code_digests(package_dir), code_digests(path / surveyed["path"])
    differ = sorted(name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name))
    if differ:
        raise IdentityError(f"{package_dir}: the codes of {', '.join(differ[:4])} differ from the surveyed package "
                            f"{path / surveyed['path']}'s: the shipped package is not what the survey measured")


def _check_tokenizer(path: Path, manifest: dict) -> None:
    """tokenizer/ holds the files the release's `tokenizer` record names, and every package
    records that same identity (the bundle's)."""
    record, where = manifest.get("tokenizer"), path / MANIFEST_NAME
    if record is None:
        return
    _expect(where, "tokenizer.sha256", record["sha256"], path / TOKENIZER_DIR / package_manifest.TOKENIZER_JSON)
    for entry in manifest["packages"]:
        recorded = (read_json(path / entry["path"] / MANIFEST_NAME).get("tokenizer") or {}).get("sha256")
        if recorded != record["sha256"]:
            raise IdentityError(f"{where}: field 'tokenizer.sha256' is {record['sha256']}, but "
                                f"{path / entry['path'] / MANIFEST_NAME} records tokenizer sha256 {recorded}")


def _check_metadata(path: Path, manifest: dict) -> None:
    """metadata.json is the descriptor these packages and this tokenizer give (its bytes are
    in the inventory; this checks it says what the manifest says)."""
    metadata_path = path / METADATA_NAME
    if not metadata_path.is_file():
        raise IdentityError(f"{path}: no {METADATA_NAME} (the release's descriptor)")
    survey = read_json(path / manifest["survey"]["path"])
    record = next(r for r in survey["recipes"] if r["name"] == manifest["recipe"])
    if read_json(metadata_path) != json.loads(json.dumps(release_metadata(manifest, record))):
        raise IdentityError(f"{metadata_path}: differs from what {path / MANIFEST_NAME} and the survey describe")


# --- metadata.json and RELEASE.md -------------------------------------------------------------------


def release_metadata(manifest: dict, record: dict) -> dict:
    """The release's descriptor, in the spirit of Apple's Core AI export bundles (`metadata.json`
    beside the model, the tokenizer saved in `tokenizer/`): what an app needs to load it."""
    interface = manifest["interface"]
    deployed = shipped_entry(manifest)
    return {
        "kind": "causal-language-model",
        "model": manifest["model"],
        "context_length": interface["context"],
        "minimum_deployment_target": interface["minimum_deployment_target"],
        "assets": {
            "model": _model_asset(deployed, interface),
            "model_kind": interface["kind"],
            "tokenizer": f"{TOKENIZER_DIR}/{package_manifest.TOKENIZER_JSON}",
            "tokenizer_config": (f"{TOKENIZER_DIR}/{package_manifest.TOKENIZER_CONFIG}"
                                 if (manifest.get("tokenizer") or {}).get("has_config") else None),
            "packages": {e["name"]: {"path": _model_asset(e, interface), "kind": e["kind"], "role": e["role"]}
                         for e in manifest["packages"]},
            **({"pieces": [{"path": f"{deployed['path']}/{piece['name']}", "layers": piece["piece"]["layers"],
                            "takes": piece["piece"]["takes"], "gives": piece["piece"]["gives"], "sha256": digest}
                           for piece, digest in zip(interface["pieces"], deployed["pieces_sha256"])]}
               if "pieces" in interface else {}),
        },
        "compression": {"recipe": manifest["recipe"], "params": record["params"], **_shipped_size(manifest, record)},
        "special_tokens": manifest["special_tokens"],
    }


def _model_asset(entry: dict, interface: dict) -> str:
    """Where a package's program is in the release: its .mlpackage, or the folder of a split
    package's pieces (`pieces` lists them in order)."""
    return entry["path"] if "pieces" in interface else f"{entry['path']}/{interface['name']}"


def _shipped_size(manifest: dict, record: dict) -> dict:
    """The shipped package's bytes, and their ratio to the FP32 package it was compressed from."""
    shipped = shipped_entry(manifest)
    if shipped["role"] != "shipped":
        return {"size_bytes": record["package"]["size_bytes"], "bytes_vs_fp32": record["package"]["bytes_vs_fp32"]}
    source = next(e for e in manifest["packages"] if e["manifest_sha256"] == shipped["source_manifest_sha256"])
    return {"size_bytes": shipped["size_bytes"], "bytes_vs_fp32": shipped["size_bytes"] / source["size_bytes"]}


def release_folder(manifest: dict) -> str:
    """Where the snippets say the release is: `make release`'s dist/<model>-<recipe>."""
    return f"dist/{manifest['model']}-{manifest['recipe']}"


def _python_snippet(manifest: dict, folder: str) -> str:
    """Load the shipped package and the tokenizer on a Mac and predict the next token."""
    interface = manifest["interface"]
    kind = package_kind(interface["kind"], "the release's interface")
    aim = release_target(manifest)
    lines = [
        "import json",
        "",
        "import coremltools as ct",
        "import numpy as np",
        "from tokenizers import Tokenizer",
        "",
        f'release = "{folder}"  # this folder',
        'tokenizer = Tokenizer.from_file(f"{release}/tokenizer/tokenizer.json")',
        'config = json.load(open(f"{release}/tokenizer/tokenizer_config.json"))',
        *(_chain_lines(manifest, kind, aim) if "pieces" in interface else [
            f'model = ct.models.MLModel(f"{{release}}/{shipped_entry(manifest)["path"]}/model.mlpackage"'
            f'{kind.snippet_model_arguments(interface)},',
            f'                          compute_units=ct.ComputeUnit.{aim.compute_units})  # target {aim.name}: '
            f'{aim.description}']),
        'ids = tokenizer.encode("I was sent to", add_special_tokens=False).ids',
        'if config.get("bos_token_id") is not None:',
        '    ids = [config["bos_token_id"]] + ids',
        f'inputs = {{"{package_interface(interface, "the release").token_input}": np.array([ids], dtype=np.int32)}}',
    ]
    lines += prediction_lines(interface)
    lines += ["print(tokenizer.decode(ids + [next_id]))"]
    return "\n".join(lines)


def _chain_lines(manifest: dict, kind, aim) -> list[str]:
    """A split package's pieces loaded and run in turn as one model (`Chain`), for the kind's lines."""
    interface = manifest["interface"]
    names = [piece["name"] for piece in interface["pieces"]]
    return [
        "",
        "class Chain:  # the pieces run in turn as one model: each takes the hidden state the one before gave",
        "    def __init__(self, pieces):",
        "        self.pieces = pieces",
        "",
        "    def make_state(self):  # each piece's own layers' caches",
        "        return [piece.make_state() for piece in self.pieces]",
        "",
        "    def predict(self, inputs, state):",
        "        for piece, piece_state in zip(self.pieces, state):",
        "            out = piece.predict(inputs, state=piece_state)",
        '            if "hidden_out" in out:',
        '                inputs = {"hidden_in": out["hidden_out"], **{k: v for k, v in inputs.items() '
        'if k not in ("input_ids", "hidden_in")}}',
        "        return out",
        "",
        "",
        f'model = Chain([ct.models.MLModel(f"{{release}}/{shipped_entry(manifest)["path"]}/{{name}}"'
        f'{kind.snippet_model_arguments(interface)},',
        f'                                compute_units=ct.ComputeUnit.{aim.compute_units})  # target {aim.name}',
        f"               for name in {names}])",
    ]


def prediction_lines(interface: dict) -> list[str]:
    """The Python example's prediction: the kind's lines on the prompt `ids` (`PackageKind.snippet`),
    the logits (a split head's parts concatenated in vocabulary order), the next token's id."""
    names = logit_outputs(interface)
    joined = (['logits = out["logits"]'] if names == ["logits"] else
              [f"logits = np.concatenate([out[name] for name in {names}], axis=-1)  # the head's parts, in vocabulary order"])
    return [*package_kind(interface["kind"], "the release's interface").snippet(interface), *joined,
            "next_id = int(logits[0, -1].argmax())"]


def _release_target_name(survey: dict, recipe: str) -> str:
    """The target the release's snippets run on: the one its survey's deployed recipe was deployed
    for (the survey's, or its fallback), the survey's for a recipe picked by hand."""
    deployed = survey["deployed"]
    if recipe == deployed["recipe"] and "deployed_for" in deployed:
        return deployed["deployed_for"]
    return survey.get("target", "cpu")


def release_target(manifest: dict):
    """The deployment target (`coreml.targets`) the release's survey deployed for."""
    from coreml.targets import target

    return target(manifest["survey"].get("target", "cpu"), "the release's survey")


def _swift_sketch(manifest: dict, folder: str) -> str:
    interface = manifest["interface"]
    unit = package_interface(interface, "the release")
    if unit.swift_usage:
        return _swift_loader_sketch(manifest, unit, folder)
    if "pieces" in interface:
        return _swift_chain_sketch(manifest, folder)
    lengths, names = enumerated_lengths(interface, "prefill"), logit_outputs(interface)
    head = (['let logits = out.featureValue(for: "logits")!.multiArrayValue!  // [1, T, vocab]: argmax of the last row']
            if names == ["logits"] else
            [f"// the head in parts: {', '.join(names)}, concatenated in this order on the last axis, are the logits",
             f"let parts = {json.dumps(names)}.map {{ out.featureValue(for: $0)!.multiArrayValue! }}  // [1, T, rows] each"])
    chunks = [] if lengths is None else [
        f"// input_ids takes the enumerated lengths {list(lengths)} only: feed the prompt in chunks of those, largest "
        "first, each from the cache the one before wrote"]
    return "\n".join([
        *_swift_prologue(manifest, folder),
        f'let package = release.appendingPathComponent("{shipped_entry(manifest)["path"]}/model.mlpackage")',
        "let model = try MLModel(contentsOf: try await MLModel.compileModel(at: package), configuration: config)",
        *SWIFT_PROMPT,
        *chunks,
        "// + the other inputs of the Interface table below (position, caches), zero-filled for a first call",
        f'let out = try await model.prediction(from: MLDictionaryFeatureProvider(dictionary: ["{unit.token_input}": '
        "inputIds]))",
        *head,
    ])


# The Swift sketches' prompt: its token ids as the model's first input.
SWIFT_PROMPT = ('let ids = tokenizer.encode(text: "I was sent to")',
                "let inputIds = try MLMultiArray(shape: [1, NSNumber(value: ids.count)], dataType: .int32)",
                "for (i, id) in ids.enumerated() { inputIds[i] = NSNumber(value: id) }")


def _swift_prologue(manifest: dict, folder: str) -> list[str]:
    """What every cmfdeploy-interface Swift sketch opens with: the release folder, its tokenizer, and
    a configuration on the release's compute units."""
    return ["import CoreML",
            "import Tokenizers  // swift-transformers",
            "",
            f'let release = URL(fileURLWithPath: "{folder}")',
            'let tokenizer = try await AutoTokenizer.from(modelFolder: release.appendingPathComponent("tokenizer"))',
            "let config = MLModelConfiguration()",
            f"config.computeUnits = {release_target(manifest).swift_compute_units}"]


def _swift_chain_sketch(manifest: dict, folder: str) -> str:
    """A split package's pieces run in turn, each with a state of its own layers' caches."""
    interface = manifest["interface"]
    names = json.dumps([piece["name"] for piece in interface["pieces"]])
    return "\n".join([
        *_swift_prologue(manifest, folder),
        'config.functionName = "prefill"  // "decode" for one token at a time',
        f"// The package in {len(interface['pieces'])} pieces (metadata.json: assets.pieces, with their sha256), each "
        "under the device's per-package limit",
        "var pieces: [MLModel] = []",
        f"for name in {names} {{",
        f'    let url = release.appendingPathComponent("{shipped_entry(manifest)["path"]}/\\(name)")',
        "    pieces.append(try MLModel(contentsOf: try await MLModel.compileModel(at: url), configuration: config))",
        "}",
        "let states = pieces.map { $0.makeState() }  // each piece's own layers' K/V caches",
        *SWIFT_PROMPT,
        "let position = try MLMultiArray(shape: [1], dataType: .int32)  // 0: the first call",
        'var features: MLFeatureProvider = try MLDictionaryFeatureProvider(dictionary: ["input_ids": inputIds, '
        '"position": position])',
        "for (piece, state) in zip(pieces, states) {",
        "    let out = try await piece.prediction(from: features, using: state)",
        '    guard let hidden = out.featureValue(for: "hidden_out") else { features = out; break }  // the last: logits',
        '    features = try MLDictionaryFeatureProvider(dictionary: ["hidden_in": hidden, "position": position])',
        "}",
        "// features holds the logits (the Interface table below names them)",
    ])


def _swift_loader_sketch(manifest: dict, unit, folder: str) -> str:
    """A package in a Swift loader's interface (`coreml.interfaces`) is that loader's to run."""
    return "\n".join([
        "import CoreML", "",
        f"// The package takes the names {unit.loader} asserts (interface {unit.name}, docs/INTERFACES.md).",
        f'let package = URL(fileURLWithPath: "{folder}/{shipped_entry(manifest)["path"]}/model.mlpackage")',
        "let config = MLModelConfiguration()",
        f"config.computeUnits = {release_target(manifest).swift_compute_units}",
        "let model = try MLModel(contentsOf: try await MLModel.compileModel(at: package), configuration: config)",
        *(line.format(tokenizer=f"{folder}/{TOKENIZER_DIR}") for line in unit.swift_usage)])


def usage_markdown(manifest: dict, folder: str | None = None) -> list[str]:
    """RELEASE.md's first section: the release as a Mac developer uses it, from `folder` (the
    release's own, or an app folder cut from it, which holds the shipped package at the same
    relative path)."""
    rel = folder or release_folder(manifest)
    return [
        "## Use it",
        "",
        "Everything needed is in this folder: the package, the tokenizer (`tokenizer/`, with the chat "
        "template and special ids in `tokenizer_config.json`) and `metadata.json`, which names the assets, the "
        "compression and the context length. From the command line:",
        "",
        "```sh",
        f'cmfdeploy generate {rel} --prompt "I was sent to" --max-tokens 32',
        f"cmfdeploy score {rel} items.jsonl",
        f"cmfdeploy verify-artifact {rel}",
        "```",
        "",
        "In Python on a Mac (coremltools and `tokenizers`; Core ML prediction needs macOS):",
        "",
        "```python",
        _python_snippet(manifest, rel),
        "```",
        "",
        "In Swift (Core ML's `MLModel` and swift-transformers' `Tokenizers`), a sketch **not compiled here**:",
        "",
        "```swift",
        _swift_sketch(manifest, rel),
        "```",
        "",
    ]


def _token_count_note(interface: dict) -> str:
    """What `T` takes, and how a split head's parts make the logits."""
    lengths = enumerated_lengths(interface, "prefill")
    note = (f"`T` is the flexible token count, {interface['dims']['T'][0]}..{interface['dims']['T'][1]}. "
            if lengths is None else f"`T` is the token count, one of the enumerated lengths "
            f"{', '.join(map(str, lengths))} (no others). ")
    if "head_split" in interface:
        note += (f"The logits are the outputs {', '.join(logit_outputs(interface))} concatenated in this order (the "
                 f"head split in parts of at most {interface['head_split']['part_width']} rows for the Neural Engine). ")
    return note


def interface_markdown(manifest: dict) -> list[str]:
    """RELEASE.md's interface section: the shipped package's features, token count and special ids."""
    from pipeline.stages.report import md_table

    interface, tokens = manifest["interface"], manifest["special_tokens"]
    features = [[direction, f["name"], f["dtype"], "[" + ", ".join(map(str, f["shape"])) + "]", f.get("meaning", "")]
                for direction, key in (("input", "inputs"), ("output", "outputs"), ("state", "states"))
                for f in interface.get(key, [])]
    return ["## Interface", "",
            md_table(["", "name", "dtype", "shape", "meaning"], features),
            _token_count_note(interface) +
            f"Special tokens: BOS {tokens['bos_token_id']}, EOS {tokens['eos_token_ids']}, PAD {tokens['pad_token_id']}.",
            ""]


def release_markdown(manifest: dict, survey: dict) -> str:
    from pipeline.stages.report import md_table

    interface = manifest["interface"]
    packages = [[e["name"], e["role"], e["kind"], e["size_bytes"], e["gate"]["recipe"], e["gate"]["backend"],
                 e["gate"]["summary"]["max_abs"], e["gate"]["summary"]["top1_agreement_min"],
                 e["gate"]["summary"]["kl_mean_max"], e["gate"]["passed"]] for e in manifest["packages"]]
    tolerances = {e["gate"]["recipe"]: e["gate"]["tolerance"] for e in manifest["packages"]}
    record = next(r for r in survey["recipes"] if r["name"] == manifest["recipe"])
    chosen = (f"the survey's deployed recipe: {manifest['survey']['deployed_rule']}" if manifest["deployed"]
              else "chosen by hand, not the survey's deployed recipe")
    if "fallback" in manifest["survey"]:
        chosen += f"; the survey's target fell back: {manifest['survey']['fallback']}"
    lines = [
        f"# {manifest['model']} — {manifest['recipe']}",
        "",
        f"Core ML package `{_model_asset(shipped_entry(manifest), interface)}` ({interface['kind']}, "
        + (f"in {len(interface['pieces'])} pieces under {interface['split']['max_package_bytes']} bytes each, run in "
           "turn: metadata.json's `assets.pieces`; " if "pieces" in interface else "") +
        f"context {interface['context']}, minimum deployment target {interface['minimum_deployment_target']}, "
        f"compute precision {interface['compute_precision']}), compressed with recipe `{manifest['recipe']}` "
        f"({chosen}).",
        "",
        *usage_markdown(manifest),
        *interface_markdown(manifest),
        "## Packages and their gates",
        "",
        "Every package passed its three-part alignment gate: exact against a PyTorch reference of its intended "
        "numerics (FP32, or its own decoded weights), within the quality budget of FP32, and its invariants.",
        "",
        md_table(["package", "role", "kind", "bytes", "recipe", "gate backend", "max |Δ logit|",
                  "top-1 agreement", "KL mean max", "passed"], packages),
        "## Exactness bounds",
        "",
        md_table(["recipe", "max |Δ logit| allowed", "why"],
                 [[k, f"{t['atol']:.3g}", t["why"]] for k, t in tolerances.items()]),
        "## Effect on the scoring set",
        "",
        _scoring_effect(survey, record["scoring"]),
        "",
        "## Identity chain",
        "",
        md_table(["link", "sha256", "bound by"],
                 [[c["link"], f"`{c['sha256']}`", c["bound_by"]] for c in manifest["chain"]]),
        "Check everything offline with `cmfdeploy verify-artifact <this folder>`.",
        "",
    ]
    return "\n".join(lines)


def _scoring_effect(survey: dict, scoring: dict) -> str:
    """What the deployed recipe did to the scoring set's rankings, or why its gate did not score it."""
    fp32 = survey["fp32"]["scoring"]
    head = f"`{survey['scoring_set']['name']}` ({survey['scoring_set']['n_items']} items): "
    if "not_measured" in scoring:
        return (head + f"not scored for this package ({scoring['not_measured']}); FP32's top-1 accuracy "
                f"{fp32['top1_accuracy']:.3f}, MRR {fp32['mrr']:.3f}. `cmfdeploy score` on this release scores it. "
                "The full survey is in `survey/survey.md`.")
    return (head + f"top-1 accuracy {scoring['top1_accuracy']:.3f} (FP32 {fp32['top1_accuracy']:.3f}), MRR "
            f"{scoring['mrr']:.3f} (FP32 {fp32['mrr']:.3f}); {scoring['top1_changed']} items change their top "
            f"candidate, max |Δ score| {scoring['max_abs_delta_score']:.3g}. The full survey is in `survey/survey.md`.")
