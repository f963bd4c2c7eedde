"""A `.gguf` loaded in place for q4 (loading/gguf_model.py): the model transformers' conversion gave, without the
conversion — the same logits bit for bit, a split set as its whole file, no whole-model float copy at the peak, and
one line for what it cannot do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec_cli.errors import ModelLoadError
from specdec_cli.models import load_model
from specdec_cli.models.loading import gguf_model
from specdec_cli.models.loading import loaded as loading
from specdec_cli.models.loading import preflight
from specdec_cli.models.loading.gguf import existing_conversions
from specdec_cli.models.formats import gguf_rows
from specdec_cli.models.formats.gguf_rows import BlockRows
from specdec_cli.models.formats.levels import LevelsLinear
from specdec_cli.models.formats.q4 import Q4KLinear, Q4Linear, quantize_packed
from specdec_cli.engine.kv import CachedModel
from specdec_cli.models.native import binding
from specdec_cli.models.runtime import decoder_stack, lean_layers
from tests.tiny import build_4bit_gguf, build_gemma3_gguf

pytestmark = pytest.mark.skipif(binding.library()[0] is None, reason=f"no q4 kernel: {binding.library()[2]}")
IDS = torch.tensor([[1, 5, 9, 22, 7, 3, 11, 40, 2]])


def _converted(path: Path) -> torch.nn.Module:
    """transformers' own float32 conversion of the file: the file's values, dequantised by the gguf package."""
    plan = loading._plan(str(path), "cpu", "float32", None, False, False, False)
    return loading._from_pretrained(plan, loading.weights_folder(plan.source, plan.dtype, False, False)).eval()


def _differences(in_place: torch.nn.Module, converted: torch.nn.Module, requantised: tuple[str, ...] = ()) -> list[str]:
    """The parameters where the model read in place is not the converted one: a 4-bit layer must hold the file's
    values exactly, a layer of another type the q4 of the file's values, a fused layer (q/k/v, gate/up: fused as it
    loads) its parts' rows one after another, everything else the values themselves."""
    wrong, covered = [], set()
    for name, layer in in_place.named_modules():
        if not hasattr(layer, "dequantized_weight"):
            continue
        parent, _, leaf = name.rpartition(".")
        parts = [name] if hasattr(converted.get_submodule(parent), leaf) else [
            f"{parent}.{part}" for part in _FUSED_PARTS[leaf]]
        references = [converted.get_submodule(part) for part in parts]
        covered.update(parts)
        expected = torch.cat([_expected_weight(reference, part.rpartition(".")[2] in requantised)
                              for part, reference in zip(parts, references)])
        biases = [reference.bias if reference.bias is not None else torch.zeros(reference.out_features)
                  for reference in references]
        has_bias = any(reference.bias is not None for reference in references)
        bias_equal = (layer.bias is not None) == has_bias and (
            not has_bias or torch.equal(layer.bias, torch.cat(biases)))
        if not (torch.equal(layer.dequantized_weight(), expected) and bias_equal):
            wrong.append(name)
    linears = {name for name, module in converted.named_modules() if isinstance(module, torch.nn.Linear)}
    wrong += sorted(linears - covered)  # a Linear of the file's model that no layer read in place holds
    for name, reference in converted.named_parameters():
        if name.rpartition(".")[0] in linears:
            continue
        if isinstance(in_place.get_submodule(name.rpartition(".")[0]), BlockRows):  # every row looked up
            ids = torch.arange(reference.shape[0]).unsqueeze(0)
            if not torch.equal(in_place.get_input_embeddings()(ids)[0], reference):
                wrong.append(name)
        elif not torch.equal(in_place.get_parameter(name), reference):
            wrong.append(name)
    return wrong


_FUSED_PARTS = {fused: parts for _, fused, parts in decoder_stack.FUSED}


def _expected_weight(reference: torch.nn.Linear, requantised: bool) -> torch.Tensor:
    expected = reference.weight.detach()
    if requantised:
        expected = Q4Linear(quantize_packed(expected), None, *expected.shape[::-1]).dequantized_weight()
    return expected


def _read_in_place(path: Path) -> torch.nn.Module:
    plan = loading._plan(str(path), "cpu", "float32", "q4", False, False, False)
    return gguf_model.load_q4(path, loading._load_config(plan))


