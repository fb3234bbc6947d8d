"""The MLX runtime against the PyTorch reference decoder (pipeline.ground.models) running the same
decoded weights: random-weight transformers models written to CMF in every dtype the writer
produces, task masks and skills, the KV cache's snapshot/extend/trim, greedy generation,
chat templates (against transformers' renderer) and the CLI."""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from _hf_models import load_saved, save_hf_model
from pipeline.ground.models.numerics import model_logits_bound
from _one_thread import one_thread  # noqa: F401 (autouse fixture)
from pipeline.stages.backends import open_backend
from pipeline.cli import main
from pipeline.ground.cmf import DTYPES, open_cmf, write_cmf
from pipeline.ground.cmf.skills import add_skill
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models import KVCache as TorchCache
from pipeline.ground.models.hf_config import arch_from_hf_config
from pipeline.ground.reference import load_reference
from pipeline.ground.tokenizer import load_tokenizer
from mlx_runtime.backend import MlxBackend
from pipeline.ground.chat import CHATML, ChatTemplateError, render_chat
from mlx_runtime.generate import Sampling, Stats, generate, sample
from mlx_runtime.models import forward, load_model

CONFORMANCE = Path("/work/shared/cmf-conformance")
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "botchan-llama-1m.cmf"
FIXTURE_TOKENIZER = FIXTURE.with_name("tokenizer.json")
FROZEN = FIXTURE.parent / "reference" / "logits.npz"
FIXTURE_IDS = np.load(FROZEN, allow_pickle=False)["long.input_ids"]  # 128 tokens of Botchan
WRITER_DTYPES = [dt.name for dt in DTYPES.values() if dt.encode is not None]
IDS = np.random.default_rng(5).integers(0, 128, 40)
# MLX's q4tp/q2tp weights are within 2^-20 of the decoder's (tests/test_mlx_weights.py);
# every other dtype's are bitwise.
MLX_WEIGHT_RTOL = 2.0**-20
ROW_TILED = {"vbit", "vbit_ro", "q4tp", "q2tp"}


def _write(tmp_path_factory, family: str, dtype: str, seed: int = 0, **overrides) -> Path:
    """A random transformers model of `family` as CMF: matrices in `dtype` (q4_block where the
    dtype needs in % 32 == 0 and the matrix does not have it), vectors in f32."""
    directory = tmp_path_factory.mktemp(f"{family}-{dtype}")
    save_hf_model(family, directory / "hf", seed=seed, **overrides)
    config, weights = load_saved(directory / "hf")
    arch, moe = arch_from_hf_config(config)
    path = directory / "model.cmf"
    def dtype_of(t):
        if t.dim() != 2:
            return "f32"
        return "q4_block" if dtype in ROW_TILED and t.shape[1] % 32 else dtype

    write_cmf(path, arch=arch, moe=moe, tensors=[(n, t.numpy(), dtype_of(t)) for n, t in weights.items()])
    return path


@torch.no_grad()
def _reference_logits(path: Path, ids, **options) -> np.ndarray:
    model, _, _ = load_reference(path, **options)
    return model(torch.from_numpy(np.asarray(ids))).numpy()


def _bound(path: Path, **options) -> float:
    """Max |Δ logit| of MLX vs torch float32 on the model's decoded weights (pipeline/ground/models/numerics.py),
    over its whole context."""
    model, args, _ = load_reference(path, **options)
    return model_logits_bound(model, args.max_position_embeddings, weight_rtol=MLX_WEIGHT_RTOL)


def _assert_logits(got: np.ndarray, want: np.ndarray, bound: float) -> None:
    assert np.abs(got - want).max() <= bound
    # The same next token wherever the reference's top-2 gap exceeds 2 * bound; a closer pair
    # may swap on another CPU's kernels.
    top2 = np.sort(want, axis=-1)[..., -2:]
    decided = top2[..., 1] - top2[..., 0] > 2 * bound
    assert decided.any()
    np.testing.assert_array_equal(got.argmax(-1)[decided], want.argmax(-1)[decided])


@pytest.fixture(scope="module", params=WRITER_DTYPES)
def fixture_in_dtype(request, tmp_path_factory):
    """The fixture model (fixtures/botchan-llama-1m.cmf) with its matrices re-encoded in one dtype."""
    path = tmp_path_factory.mktemp(f"fixture-{request.param}") / "model.cmf"
    with open_cmf(FIXTURE) as cmf:
        tensors = [(n, np.array(cmf.decode(n)), request.param if len(i.shape) == 2 else "f32")
                   for n, i in cmf.tensors.items()]
        write_cmf(path, arch=cmf.arch, tensors=tensors)
    return path


