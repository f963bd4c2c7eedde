"""Popular architectures beside Llama and Qwen2 (runtime/architectures.py), each a tiny random model of its
transformers class built here (tests/conftest.py's OTHER_ARCHITECTURES), its norms' weights drawn at random so that a
norm applied in the wrong place shows.

On the fast path (Qwen3's per-head q/k norms, Mistral, Phi-3's fused projections and Phi-4-mini's rotary embedding
over part of each head, Llama 3's rope scaling, Gemma 2's
soft-capped attention and logits, Gemma 3's q/k norms and two rotary tables, both Gemmas' four norms of 1 + weight,
GELU and sliding-window layers beside global ones): an int8 or q4 model's logits, prefill and then token by token over
the engine's cache, are transformers' own forward's on the same weights up to rounding, the whole decoder in C where
no layer has a sliding window, else its layers one by one in C; a batch of two (the torch lean path) too; a verify
gives the one-token logits bit for bit; and speculative greedy decoding is the target alone's. Another architecture
(Granite here) and a Llama whose MLP takes the exact GELU keep transformers' layers, and the load line says so in one
part."""

import copy

import pytest
import torch
from transformers import DynamicCache

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.kv import CachedModel
from specdec_cli.models.loading.loaded import LoadedModel
from specdec_cli.models.runtime import decoder_stack
from specdec_cli.models.runtime.lean_layers import lean_forward
from specdec_cli.models.runtime.quantize import quantize

from tests.conftest import hf_greedy, tiny_causal_lm

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.kernels]

WINDOWED = ["gemma2", "gemma3", "mistral-window"]  # sliding-window layers (an 8-token window)
FAST = ["qwen3", "mistral", "phi3", "phi3-partial", "llama3", *WINDOWED]
SLOW = {  # architecture → what its load line says
    "granite": "transformers' layers (no fast path for granite)",
    "llama-gelu": "transformers' layers (its gelu MLP has no fast path)",
}
IDS = [1] + [(7 * i + 2) % 90 + 3 for i in range(40)]
PROMPT = 30  # tokens read in one forward before the rest go one at a time


def _model(arch: str, seed: int = 0, hidden: int = 64) -> torch.nn.Module:
    model = tiny_causal_lm(arch.removesuffix("-window"), seed=seed, layers=2, hidden=hidden, logit_scale=8.0)
    if arch == "mistral-window":
        model.config.sliding_window = 8
    generator = torch.Generator().manual_seed(seed)
    gemma = arch.startswith("gemma")  # its norms scale by 1 + weight
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.copy_(torch.rand(weight.shape, generator=generator) - (0.5 if gemma else -0.5))
    return model


def _fast_and_transformers(arch: str, quantization: str, monkeypatch) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model as specdec runs it, the same weights in transformers' own layers and eager attention)."""
    model = _model(arch)
    fast = quantize(copy.deepcopy(model), quantization)
    with monkeypatch.context() as patch:
        patch.setattr(decoder_stack, "use_lean_layers", lambda model: model)
        plain = quantize(copy.deepcopy(model), quantization, exact_rows=False)
    assert plain.config._attn_implementation == "eager"
    return fast, plain