@pytest.mark.parametrize(("arch", "kind"), [("qwen2", "Q4_K"), ("llama", "Q4_0"), ("llama", "Q4_1")])
def test_a_4_bit_gguf_read_in_place_is_the_files_model_without_a_conversion(tmp_path, specdec_home, arch, kind):
    path = tmp_path / f"{arch}.gguf"
    build_4bit_gguf(path, arch=arch, kind=kind)
    in_place = load_model(str(path), quantization="q4", dtype="float32", progress=False)
    assert existing_conversions(path) == []  # nothing converted, on disk or in memory
    assert _differences(_read_in_place(path), _converted(path)) == []
    layers = sum(isinstance(module, torch.nn.Linear) for module in in_place.model.modules())
    taken, total = in_place.model._specdec_q4_from_gguf
    assert layers == 0 and taken == total == 15  # every Linear q4, each from the file's blocks
    assert torch.isfinite(in_place.model(IDS).logits).all()


def test_a_type_with_no_kernel_is_requantised_and_said(tmp_path, specdec_home):
    """Q6_K and Q8_0 layers keep the file's weights (levels layers); a Q2_K one, which has no kernel, is q4 of them."""
    path = tmp_path / "mixed.gguf"
    build_4bit_gguf(path, kinds={"ffn_down": "Q2_K", "attn_v": "Q8_0", "attn_output": "Q6_K"})
    in_place = load_model(str(path), quantization="q4", dtype="float32", progress=False)
    assert _differences(_read_in_place(path), _converted(path), requantised=("down_proj",)) == []
    assert in_place.model._specdec_requantised == {"Q2_K": 2}
    assert in_place.describe("target").endswith(" · 13 of 15 layers kept as the .gguf's own blocks (9 Q4_K, 2 Q6_K, "
                                                "2 Q8_0) · 2 Q2_K requantised to q4 (no kernel for that type yet)")


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0", "Q6_K", "Q5_0", "F16"])
def test_an_embedding_is_kept_as_the_files_own_bytes_and_looks_up_its_exact_rows(tmp_path, specdec_home, kind):
    """No float table: the module reads the file's bytes of the embedding (its mapped pages), and every row it looks
    up is what transformers' conversion of the file holds (the model's other tensors as before)."""
    path = tmp_path / "m.gguf"
    build_4bit_gguf(path, embedding=kind)
    in_place = _read_in_place(path)
    embedding = in_place.get_input_embeddings()
    assert isinstance(embedding, BlockRows) and "model.embed_tokens.weight" not in dict(in_place.named_parameters())
    stored = gguf_model._Tensors([path]).by_name["token_embd.weight"]
    assert np.asarray(embedding.blocks).tobytes() == np.asarray(stored.data).tobytes()
    assert embedding.weight.shape == (embedding.num_embeddings, 256) and embedding.weight.is_meta
    assert _differences(in_place, _converted(path)) == []


def _float_rows(monkeypatch, path: Path):
    """The model of `path` loaded as before this change: its embedding dequantised whole into a float32 table."""
    with monkeypatch.context() as patch:
        patch.setattr(gguf_rows, "keeps", lambda kind: False)
        loaded = load_model(str(path), quantization="q4", dtype="float32", progress=False)
    assert not isinstance(loaded.model.get_input_embeddings(), BlockRows)
    return loaded.model


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_model_with_its_embedding_as_blocks_computes_what_the_float_table_computes(tmp_path, specdec_home,
                                                                                     monkeypatch, arch):
    """Through the decoder stack's one C call (which gathers rows of a table it is given) and transformers' forward
    alike, prefill, decoding and verification give the logits of the same model with a float32 table, bit for bit."""
    path = tmp_path / "m.gguf"
    build_4bit_gguf(path, arch=arch, embedding="Q4_K")
    blocks = load_model(str(path), quantization="q4", dtype="float32", progress=False).model
    floats = _float_rows(monkeypatch, path)
    assert isinstance(blocks.get_input_embeddings(), BlockRows)
    assert blocks.model.forward.__func__ is decoder_stack.stack_forward
    ours, theirs = CachedModel(blocks, prefill_chunk=8), CachedModel(floats, prefill_chunk=8)
    ids = IDS[0].tolist()
    for step in (lambda model: model.extend(ids, 1), lambda model: model.extend(ids + [4], 1),
                 lambda model: model.extend(ids + [4, 8, 15, 16], 3)):
        assert torch.equal(step(ours), step(theirs))
    assert torch.equal(blocks(IDS).logits, floats(IDS).logits)  # transformers' own forward (no cache of ours)
    with pytest.raises(IndexError, match="embedding"):
        ours.extend(ids + [blocks.get_input_embeddings().num_embeddings], 1)