def test_fixture_logits_match_reference_in_every_writer_dtype(fixture_in_dtype):
    want = _reference_logits(fixture_in_dtype, FIXTURE_IDS)
    bound = _bound(fixture_in_dtype)
    with open_cmf(fixture_in_dtype) as cmf:
        model = load_model(cmf)
    assert not model.report.fallbacks
    for gemm in (False, True):
        _assert_logits(np.array(forward(model, FIXTURE_IDS, model.new_cache(), gemm=gemm)), want, bound)


def test_fixture_matches_its_frozen_reference_logits():
    frozen = np.load(FROZEN, allow_pickle=False)
    backend = MlxBackend(FIXTURE)
    bound = _bound(FIXTURE)  # the frozen logits came from another CPU: the same two-evaluation bound
    for case in ("short", "long"):
        _assert_logits(backend.logits(frozen[f"{case}.input_ids"]), frozen[f"{case}.logits"], bound)
    cache = backend.model.new_cache()  # one token at a time through the KV cache
    steps = [np.array(forward(backend.model, np.array([t]), cache)) for t in frozen["long.input_ids"]]
    _assert_logits(np.concatenate(steps), frozen["long_kv_step_logits"], bound)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["q8_row", "q4_block", "vbit_ro"])
def test_families_match_reference(tmp_path_factory, family, dtype):
    path = _write(tmp_path_factory, family, dtype, seed=2)
    want = _reference_logits(path, IDS)
    backend = MlxBackend(path)
    bound = _bound(path)
    _assert_logits(backend.logits(IDS), want, bound)  # dense GEMM path
    logits, snap = backend.prefill(IDS[:3])  # quantized-kernel path, then branches
    _assert_logits(np.concatenate([logits, backend.extend(snap, IDS[3:6])]), want[:6], bound)


@pytest.fixture(scope="module")
def qwen3_q4(tmp_path_factory):
    return _write(tmp_path_factory, "qwen3", "q4_block", seed=3)


def test_snapshots_are_immutable_and_branch(qwen3_q4):
    backend = MlxBackend(qwen3_q4)
    full = backend.logits(IDS)
    head, snap = backend.prefill(IDS[:25])
    first = backend.extend(snap, IDS[25:])
    other = backend.extend(snap, IDS[25:30][::-1].copy())
    again = backend.extend(snap, IDS[25:])
    np.testing.assert_array_equal(first, again)
    bound = _bound(qwen3_q4)
    assert np.abs(np.concatenate([head, first]) - full).max() <= bound  # other chunking: other sums
    want_other = _reference_logits(qwen3_q4, np.concatenate([IDS[:25], IDS[25:30][::-1]]))[25:]
    _assert_logits(other, want_other, bound)


def test_trim_rewinds_the_cache(qwen3_q4):
    with open_cmf(qwen3_q4) as cmf:
        model = load_model(cmf)
    cache = model.new_cache()
    forward(model, IDS[:30], cache, gemm=True)
    cache.trim(10)
    assert cache.position == 20
    got = np.array(forward(model, IDS[20:30], cache))
    _assert_logits(got, _reference_logits(qwen3_q4, IDS[:30])[20:], _bound(qwen3_q4))


def test_backend_refuses_bad_ids(qwen3_q4):
    from pipeline.stages.backends import BackendError

    backend = open_backend(qwen3_q4, "mlx")
    with pytest.raises(BackendError, match="token id 128"):
        backend.logits(np.array([1, 128]))
    with pytest.raises(BackendError, match="1-D"):
        backend.logits(np.zeros((2, 2), np.int64))


@torch.no_grad()
def _reference_greedy(path: Path, prompt: np.ndarray, count: int) -> list[int]:
    model, args, _ = load_reference(path)
    cache = TorchCache.empty(args, prompt.size + count)
    logits = model.forward_cached(torch.from_numpy(prompt), cache)
    out = []
    for _ in range(count):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = model.forward_cached(torch.tensor([token]), cache)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["q8_row", "q4_block"])
def test_greedy_generation_matches_reference(tmp_path_factory, family, dtype):
    path = _write(tmp_path_factory, family, dtype, seed=4)
    prompt = IDS[:12]
    with open_cmf(path) as cmf:
        model = load_model(cmf)
    stats = Stats()
    got = list(generate(model, prompt, max_tokens=32, stats=stats))
    assert got == _reference_greedy(path, prompt, 32)
    assert (stats.prompt_tokens, stats.generated, stats.decode_steps) == (12, 32, 31)


