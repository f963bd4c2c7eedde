"""A q4 target that reads its prompts with a bfloat16 copy of its decoder (models/prefill.py): the prompt's cache
entries are the copy's (not what q4 computes), the same for the target alone and for every drafter, so speculative
greedy stays that target's own output, turn after turn; a verify never goes through the copy.

The power checks: the copy's entries differ from q4's own (the path is used, so the equalities below are not
trivial), and a decoder that skips the prompt read leaves other entries in the cache than the target alone."""

import copy
import threading

import pytest
import torch
from transformers import DynamicCache

from specdec_cli.batch import sidecar
from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.kv import CachedModel, prefill_path
from specdec_cli.engine.packed import PackedCache
from specdec_cli.errors import InputError, InsufficientMemoryError, ModelLoadError
from specdec_cli.models.formats.q4 import kernel_problem
from specdec_cli.models.loading import prefill
from specdec_cli.models.runtime.quantize import computes_rows_alone, quantize
from specdec_cli.settings import ModelOverrides, choose_models

from tests.conftest import tiny_causal_lm

pytestmark = [pytest.mark.kernels, pytest.mark.skipif(kernel_problem() is not None,
                                                      reason=f"q4 needs specdec's C kernels: {kernel_problem()}")]

MIN_TOKENS = 8
PROMPT = [1] + [(7 * i + 2) % 90 + 3 for i in range(30)]
SECOND_TURN = [(5 * i + 4) % 90 + 3 for i in range(12)]
NEW_TOKENS = 24


def _q4_with_copy(arch: str, seed: int, layers: int = 4):
    """A q4 model with its float model's decoder in bfloat16 as its prefill path, and that float model in bfloat16."""
    float_model = tiny_causal_lm(arch, seed=seed, logit_scale=8.0, layers=layers)
    target = quantize(copy.deepcopy(float_model), "q4")
    prefill.attach_decoder(target, copy.deepcopy(float_model).to(torch.bfloat16).model, min_tokens=MIN_TOKENS)
    return target, float_model.to(torch.bfloat16)


@pytest.fixture(scope="module", params=[("qwen2", 2), ("llama", 0)], ids=["qwen2", "llama"])
def with_reference(request):
    return _q4_with_copy(*request.param)


@pytest.fixture(scope="module")
def target(with_reference):
    return with_reference[0]


@pytest.fixture(scope="module")
def draft():
    return quantize(tiny_causal_lm("llama", seed=0, logit_scale=8.0, layers=2), "q4")


def _drafters(draft):
    return [("chain k=3", DraftModelDrafter(draft), FixedK(3)), ("chain k=6", DraftModelDrafter(draft), FixedK(6)),
            ("tree", TreeDrafter(draft, budget=8, branching=2), FixedK(4))]


def _entries(runner: CachedModel, length: int) -> list[torch.Tensor]:
    return [layer.keys[..., :length, :].clone() for layer in runner.cache.layers]


@torch.inference_mode()
def test_the_copy_reads_the_prompt_in_chunks_and_its_entries_are_not_q4s(with_reference):
    target, reference = with_reference
    read, own = CachedModel(target, prefill_chunk=MIN_TOKENS + 3), CachedModel(target)
    read.prefill(PROMPT[:10])
    read.prefill(PROMPT)  # the rest after what it holds, in chunks
    own.extend(PROMPT)
    assert read.ids == PROMPT and read.cache.layers[0].keys.shape[-2] == len(PROMPT)
    assert read.cache.layers[0].keys.dtype == torch.float32
    cache = DynamicCache(config=reference.config)
    reference(input_ids=torch.tensor([PROMPT[:10]]), cache=cache)
    for start in range(10, len(PROMPT), MIN_TOKENS + 3):
        reference(input_ids=torch.tensor([PROMPT[start:start + MIN_TOKENS + 3]]), cache=cache)
    for mine, bf16, q4 in zip(_entries(read, len(PROMPT)), cache.layers, _entries(own, len(PROMPT))):
        assert torch.equal(mine, bf16.keys.float())  # the bfloat16 model's own entries
        assert not torch.equal(mine, q4)
    assert prefill_path(target).min_tokens == MIN_TOKENS and not computes_rows_alone(target)


