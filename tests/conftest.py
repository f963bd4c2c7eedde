"""Tiny random models for engine tests: built in memory from configs, seeded, fp32, CPU.

Builders for tokenizers and saved model folders live in tests/tiny.py."""

from __future__ import annotations

import os
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.isolation import module_specdec_home, specdec_home  # noqa: F401  (autouse: no test writes the real cache)

VOCAB = 96

# Under pytest-xdist (`-n auto` in pyproject's addopts) each worker takes its share of the cores for torch's threads:
# two workers of two threads each on two cores would oversubscribe them, and OpenMP's waits then cost far more.
WORKER_MEMORY = 8 * 2**30  # a worker may load the real demo pair (and a test beside it): about this much at its peak


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)  # a run with -p no:xdist has no such hook
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker per core, as many as the memory holds at WORKER_MEMORY each (two on CI's 2 cores and
    24 GiB)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(_cores(), memory // WORKER_MEMORY))


if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# A kernel test may skip in CI only where the CPU lacks the instructions it tests, and its reason names them:
# "this CPU has no AMX", "this CPU has neither AVX512-VNNI nor AVX2".
MISSING_ISA = re.compile(r"\bthis CPU has (?:no|neither) (?:AVX2|AVX512-VNNI|VNNI|AMX)")
# Modules the test extra installs: in CI an importorskip of one (at module level too) fails.
TEST_EXTRA_IMPORTS = re.compile(r"could not import '(bitsandbytes|gguf)'")


def _skip_reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def ci_failure(skip_reason: str, real: bool, kernels: bool) -> str | None:
    """Why a skip with this reason fails in CI (None: it may skip there)."""
    if real:
        return f"a real-pair test skipped in CI ({skip_reason}): CI must run every real test"
    if kernels and not MISSING_ISA.search(skip_reason):
        return (f"a kernel test skipped in CI ({skip_reason}): CI must run specdec's kernels wherever the CPU has "
                f"their instructions")
    if TEST_EXTRA_IMPORTS.search(skip_reason):
        return f"skipped in CI ({skip_reason}): the test extra installs it"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (the CI environment variable set), a skip that hides a missing part fails instead: a `real` test's (a
    machine without the demo pair must not pass for one that ran it), a `kernels` test's unless the CPU lacks the
    instructions, and an importorskip of a module the test extra installs."""
    outcome = yield
    report = outcome.get_result()
    # An xfail is reported as skipped with `wasxfail`: a known bug the test records, not a part missing here.
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        why = ci_failure(_skip_reason(report), item.get_closest_marker("real") is not None,
                         item.get_closest_marker("kernels") is not None)
        if why is not None:
            report.outcome = "failed"
            report.longrepr = why


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """In CI, a module-level importorskip of a module the test extra installs fails its collection (which stops the
    run: CI's environment lacks what the suite needs)."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped:
        why = ci_failure(_skip_reason(report), real=False, kernels=False)
        if why is not None:
            report.outcome = "failed"
            report.longrepr = why


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a shared CPU oversubscribed threads make each forward
    many times slower. Use it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_causal_lm(arch: str = "llama", vocab_size: int = VOCAB, seed: int = 0, layers: int = 2,
                   hidden: int = 64, logit_scale: float = 1.0) -> torch.nn.Module:
    """A random causal LM. `logit_scale` sharpens its output layer so greedy decoding is stable and
    a draft built from the same seed agrees with the target often (not always)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    elif arch in OTHER_ARCHITECTURES:
        model = _other_architecture(arch, common)
    else:
        raise ValueError(arch)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.eval()


# Architectures beside Llama and Qwen2 (tests/models/test_architectures.py): model_type → (class name, config
# changes from `common`). Each as its popular checkpoints configure it, where that matters to the fast path.
OTHER_ARCHITECTURES = {
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 16}),  # q/k norms per head
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),  # Mistral 7B v0.2 on: no window
    "phi3": ("Phi3ForCausalLM", {"sliding_window": None}),  # fused qkv and gate_up
    "llama3": ("LlamaForCausalLM", {"rope_parameters": {  # Llama 3.1's rope scaling
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "gemma2": ("Gemma2ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                     "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0,
                                     "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3": ("Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                     "hidden_activation": "gelu_pytorch_tanh",
                                     "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3-partial": ("Phi3ForCausalLM", {"sliding_window": None, "partial_rotary_factor": 0.5}),  # Phi-4-mini's kind
    "granite": ("GraniteForCausalLM", {}),  # an architecture without a fast path
    "llama-gelu": ("LlamaForCausalLM", {"hidden_act": "gelu"}),  # an activation the C layers do not compute
}


def _other_architecture(arch: str, common: dict) -> torch.nn.Module:
    import transformers

    name, changes = OTHER_ARCHITECTURES[arch]
    model_class = getattr(transformers, name)
    config = model_class.config_class(**{**common, **changes})
    config._attn_implementation = "eager"  # Gemma 2's soft-capping runs in eager only; the others give the same
    return model_class(config)


@pytest.fixture(scope="session")
def llama_target():
    return tiny_causal_lm("llama", seed=0, logit_scale=8.0)


@pytest.fixture(scope="session")
def llama_draft():
    """A different random model: low acceptance."""
    return tiny_causal_lm("llama", seed=1, logit_scale=8.0)


@pytest.fixture(scope="session")
def qwen_target():
    return tiny_causal_lm("qwen2", seed=2, logit_scale=8.0)


@pytest.fixture(scope="session")
def qwen_draft():
    return tiny_causal_lm("qwen2", seed=3, hidden=32, logit_scale=8.0)


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int = 0) -> torch.nn.Module:
    """The model with Gaussian noise added to every weight (relative to its scale): a draft that
    agrees with the target often but not always."""
    import copy

    torch.manual_seed(seed)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in twin.parameters():
            parameter.add_(torch.randn_like(parameter) * parameter.std().clamp_min(1e-3) * noise)
    return twin.eval()


@pytest.fixture(scope="session")
def llama_near_draft(llama_target):
    """The target with noise: medium acceptance, rejections at varied positions."""
    return perturbed_copy(llama_target, noise=0.15, seed=7)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: HF generate(do_sample=False), never stopping early."""
    output = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
    )
    return output[0, len(prompt):].tolist()


