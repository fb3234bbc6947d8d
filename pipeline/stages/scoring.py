"""Candidate ranking over any backend: which continuation of a context does the model prefer?

An item is `{id, context, candidates[], gold?}` (`gold` is an index into `candidates`).
Each candidate is tokenized jointly with its context (BOS + context + candidate), so word
boundaries tokenize as the model saw them in training. The token prefix every candidate
shares is run once (`backend.prefill`) and each candidate's remaining tokens are run from
that immutable snapshot (`backend.extend`). A candidate's score is the summed log-prob of
its tokens after the shared prefix: it differs from the log-prob of the whole sequence by
the same constant for every candidate of an item, so rankings are those of full sequences.
No EOS is appended and nothing is truncated: an item that does not fit is refused.

A run directory holds `scores.jsonl` (per-candidate scores), `items.jsonl` (gold rank and
top-1 per item) and `manifest.json` (format `cmfdeploy.scores/1`, summary metrics).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from manifests.identity import (
    MANIFEST_NAME,
    Manifest,
    artifact_source,
    check_files,
    cmf_source,
    environment,
    inventory,
    load_manifest,
    sha256_bytes,
    sha256_file,
    write_json,
)
from manifests.output import refuse_existing, staged_output
from pipeline.ground.backend_protocol import Backend, log_softmax
from pipeline.ground.cmf import open_cmf
from pipeline.ground.errors import CmfdeployError
from pipeline.ground.tokenizer import Tokenizer, tokenizer_from_artifact

FORMAT = "cmfdeploy.scores/1"
SCORES_NAME = "scores.jsonl"
ITEMS_NAME = "items.jsonl"


class ScoringError(CmfdeployError):
    """A scoring set or a scoring run that cannot be used."""


class ItemTooLong(ScoringError):
    """BOS + context + a candidate is longer than the backend's context."""


@dataclass(frozen=True)
class Item:
    id: str
    context: str
    candidates: tuple[str, ...]
    gold: int | None = None
    where: str = "items"  # file:line it came from, for error messages


@dataclass(frozen=True)
class ItemScores:
    id: str
    scores: np.ndarray  # float64 [candidates], summed log-prob after the shared prefix
    n_tokens: tuple[int, ...]  # tokens scored per candidate
    gold: int | None

    @property
    def top1(self) -> int:
        """The best candidate; the first one on a tie."""
        return int(np.argmax(self.scores))

    @property
    def rank(self) -> int | None:
        """1-based rank of the gold; a tie with the gold counts against it."""
        if self.gold is None:
            return None
        others = np.delete(self.scores, self.gold)
        return 1 + int(np.count_nonzero(others >= self.scores[self.gold]))


@dataclass(frozen=True)
class RankDifferences:
    order_changed: tuple[str, ...]  # ids whose candidate ordering differs
    top1_changed: tuple[str, ...]  # ids whose best candidate differs
    max_abs_delta: float  # largest |score_a - score_b| over all candidates


@dataclass(frozen=True)
class ChangedItems:
    improved: tuple[str, ...]  # gold ranked higher in b than in a
    regressed: tuple[str, ...]  # gold ranked lower in b than in a


# -- items