def test_a_short_unread_part_is_left_to_the_model_itself(target):
    runner = CachedModel(target)
    runner.prefill(PROMPT[:MIN_TOKENS - 1])
    assert runner.ids == []
    runner.prefill(PROMPT[:MIN_TOKENS])
    assert runner.ids == PROMPT[:MIN_TOKENS]


def test_speculation_on_it_is_that_target_alone_turn_after_turn(target, draft):
    speculation_is_that_target_alone_turn_after_turn(target, draft, PROMPT)


def speculation_is_that_target_alone_turn_after_turn(target, draft, prompt: list[int]) -> None:
    """Chains and a tree over `draft` give `target` alone's tokens on `prompt`, then on a second turn after it."""
    alone = SpeculativeDecoder(target, None, FixedK(0), ())
    first = alone.generate(prompt, SamplingParams(), NEW_TOKENS).tokens
    conversation = prompt + first + SECOND_TURN
    second = alone.generate(conversation, SamplingParams(), NEW_TOKENS).tokens
    drafted = 0
    for name, drafter, policy in _drafters(draft):
        decoder = SpeculativeDecoder(target, drafter, policy, ())
        result = decoder.generate(prompt, SamplingParams(), NEW_TOKENS)
        assert result.tokens == first, name
        again = decoder.generate(conversation, SamplingParams(), NEW_TOKENS)
        assert again.tokens == second, name
        drafted += result.stats.drafted + again.stats.drafted
    assert drafted > 0


def test_the_prompt_entries_are_the_target_alones_and_skipping_the_read_is_caught(target, draft, monkeypatch):
    alone = SpeculativeDecoder(target, None, FixedK(0), ())
    alone.generate(PROMPT, SamplingParams(), NEW_TOKENS)
    expected = _entries(alone.target, len(PROMPT) - 1)
    spec = SpeculativeDecoder(target, DraftModelDrafter(draft), FixedK(4), ())
    spec.generate(PROMPT, SamplingParams(), NEW_TOKENS)
    assert all(torch.equal(a, b) for a, b in zip(_entries(spec.target, len(PROMPT) - 1), expected))
    # Planted: the decoder verifies the prompt with its first drafts instead of reading it first.
    monkeypatch.setattr(CachedModel, "prefill", lambda self, ids, keep_at_most=None: None)
    skipped = SpeculativeDecoder(target, DraftModelDrafter(draft), FixedK(4), ())
    skipped.generate(PROMPT, SamplingParams(), NEW_TOKENS)
    assert not all(torch.equal(a, b) for a, b in zip(_entries(skipped.target, len(PROMPT) - 1), expected))


def test_a_batch_row_reads_its_prompt_as_one_sequence_does(target):
    """The batched engine admits a row's prompt but its last token (its first step feeds that one), as the one-sequence
    decoder prefills it: all of those through the prefill path."""
    packed = PackedCache(target)
    packed.admit("row", PROMPT[:-1])
    single = CachedModel(target)
    single.prefill(PROMPT[:-1])
    assert single.ids == PROMPT[:-1]  # the path took them all
    for layer, alone in zip(packed.cache.layers, single.cache.layers):
        assert torch.equal(layer.keys[..., :len(PROMPT) - 1, :], alone.keys[..., :len(PROMPT) - 1, :])


def test_interrupted_read_leaves_the_cache_as_it_was(target, monkeypatch):
    runner = CachedModel(target)
    runner.extend(PROMPT[:5])
    path = prefill_path(target)

    def half_then_interrupt(cache, new_ids):
        cache.layers[0].update(torch.zeros(1, 2, len(new_ids), 16), torch.zeros(1, 2, len(new_ids), 16))
        raise KeyboardInterrupt

    monkeypatch.setattr(path, "decoder", None)
    monkeypatch.setattr(type(path), "__call__", lambda self, cache, new_ids: half_then_interrupt(cache, new_ids))
    with pytest.raises(KeyboardInterrupt):
        runner.prefill(PROMPT)
    assert runner.ids == PROMPT[:5]
    assert all(layer.keys.shape[-2] == 5 for layer in runner.cache.layers)