class _TrigramBody(torch.nn.Module):
    """The 'decoder' of TrigramLM: each position's hidden state is the one-hot code of its (previous id,
    id) pair, (1, T, V*V). A real DynamicCache holds the ids as its 'keys', so the first new position can
    see the id before it, and rollbacks crop it like a transformer's cache."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids, cache=None, use_cache=True, **kwargs):
        from types import SimpleNamespace

        new = input_ids.float()[:, None, :, None]  # (1, 1, T, 1)
        keys, _ = cache.update(new, new, 0)
        ids = keys[0, 0, :, 0].long()  # (L,) the whole sequence
        pairs = torch.cat([ids.new_zeros(1), ids])[-input_ids.shape[1] - 1:]  # (T+1,) the id before, then the new ids
        codes = pairs[:-1] * self.vocab_size + pairs[1:]  # (T,)
        hidden = torch.nn.functional.one_hot(codes, self.vocab_size**2).float()[None]  # (1, T, V*V)
        return SimpleNamespace(last_hidden_state=hidden)


class TrigramLM(torch.nn.Module):
    """A random trigram language model behind the transformers interface (forward with input_ids, cache=,
    logits_to_keep=; get_decoder / get_output_embeddings, so a subset head can wrap it). It is ~50x cheaper
    per forward than the smallest transformer, which makes 20,000-draw distribution tests affordable.
    `table[a, b]` holds the logits of the id after a, b."""

    def __init__(self, vocab_size: int, seed: int, scale: float = 1.0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        table = torch.randn(vocab_size, vocab_size, vocab_size, generator=generator) * scale  # (V, V, V)
        self.body = _TrigramBody(vocab_size)
        self.lm_head = torch.nn.Linear(vocab_size**2, vocab_size, bias=False)
        self.lm_head.weight = torch.nn.Parameter(table.reshape(vocab_size**2, vocab_size).T.contiguous(), requires_grad=False)
        self.config = LlamaConfig(num_hidden_layers=1, vocab_size=vocab_size)

    @property
    def table(self) -> torch.Tensor:
        vocab_size = self.config.vocab_size
        return self.lm_head.weight.T.reshape(vocab_size, vocab_size, vocab_size)

    def get_decoder(self) -> torch.nn.Module:
        return self.body

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, **kwargs):
        from types import SimpleNamespace

        hidden = self.body(input_ids, cache=cache).last_hidden_state  # (1, T, V*V)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.lm_head(hidden))  # (1, n, V)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Saved folders for command tests (load them with --dtype float32): a Qwen2-style target, a
    different random draft (`draft`: low acceptance, resampled tokens appear) and a copy of the
    target (`same`: every draft accepted), sharing one offline byte-level BPE tokenizer."""
    from types import SimpleNamespace

    from tests.tiny import build_tiny_model, build_tokenizer

    root = tmp_path_factory.mktemp("tiny-pair")
    tokenizer = build_tokenizer()
    build_tiny_model(root / "target", arch="qwen2", seed=0, tokenizer=tokenizer)
    build_tiny_model(root / "draft", arch="qwen2", seed=1, tokenizer=tokenizer)
    build_tiny_model(root / "same", arch="qwen2", seed=0, tokenizer=tokenizer)
    return SimpleNamespace(target=str(root / "target"), draft=str(root / "draft"), same=str(root / "same"))