def test_generation_stops_at_eos_and_sampling_is_seeded(qwen3_q4):
    with open_cmf(qwen3_q4) as cmf:
        model = load_model(cmf)
    greedy = list(generate(model, IDS[:8], max_tokens=10))
    stop = greedy[4]
    first = greedy.index(stop)
    assert list(generate(model, IDS[:8], max_tokens=10, eos_ids=(stop,))) == greedy[: first + 1]
    sampling = Sampling(temperature=0.9, top_p=0.8, seed=7)
    a = list(generate(model, IDS[:8], max_tokens=10, sampling=sampling))
    assert a == list(generate(model, IDS[:8], max_tokens=10, sampling=sampling))


def test_top_p_keeps_the_smallest_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    draws = {sample(logits, Sampling(temperature=1.0, top_p=0.7), rng) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 alone is below 0.7; 0.5 + 0.3 reaches it
    assert sample(logits, Sampling(), rng) == 0


def test_task_masks_match_reference():
    path = CONFORMANCE / "model_masks_tok_a.cmf"
    ids = np.random.default_rng(1).integers(0, 100, 24)
    for task in ("general", "coding", "sparse-random"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unmeasured tasks warn, on both runtimes
            want = _reference_logits(path, ids, task=task)
            got = MlxBackend(path, task=task).logits(ids)
            bound = _bound(path, task=task)
        _assert_logits(got, want, bound)


def test_unmeasured_task_warns():
    with pytest.warns(UserWarning, match="no measured quality"):
        MlxBackend(CONFORMANCE / "model_masks_tok_a.cmf", task="coding")


def test_skills_match_reference(tmp_path_factory):
    path = _write(tmp_path_factory, "qwen3", "q8_row", seed=5)
    with open_cmf(path) as cmf:
        names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
        shapes = {n: cmf.info(n).shape for n in names}
    rng = np.random.default_rng(3)
    replaced = [(n, rng.standard_normal(s).astype(np.float32) * 0.1, "q4_block") for n, s in shapes.items()]
    add_skill(path, {"id": "math", "name": "math"}, replaced)
    for skill in (None, "math"):
        _assert_logits(MlxBackend(path, skill=skill).logits(IDS), _reference_logits(path, IDS, skill=skill),
                       _bound(path, skill=skill))


def test_resident_memory_is_the_packed_weights(tmp_path_factory):
    """Nothing is held twice: stacked MoE experts share their buffers with the per-expert
    views, and no decoded copy stays behind."""
    import gc

    import mlx.core as mx

    path = _write(tmp_path_factory, "qwen3_moe", "q4_block", seed=9)
    gc.collect()
    before = mx.get_active_memory()
    model = MlxBackend(path).model
    gc.collect()
    resident = mx.get_active_memory() - before
    assert model.report.packed_bytes <= resident <= model.report.packed_bytes + 64 * 1024
    with open_cmf(path) as cmf:  # every tensor is loaded once, the tied head included
        assert model.report.payload_bytes == sum(info.nbytes for info in cmf.tensors.values())


def test_skill_files_are_refused(tmp_path_factory):
    from pipeline.ground.cmf.skills import export_skill_file

    path = _write(tmp_path_factory, "qwen3", "f16", seed=5)
    name = "model.layers.0.self_attn.q_proj.weight"
    with open_cmf(path) as cmf:
        shape = cmf.info(name).shape
    add_skill(path, {"id": "math", "name": "math"}, [(name, np.zeros(shape, np.float32), "f16")])
    skill_file = export_skill_file(path, "math", path.with_name("math.cmf"))
    with pytest.raises(UnsupportedModel, match="math.cmf: a skill file .* never runs on its own"):
        MlxBackend(skill_file)


def test_unknown_tensors_and_layer_types_are_refused(tmp_path_factory):
    directory = tmp_path_factory.mktemp("refuse")
    save_hf_model("qwen3", directory / "hf", seed=7)
    config, weights = load_saved(directory / "hf")
    arch, _ = arch_from_hf_config(config)
    tensors = [(n, t.numpy(), "f32") for n, t in weights.items()]
    sinks = ("model.layers.0.self_attn.sinks", np.zeros(4), "f32")
    write_cmf(directory / "sinks.cmf", arch=arch, tensors=[*tensors, sinks])
    with pytest.raises(UnsupportedModel, match="sinks.cmf: .*model.layers.0.self_attn.sinks"):
        MlxBackend(directory / "sinks.cmf")
    linear = {**arch, "layer_types": ["FullAttention", "LinearAttention"]}
    write_cmf(directory / "linear.cmf", arch=linear, tensors=tensors)
    with pytest.raises(UnsupportedModel, match="linear.cmf: layer 1 has layer type 'LinearAttention'"):
        MlxBackend(directory / "linear.cmf")


def test_matrices_the_kernels_cannot_take_are_reported_and_exact(tmp_path_factory):
    # Qwen2-MoE's shared expert is 48 wide: its down_proj (in = 48) is stored as q4_block,
    # whose groups then span rows, so it runs on exact decoded weights.
    path = _write(tmp_path_factory, "qwen2_moe", "vbit", seed=8)
    with open_cmf(path) as cmf:
        model = load_model(cmf)
        down = [n for n in cmf.tensors if n.endswith("shared_expert.down_proj.weight")]
    assert sorted(model.report.fallbacks) == sorted(down)
    assert all("in = 48" in why for why in model.report.fallbacks.values())
    assert model.report.tensors["q4_block"] == len(down)
    assert f"dense fallback: {down[0]}: in = 48" in model.report.format()
    _assert_logits(MlxBackend(path).logits(IDS), _reference_logits(path, IDS), _bound(path))


def test_chat_templates_render_like_transformers():
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}\n  <{{ m['role'] }}>{{ m['content'] | tojson }}\n"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße, \"cat\""},
                {"role": "assistant", "content": "Nyan"}, {"role": "user", "content": "dropped"}]
    for tmpl in (template, CHATML):
        want, _ = render_jinja_template(conversations=[messages], chat_template=tmpl, add_generation_prompt=True,
                                        bos_token="<s>")
        assert render_chat(tmpl, messages, special_tokens={"bos_token": "<s>"}) == want[0]
    with pytest.raises(ChatTemplateError, match="tokenizer_config: chat_template: no tools"):
        render_chat(template, [{"role": "tool", "content": ""}])


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    save_hf_model("qwen3", directory / "hf", seed=6, vocab_size=1024)
    config, weights = load_saved(directory / "hf")
    arch, moe = arch_from_hf_config(config)
    path = directory / "model.cmf"
    tensors = [(n, t.numpy(), "q4_block" if t.dim() == 2 else "f32") for n, t in weights.items()]
    write_cmf(path, arch=arch, tensors=tensors,
              tokenizer_json=FIXTURE_TOKENIZER.read_bytes(), tokenizer_config={"eos_token_ids": [2], "bos_token_id": 1})
    return path