def load_items(path: str | Path) -> list[Item]:
    """Items from a JSON-lines file; any malformed line is a ScoringError naming line and field."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ScoringError(f"{path}: file not found") from None
    except UnicodeDecodeError as error:
        raise ScoringError(f"{path}: not UTF-8 ({error})") from None
    items, seen = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            raise ScoringError(f"{where}: not valid JSON ({error})") from None
        item = _parse_item(raw, where)
        if item.id in seen:
            raise ScoringError(f"{where}: field id = {item.id!r} is used by an earlier item")
        seen.add(item.id)
        items.append(item)
    if not items:
        raise ScoringError(f"{path}: holds no items")
    return items


def _parse_item(raw, where: str) -> Item:
    if not isinstance(raw, dict):
        raise ScoringError(f"{where}: an item must be a JSON object, got {type(raw).__name__}")
    item_id, context, candidates, gold = (raw.get(k) for k in ("id", "context", "candidates", "gold"))
    if not isinstance(item_id, str) or not item_id:
        raise ScoringError(f"{where}: field id = {item_id!r} is not a non-empty string")
    label = f"{where} (item {item_id!r})"
    if not isinstance(context, str):
        raise ScoringError(f"{label}: field context = {context!r} is not a string")
    if not isinstance(candidates, list) or len(candidates) < 2:
        raise ScoringError(f"{label}: field candidates = {candidates!r} is not a list of at least 2 strings")
    for index, candidate in enumerate(candidates):
        if not isinstance(candidate, str) or not candidate:
            raise ScoringError(f"{label}: field candidates[{index}] = {candidate!r} is not a non-empty string")
    if len(set(candidates)) != len(candidates):
        raise ScoringError(f"{label}: field candidates = {candidates!r} repeats a candidate")
    if gold is not None and (isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(candidates)):
        raise ScoringError(f"{label}: field gold = {gold!r} is not an index into the {len(candidates)} candidates")
    return Item(item_id, context, tuple(candidates), gold, where)


# -- scoring


def encode_item(tokenizer: Tokenizer, item: Item) -> tuple[np.ndarray, list[np.ndarray]]:
    """(shared prefix ids, per-candidate suffix ids) of BOS + context + candidate.

    The prefix stops one token short of the shortest sequence, so every candidate scores at
    least one token even when its whole tokenization is a prefix of another's.
    """
    sequences = [tokenizer.encode(item.context + candidate, add_bos=True) for candidate in item.candidates]
    shortest = min(map(len, sequences))
    heads = np.stack([s[:shortest] for s in sequences])
    differ = np.flatnonzero(np.any(heads != heads[0], axis=0))
    shared = min(int(differ[0]) if differ.size else shortest, shortest - 1)
    return sequences[0][:shared], [s[shared:] for s in sequences]


# Items whose prefixes, then whose candidates, one batch holds (`prefill_batch`,
# `extend_batch`): 8 items are 40 branches, ~0.5 GB of caches on SmolLM2 at context 128.
ITEM_BATCH = 8


def _encoded(backend: Backend, tokenizer: Tokenizer, item: Item) -> tuple[np.ndarray, list[np.ndarray]]:
    prefix, suffixes = encode_item(tokenizer, item)
    longest = len(prefix) + max(map(len, suffixes))
    if longest > backend.context:
        raise ItemTooLong(
            f"{item.where}: item {item.id!r}: BOS + context + candidate is {longest} tokens, over the "
            f"{backend.context}-token context of backend {backend.name!r}"
        )
    return prefix, suffixes


def _fed(suffixes: list[np.ndarray]) -> list[np.ndarray]:
    """What each candidate runs after the prefix: all its tokens but the last (row j of the
    prefix's last row, then of each fed token, predicts suffix[j])."""
    return [suffix[:-1] for suffix in suffixes if len(suffix) > 1]


def _item_scores(item: Item, prefix_logits: np.ndarray, suffixes: list[np.ndarray], rows_after) -> ItemScores:
    first = np.asarray(prefix_logits)[-1:]
    scores = []
    for suffix in suffixes:
        rows = first if len(suffix) == 1 else np.concatenate([first, next(rows_after)])
        scores.append(log_softmax(rows)[np.arange(len(suffix)), suffix].sum())
    return ItemScores(item.id, np.asarray(scores), tuple(map(len, suffixes)), item.gold)


def score_item(backend: Backend, tokenizer: Tokenizer, item: Item) -> ItemScores:
    prefix, suffixes = _encoded(backend, tokenizer, item)
    prefix_logits, snapshot = backend.prefill(prefix)
    return _item_scores(item, prefix_logits, suffixes, iter([backend.extend(snapshot, ids) for ids in _fed(suffixes)]))


def _score_batch(backend: Backend, items: list[Item], encoded: list) -> list[ItemScores]:
    prefilled = backend.prefill_batch([prefix for prefix, _ in encoded])
    branches = [(snapshot, ids) for (_, snapshot), (_, suffixes) in zip(prefilled, encoded) for ids in _fed(suffixes)]
    rows_after = iter(backend.extend_batch(branches) if branches else [])
    return [_item_scores(item, logits, suffixes, rows_after)
            for item, (logits, _), (_, suffixes) in zip(items, prefilled, encoded)]


def item_batches(prefixes: list[np.ndarray]) -> list[list[int]]:
    """The items (indices) each batch holds, `ITEM_BATCH` at a time, items of like prefix
    lengths together (a batch pads its prefixes to its longest: 9% more tokens in the file
    order of SmolLM2's cloze set, 0.4% sorted)."""
    order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))
    return [order[start:start + ITEM_BATCH] for start in range(0, len(order), ITEM_BATCH)]


