"""The scoring harness: prefix + extend scores equal full-forward scores computed independently
(transformers), the fixture ranks the held-out cloze set far above chance, and runs are written,
read back and compared."""

import json
import math

import numpy as np
import pytest
import torch
from pipeline.ground.models.numerics import model_logits_bound
from _one_thread import one_thread  # noqa: F401 (autouse fixture)

from fixtures.make_scoring_set import OUT as CLOZE
from fixtures.train_fixture import CMF_PATH, fixture_tokenizer, transformers_model
from manifests.identity import load_manifest
from pipeline.cli import main as cli_main
from pipeline.ground.errors import CmfdeployError, OutputExists
from pipeline.ground.torch_backend import TorchBackend
from pipeline.stages.backends import open_backend
from pipeline.ground.reference import load_reference
from pipeline.stages.scoring import (
    Item,
    ItemScores,
    ItemTooLong,
    ScoringError,
    changed_items,
    load_items,
    rank_differences,
    read_run,
    score_item,
    score_items,
    summarize,
    write_run,
)


@pytest.fixture(scope="module")
def backend():
    return open_backend(CMF_PATH)


@pytest.fixture(scope="module")
def tokenizer():
    return fixture_tokenizer()


@pytest.fixture(scope="module")
def cloze_results(backend, tokenizer):
    return score_items(backend, tokenizer, load_items(CLOZE))


def test_prefix_extend_scores_equal_independent_full_forward_scores(cloze_results, tokenizer):
    hf = transformers_model(CMF_PATH)
    bound = model_logits_bound(load_reference(CMF_PATH)[0], 128)
    items = load_items(CLOZE)[:40]
    for item, result in zip(items, cloze_results):
        sequences = [tokenizer.encode(item.context + c, add_bos=True) for c in item.candidates]
        full = []
        with torch.no_grad():
            for ids in sequences:
                logp = torch.log_softmax(hf(input_ids=torch.as_tensor(ids)[None]).logits[0].double(), dim=-1)
                full.append(logp[torch.arange(len(ids) - 1), torch.as_tensor(ids[1:])].numpy())
        # The harness drops the shared prefix; dropping it here too from the full-sequence log-probs.
        shared = len(sequences[0]) - result.n_tokens[0]
        expected = [lp[shared - 1 :].sum() for lp in full]
        assert all(len(ids) - shared == n for ids, n in zip(sequences, result.n_tokens))
        # Each of a candidate's n log-probs is within 2 max|Δ logit| of transformers' (two float32
        # evaluations of the fixture, pipeline/ground/models/numerics.py).
        slack = 2 * bound * np.array(result.n_tokens)
        assert np.all(np.abs(result.scores - np.array(expected)) <= slack), item.id


def test_batched_scoring_equals_one_item_at_a_time(backend, tokenizer, cloze_results):
    """The torch backend scores ITEM_BATCH items per batch (prefixes, then every candidate);
    one `prefill` and one `extend` per candidate must give the same scores: two float32
    evaluations, each log-prob within 2 max|Δ logit| (pipeline/ground/models/numerics.py)."""
    bound = model_logits_bound(load_reference(CMF_PATH)[0], 128)
    for item, batched in zip(load_items(CLOZE)[:12], cloze_results):  # one full batch of 8, one partial
        single = score_item(backend, tokenizer, item)
        assert single.n_tokens == batched.n_tokens and single.id == batched.id
        assert np.all(np.abs(single.scores - batched.scores) <= 2 * bound * np.array(single.n_tokens)), item.id


def test_fixture_ranks_held_out_cloze_far_above_chance(cloze_results):
    summary = summarize(cloze_results)
    n = summary["items_with_gold"]
    chance = 1 / 5
    # Five binomial standard deviations above chance: luck cannot explain it.
    assert summary["top1_accuracy"] > chance + 5 * math.sqrt(chance * (1 - chance) / n)
    assert summary["mrr"] > summary["top1_accuracy"]
    print(f"cloze top-1 accuracy {summary['top1_accuracy']:.3f}, MRR {summary['mrr']:.3f} over {n} items")


