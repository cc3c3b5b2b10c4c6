"""SentencePiece BPE family: train a target-language model and append its pieces to the base.

Why scores matter: sentencepiece BPE has no merge list. While encoding it repeatedly joins the
adjacent pair whose concatenation is a piece with the highest score. An appended piece is
therefore reachable only if (a) some split of it into two pieces exists in the merged vocabulary,
recursively down to characters, and (b) its score lets that join win against competing joins.
We give the added pieces scores *above* every base piece, in the order the target-language
trainer learned them, so that on target-language text the merged model replays the target
model's merge order (the order that gave it its low fertility). English text is untouched
because only pieces that contain a target-script character are added, and such a piece can
never be formed from text without that script, whatever its score.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BPE_TYPE = 2
SPACE = "\u2581"


def load_proto(path: str | Path) -> Any:
    """Parse a ``.model`` file into a ``ModelProto`` (protobuf must be installed)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def check_bpe(proto: Any, where: str) -> None:
    """Refuse Unigram/word/char models: their pieces have no merge order to extend."""
    if proto.trainer_spec.model_type != BPE_TYPE:
        kinds = {1: "Unigram", 2: "BPE", 3: "word", 4: "char"}
        kind = kinds.get(proto.trainer_spec.model_type, str(proto.trainer_spec.model_type))
        raise ValueError(
            f"{where}: a SentencePiece {kind} model is not supported; supported families are"
            " SentencePiece BPE (tokenizer.model) and byte-level BPE (tokenizer.json, or a"
            " tiktoken/tekken json)"
        )


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    base: Any,
    character_coverage: float = 0.9995,
    input_sentence_size: int = 0,
    seed: int = 0,
    num_threads: int = 2,
) -> Any:
    """Train a sentencepiece BPE model in memory, mirroring the base's splitting rules.

    Digits, whitespace and script splitting follow the base so that every learned piece
    respects the boundaries the base tokenizer already assumes.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    spec = base.trainer_spec
    spm.set_random_generator_seed(seed)  # input_sentence_size sampling is then repeatable
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        seed_sentencepiece_size=1_000_000,
        max_sentence_length=1 << 20,
        max_sentencepiece_length=spec.max_sentencepiece_length or 16,
        split_digits=spec.split_digits,
        split_by_whitespace=spec.split_by_whitespace,
        split_by_unicode_script=spec.split_by_unicode_script,
        normalization_rule_name="identity",
        add_dummy_prefix=base.normalizer_spec.add_dummy_prefix,
        remove_extra_whitespaces=False,
        byte_fallback=False,
        hard_vocab_limit=False,
        num_threads=num_threads,
        minloglevel=2,
    )
    proto = pb.ModelProto()
    proto.ParseFromString(buf.getvalue())
    return proto


@dataclass
class MergeResult:
    """The merged model and what went into it."""

    proto: Any
    added: list[str]
    scores: dict[str, float]
    rescored_base: int
    skipped_in_base: int
    skipped_script: int
    skipped_no_path: int


def merge_pieces(base: Any, new: Any, max_added: int, script: Callable[[str], bool] | None) -> MergeResult:
    """Append the target model's normal pieces to a copy of ``base`` as NORMAL pieces.

    Kept: pieces absent from the base, passing the ``script`` test (when given), with at
    least one split into two pieces already present (so a join can build them); at most
    ``max_added``, taken in the target model's learning order (most useful first).
    """
    from sentencepiece import sentencepiece_model_pb2 as pb

    merged = pb.ModelProto()
    merged.CopyFrom(base)
    vocab = {p.piece for p in base.pieces}
    added: list[str] = []
    in_base = wrong_script = no_path = 0
    for p in new.pieces:
        if len(added) >= max_added:
            break
        if p.type != NORMAL:
            continue
        if p.piece in vocab:
            in_base += 1
        elif script is not None and not script(p.piece):
            wrong_script += 1
        elif len(p.piece) > 1 and not has_split(p.piece, vocab):
            no_path += 1
        else:
            vocab.add(p.piece)
            added.append(p.piece)
    scores = target_scores(base, new, script)
    rescored = set_added(merged, base, added, scores)
    return MergeResult(merged, added, scores, rescored, in_base, wrong_script, no_path)


def target_scores(base: Any, new: Any, script: Callable[[str], bool] | None) -> dict[str, float]:
    """Scores that replay the target model's merge order, all above every base score.

    The i-th piece the target trainer learned scores ``top + n - i``. Base pieces that hold a
    target-script character (``ال`` and friends) get their target-order score too: otherwise
    they would join last and block the paths the target model built on them. Their ids stay,
    and text without the script never meets them, so the base's own behaviour is unchanged.
    """
    top = max((p.score for p in base.pieces if p.type in (NORMAL, USER_DEFINED)), default=0.0)
    top = max(top, 0.0)
    normal = [p.piece for p in new.pieces if p.type == NORMAL and len(p.piece) > 1]
    return {piece: float(top + len(normal) - i) for i, piece in enumerate(normal) if script is None or script(piece)}


def set_added(merged: Any, base: Any, added: list[str], scores: dict[str, float]) -> int:
    """Replace whatever follows the base pieces with ``added``; apply ``scores``.

    Returns how many base pieces were re-scored (ids and pieces unchanged). An added piece
    without a target score (a single character) gets the lowest added score: characters are
    never joined into, only from.
    """
    del merged.pieces[len(base.pieces) :]
    rescored = 0
    if scores:
        for bp, mp in zip(base.pieces, merged.pieces):
            if bp.type == NORMAL and bp.piece in scores:
                mp.score = scores[bp.piece]
                rescored += 1
    floor = min(scores.values(), default=1.0)
    for piece in added:
        new = merged.pieces.add()
        new.piece = piece
        new.score = scores.get(piece, floor)
        new.type = NORMAL
    merged.trainer_spec.vocab_size = len(merged.pieces)
    return rescored


def has_split(piece: str, vocab: set[str]) -> bool:
    """Whether ``piece`` splits into two pieces that are both in ``vocab``."""
    return any(piece[:k] in vocab and piece[k:] in vocab for k in range(1, len(piece)))


def processor(proto: Any, add_dummy_prefix: bool | None = None) -> Any:
    """A ``SentencePieceProcessor`` over ``proto`` (optionally without the dummy prefix)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    if add_dummy_prefix is not None:
        copy = pb.ModelProto()
        copy.CopyFrom(proto)
        copy.normalizer_spec.add_dummy_prefix = add_dummy_prefix
        proto = copy
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def unreached(proto: Any, first_added: int, texts: list[str]) -> list[int]:
    """Ids of added pieces that neither their own text nor any of ``texts`` produces.

    A piece's own text is probed without the dummy prefix, so a word-internal piece is
    tested as itself rather than as the start of a word.
    """
    probe = processor(proto, add_dummy_prefix=False)
    n = len(proto.pieces)
    seen: set[int] = set()
    own = [proto.pieces[i].piece.replace(SPACE, " ") for i in range(first_added, n)]
    for i, ids in enumerate(probe.encode(own), start=first_added):
        if i in ids:
            seen.add(i)
    for ids in processor(proto).encode(texts):
        seen.update(ids)
    return [i for i in range(first_added, n) if i not in seen]


def prune_unreached(
    merged: Any, base: Any, added: list[str], scores: dict[str, float], texts: list[str], rounds: int = 4
) -> tuple[list[str], int]:
    """Drop added pieces that nothing produces, re-checking until none is left.

    Returns the surviving pieces and how many were unreachable before any pruning. Dropping
    a piece can strand another that needed it as an intermediate, hence the rounds.
    """
    first = len(base.pieces)
    dead = unreached(merged, first, texts)
    initial = len(dead)
    for _ in range(rounds):
        if not dead:
            break
        drop = {merged.pieces[i].piece for i in dead}
        vocab = {p.piece for p in base.pieces}
        kept = []
        for piece in added:
            if piece not in drop and (len(piece) == 1 or has_split(piece, vocab)):
                kept.append(piece)
                vocab.add(piece)
        added = kept
        set_added(merged, base, added, scores)
        dead = unreached(merged, first, texts)
    return added, initial