def score_items(backend: Backend, tokenizer: Tokenizer, items: list[Item],
                progress: Callable[[int], None] | None = None) -> list[ItemScores]:
    """Every item's scores, in the items' order; a batch of `item_batches` at a time where the
    backend batches. A batch's items are scored alike whichever others the call holds."""
    done = progress or (lambda count: None)
    if not (hasattr(backend, "prefill_batch") and hasattr(backend, "extend_batch")):
        results = []
        for item in items:
            results.append(score_item(backend, tokenizer, item))
            done(1)
        return results
    encoded = [_encoded(backend, tokenizer, item) for item in items]
    scored = {}
    for batch in item_batches([prefix for prefix, _ in encoded]):
        scored.update(zip(batch, _score_batch(backend, [items[i] for i in batch], [encoded[i] for i in batch])))
        done(len(batch))
    return [scored[i] for i in range(len(items))]


def score_items_in_workers(artifact: Path, items_path: Path, items: list[Item], tokenizer_from: Path, backend: str,
                           jobs: int, progress: Callable[[int], None], engine=None) -> tuple[list[ItemScores], str]:
    """`score_items` over `jobs` worker processes (`pipeline.ground.workers`), each opening the
    backend once and taking a batch of `item_batches` at a time: the batches are the ones one
    process scores, so an item's scores differ from one process's only where a worker's single
    BLAS thread sums a product in another order. (scores in the items' order, backend name).
    On the MIL executor most of an item's time is single-threaded (an op at a time, in
    Python), so two workers score SmolLM2's fp16 chunk-KV package 1.5x as fast as one process."""
    from pipeline.ground.workers import LOCAL, run_in_workers

    tokenizer = tokenizer_from_artifact(tokenizer_from)
    batches = item_batches([encode_item(tokenizer, item)[0] for item in items])
    setup = {"artifact": str(artifact), "items": str(items_path), "tokenizer": str(tokenizer_from), "backend": backend}

    def done(batch: list[int], answer: dict) -> None:
        if "refused" in answer:  # the first refused item stops the run, as it does in one process
            raise ItemTooLong(answer["refused"])
        progress(len(batch))

    answers = run_in_workers("pipeline.stages.scoring:scoring_worker", setup, batches, jobs, where=artifact,
                             shared=[path if path.is_dir() else path.parent for path in (artifact, items_path)],
                             engine=engine or LOCAL, done=done,
                             memory_per_job=_worker_memory(artifact))
    scored = {}
    for batch, answer in zip(batches, answers):
        scored.update(zip(batch, (_from_row(row) for row in answer["scores"])))
    return [scored[i] for i in range(len(items))], answers[0]["backend"]


def scoring_worker(setup: dict):
    """A worker of `score_items_in_workers`: the items of each batch it is given, scored."""
    from pipeline.stages.backends import open_backend

    items = load_items(setup["items"])
    tokenizer = tokenizer_from_artifact(setup["tokenizer"])
    runner = open_backend(setup["artifact"], setup["backend"])
    # Every item is checked before any is scored, as one process does: an item that does not
    # fit is the user's input, refused by name in the first answer, not a worker that failed.
    try:
        for item in items:
            _encoded(runner, tokenizer, item)
        refused = None
    except ItemTooLong as exc:
        refused = str(exc)

    def handle(batch: list[int]) -> dict:
        if refused:
            return {"refused": refused}
        return {"backend": runner.name, "scores": [_row(r) for r in score_items(runner, tokenizer, [items[i] for i in batch])]}

    return handle


