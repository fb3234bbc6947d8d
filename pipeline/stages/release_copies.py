"""The values a release manifest and its survey copy from the packages and gates they ship,
compared with those packages' manifests and the gates' own reports (`verify_release` calls
this once every file and binding has checked out).
"""

from pathlib import Path

from coreml import manifest as package_manifest
from manifests.copied import check_copied
from manifests.identity import MANIFEST_NAME, read_json
from pipeline.stages import gates
from pipeline.stages.backends import shipped_entry


def check_package_entry(where, field: str, entry: dict, package_dir: Path, package: dict) -> None:
    """A release's (or an app folder's) entry of a package says what the package's manifest and
    files do: its format, kind, program bytes and, split, its pieces' sha256."""
    check_copied(where, field, entry, {
        "format": package["format"], "kind": package["package"]["kind"],
        "size_bytes": package_manifest.programs_bytes(package_dir, package),
        **({"pieces_sha256": package_manifest.pieces_sha256(package)} if "pieces" in package["package"] else {})},
        package_dir, keys=("format", "kind", "size_bytes", "pieces_sha256"))


def check_release_copies(path: Path, manifest: dict, survey: dict, record: dict) -> None:
    """Every value the release and its survey copy from a package or gate equals the original."""
    where, survey_where = path / MANIFEST_NAME, path / manifest["survey"]["path"]
    for index, entry in enumerate(manifest["packages"]):
        package_dir, gate_dir = path / entry["path"], path / entry["gate"]["path"]
        package, report = read_json(package_dir / MANIFEST_NAME), read_json(gate_dir / gates.REPORT_NAME)
        check_package_entry(where, f"packages/{index}", entry, package_dir, package)
        check_copied(where, f"packages/{index}/gate", entry["gate"], {
            "recipe": report["recipe"], "backend": report["candidate_backend"], "passed": report["passed"],
            "tolerance": report["tolerance"], "summary": report["summary"]}, gate_dir / gates.REPORT_NAME,
            keys=("recipe", "backend", "passed", "tolerance", "summary"))
    fp32, compressed = manifest["packages"][0], manifest["packages"][1]
    deployed = read_json(path / compressed["path"] / MANIFEST_NAME)
    shipped = shipped_entry(manifest)  # what the release describes is the package an app loads
    shipped_manifest = read_json(path / shipped["path"] / MANIFEST_NAME)
    check_copied(where, "", manifest, shipped_manifest, path / shipped["path"] / MANIFEST_NAME,
                 keys=("architecture", "special_tokens"))
    check_copied(where, "interface", manifest["interface"], shipped_manifest["package"],
                 path / shipped["path"] / MANIFEST_NAME)
    report = read_json(path / compressed["gate"]["path"] / gates.REPORT_NAME)
    check_copied(survey_where, f"recipes[{record['name']}].gate", record["gate"],
                 {**report["summary"], "passed": report["passed"], "tolerance": report["tolerance"],
                  "compute_units": report.get("compute_units", {}).get("claimable"),
                  "quality": {k: report["quality"].get(k) for k in record["gate"].get("quality", {})}},
                 path / compressed["gate"]["path"] / gates.REPORT_NAME,
                 keys=[k for k in record["gate"] if k != "report"])
    check_copied(survey_where, f"recipes[{record['name']}].package", record["package"], deployed,
                 path / compressed["path"] / MANIFEST_NAME, keys=("size_bytes",))
    check_copied(survey_where, "fp32.gate", survey["fp32"]["gate"],
                 read_json(path / fp32["gate"]["path"] / MANIFEST_NAME), path / fp32["gate"]["path"] / MANIFEST_NAME,
                 keys=("summary",))
