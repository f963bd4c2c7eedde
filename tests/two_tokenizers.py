"""Two tiny tokenizers of different families for cross-vocabulary drafting, and models that read text through them.

- `target_tokenizer`: a byte-level BPE (GPT-2 / Qwen style) trained on one corpus, ChatML special tokens.
- `draft_tokenizer`: a SentencePiece-style BPE (▁ for a space, Llama 2 style) trained with other merges on another
  corpus, with byte fallback (<0x00>..<0xFF>: a character it never saw is spelled in bytes), a BOS of its own that
  it puts before every text, and more special tokens (</s> as EOS, <unk>, <|extra_0|>, and ChatML's).

`TextOracle` is a causal LM behind the transformers interface whose next token is the first token of its tokenizer's
tokenisation of a reference text from where the text so far ends: a target that writes that text, and a draft that
agrees with it but where its own reference differs. Its cache holds the ids (as TrigramLM's in conftest.py), so
rollbacks crop it like a transformer's. `BigramLM` is a random bigram LM for distribution tests (exact marginals by
matrix products)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from transformers import LlamaConfig

from tests.tiny import CHAT_TEMPLATE

TARGET_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day long.",
    "Speculative decoding drafts several tokens and the target verifies them in one pass.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n",
    "Hello, how are you today? I am fine, thank you, and you?",
] * 3
DRAFT_CORPUS = [
    "Tokenizers of other families split words elsewhere: unbelievable, understanding, overdraft.",
    "A small draft model writes ahead; the large target model checks every word it wrote.",
    "quick quickly quicker; brown browner; jumping jumped jumps; sleeping sleepy slept.",
    "return returns returned; print printing printed; range ranges; verify verified verifies.",
] * 3
TARGET_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DRAFT_SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|extra_0|>"]


def target_tokenizer(vocab_size: int = 300, corpus: list[str] | None = None, specials_last: bool = False):
    """Byte-level BPE: the 256 byte characters, the special tokens, then merges learnt from `corpus` (TARGET_CORPUS);
    `specials_last`: the special tokens after the merges instead (the highest ids, as Qwen's and Llama 3's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[] if specials_last else TARGET_SPECIAL,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus or TARGET_CORPUS, trainer=trainer)
    if specials_last:
        backend.add_special_tokens(TARGET_SPECIAL)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def draft_tokenizer(merges_vocab: int = 160):
    """SentencePiece-style BPE with byte fallback: ▁ for spaces, merges from DRAFT_CORPUS, every byte as <0xNN>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=merges_vocab, special_tokens=DRAFT_SPECIAL, show_progress=False)
    learner.train_from_iterator(DRAFT_CORPUS, trainer=trainer)
    learnt = json.loads(learner.to_str())["model"]
    vocab = dict(learnt["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in learnt["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.add_special_tokens(DRAFT_SPECIAL)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", additional_special_tokens=["<|extra_0|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class _IdsBody(torch.nn.Module):
    """Keeps the ids in a real DynamicCache (as their 'keys') and returns the whole sequence so far."""

    def forward(self, input_ids, cache):
        new = input_ids.float()[:, None, :, None]  # (1, 1, T, 1)
        keys, _ = cache.update(new, new, 0)
        return keys[0, 0, :, 0].long()  # (L,)


class TextOracle(torch.nn.Module):
    """Greedy: the first token of `tokenizer`'s tokenisation of `reference` from where the text so far ends: at its
    length in characters (a draft whose reference differs in a few same-length places stays in step), EOS past the
    reference's end; or, with `follow`, after the reference's first occurrence of the longest end of the text (up
    to 12 characters) that it holds, from its start where none. Answers are memoised per ids."""

    def __init__(self, tokenizer, reference: str, lookahead: int = 24, follow: bool = False) -> None:
        super().__init__()
        self.tokenizer, self.reference, self.lookahead, self.follow = tokenizer, reference, lookahead, follow
        self.answers: dict[tuple[int, ...], int] = {}
        self.body = _IdsBody()
        self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)  # a device and a dtype
        self.config = LlamaConfig(num_hidden_layers=1, vocab_size=len(tokenizer), max_position_embeddings=4096)
        self.forwards = 0

    def next_token(self, ids: list[int]) -> int:
        key = tuple(ids)
        if key not in self.answers:
            self.answers[key] = self._next_token(ids)
        return self.answers[key]

    def _done(self, text: str) -> int:
        """Where in the reference the text so far ends."""
        if not self.follow:
            return len(text)
        for length in range(min(12, len(text)), 0, -1):
            found = self.reference.find(text[-length:])
            if 0 <= found and found + length < len(self.reference):
                return found + length
        return 0

    def _next_token(self, ids: list[int]) -> int:
        done = self._done(self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))
        if done >= len(self.reference):
            return self.tokenizer.eos_token_id
        rest = self.reference[done: done + self.lookahead]
        anchored = self.tokenizer.encode("\n" + rest, add_special_tokens=False)
        anchor = self.tokenizer.encode("\n", add_special_tokens=False)
        return anchored[len(anchor)] if anchored[: len(anchor)] == anchor else self.tokenizer.encode(
            rest, add_special_tokens=False)[0]

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, **kwargs):
        self.forwards += 1
        ids = self.body(input_ids, cache).tolist()
        rows = logits_to_keep or input_ids.shape[1]
        logits = torch.zeros(1, rows, self.config.vocab_size)
        for row in range(rows):
            end = len(ids) - rows + row + 1
            logits[0, row, self.next_token(ids[:end])] = 10.0
        return SimpleNamespace(logits=logits)


class BigramLM(torch.nn.Module):
    """Random bigram logits `table[a]` for the id after a, -inf outside `support` (every row): the marginals of
    each generated position live on those ids, few enough for a chi-square at 20,000 draws."""

    def __init__(self, vocab_size: int, support: list[int], seed: int, scale: float = 1.5) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        table = torch.full((vocab_size, vocab_size), float("-inf"))
        table[:, support] = torch.randn(vocab_size, len(support), generator=generator) * scale
        self.table = table
        self.body = _IdsBody()
        self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.config = LlamaConfig(num_hidden_layers=1, vocab_size=vocab_size, max_position_embeddings=4096)

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, **kwargs):
        ids = self.body(input_ids, cache)
        rows = logits_to_keep or input_ids.shape[1]
        return SimpleNamespace(logits=self.table[ids[-rows:]][None])  # (1, rows, V)