def _worker_memory(artifact: Path) -> int | None:
    """What a worker scoring `artifact` is let to hold (`job_memory` of the model's FP32 weight
    bytes): a package's manifest records them, a bundle's weights file is them, a CMF's tensors
    expand to them. None for anything else (the backend refuses it by name)."""
    from coreml.manifest import fp32_weight_bytes
    from pipeline.ground.workers import bundle_job_memory, job_memory
    from coreml.package import is_package
    from pipeline.stages.backends import release_package

    path = release_package(artifact) or artifact
    if path.is_dir() and is_package(path):
        return job_memory(fp32_weight_bytes(json.loads((path / MANIFEST_NAME).read_text())))
    if path.is_file():
        with open_cmf(path) as cmf:
            return job_memory(4 * sum(int(np.prod(info.shape)) for info in cmf.tensors.values()))
    return bundle_job_memory(path)


def summarize(results: list[ItemScores]) -> dict:
    """top-1 accuracy and MRR over the items that have a gold (None when none has)."""
    ranks = np.array([r.rank for r in results if r.gold is not None], dtype=np.float64)
    return {
        "items": len(results),
        "items_with_gold": int(ranks.size),
        "top1_accuracy": float(np.mean(ranks == 1)) if ranks.size else None,
        "mrr": float(np.mean(1.0 / ranks)) if ranks.size else None,
    }


# -- comparing runs


def _paired(a: list[ItemScores], b: list[ItemScores]) -> list[tuple[ItemScores, ItemScores]]:
    by_id = {r.id: r for r in b}
    if [r.id for r in a] != [r.id for r in b]:
        missing = sorted({r.id for r in a} ^ by_id.keys())
        raise ScoringError(f"the two runs score different items (first differing id: {missing[:1] or 'order'})")
    for ra in a:
        rb = by_id[ra.id]
        if len(ra.scores) != len(rb.scores) or ra.gold != rb.gold:
            raise ScoringError(f"item {ra.id!r}: the two runs differ in its candidate count or gold")
    return [(ra, by_id[ra.id]) for ra in a]


def rank_differences(a: list[ItemScores], b: list[ItemScores]) -> RankDifferences:
    pairs = _paired(a, b)
    order = tuple(ra.id for ra, rb in pairs if not np.array_equal(
        np.argsort(-ra.scores, kind="stable"), np.argsort(-rb.scores, kind="stable")))
    top1 = tuple(ra.id for ra, rb in pairs if ra.top1 != rb.top1)
    delta = max((float(np.max(np.abs(ra.scores - rb.scores))) for ra, rb in pairs), default=0.0)
    return RankDifferences(order, top1, delta)


def changed_items(a: list[ItemScores], b: list[ItemScores]) -> ChangedItems:
    pairs = [(ra, rb) for ra, rb in _paired(a, b) if ra.gold is not None]
    return ChangedItems(
        improved=tuple(ra.id for ra, rb in pairs if rb.rank < ra.rank),
        regressed=tuple(ra.id for ra, rb in pairs if rb.rank > ra.rank),
    )


# -- run directories


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row, allow_nan=False) + "\n" for row in rows).encode()


def _row(result: ItemScores) -> dict:
    """An item's scores as JSON (a float64 round-trips through Python's JSON exactly)."""
    return {"id": result.id, "scores": result.scores.tolist(), "n_tokens": list(result.n_tokens), "gold": result.gold}


def _from_row(row: dict) -> ItemScores:
    return ItemScores(row["id"], np.asarray(row["scores"], dtype=np.float64), tuple(row["n_tokens"]), row["gold"])


def _source(artifact: Path, out_dir: Path) -> dict:
    if artifact.is_dir():
        return artifact_source(artifact, relative_to=out_dir)
    with open_cmf(artifact) as cmf:
        return cmf_source(cmf)