def test_cli_generate_streams_the_greedy_completion(with_tokenizer, capsys):
    assert main(["mlx", "generate", str(with_tokenizer), "--prompt", "I am a cat.", "--max-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    tokenizer = load_tokenizer(FIXTURE_TOKENIZER.read_bytes(), {"eos_token_ids": [2], "bos_token_id": 1})
    with open_cmf(with_tokenizer) as cmf:
        model = load_model(cmf)
    prompt = tokenizer.encode("I am a cat.")
    tokens = list(generate(model, prompt, max_tokens=12, eos_ids=(2,)))
    assert out == tokenizer.decode(tokens) + "\n"
    assert f"prefill: {prompt.size} tokens" in err and f"decode: {len(tokens)} tokens" in err


def test_cli_errors_are_one_line(with_tokenizer, tmp_path, capsys):
    assert main(["mlx", "generate", str(tmp_path / "missing.cmf"), "--prompt", "x"]) == 1
    assert capsys.readouterr().err.startswith("Bounds: missing.cmf")
    assert main(["mlx", "generate", str(with_tokenizer), "--prompt", "I am a cat.", "--max-tokens", "600"]) == 1
    assert "ContextOverflow: generate: 6 prompt tokens + 600 new tokens exceed the model's context of 512" in \
        capsys.readouterr().err


def test_cli_score_matches_the_torch_backend(with_tokenizer, tmp_path):
    from pipeline.stages.scoring import read_run, score

    items = tmp_path / "items.jsonl"
    items.write_text('{"id": "a", "context": "I am a cat.", "candidates": [" As yet", " I have", " no name"], '
                     '"gold": 0}\n'
                     '{"id": "b", "context": "Where I was born", "candidates": [" I have", " no idea"]}\n')
    assert main(["mlx", "score", str(with_tokenizer), str(items), "-o", str(tmp_path / "mlx")]) == 0
    score(with_tokenizer, items, tmp_path / "torch", backend="torch")
    # A candidate's score sums n log-probs, each within 2 max|Δ logit| (log_softmax).
    # The winner stays the winner wherever it leads by more than both sides' slack.
    bound = _bound(with_tokenizer)
    decided = 0
    for got, want in zip(read_run(tmp_path / "mlx"), read_run(tmp_path / "torch")):
        slack = 2 * bound * np.array(want.n_tokens)
        assert np.all(np.abs(got.scores - want.scores) <= slack)
        runner_up, best = np.sort(want.scores)[-2:]
        if best - runner_up > 2 * slack.max():
            assert got.top1 == want.top1
            decided += 1
    assert decided
