"""SentencePiece BPE model -> HF fast tokenizer with identical ids.

transformers 5's own ``LlamaTokenizer`` conversion splits on whitespace before BPE, which
tokenizes runs of spaces differently from sentencepiece (e.g. ``"  x"``), and adds no BOS. Here
the BPE runs over the whole normalised string, as sentencepiece does, with merges ranked by
piece score (the order sentencepiece merges in), so both libraries give the same ids. Both the
bootstrap model and the extended tokenizers go through this one converter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

SPIECE_UNDERLINE = "\u2581"
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6


def load_proto(model_file: str | Path) -> Any:
    """Parse a ``.model`` file into a ``ModelProto`` (needs protobuf installed)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    return proto


def bpe_merges(proto: Any) -> list[tuple[str, str]]:
    """Every merge that can build a normal piece from two pieces, ranked like sentencepiece.

    Sentencepiece merges the adjacent pair whose merged piece has the highest score; HF BPE
    applies the merge of lowest rank. Ranking by (-score, id) makes the two agree.
    """
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for pid, p in enumerate(proto.pieces):
        if p.type not in (_NORMAL, _USER_DEFINED) or len(p.piece) < 2:
            continue
        for k in range(1, len(p.piece)):
            left, right = p.piece[:k], p.piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-p.score, pid, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_tokenizer(proto: Any) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to the sentencepiece BPE model ``proto``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    if proto.trainer_spec.model_type != 2:  # 2 = BPE
        raise ValueError(
            "tokenizer.model: only SentencePiece BPE models are supported (Llama-2/Mistral type);"
            f" this one has model_type {proto.trainer_spec.model_type}"
        )
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    unk = proto.pieces[proto.trainer_spec.unk_id].piece
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=bpe_merges(proto),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=proto.trainer_spec.byte_fallback,
        )
    )
    steps = [normalizers.Replace(" ", SPIECE_UNDERLINE)]
    if proto.normalizer_spec.add_dummy_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_UNDERLINE))
    tok.normalizer = normalizers.Sequence(steps)
    strip = 1 if proto.normalizer_spec.add_dummy_prefix else 0
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPIECE_UNDERLINE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", strip, 0),
        ]
    )
    bos = proto.pieces[proto.trainer_spec.bos_id].piece
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
    for p in proto.pieces:
        if p.type == _CONTROL or p.type == _UNKNOWN:
            from tokenizers import AddedToken

            tok.add_special_tokens([AddedToken(p.piece, normalized=False, special=True)])
    return tok


def sp_model_to_hf(model_file: str | Path, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and tokenizer.model.

    ``tokenizer_class`` is the generic fast class so that ``AutoTokenizer`` loads
    tokenizer.json exactly as written instead of rebuilding a Llama pipeline around it.
    """
    proto = load_proto(model_file)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(proto).save(str(out_dir / "tokenizer.json"))
    if Path(model_file).resolve() != (out_dir / "tokenizer.model").resolve():
        shutil.copyfile(model_file, out_dir / "tokenizer.model")
    spec = proto.trainer_spec
    special = {
        "bos_token": proto.pieces[spec.bos_id].piece,
        "eos_token": proto.pieces[spec.eos_id].piece,
        "unk_token": proto.pieces[spec.unk_id].piece,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