def test_gemmas_scaled_embedding_kept_as_blocks_still_scales(tmp_path, specdec_home, monkeypatch):
    """Gemma multiplies its embedding's rows by √hidden in the embedding's own forward: kept as blocks, it still does
    (the same logits as its float table's)."""
    path = tmp_path / "gemma.gguf"
    build_gemma3_gguf(path, embedding="Q4_K")
    blocks = load_model(str(path), quantization="q4", dtype="float32", progress=False).model
    embedding = blocks.get_input_embeddings()
    assert isinstance(embedding, BlockRows) and float(embedding.embed_scale) == 16.0
    assert torch.equal(blocks(IDS).logits, _float_rows(monkeypatch, path)(IDS).logits)


@pytest.mark.parametrize("kind, layer", [("Q4_K", Q4KLinear), ("Q8_0", LevelsLinear), ("F32", Q4Linear)])
def test_a_tied_output_layer_is_made_from_the_embeddings_tensor(tmp_path, specdec_home, kind, layer):
    """A file with no output tensor: the output layer is the embedding's blocks (a float table's q4, as before) and
    computes with the embedding's own rows, as llama.cpp's does."""
    path = tmp_path / "m.gguf"
    build_4bit_gguf(path, embedding=kind, tied=True)
    in_place = _read_in_place(path)
    output, reference = in_place.get_output_embeddings(), _converted(path).get_input_embeddings().weight
    assert type(output) is layer and in_place._specdec_requantised == {}
    expected = reference if kind != "F32" else Q4Linear(quantize_packed(reference), None,
                                                        *reference.shape[::-1]).dequantized_weight()
    assert torch.equal(output.dequantized_weight(), expected)
    assert in_place._specdec_q4_from_gguf == ((15, 15) if kind != "F32" else (14, 15))


@pytest.mark.parametrize("arch, kinds", [("qwen2", {}), ("llama", {"attn_v": "Q6_K", "ffn_down": "Q8_0"})])
def test_q_k_v_and_gate_up_are_fused_as_they_load_and_stored_fused(tmp_path, specdec_home, monkeypatch, arch, kinds):
    """The layers the lean forward fuses are made fused by the loader and stored so: a second load reads them back
    without fusing (no copy of the stored bytes made), and both compute what the model fused after loading (the
    way before) computes, bit for bit."""
    path = tmp_path / "m.gguf"
    build_4bit_gguf(path, arch=arch, kinds=kinds)
    fusions, fuse = [], lean_layers.fused
    for module in (lean_layers, decoder_stack):  # the loader's and the lean layers' fusing
        monkeypatch.setattr(module, "fused", lambda layers: fusions.append(1) or fuse(layers))
    first = load_model(str(path), quantization="q4", dtype="float32", progress=False).model
    assert len(fusions) == 2 * first.config.num_hidden_layers
    again = load_model(str(path), quantization="q4", dtype="float32", progress=False).model
    assert len(fusions) == 2 * first.config.num_hidden_layers  # read back fused
    with monkeypatch.context() as patch:
        patch.setattr(decoder_stack, "fuse_skeleton", lambda model: {})
        patch.setenv("SPECDEC_HOME", str(tmp_path / "elsewhere"))
        after = load_model(str(path), quantization="q4", dtype="float32", progress=False).model
    assert len(fusions) == 4 * first.config.num_hidden_layers  # the way before: fused after loading
    for model in (first, again, after):
        assert model.model.forward.__func__ is decoder_stack.stack_forward
    runs = [CachedModel(model, prefill_chunk=8) for model in (first, again, after)]
    ids = IDS[0].tolist()
    for step in (lambda model: model.extend(ids, 1), lambda model: model.extend(ids + [4, 8, 15, 16], 3)):
        logits = [step(run) for run in runs]
        assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[2])


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
def test_a_large_layer_made_in_pieces_is_the_layer_made_whole(tmp_path, specdec_home, monkeypatch, kind):
    """A layer of more rows than gguf_model.CHUNK_ROWS is made a piece at a time: the same bytes as one made whole,
    the file's values (here pieces of 64 rows: the output layer's 300 rows end in a part-block, ffn_down's 256 and
    the fused gate/up's parts' 512 do not)."""
    path = tmp_path / "m.gguf"
    build_4bit_gguf(path, kinds={"output": kind, "ffn_down": kind})
    whole = _read_in_place(path)
    monkeypatch.setattr(gguf_model, "CHUNK_ROWS", 64)
    in_place = _read_in_place(path)
    pairs = [(in_place.lm_head, whole.lm_head)] + [
        (in_place.model.layers[index].mlp.get_submodule(name), whole.model.layers[index].mlp.get_submodule(name))
        for index, name in ((0, "down_proj"), (1, "gate_up_proj"))]
    for ours, theirs in pairs:
        assert type(ours) is type(theirs) and ours.out_features == theirs.out_features
        assert torch.equal(ours.packed_weight, theirs.packed_weight)
    assert in_place.lm_head.out_features == 300
    assert _differences(in_place, _converted(path)) == []