def _prefill_then_steps(fast: torch.nn.Module, plain: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(V,) logits after IDS[:PROMPT] and after each token past it: (the engine's cache, transformers' own), each
    (len(IDS) - PROMPT + 1, V)."""
    runner = CachedModel(fast)
    ours = [runner.extend(IDS[:end], 1)[0] for end in range(PROMPT, len(IDS) + 1)]
    cache = DynamicCache(config=plain.config)
    with torch.no_grad():
        theirs = [plain(input_ids=torch.tensor([IDS[:PROMPT]]), cache=cache).logits[0, -1]]
        theirs += [plain(input_ids=torch.tensor([[token]]), cache=cache).logits[0, -1] for token in IDS[PROMPT:]]
    return torch.stack(ours), torch.stack(theirs)


def _verify_and_decode(model: torch.nn.Module, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of IDS' last `rows` positions: (one verify forward after the rest, one forward per token)."""
    verifier, decoder = CachedModel(model), CachedModel(model)
    verifier.extend(IDS[:-rows], 1)
    verified = verifier.extend(IDS, rows)
    decoder.extend(IDS[:-rows], 1)
    decoded = [decoder.extend(IDS[:end], 1)[0] for end in range(len(IDS) - rows + 1, len(IDS) + 1)]
    return verified, torch.stack(decoded)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
@pytest.mark.parametrize("arch", FAST)
def test_the_fast_path_gives_transformers_logits(arch, quantization, monkeypatch):
    fast, plain = _fast_and_transformers(arch, quantization, monkeypatch)
    assert decoder_stack.slow_path(fast) is None
    stacked = getattr(fast.model.forward, "__func__", None) is decoder_stack.stack_forward
    assert stacked == (arch not in WINDOWED)
    ours, theirs = _prefill_then_steps(fast, plain)
    if stacked:
        assert fast.model._c_stack[1] is not None  # the whole decoder ran in C
    assert all(layer._c_projections[1] is not None for layer in fast.model.layers)  # else each layer did
    # Up to rounding (the C norm's double sum, SiLU's and GELU's exp): ~1e-6 on these models, where a rotary embedding
    # without Llama 3's scaling is 0.046 off. q4's activations are quantised per group of 32, so a last-bit
    # difference can move one a whole step: 0.023 on Gemma 2's last rows.
    assert torch.allclose(ours, theirs, atol=2e-3 if quantization == "int8" else 0.05), (ours - theirs).abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    rows = torch.tensor([IDS[:20], IDS[20:40]])  # a batch of two: the lean layers in torch
    with torch.no_grad():
        ours, theirs = fast(rows).logits, plain(rows).logits
    assert torch.allclose(ours, theirs, atol=0.05), (ours - theirs).abs().max()  # here one such step: 0.012


@pytest.mark.parametrize("arch", SLOW)
def test_transformers_layers_give_transformers_logits(arch, monkeypatch):
    """A model the fast path does not compute keeps transformers' layers, with attention row by row: transformers'
    eager logits up to rounding."""
    fast, plain = _fast_and_transformers(arch, "q4", monkeypatch)
    ours, theirs = _prefill_then_steps(fast, plain)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    assert getattr(fast.model.layers[0].forward, "__func__", None) is not lean_forward  # transformers' layers


@pytest.mark.parametrize("quantization", ["int8", "q4"])
@pytest.mark.parametrize("arch", FAST + list(SLOW))
def test_a_verify_gives_the_one_token_logits_bit_for_bit(arch, quantization):
    verified, decoded = _verify_and_decode(quantize(_model(arch), quantization))
    assert torch.equal(verified, decoded)


@pytest.mark.parametrize("arch", FAST + list(SLOW))
def test_speculative_greedy_is_the_q4_target_alone(arch):
    """Sliding-window models included: the engine's cache keeps every key of a sliding layer, so a rollback after a
    rejected draft finds the keys it needs (transformers' sliding layer dropped them)."""
    target = quantize(_model(arch), "q4")
    draft = quantize(_model(arch, seed=1, hidden=32), "q4", exact_rows=False)
    result = SpeculativeDecoder(target, DraftModelDrafter(draft), FixedK(3)).generate(IDS[:20], SamplingParams(), 16)
    assert result.tokens == hf_greedy(target, IDS[:20], 16)


@pytest.mark.parametrize("arch, says", list(SLOW.items()) + [("qwen3", None), ("gemma3", None)])
def test_the_load_line_says_when_transformers_layers_run(arch, says):
    model = quantize(_model(arch), "q4")
    loaded = LoadedModel(model=model, tokenizer=None, name="m", source="m", device=torch.device("cpu"),
                         dtype=torch.float32, quantization="q4", eos_token_ids=(2,), vocab_size=96)
    line = loaded.describe("target")
    assert "\n" not in line
    if says is None:
        assert "transformers' layers" not in line
    else:
        assert line.endswith(" · " + says), line


@pytest.mark.parametrize("arch, sizes", [("qwen3", (512, 512, 2)), ("phi3", (256, 512, 2))])
def test_a_gguf_read_in_place_runs_the_fast_path(tmp_path, specdec_home, arch, sizes):
    """A Qwen3 `.gguf` in q4 (its 4-bit blocks kept, its q/k norms among the float tensors; heads 128 wide, the
    width transformers' GGUF config assumes) and a Phi-3 one (q/k/v and gate/up fused in the file too) are
    transformers' own conversion of the file and run the whole decoder in C, a verify the one-token logits bit for
    bit."""
    from specdec_cli.models import load_model

    from tests.models.test_gguf_in_place import _converted, _differences, _read_in_place
    from tests.tiny import build_4bit_gguf

    path = tmp_path / f"{arch}.gguf"
    build_4bit_gguf(path, arch=arch, kind="Q4_K", sizes=sizes)
    assert _differences(_read_in_place(path), _converted(path)) == []
    loaded = load_model(str(path), quantization="q4", dtype="float32", progress=False)
    assert "transformers' layers" not in loaded.describe("target")
    verified, decoded = _verify_and_decode(loaded.model)
    assert loaded.model.model._c_stack[1] is not None and torch.equal(verified, decoded)


def test_a_gemma3_gguf_read_in_place_holds_its_norms_and_runs_its_layers_in_c(tmp_path, specdec_home):
    """A Gemma 3 `.gguf` in q4: its norms are stored as 1 + weight, which transformers' Gemma processor takes back
    (gguf_model's map names the gemma3_text config's processor gemma3), its tied output layer is q4 of the embedding;
    its layers run in C and a verify is the one-token logits bit for bit."""
    from specdec_cli.models import load_model

    from tests.models.test_gguf_in_place import _converted, _differences, _read_in_place
    from tests.tiny import build_gemma3_gguf

    path = tmp_path / "gemma3.gguf"
    build_gemma3_gguf(path)
    assert _differences(_read_in_place(path), _converted(path), requantised=("lm_head",)) == []
    loaded = load_model(str(path), quantization="q4", dtype="float32", progress=False)
    assert "transformers' layers" not in loaded.describe("target")
    verified, decoded = _verify_and_decode(loaded.model)
    assert torch.equal(verified, decoded)
    assert all(layer._c_projections[1] is not None for layer in loaded.model.model.layers)


def test_a_folder_of_another_architecture_loads_through_transformers_and_says_so(tmp_path, specdec_home):
    """The whole load (a safetensors folder, q4): a Granite model keeps transformers' layers, decodes, and its load
    line, one line, ends by saying so."""
    from specdec_cli.models import load_model

    from tests.tiny import build_tokenizer

    _model("granite").save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path), quantization="q4", dtype="float32", progress=False)
    line = loaded.describe("target")
    assert "\n" not in line and line.endswith(" · " + SLOW["granite"]), line
    verified, decoded = _verify_and_decode(loaded.model)
    assert torch.equal(verified, decoded)