def test_cloze_set_shape_and_every_item_fits_the_context(tokenizer, backend):
    items = load_items(CLOZE)
    assert len(items) >= 300
    assert all(len(item.candidates) == 5 and item.gold is not None for item in items)
    longest = max(len(tokenizer.encode(i.context + c, add_bos=True)) for i in items for c in i.candidates)
    assert longest <= backend.context == 128


def test_item_over_the_context_is_refused_naming_the_item(tokenizer):
    item = Item("too-long", "the " * 40, (" cat", " dog"), 0)
    with pytest.raises(ItemTooLong, match="'too-long'.*over the 32-token context"):
        score_items(TorchBackend(*load_reference(CMF_PATH)[:2], context=32), tokenizer, [item])


def test_candidate_inside_another_still_scores_its_own_tokens(backend, tokenizer):
    # " he" tokenizes as a prefix of " he said": the harness must still score a token of each.
    (result,) = score_items(backend, tokenizer, [Item("nested", "Then", (" he", " he said"), None)])
    assert min(result.n_tokens) >= 1 and np.isfinite(result.scores).all()
    assert result.rank is None


def _scores(id_, values, gold):
    return ItemScores(id_, np.asarray(values, dtype=np.float64), (1,) * len(values), gold)


def test_rank_and_summary_by_hand():
    a = [_scores("x", [-1.0, -2.0, -3.0], 0), _scores("y", [-3.0, -1.0, -2.0], 0), _scores("z", [-1.0, -1.0], 1)]
    assert [r.rank for r in a] == [1, 3, 2]  # z: a tie with the gold counts against it
    summary = summarize(a)
    assert summary["top1_accuracy"] == pytest.approx(1 / 3)
    assert summary["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 2) / 3)


def test_rank_differences_and_changed_items():
    a = [_scores("x", [-1.0, -2.0, -3.0], 0), _scores("y", [-3.0, -1.0, -2.0], 0), _scores("z", [-1.0, -2.0], 0)]
    b = [_scores("x", [-1.0, -3.5, -3.0], 0), _scores("y", [-0.5, -1.0, -2.0], 0), _scores("z", [-2.5, -2.0], 0)]
    diff = rank_differences(a, b)
    assert diff.order_changed == ("x", "y", "z")
    assert diff.top1_changed == ("y", "z")
    assert diff.max_abs_delta == pytest.approx(2.5)
    changed = changed_items(a, b)
    assert (changed.improved, changed.regressed) == (("y",), ("z",))
    assert rank_differences(a, a).order_changed == () and rank_differences(a, a).max_abs_delta == 0.0


def test_comparing_runs_over_different_items_is_refused():
    with pytest.raises(ScoringError, match="different items"):
        rank_differences([_scores("x", [0.0, 1.0], 0)], [_scores("w", [0.0, 1.0], 0)])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        ('["a"]', "must be a JSON object"),
        ('{"context": "a", "candidates": [" b", " c"]}', "field id = None"),
        ('{"id": "q", "context": 3, "candidates": [" b", " c"]}', "field context = 3"),
        ('{"id": "q", "context": "a", "candidates": [" b"]}', "at least 2"),
        ('{"id": "q", "context": "a", "candidates": [" b", ""]}', r"candidates\[1\] = ''"),
        ('{"id": "q", "context": "a", "candidates": [" b", " b"]}', "repeats"),
        ('{"id": "q", "context": "a", "candidates": [" b", " c"], "gold": 2}', "field gold = 2"),
        ('{"id": "q", "context": "a", "candidates": [" b", " c"], "gold": true}', "field gold = True"),
    ],
)
def test_bad_items_are_typed_errors_naming_line_and_field(tmp_path, line, message):
    path = tmp_path / "items.jsonl"
    path.write_text('{"id": "ok", "context": "a", "candidates": [" b", " c"]}\n' + line + "\n")
    with pytest.raises(ScoringError, match=message) as info:
        load_items(path)
    assert f"{path}:2" in str(info.value) and isinstance(info.value, CmfdeployError)