def test_a_split_set_reads_as_its_whole_file(tmp_path, specdec_home):
    whole, split = tmp_path / "whole" / "m.gguf", tmp_path / "split" / "m.gguf"
    for path, parts in ((whole, 0), (split, 7)):
        path.parent.mkdir()
        build_4bit_gguf(path, kinds={"ffn_down": "Q6_K"}, split_max_tensors=parts)
    parts = sorted(split.parent.glob("*.gguf"))
    assert [part.name for part in parts] == [f"m-0000{index}-of-00004.gguf" for index in range(1, 5)]
    first = load_model(str(parts[0]), quantization="q4", dtype="float32", progress=False)
    reference = load_model(str(whole), quantization="q4", dtype="float32", progress=False)
    assert torch.equal(first.model(IDS).logits, reference.model(IDS).logits)


def test_a_part_cut_short_is_one_line_saying_to_download_it_again(tmp_path, specdec_home):
    """The first part holds the metadata and reads; the last one, cut, is found as its tensors are read."""
    build_4bit_gguf(tmp_path / "m.gguf", split_max_tensors=7)
    parts = sorted(tmp_path.glob("m-*.gguf"))
    data = parts[-1].read_bytes()
    parts[-1].write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError) as cut:
        load_model(str(parts[0]), quantization="q4", dtype="float32", progress=False)
    assert cut.value.one_line().startswith(f"cannot read the weights of {parts[-1].name}: ")
    assert cut.value.one_line().endswith(" — download the .gguf again (a cut or damaged file reads this way)")


PEAK = """
import json, sys
from specdec_cli.models import load_model

def peak_kib():  # VmHWM: this process's own peak (ru_maxrss keeps the parent's across exec)
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])

before = peak_kib()
loaded = load_model(sys.argv[1], quantization="q4", dtype="float32", progress=False)
after = peak_kib()
linears = [module for module in loaded.model.modules() if hasattr(module, "packed_weight")]
print(json.dumps({"before": before, "after": after,
                  "float_bytes": sum(4 * layer.in_features * layer.out_features for layer in linears)}))
"""


@pytest.mark.slow
def test_loading_in_place_holds_no_whole_model_float_copy_at_its_peak(tmp_path, specdec_home):
    """Linear layers of 4 layers x 2048 x 8192 (~1 GiB in float32, a seventh of it in q4): the load's peak growth —
    the file's mapped pages (~0.2 GiB), the q4 layers and one tensor's temporaries — stays well under the
    whole-model float copy that the conversion made (a load that dequantised every tensor first would pass it)."""
    path = tmp_path / "wide.gguf"
    build_4bit_gguf(path, kinds={"ffn_down": "Q6_K"}, sizes=(2048, 8192, 4))
    run = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "SPECDEC_HOME": str(specdec_home)}, check=True)
    peak = json.loads(run.stdout.splitlines()[-1])
    grown = (peak["after"] - peak["before"]) * 1024
    assert peak["float_bytes"] > 0.9 * 2**30 and grown < 0.6 * peak["float_bytes"], peak