@pytest.mark.parametrize("in_c", [True, False])
def test_soft_capped_attention_rows_are_eagers_and_each_rows_own(in_c, monkeypatch):
    """Gemma 2's soft-capped attention, row by row (runtime/attention.py): in C (attention.c's softcap) and in torch
    (where C does not run) transformers' eager soft-capped attention up to rounding, under a causal mask and a tree's;
    each row of a 6-row call bit for bit what a one-row call over its visible keys gives."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from specdec_cli.models.native import binding
    from specdec_cli.models.runtime.attention import rowwise_attention_forward

    if not in_c:
        monkeypatch.setattr(binding, "library", lambda: (None, 0, "no C here"))
    generator = torch.Generator().manual_seed(4)
    query = torch.randn(1, 4, 6, 16, generator=generator) * 3  # large scores, so the cap bites
    key, value = (torch.randn(1, 2, 21, 16, generator=generator) * 3 for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    tree = torch.ones(1, 1, 6, 21, dtype=torch.bool).tril(15)
    tree[0, 0, 4, 19] = False  # row 4 does not see key 19 (a sibling's)
    for mask in (None, tree):
        ours, _ = rowwise_attention_forward(module, query, key, value, mask, scaling=0.25, softcap=2.0)
        visible = torch.ones(6, 21, dtype=torch.bool).tril(15) if mask is None else mask[0, 0]
        additive = torch.zeros(1, 1, 6, 21).masked_fill(~visible, float("-inf"))
        theirs, _ = eager_attention_forward(module, query, key, value, additive, scaling=0.25, softcap=2.0)
        assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
        for row in range(6):
            own = visible[row].nonzero().flatten()
            alone, _ = rowwise_attention_forward(module, query[:, :, row:row + 1], key[:, :, own].contiguous(),
                                                 value[:, :, own].contiguous(), None, scaling=0.25, softcap=2.0)
            assert torch.equal(ours[:, row], alone[:, 0]), row


def test_gemma3_with_a_vision_tower_runs_its_text_layers_on_the_fast_path(monkeypatch):
    """Gemma 3 from 4B up loads as Gemma3ForConditionalGeneration (model type gemma3, the text config inside): its
    text layers take the fast path, with transformers' logits and a verify the one-token logits bit for bit."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from tests.conftest import OTHER_ARCHITECTURES, VOCAB

    text = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            **OTHER_ARCHITECTURES["gemma3"][1])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=95,
                          boi_token_index=93, eoi_token_index=94)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    fast = quantize(copy.deepcopy(model), "q4")
    with monkeypatch.context() as patch:
        patch.setattr(decoder_stack, "use_lean_layers", lambda model: model)
        plain = quantize(copy.deepcopy(model), "q4", exact_rows=False)
    layers = fast.model.language_model.layers
    assert decoder_stack.slow_path(fast) is None and all(layer.forward.__func__ is lean_forward for layer in layers)
    ours, theirs = _prefill_then_steps(fast, plain)
    assert torch.allclose(ours, theirs, atol=0.05), (ours - theirs).abs().max()
    assert all(layer._c_projections[1] is not None for layer in layers)
    verified, decoded = _verify_and_decode(fast)
    assert torch.equal(verified, decoded)