def write_run(results: list[ItemScores], out_dir: str | Path, *, artifact: str | Path, backend_name: str,
              items_path: str | Path, force: bool = False) -> Path:
    """Write a run directory atomically (temp sibling, renamed into place; status last)."""
    out_dir, artifact, items_path = Path(out_dir), Path(artifact), Path(items_path)
    refuse_existing(out_dir, force)
    scores = _jsonl([_row(r) for r in results])
    items = _jsonl([{"id": r.id, "gold": r.gold, "rank": r.rank, "top1": r.top1} for r in results])
    summary = summarize(results)
    with staged_output(out_dir, force) as tmp:
        manifest = {"format": FORMAT, "status": "incomplete", "source": _source(artifact, out_dir)}
        write_json(tmp / MANIFEST_NAME, manifest)
        (tmp / SCORES_NAME).write_bytes(scores)
        (tmp / ITEMS_NAME).write_bytes(items)
        manifest.update(
            backend=backend_name,
            scoring_set={"name": items_path.name, "sha256": sha256_file(items_path),
                         "n_items": len(results), "n_tokens": int(sum(sum(r.n_tokens) for r in results))},
            summary=[{"name": name, "value": summary[name]}
                     for name in ("top1_accuracy", "mrr", "items", "items_with_gold")],
            scores_sha256=sha256_bytes(scores),
            files=inventory(tmp),
            environment=environment(),
        )
        manifest["status"] = "complete"
        write_json(tmp / MANIFEST_NAME, manifest)
    return out_dir


def verify_scores(path: str | Path, hashes: bool = True) -> Manifest:
    """Verifier for `cmfdeploy verify-artifact`: a finished run whose files are as recorded."""
    path = Path(path)
    manifest = load_manifest(path, FORMAT)
    check_files(path, manifest["files"], hashes=hashes)
    return Manifest(path, manifest)


def read_run(run_dir: str | Path) -> list[ItemScores]:
    """The per-item scores of a finished run directory (for rank_differences / changed_items)."""
    run_dir = Path(run_dir)
    verify_scores(run_dir)
    return [_from_row(json.loads(line)) for line in (run_dir / SCORES_NAME).read_text().splitlines()]


def score(artifact: str | Path, items_path: str | Path, out_dir: str | Path | None, *, backend: str = "auto",
          tokenizer_from: str | Path | None = None, force: bool = False,
          progress: bool = True, jobs: int = 1, engine=None) -> tuple[Path | None, dict]:
    """Score a scoring set with one backend and write the run directory; (path, summary).

    The tokenizer comes from `tokenizer_from` (a CMF or a folder with tokenizer.json),
    by default the artifact itself (packages and releases carry theirs). With `out_dir`
    None nothing is written and the path is None. `jobs` > 1 scores in that many worker
    processes (`score_items_in_workers`, on `engine`).
    """
    from pipeline.stages.backends import open_backend  # imports torch, which MLX-only scoring never needs

    if out_dir is not None:
        refuse_existing(out_dir, force)
    items = load_items(items_path)
    tokenizer_from = Path(tokenizer_from or artifact)
    bars = []  # opened at the first scored batch: a refused item's error is the first line on stderr

    def advance(count: int) -> None:
        if not bars:
            bars.append(tqdm(total=len(items), desc="score", unit="item", disable=not progress))
        bars[0].update(count)

    try:
        if jobs > 1:
            results, backend_name = score_items_in_workers(Path(artifact), Path(items_path), items, tokenizer_from,
                                                           backend, jobs, advance, engine)
        else:
            runner = open_backend(artifact, backend)
            results, backend_name = score_items(runner, tokenizer_from_artifact(tokenizer_from), items, advance), runner.name
    finally:
        for bar in bars:
            bar.close()
    path = None if out_dir is None else write_run(results, out_dir, artifact=artifact, backend_name=backend_name,
                                                  items_path=items_path, force=force)
    return path, summarize(results)
