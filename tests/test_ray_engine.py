"""The worker pool's Ray engine (pipeline.ground.ray_engine) on a Ray cluster this module starts
on this machine: the same entries, setups and JSON tasks as the local worker processes, results
in order, failures typed; and the fixture's survey and conversion through it, compared with the
local workers' run of the same jobs.

Both runs use jobs=2 and the cluster has the CPUs of two local workers, so each Ray actor runs
the thread share a local worker does: the same code on the same inputs with the same threads,
so every package file is the same bytes and every record the same values, apart from what a run
measures of itself (seconds per step, coremltools' conversion date) and the hashes and sizes of
the files that record those, compared here file by file without them. The spec's fields are
compared in protobuf's deterministic order: its maps serialize in an order that varies between
processes.
"""

import json
import re
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is the optional install cmfdeploy[cluster] (`make venv` installs it)")

from _survey_models import SURVEY_BUDGET, WORKER_RECIPES, built_survey, survey_in_workers  # noqa: E402
from conftest import FIXTURE_REFERENCE  # noqa: E402
from coremltools.proto import Model_pb2  # noqa: E402

from coreml.convert import _kinds_in_workers  # noqa: E402
from pipeline.cli import main  # noqa: E402
from pipeline.ground.ray_engine import FolderNotShared, RayUnreachable, refuse_unreachable  # noqa: E402
from pipeline.ground.workers import WorkerEngine, WorkerFailed, run_in_workers, thread_share  # noqa: E402
from pipeline.stages.survey import load_survey, run_survey  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RAY = WorkerEngine("ray")
# What a run measures of itself, and the hashes and sizes of files, which change with it.
MEASURED = {"seconds"}
HASHES = {"sha256", "manifest_sha256", "bytes"}
CONVERSION_DATE = "com.github.apple.coremltools.conversion_date"


@pytest.fixture(scope="module", autouse=True)
def cluster(tmp_path_factory):
    """A Ray cluster of this machine, with the CPUs two local workers share between them. Ray's
    memory monitor is off, as nothing watches the local workers: it kills a Ray worker when the
    whole machine nears its memory, which on a shared machine is other processes' doing."""
    ray.init(num_cpus=2 * thread_share(2), include_dashboard=False, log_to_driver=False,
             object_store_memory=80 * 2**20, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             _system_config={"memory_monitor_refresh_ms": 0})
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _from_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # a worker imports `tests._worker_jobs` from the stage's working folder


def test_tasks_come_back_in_order_from_actors_that_build_their_setup_once():
    seen = []
    results = run_in_workers("tests._worker_jobs:arithmetic", {"factor": 3}, [5, 1, 4, 1, 2], jobs=2,
                             where="test", engine=RAY, done=lambda task, result: seen.append(task))
    assert [r["value"] for r in results] == [15, 3, 12, 3, 6]
    assert sorted(seen) == [1, 1, 2, 4, 5]
    assert len({r["pid"] for r in results}) <= 2
    assert {r["setups"] for r in results} == {1}
    assert {r["threads"] for r in results} == {str(thread_share(2))}  # a local worker's share


def test_a_failing_task_is_a_typed_error_naming_it_with_the_remote_traceback():
    with pytest.raises(WorkerFailed, match=r"survey: the Ray worker running 'b' failed:\n(.|\n)*cannot do b"):
        run_in_workers("tests._worker_jobs:raises_on", {"fatal": "b"}, ["a", "b", "c"], jobs=2, where="survey",
                       engine=RAY)


def test_a_dead_actor_is_a_typed_error_naming_its_task():
    with pytest.raises(WorkerFailed, match=r"survey: the Ray worker running 'b' failed:\n"):
        run_in_workers("tests._worker_jobs:dies_on", {"fatal": "b"}, ["a", "b", "c"], jobs=2, where="survey",
                       engine=RAY)


def test_a_worker_that_cannot_see_the_shared_folder_names_it(tmp_path):
    unseen = tmp_path / "staging-on-another-disk"
    with pytest.raises(FolderNotShared, match=f"cannot read and write {re.escape(str(unseen))}: every node must see"):
        run_in_workers("tests._worker_jobs:arithmetic", {"factor": 1}, [1], jobs=1, where="stage",
                       shared=(unseen,), engine=RAY)


