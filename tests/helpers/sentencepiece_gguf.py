"""A real SentencePiece BPE model trained here, and its vocabulary written into a GGUF header
the way llama.cpp's convert_hf_to_gguf.py writes a Llama or Gemma vocabulary
(``_set_vocab_sentencepiece``: tokens, scores, token types, BOS/EOS/UNK/PAD ids, add BOS/EOS;
Gemma's converter also writes ``add_space_prefix = false``). Nothing downloaded: the corpus
is the Zen of Python plus a few lines of other scripts, and training takes well under a second.
"""

from __future__ import annotations

import codecs
import functools
import io
from dataclasses import dataclass

CONTROL_SYMBOLS = ("<start_of_turn>", "<end_of_turn>")
USER_DEFINED_SYMBOLS = ("<tool>",)
_EXTRA_LINES = (
    "Le café est très chaud, n'est-ce pas ? Où êtes-vous ?",
    "日本語のテキストと中文の文章です。東京は大きい。",
    "Привет, как дела? Всё хорошо.",
    "def main():\n    return 42\n\n\tindented\twith\ttabs",
    "x = 3.14159 * 2    # four spaces    inside",
)


@dataclass(frozen=True)
class SentencePieceVocab:
    """The trained model (serialized ``ModelProto``) and what a GGUF header stores of it."""

    model_proto: bytes
    tokens: list[str]
    scores: list[float]
    types: list[int]  # SentencePiece piece types, which are GGUF's token types
    bos_id: int
    eos_id: int
    unk_id: int


def _corpus() -> str:
    import this  # noqa: F401 - prints the Zen once on first import; its text is `this.s`, rot13

    zen = codecs.decode(this.s, "rot13")
    return "\n".join([zen] * 3 + list(_EXTRA_LINES) * 5)


@functools.lru_cache(maxsize=1)
def trained_vocab() -> SentencePieceVocab:
    """A 600-piece SentencePiece BPE model with byte fallback, identity normalization and no
    whitespace cleanup (Llama's ``tokenizer.model`` settings), ids unk 0, bos 1, eos 2, two
    control and one user-defined symbol."""
    import contextlib

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    out = io.BytesIO()
    with contextlib.redirect_stdout(io.StringIO()):
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(_corpus().split("\n")), model_writer=out, model_type="bpe",
            vocab_size=600, byte_fallback=True, character_coverage=1.0,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_digits=True, hard_vocab_limit=False,
            control_symbols=list(CONTROL_SYMBOLS), user_defined_symbols=list(USER_DEFINED_SYMBOLS),
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(out.getvalue())
    return SentencePieceVocab(
        model_proto=out.getvalue(), tokens=[p.piece for p in proto.pieces],
        scores=[p.score for p in proto.pieces], types=[int(p.type) for p in proto.pieces],
        bos_id=1, eos_id=2, unk_id=0)


def processor(vocab: SentencePieceVocab, *, add_dummy_prefix: bool):
    """``sentencepiece.SentencePieceProcessor`` of ``vocab``, its dummy prefix on or off (off:
    Gemma's tokenizer)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(vocab.model_proto)
    proto.normalizer_spec.add_dummy_prefix = add_dummy_prefix
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def add_sentencepiece_vocab(writer, vocab: SentencePieceVocab, *, add_space_prefix: bool = True,
                            add_bos: bool | None = True) -> None:
    """Write ``vocab`` into ``writer`` (a ``gguf.GGUFWriter``) as convert_hf_to_gguf.py does:
    ``tokenizer.ggml.model = "llama"``; ``add_space_prefix`` False writes that key (Gemma);
    ``add_bos`` None leaves the key out (llama.cpp then adds BOS)."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_unk_token_id(vocab.unk_id)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)
    if not add_space_prefix:
        writer.add_add_space_prefix(False)