def test_who_may_read_prompts(target, specdec_home):
    class Loaded:  # what `wanted` reads of a LoadedModel
        name, device, quantization, model = "tiny", torch.device("cpu"), "q4", target

    amx = {"amx_bf16", "amx_tile", "avx512_bf16"}
    assert prefill.wanted("auto", Loaded, flags=amx)
    assert not prefill.wanted("auto", Loaded, flags={"avx512_bf16", "avx2"})
    assert not prefill.wanted("none", Loaded, flags=amx)
    assert prefill.wanted("bf16", Loaded, flags=set())
    Loaded.quantization = None
    assert not prefill.wanted("auto", Loaded, flags=amx)
    with pytest.raises(InputError, match="q4 or int8 target"):
        prefill.wanted("bf16", Loaded)
    with pytest.raises(InputError, match="unknown --prefill"):
        choose_models(ModelOverrides(prefill="fp8"))
    assert prefill.resolve("auto", torch.device("cpu"), "demo:missing", "q4", None, None, flags=set()) == "none"
    assert prefill.resolve("none", torch.device("cpu"), "x", "q4", None, None) == "none"


def test_auto_resolves_a_gguf_target_from_its_own_metadata_whether_or_not_it_was_converted(tmp_path, specdec_home):
    """`--prefill auto` before loading read the target's config only from a bfloat16 conversion of its .gguf: a q4
    target read in place (the default) had none until some command converted it, so the same `run` resolved "none"
    (prompts read by q4) on a fresh machine and "bf16" (read on AMX) later, and gave other text (issue 61's flaky
    e2e identity). Now the file's metadata answers where no conversion exists, and the answer is the same after."""
    pytest.importorskip("gguf")
    from specdec_cli.models.loading import gguf as gguf_loading
    from tests.tiny import build_4bit_gguf

    path = tmp_path / "tiny-q4_k.gguf"
    build_4bit_gguf(path, arch="qwen2")
    amx = {"amx_bf16", "amx_tile", "avx512_bf16"}
    before = prefill.resolve("auto", torch.device("cpu"), str(path), "q4", None, None, flags=amx)
    gguf_loading.ensure_converted(path, torch.bfloat16, None, progress=False)
    after = prefill.resolve("auto", torch.device("cpu"), str(path), "q4", None, None, flags=amx)
    assert before == after == "bf16"
    assert prefill.resolve("auto", torch.device("cpu"), str(path), "q4", None, None, flags={"avx2"}) == "none"
    assert prefill.resolve("auto", torch.device("cpu"), str(tmp_path / "absent.gguf"), "q4", None, None,
                           flags=amx) == "none"


