"""Test doubles for the engine: a deterministic fake model runner that keeps a
token-id "KV cache" (so wrong block tables or shared slots are caught), a
byte-level BPE tokenizer trained on the spot, and a manual clock."""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.token_bytes import TokenBytes
from worker.runner_io import ModelInput, ModelOutput

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, hello engine, hello batching and paged attention.",
    "你好，世界。今天天气很好。我们一起学习机器学习。",
    "日本語のテキストも少し。こんにちは世界。",
    "Emoji: 🚀🔥😀 rocket fire grin, 👍🏽 thumbs. 😀😀",
    "continuous batching keeps the accelerator busy; static batching waits.",
]


class FakeTokenizer:
    """The CONTRACTS.md tokenizer surface over a small byte-level BPE."""

    def __init__(self, hf: Tokenizer) -> None:
        self.hf = hf
        self.vocab_size = hf.get_vocab_size()
        self.special_token_ids = frozenset(hf.token_to_id(t) for t in SPECIALS)
        self.eos_token_ids = frozenset({hf.token_to_id("<|endoftext|>")})
        self.bos_token_id = None
        self.context_length = 2048
        self.model_name = "fake-bpe"
        self.token_bytes = TokenBytes(hf)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)


@functools.lru_cache(maxsize=1)
def fake_tokenizer() -> FakeTokenizer:
    """A ~400-token byte-level BPE: CJK characters and emoji are split
    across several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return FakeTokenizer(tok)


def _mix(values: list[int]) -> int:
    h = 1469598103934665603
    for v in values:
        h = ((h ^ (v + 1)) * 1099511628211) % (1 << 61)
    return h


def _follower(context: list[int]) -> int | None:
    """The token after the most recent earlier occurrence of ``context[-1]``, or None."""
    last = context[-1]
    for i in range(len(context) - 2, -1, -1):
        if context[i] == last:
            return context[i + 1]
    return None


class FakeRunner:
    """Deterministic stand-in for ModelRunner.

    Writes each fed token id into its KV slot (``block_id * block_size +
    offset``) and computes a row's logits from the whole context read back
    through the block table, so logits depend only on the sequence's tokens
    and any paging bug changes them (or trips an assertion: every slot read
    back must hold the position it is read for). Slots may be shared between
    sequences (prefix caching), so ownership is not checked; wrong sharing
    shows up as different tokens. The argmax is
    never a special token, except EOS (id 0) at context length ``eos_at``.
    With ``copying``, three rows in four favour the token that followed the last
    token's previous occurrence, so n-gram drafts are often but not always right.
    A verification chunk (``num_draft_tokens``) gets one row per token.
    """

    def __init__(self, num_blocks: int = 64, block_size: int = 4, vocab_size: int | None = None,
                 context_length: int = 512, special_ids: frozenset[int] = frozenset(), fail: bool = False,
                 eos_at: int | None = None, copying: bool = False) -> None:
        self.num_blocks = num_blocks
        self.copying = copying  # prompt-lookup-friendly: see _logits
        self.block_size = block_size
        self.vocab_size = vocab_size or fake_tokenizer().vocab_size
        self.context_length = context_length
        self.dtype = torch.float32
        self.allowed = [t for t in range(self.vocab_size) if t not in special_ids]
        self.allowed_set = frozenset(self.allowed)
        self.slots = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        self.pos = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        self.inputs: list[ModelInput] = []
        self.fail = fail
        self.eos_at = eos_at  # context length at which token 0 (EOS) is the argmax

    def _slot(self, table: list[int], pos: int) -> int:
        assert pos // self.block_size < len(table), f"position {pos} beyond block table {table}"
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, model_input: ModelInput) -> ModelOutput:
        if self.fail:
            raise RuntimeError("injected runner failure")
        self.inputs.append(model_input)
        for src, dst in model_input.blocks_to_copy:  # copy-on-write, before any write
            copied = slice(dst * self.block_size, (dst + 1) * self.block_size)
            origin = slice(src * self.block_size, (src + 1) * self.block_size)
            self.slots[copied], self.pos[copied] = self.slots[origin].clone(), self.pos[origin].clone()
        seq_ids, rows = [], []
        for chunk in model_input.chunks:
            assert len(set(chunk.block_table)) == len(chunk.block_table)
            for i, tok in enumerate(chunk.token_ids):
                slot = self._slot(chunk.block_table, chunk.start_pos + i)
                self.slots[slot], self.pos[slot] = tok, chunk.start_pos + i
            end = chunk.start_pos + len(chunk.token_ids)
            for n in range(end - chunk.num_logits + 1, end + 1):  # verification chunks: one row per token
                idx = torch.tensor([self._slot(chunk.block_table, p) for p in range(n)])
                assert self.pos[idx].tolist() == list(range(n)), "KV slot holds another position"
                seq_ids.append(chunk.seq_id)
                rows.append(self._logits(self.slots[idx].tolist()))
        logits = torch.stack(rows) if rows else torch.empty(0, self.vocab_size)
        return ModelOutput(seq_ids=seq_ids, logits=logits)

    def _logits(self, context: list[int]) -> torch.Tensor:
        h = _mix(context)
        g = torch.Generator().manual_seed(h)
        row = torch.randn(self.vocab_size, generator=g) * 2.0
        row[sorted(set(range(self.vocab_size)) - set(self.allowed))] = -30.0
        if len(context) == self.eos_at:
            row[0] = 40.0
        row[self.allowed[h % len(self.allowed)]] += 6.0
        if self.copying:
            follower = _follower(context)
            if follower is not None and follower in self.allowed_set and h % 4:
                row[follower] += 12.0  # three times in four: copy what followed the last token before
        return row


class ManualClock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