def _timeless(value):
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if k not in MEASURED | HASHES}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _spec(path: Path) -> bytes:
    model = Model_pb2.Model()
    model.ParseFromString(path.read_bytes())
    model.description.metadata.userDefined.pop(CONVERSION_DATE, None)
    return model.SerializeToString(deterministic=True)


def _untimed_page(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.startswith("Wall seconds per step")]


def _assert_same_files(local: Path, remote: Path) -> None:
    """Every file of `local` in `remote` and no other; the same bytes, but for what a run measures."""
    files = sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(remote) for p in remote.rglob("*") if p.is_file())
    for name in files:
        a, b = local / name, remote / name
        if name.name == "Manifest.json":  # the .mlpackage's: its item identifiers are fresh UUIDs each save
            items = [json.loads(p.read_text())["itemInfoEntries"] for p in (a, b)]
            assert sorted(map(json.dumps, items[0].values())) == sorted(map(json.dumps, items[1].values()))
        elif name.suffix == ".json":
            assert _timeless(json.loads(a.read_text())) == _timeless(json.loads(b.read_text())), name
        elif name.name == "model.mlmodel":
            assert _spec(a) == _spec(b), name
        elif name.name == "alignment.md":  # its cost line is the gate's measured seconds
            assert _untimed_page(a) == _untimed_page(b), name
        else:  # weight.bin, tokenizers, scores.jsonl, survey.md, the plot
            assert a.read_bytes() == b.read_bytes(), name


@pytest.fixture(scope="module")
def survey(fixture_packages, tmp_path_factory):
    return built_survey(fixture_packages, tmp_path_factory.getbasetemp())


def test_an_address_where_no_head_listens_is_refused_by_name_not_waited_on():
    """ray.init retries an address that never answers for ever; the stage probes the head first. A
    socket bound and not listening refuses every connection for as long as it is held."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        for given in (address, f"ray://{address}"):
            with pytest.raises(RayUnreachable, match=re.escape(f"survey: no Ray cluster at {given!r}")):
                refuse_unreachable(given, "survey")
    for bad in ("127.0.0.1:port", "http://127.0.0.1:6379", ":6379"):
        with pytest.raises(RayUnreachable, match="is not host:port or ray://host:port"):
            refuse_unreachable(bad, "survey")
    refuse_unreachable("auto", "survey")  # Ray's own lookup of a running cluster: nothing to probe


def test_a_survey_on_ray_is_the_local_workers_survey(survey):
    local, record = survey_in_workers(survey.path, survey.package, survey.fp32_gate, survey.items)
    out = local.parent / "survey-on-ray"  # beside it: the records' relative paths are the same
    remote = run_survey(survey.package, survey.fp32_gate, FIXTURE_REFERENCE, survey.items, out,
                        recipes=WORKER_RECIPES, jobs=2, progress=False, fp32_scores=survey.path / "scores" / "fp32",
                        engine=RAY, budget=SURVEY_BUDGET)
    assert load_survey(out) == json.loads(json.dumps(remote))
    assert [r["name"] for r in remote["recipes"]] == list(WORKER_RECIPES)
    assert _timeless(remote) == _timeless(json.loads(json.dumps(record)))
    _assert_same_files(local, out)


def test_a_conversion_on_ray_is_the_local_workers_conversion(fixture_bundle, tmp_path):
    """One kind, converted by the CLI on Ray (the Ray engine converts even one kind in a worker,
    with jobs=2 a 1/2 share) and by the local pool's worker with the same share."""
    _kinds_in_workers(("chunk_kv",), fixture_bundle, tmp_path / "local", tmp_path / "local", None, 2,
                      lambda stage: None)
    assert main(["coreml", str(fixture_bundle), "-o", str(tmp_path / "ray"), "--kinds", "chunk_kv", "--jobs", "2",
                 "--worker-engine", "ray"]) == 0
    _assert_same_files(tmp_path / "local", tmp_path / "ray")