def test_a_gguf_targets_metadata_is_read_once_for_the_resolution_and_the_load(tmp_path, specdec_home, monkeypatch):
    """Reading a .gguf's config parses all its metadata (~9 s for the demo target's file): `--prefill auto`'s
    resolution and the load share one read per process (gguf.config_of), where the demo pair's start read its target's
    three times and its draft's twice."""
    pytest.importorskip("gguf")
    from transformers import AutoConfig

    from specdec_cli.models import load_model
    from tests.tiny import build_4bit_gguf

    path = tmp_path / "tiny-q4_k.gguf"
    build_4bit_gguf(path, arch="qwen2")
    reads, original = [], AutoConfig.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        reads.append(kwargs.get("gguf_file"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(counted))
    assert prefill.resolve("auto", torch.device("cpu"), str(path), "q4", None, None,
                           flags={"amx_bf16", "amx_tile", "avx512_bf16"}) == "bf16"
    loaded = load_model(str(path), quantization="q4", dtype="float32", progress=False)
    assert reads.count(path.name) == 1 and loaded.model.config.hidden_size == 256


def test_run_names_the_prompt_read_only_where_the_copy_reads_it():
    from specdec_cli.settings import DecodingSettings

    choice = choose_models(ModelOverrides(target="some/model", prefill="none"))
    settings = DecodingSettings(k="auto", temperature=0.0, top_p=1.0, top_k=0, seed=0, max_new_tokens=8, system=None)
    assert "prefill" not in sidecar.record_settings(choice, settings)
    from dataclasses import replace

    assert sidecar.record_settings(replace(choice, prefill="bf16"), settings)["prefill"] == "bf16"


def test_run_tells_a_q4_targets_read_on_amx_from_the_copys(monkeypatch):
    """Both are `--prefill bf16` but give other records (models/prefill.py): a file begun one way is not resumed the
    other (the stored settings differ)."""
    from dataclasses import replace

    from specdec_cli.settings import DecodingSettings

    choice = replace(choose_models(ModelOverrides(target="some/model")), prefill="bf16", target_quantization="q4")
    settings = DecodingSettings(k="auto", temperature=0.0, top_p=1.0, top_k=0, seed=0, max_new_tokens=8, system=None)
    monkeypatch.setattr(prefill, "cpu_flags", lambda: {"amx_bf16", "amx_tile", "avx512_bf16"})
    on_amx = sidecar.record_settings(choice, settings)
    assert on_amx["prefill"] == "bf16" and on_amx["prompt_reader"] == "q4 on AMX"
    assert "prompt_reader" not in sidecar.record_settings(replace(choice, target_quantization="int8"), settings)
    monkeypatch.setattr(prefill, "cpu_flags", lambda: {"avx512_bf16", "avx2"})
    copy_read = sidecar.record_settings(choice, settings)
    assert copy_read["prefill"] == "bf16" and "prompt_reader" not in copy_read


def test_the_copys_weights_count_in_what_the_target_holds(target):
    from specdec_cli.models.loading.preflight import held_weight_bytes

    copy_bytes = sum(tensor.numel() * tensor.element_size() for tensor in prefill_path(target).decoder.parameters())
    path = target.__dict__.pop("_specdec_prefill")
    try:
        alone = held_weight_bytes(target)
    finally:
        target.__dict__["_specdec_prefill"] = path
    assert copy_bytes > 0 and held_weight_bytes(target) >= alone + copy_bytes


def test_auto_follows_a_calibrated_prompt_read_over_the_cpus_flags(target, specdec_home):
    from specdec_cli.models.formats.calibration import machine, save_calibration

    class Loaded:
        name, device, quantization, model = "tiny", torch.device("cpu"), "q4", target

    def calibrated(copy_seconds: float) -> None:
        read = {"model": "tiny", "quantization": "q4", "tokens": 256, "model_seconds": 1.0, "copy_seconds": copy_seconds}
        save_calibration({"machine": machine(), "entries": [], "prompt_reads": [read]})

    calibrated(0.5)  # the copy twice as fast here: taken without AMX
    assert prefill.wanted("auto", Loaded, flags=set())
    calibrated(0.9)  # not 1.2x as fast: not taken, AMX or not
    assert not prefill.wanted("auto", Loaded, flags={"amx_bf16", "amx_tile"})
    Loaded.name = "another"  # not measured: the flags decide
    assert prefill.wanted("auto", Loaded, flags={"amx_bf16", "amx_tile"})


def test_compare_names_who_read_the_prompts(target):
    from specdec_cli.bench.probes import prompt_reader

    class Loaded:
        model = target

    assert prompt_reader(Loaded) == "bfloat16 copy"
    Loaded.model = torch.nn.Linear(2, 2)
    assert prompt_reader(Loaded) == "target"


def _loading_copy(gate: threading.Event, failure: BaseException | None = None):
    """A q4 model whose copy loads in the background (`LoadingPath`) once `gate` opens (or fails with `failure`),
    and the same q4 model with the copy attached at once."""
    float_model = tiny_causal_lm("qwen2", seed=2, logit_scale=8.0, layers=4)
    waiting, eager = quantize(copy.deepcopy(float_model), "q4"), quantize(copy.deepcopy(float_model), "q4")
    prefill.attach_decoder(eager, copy.deepcopy(float_model).to(torch.bfloat16).model, min_tokens=MIN_TOKENS)

    def load():
        assert gate.wait(30)
        if failure is not None:
            raise failure
        return prefill._path_of(waiting, copy.deepcopy(float_model).to(torch.bfloat16).model, MIN_TOKENS)

    waiting.__dict__["_specdec_prefill"] = prefill.LoadingPath(waiting, load, MIN_TOKENS)
    prefill.load_meanwhile(waiting)
    return waiting, eager


@torch.inference_mode()
def test_a_copy_loading_in_the_background_is_waited_for_only_by_a_long_read():
    gate = threading.Event()
    target, eager = _loading_copy(gate)
    loading = prefill_path(target)
    assert isinstance(loading, prefill.LoadingPath) and computes_rows_alone(target) is False
    short = CachedModel(target)
    short.prefill(PROMPT[:MIN_TOKENS - 1])  # too short for the copy: no wait, read by q4 in extend
    assert short.ids == [] and prefill_path(target) is loading
    runner = CachedModel(target)
    reader = threading.Thread(target=runner.prefill, args=(PROMPT[:-1],))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and runner.ids == []  # waiting for the copy
    gate.set()
    reader.join(30)
    assert not reader.is_alive() and runner.ids == PROMPT[:-1]
    assert isinstance(prefill_path(target), prefill.PrefillPath)  # the loaded path took its place
    reference = CachedModel(eager)
    reference.prefill(PROMPT[:-1])
    for layer, expected in zip(runner.cache.layers, reference.cache.layers):
        assert torch.equal(layer.keys, expected.keys) and torch.equal(layer.values, expected.values)


@torch.inference_mode()
def test_a_copy_that_failed_to_load_is_said_once_and_the_target_reads_from_then_on():
    gate = threading.Event()
    gate.set()
    target, _ = _loading_copy(gate, InsufficientMemoryError("2.9 GB needed, 1.0 GB free", "close something"))
    runner = CachedModel(target)
    runner.extend(PROMPT[:3])
    with pytest.raises(ModelLoadError) as raised:
        runner.prefill(PROMPT[:-1])
    line = raised.value.one_line()
    assert "did not load (2.9 GB needed, 1.0 GB free — close something)" in line and "--prefill none" in line
    assert "\n" not in line
    assert runner.ids == PROMPT[:3] and all(layer.keys.shape[-2] == 3 for layer in runner.cache.layers)
    assert prefill_path(target) is None
    runner.prefill(PROMPT[:-1])  # no path now: left to the target's own forwards
    assert runner.ids == PROMPT[:3]
    alone = SpeculativeDecoder(target)
    assert len(alone.generate(PROMPT, SamplingParams(), 4).tokens) == 4


def test_closing_waits_for_the_load_without_its_warm_up_read(monkeypatch):
    """What chat does before it ends (prefill.settle): the thread ends with the load, and skips the warm-up read;
    a load left alone reads once to warm up."""
    warmed = []
    real_warm = prefill.warm
    monkeypatch.setattr(prefill, "warm", lambda path, config: warmed.append(path) or real_warm(path, config))
    alone_gate, closed_gate = threading.Event(), threading.Event()
    alone, _ = _loading_copy(alone_gate)
    closed, _ = _loading_copy(closed_gate)
    loading = prefill_path(closed)
    closer = threading.Thread(target=prefill.settle, args=(closed,))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and loading._closing  # waiting for the load, which waits for its gate
    alone_gate.set()
    closed_gate.set()
    closer.join(30)
    prefill_path(alone).ready()
    assert not closer.is_alive() and not loading._thread.is_alive()
    assert warmed == [prefill_path(alone)]  # only the one left alone warmed up
    prefill.settle(alone)  # loaded: nothing to wait for
    prefill.settle(torch.nn.Linear(2, 2))


def test_a_background_copy_that_cannot_fit_is_refused_at_once(target, monkeypatch):
    from specdec_cli.models.loading import preflight

    class Loaded:
        name, device, model = "tiny", torch.device("cpu"), quantize(tiny_causal_lm("qwen2", seed=2, layers=2), "q4")

    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: 1000)
    before = threading.active_count()
    with pytest.raises(InsufficientMemoryError) as raised:
        prefill.attach(Loaded, background=True)
    assert "bfloat16 copy (--prefill)" in raised.value.message and "--prefill none" in raised.value.hint
    assert prefill_path(Loaded.model) is None and threading.active_count() == before


@torch.inference_mode()
def test_a_copy_never_started_loads_where_it_is_first_needed():
    float_model = tiny_causal_lm("qwen2", seed=2, logit_scale=8.0, layers=4)
    target = quantize(copy.deepcopy(float_model), "q4")
    loading = prefill.LoadingPath(
        target, lambda: prefill._path_of(target, copy.deepcopy(float_model).to(torch.bfloat16).model, MIN_TOKENS),
        MIN_TOKENS)
    target.__dict__["_specdec_prefill"] = loading
    prefill.finish_loading(target)  # no load_meanwhile: loaded here, in this thread
    assert loading._thread is None and isinstance(prefill_path(target), prefill.PrefillPath)