def test_duplicate_ids_and_empty_files_are_refused(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text('{"id": "a", "context": "", "candidates": [" b", " c"]}\n' * 2)
    with pytest.raises(ScoringError, match="'a' is used by an earlier item"):
        load_items(path)
    path.write_text("\n")
    with pytest.raises(ScoringError, match="holds no items"):
        load_items(path)


def test_run_directory_round_trip_and_refusal(tmp_path, cloze_results):
    results = cloze_results[:12]
    out = write_run(results, tmp_path / "run", artifact=CMF_PATH, backend_name="torch-fp32", items_path=CLOZE)
    manifest = load_manifest(out, "cmfdeploy.scores/1")
    assert manifest["source"]["file"] == CMF_PATH.name
    metrics = {m["name"]: m["value"] for m in manifest["summary"]}
    assert metrics["top1_accuracy"] == summarize(results)["top1_accuracy"]
    back = read_run(out)
    assert [r.id for r in back] == [r.id for r in results]
    assert rank_differences(results, back).max_abs_delta == 0.0  # JSON floats round-trip exactly
    ranks = [json.loads(line)["rank"] for line in (out / "items.jsonl").read_text().splitlines()]
    assert ranks == [r.rank for r in results]
    with pytest.raises(OutputExists):
        write_run(results, out, artifact=CMF_PATH, backend_name="torch-fp32", items_path=CLOZE)
    write_run(results[:3], out, artifact=CMF_PATH, backend_name="torch-fp32", items_path=CLOZE, force=True)
    assert len(read_run(out)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temp folders left behind


def test_scoring_in_worker_processes_is_one_processs_scoring(tmp_path, backend, tokenizer, capsys):
    """`score --jobs 2`: two worker processes take batches of items; the run holds every item
    in the items' order, scored as one process scores them. The batches are the same, so only
    a product's summation order can differ (a worker's BLAS threads are its share of the
    cores): each log-prob within 2 max|Δ logit| (pipeline/ground/models/numerics.py)."""
    items = tmp_path / "items.jsonl"
    items.write_text("".join(CLOZE.read_text().splitlines(keepends=True)[:36]))  # 4 full batches and a partial
    out = tmp_path / "run"
    assert cli_main(["score", str(CMF_PATH), str(items), "-o", str(out), "--jobs", "2"]) == 0
    assert "36 items" in capsys.readouterr().out
    serial = score_items(backend, tokenizer, load_items(items))
    workers = read_run(out)
    assert [r.id for r in workers] == [r.id for r in serial] == [item.id for item in load_items(items)]
    bound = model_logits_bound(load_reference(CMF_PATH)[0], 128)
    for one, other in zip(serial, workers):
        assert one.n_tokens == other.n_tokens and one.gold == other.gold
        assert np.all(np.abs(one.scores - other.scores) <= 2 * bound * np.array(one.n_tokens)), one.id
    assert load_manifest(out, "cmfdeploy.scores/1")["backend"] == backend.name
    items.write_text(items.read_text() + '{"id": "long", "context": "' + "the " * 200 + '", "candidates": [" a", " b"]}\n')
    assert cli_main(["score", str(CMF_PATH), str(items), "-o", str(tmp_path / "r2"), "--jobs", "2"]) == 1
    assert capsys.readouterr().err.startswith(f"ItemTooLong: {items}:37: item 'long': BOS + context + candidate is")
    assert not (tmp_path / "r2").exists()


def test_cli_score(tmp_path, capsys):
    items = tmp_path / "items.jsonl"
    items.write_text("".join(CLOZE.read_text().splitlines(keepends=True)[:6]))
    out = tmp_path / "run"
    assert cli_main(["score", str(CMF_PATH), str(items), "-o", str(out), "--backend", "torch"]) == 0
    assert "6 items" in capsys.readouterr().out
    assert len(read_run(out)) == 6
    assert cli_main(["score", str(CMF_PATH), str(items), "-o", str(out)]) == 1
    assert capsys.readouterr().err.startswith("OutputExists: ")
    items.write_text('{"id": "long", "context": "' + "the " * 200 + '", "candidates": [" a", " b"]}\n')
    assert cli_main(["score", str(CMF_PATH), str(items), "-o", str(tmp_path / "r2")]) == 1
    assert capsys.readouterr().err.startswith(f"ItemTooLong: {items}:1: item 'long': BOS + context + candidate is")