@pytest.mark.parametrize("rope", ["llama3", "yarn", "linear"])
def test_the_rotary_table_holds_a_scaled_ropes_own_numbers(rope):
    """Llama 3's rope scaling (and yarn's, linear's) has fixed frequencies: the decoder stack's rotary table rows are
    the rotary module's own numbers for those positions, bit for bit, past the table's first size; the stack reads
    them from the table."""
    decoder = tiny_causal_lm("llama3", layers=1).model
    if rope != "llama3":
        decoder.config.rope_parameters = {"rope_type": rope, "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 64}
        decoder.rotary_emb = type(decoder.rotary_emb)(decoder.config)
    assert decoder.rotary_emb.rope_type == rope
    hidden, first = torch.zeros(1, 1, decoder.config.hidden_size), 0
    for tokens in [1, 2, 7, 16, 1] * 40 + [1200, 3]:
        states = hidden.expand(1, tokens, -1)
        positions = torch.arange(first, first + tokens).unsqueeze(0)
        table = decoder_stack._rotary_rows(decoder, states, positions, first)
        own = decoder.rotary_emb(states, positions)
        assert all(torch.equal(row, part) for row, part in zip(table, own)), (first, tokens)
        first += tokens
    assert decoder._rotary_table[1][0].shape[1] >= first > decoder_stack.ROTARY_ROWS


@pytest.mark.parametrize("arch", ["qwen3", "phi3-partial"])
def test_a_q4_batch_of_a_new_architecture_gives_each_row_what_batch_one_gives_it(arch):
    """The batched engine packs rows into one sequence under a boolean mask, which the C stack takes: a Qwen3 (q/k
    norms) and a Phi-4-mini-shaped (partial rotary) q4 target give every row what it gets alone, greedy rows the
    target alone's tokens."""
    from tests.conftest import perturbed_copy
    from tests.engine.test_batched_q4 import BUDGETS, SAMPLED, alone, batch_of, requests

    float_target = _model(arch)
    target = quantize(float_target, "q4")
    draft = quantize(perturbed_copy(float_target, noise=0.15, seed=7), "q4", exact_rows=False)
    wanted = requests()
    batched = batch_of(target, draft, "model", 3, batch_size=3).generate_many(wanted)
    one_by_one = [batch_of(target, draft, "model", 3, batch_size=3).generate_many([request])[0] for request in wanted]
    assert [len(result.tokens) for result in batched] == BUDGETS
    assert [result.tokens for result in batched] == [result.tokens for result in one_by_one]
    greedy = [index for index in range(len(wanted)) if index not in SAMPLED]
    assert [batched[index].tokens for index in greedy] == [alone(target, wanted[index]) for index in greedy]
    assert target.model._c_stack[1] is not None and sum(result.stats.accepted for result in batched) > 0