SERVED = """
import json, sys
from specdec_cli.engine.kv import CachedModel
from specdec_cli.models import load_model

def peak_kib():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])

before = peak_kib()
loaded = load_model(sys.argv[1], quantization="q4", dtype="float32", progress=False)
CachedModel(loaded.model).extend([1, 2, 3], 1)  # a forward: every weight read
print(json.dumps({"grown": (peak_kib() - before) * 1024}))
"""


@pytest.mark.slow
def test_a_load_and_its_first_forward_hold_about_the_files_bytes(tmp_path, specdec_home):
    """A 159 MiB file (4 layers x 2048 x 8192, Q4_K with Q6_K ffn_down and output): the first load (layers made from
    the file and stored) and a later one (read back from the stored layers), each with a forward, grow this
    process's peak by about the file's size, not twice it: the file's pages are let go as each layer is made, a large
    layer is made a piece at a time, and q/k/v and gate/up are stored fused instead of copied as they fuse (before,
    x3.1 and x1.8 here; now x1.9 and x1.2: the rest is the tokenizer and the scratch of a forward)."""
    path = tmp_path / "wide.gguf"
    build_4bit_gguf(path, kinds={"ffn_down": "Q6_K", "output": "Q6_K"}, sizes=(2048, 8192, 4))
    grown = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", SERVED, str(path)], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "SPECDEC_HOME": str(specdec_home)}, check=True)
        grown.append(json.loads(run.stdout.splitlines()[-1])["grown"] / path.stat().st_size)
    assert grown[0] < 2.3 and grown[1] < 1.4, grown


def test_the_config_and_tokenizer_read_from_a_file_are_kept_for_the_next_load(tmp_path, specdec_home, monkeypatch):
    """A first load keeps what it read from the file's metadata (config, tokenizer); the next load reads them back
    without parsing the file's metadata (gguf's reader made to fail) and is the same model and tokenizer. A changed
    file is read again."""
    import gguf

    from specdec_cli.models.loading import gguf as gguf_files

    path = tmp_path / "m.gguf"
    build_4bit_gguf(path)
    first = load_model(str(path), quantization="q4", dtype="float32", progress=False)
    assert gguf_files.kept_metadata(path) is not None
    gguf_files._config_of.cache_clear()

    def unread(*args, **kwargs):
        raise AssertionError("the file's metadata was parsed again")

    with monkeypatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", unread)
        again = load_model(str(path), quantization="q4", dtype="float32", progress=False)
    assert again.model.config.to_dict() == first.model.config.to_dict()
    texts = ["hello world", "def f(x):\n    return x  # ü", "<|im_start|>user"]
    assert [again.tokenizer.encode(text) for text in texts] == [first.tokenizer.encode(text) for text in texts]
    chat = [{"role": "user", "content": "hi"}]
    assert (again.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == first.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert again.eos_token_ids == first.eos_token_ids
    assert torch.equal(again.model(IDS).logits, first.model(IDS).logits)
    build_4bit_gguf(path, seed=1)  # another file at the same path
    assert gguf_files.kept_metadata(path) is None


@pytest.mark.parametrize("kind, kinds, embedding", [("Q4_K", {}, "Q4_K"), ("Q8_0", {}, "F32"),
                                                   ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q8_0"}, "Q6_K")])
def test_the_memory_pre_flight_counts_a_file_read_in_place_by_its_own_sizes(tmp_path, specdec_home, kind, kinds,
                                                                            embedding):
    """What the pre-flight expects a .gguf read in place to hold is what the loaded model holds (its layers' and
    tensors' bytes, the mapped embedding's), to within the spare for fused layers of mixed types: neither a float32
    embedding nor q4's 5 bits a weight for an 8.5-bit Q8_0 file."""
    path = tmp_path / "m.gguf"
    build_4bit_gguf(path, kind=kind, kinds=kinds, embedding=embedding, sizes=(512, 1024, 2))
    plan = loading._plan(str(path), "cpu", "float32", "q4", False, False, False)
    expected = loading._weight_bytes(plan)
    model = load_model(str(path), quantization="q4", dtype="float32", progress=False).model
    rows = model.get_input_embeddings()
    held = preflight.held_weight_bytes(model) + (np.asarray(rows.blocks).nbytes if isinstance(rows, BlockRows) else 0)
    assert held <= expected <= 1.25 * held, (held, expected)
