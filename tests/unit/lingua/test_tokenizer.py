"""Tokenizers: round trips and special tokens for bytes, tiktoken, sentencepiece and Hugging Face, all offline."""

import base64

import pytest

from lingua.tokenizer import TIKTOKEN_N_SPECIAL, ByteTokenizer, TokenizerArgs, build_tokenizer

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a teacher model reads the same tokens as its students",
    "the students learn from the data and from the teacher",
    "knowledge distillation trades a little compute for a better student",
    "packing documents into windows keeps every token useful",
]


@pytest.mark.timeout(10)
def test_bytes_round_trip_and_specials():
    tokenizer = build_tokenizer(TokenizerArgs(name="bytes"))
    assert isinstance(tokenizer, ByteTokenizer)
    text = "héllo wörld, 世界!"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert (tokenizer.n_words, tokenizer.bos_id, tokenizer.eos_id) == (258, 256, 257)
    assert ids[0] == 256 and ids[-1] == 257
    assert ids[1:-1] == list(text.encode("utf-8"))
    assert len(tokenizer.encode(text, add_bos=False, add_eos=False)) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


@pytest.mark.timeout(10)
def test_build_tokenizer_errors_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match="data.tokenizer.name"):
        build_tokenizer(TokenizerArgs(name="gpt2"))
    with pytest.raises(ValueError, match="data.tokenizer.path"):
        build_tokenizer(TokenizerArgs(name="sp"))
    missing = tmp_path / "nowhere" / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match="data.tokenizer.path") as err:
        build_tokenizer(TokenizerArgs(name="tiktoken", path=str(missing)))
    assert str(missing) in str(err.value)
    with pytest.raises(ValueError, match="not a directory"):
        (tmp_path / "file.json").write_text("{}")
        build_tokenizer(TokenizerArgs(name="hf", path=str(tmp_path / "file.json")))


def _write_tiktoken_file(path, merges: list[bytes]) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for token in merges:
        ranks[token] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    return ranks


@pytest.mark.timeout(20)
def test_tiktoken_from_local_ranks_file(tmp_path):
    path = tmp_path / "tiny.tiktoken"
    ranks = _write_tiktoken_file(path, [b"th", b"he", b"the", b" the"])
    tokenizer = build_tokenizer(TokenizerArgs(name="tiktoken", path=str(path)))
    assert tokenizer.n_words == len(ranks) + TIKTOKEN_N_SPECIAL
    assert (tokenizer.bos_id, tokenizer.eos_id) == (len(ranks), len(ranks) + 1)
    assert tokenizer.encode("the the", add_bos=False, add_eos=False) == [ranks[b"the"], ranks[b" the"]]
    text = "the teacher, the student: déjà vu"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids) == text
    # Special-token text in a document stays plain text.
    assert tokenizer.bos_id not in tokenizer.encode("<|begin_of_text|>", add_bos=False, add_eos=False)


@pytest.mark.timeout(10)
def test_tiktoken_bad_ranks_file_is_readable(tmp_path):
    path = tmp_path / "broken.tiktoken"
    path.write_text("not-a-rank-line\n")
    with pytest.raises(ValueError, match="broken.tiktoken:1"):
        build_tokenizer(TokenizerArgs(name="tiktoken", path=str(path)))


@pytest.mark.timeout(20)
def test_sentencepiece_trained_locally(tmp_path):
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 4) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=80, model_type="bpe",
        character_coverage=1.0, hard_vocab_limit=False, num_threads=1, minloglevel=2,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    tokenizer = build_tokenizer(TokenizerArgs(name="sp", path=str(tmp_path / "sp.model")))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert 30 < tokenizer.n_words <= 80
    text = SENTENCES[2]
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) < len(text)
    assert all(0 <= i < tokenizer.n_words for i in ids)
    assert tokenizer.decode(ids) == text


def _save_hf_tokenizer(directory, with_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(SENTENCES, trainer=trainer)
    specials = dict(bos_token="<s>", eos_token="</s>") if with_bos else dict(eos_token="</s>")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    wrapped.add_tokens(["<extra_added_token>"])
    wrapped.save_pretrained(directory)
    return wrapped


@pytest.mark.timeout(30)
def test_hf_tokenizer_saved_locally(tmp_path):
    reference = _save_hf_tokenizer(tmp_path / "hf", with_bos=True)
    tokenizer = build_tokenizer(TokenizerArgs(name="hf", path=str(tmp_path / "hf")))
    assert tokenizer.n_words == len(reference) > reference.vocab_size
    assert (tokenizer.bos_id, tokenizer.eos_id) == (reference.bos_token_id, reference.eos_token_id)
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None
    text = "the teacher reads the tokens, and the students learn"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids == [tokenizer.bos_id] + reference.encode(text, add_special_tokens=False) + [tokenizer.eos_id]
    assert len(ids) < len(text)
    assert tokenizer.decode(ids) == text

    _save_hf_tokenizer(tmp_path / "hf_no_bos", with_bos=False)
    no_bos = build_tokenizer(TokenizerArgs(name="hf", path=str(tmp_path / "hf_no_bos")))
    assert no_bos.bos_id is None
    ids = no_bos.encode(text, add_bos=True, add_eos=True)
    assert ids[-1] == no_bos.eos_id and ids[:-1] == reference.encode(text, add_special_tokens=False)


# Texts the data reader passes on as documents (lingua/loading/documents.py): any Unicode but lone surrogates.
UNUSUAL_TEXTS = ["\x00", "a\x00b", "\x01\x1b\x7f\x80\x9f", "\r\n\tx\x0b\x0c", "a\u2028b\u2029", "\ufeff",
                 "\ufffe\uffff", "\U0010ffff", "\ue000\U000f0000", "e\u0301" * 50,
                 "\U0001F468\u200d\U0001F469\u200d\U0001F467", "\u202e reversed", "\U0001D573" * 5,
                 "</s> <s> <|begin_of_text|>", "x" * 100_000, "\u4e16\u754c " * 5000]


@pytest.mark.timeout(60)
def test_every_tokenizer_encodes_whatever_the_reader_passes(tmp_path):
    import sentencepiece

    _write_tiktoken_file(tmp_path / "tiny.tiktoken", [b"th", b"he", b"the"])
    (tmp_path / "corpus.txt").write_text("\n".join(SENTENCES * 4) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=80, model_type="bpe",
        character_coverage=1.0, hard_vocab_limit=False, num_threads=1, minloglevel=2, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1)
    _save_hf_tokenizer(tmp_path / "hf", with_bos=True)
    for name, path in [("bytes", None), ("tiktoken", "tiny.tiktoken"), ("sp", "sp.model"), ("hf", "hf")]:
        tokenizer = build_tokenizer(TokenizerArgs(name=name, path=str(tmp_path / path) if path else None))
        for text in UNUSUAL_TEXTS:
            ids = tokenizer.encode(text, add_bos=True, add_eos=True)
            # sentencepiece's normalizer drops some characters ("\ufeff" alone gives bos, eos): not an error.
            assert len(ids) >= 2 and all(0 <= i < tokenizer.n_words for i in ids), (name, text[:20])


def _student_tokenizer(name: str, student_tokenizers, tmp_path):
    """bytes, the trained tiktoken and sentencepiece BPE files, or sentencepiece models of other settings."""
    from tests.trained_tokenizers import sentencepiece_model

    if name == "bytes":
        return ByteTokenizer()
    if name in student_tokenizers:
        return build_tokenizer(TokenizerArgs(name=name, path=str(student_tokenizers[name])))
    # A unigram vocabulary spells its special pieces ("<s>", "<0x3C>") in single characters, as a real one does.
    settings = {"sp_unigram": dict(model_type="unigram", extra_text="<ABCDEFx/s> " * 5),
                "sp_nfkc_no_fallback": dict(normalization="nmt_nfkc", byte_fallback=False)}[name]
    return build_tokenizer(TokenizerArgs(name="sp", path=str(sentencepiece_model(tmp_path / name, **settings))))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["bytes", "tiktoken", "sp", "sp_unigram", "sp_nfkc_no_fallback"])
def test_the_exported_hugging_face_tokenizer_encodes_and_decodes_as_lingua_does(name, student_tokenizers, corpus,
                                                                                tmp_path):
    """AutoTokenizer on the export gives lingua's ids on the corpus and on unusual text, with bos exactly when the
    run added it (never eos), the run's bos/eos ids, and the same text back (unknown pieces apart)."""
    import json

    from transformers import AutoTokenizer

    from apps.main.export_hf import hf_tokenizer_of
    from tests.trained_tokenizers import CORPUS

    tokenizer = _student_tokenizer(name, student_tokenizers, tmp_path)
    documents = [json.loads(line)["text"] for line in (corpus / "text" / "text.val.jsonl").read_text().splitlines()]
    texts = CORPUS + documents + SENTENCES + UNUSUAL_TEXTS + ["", " ", "  two  spaces  ", "<s>a</s>"]
    unknown = getattr(getattr(tokenizer, "model", None), "unk_id", lambda: None)()
    for add_bos in (True, False):
        hf_tokenizer_of(tokenizer, add_bos).save_pretrained(tmp_path / f"hf_{add_bos}")
        auto = AutoTokenizer.from_pretrained(tmp_path / f"hf_{add_bos}")
        assert (auto.bos_token_id, auto.eos_token_id, len(auto)) == (tokenizer.bos_id, tokenizer.eos_id,
                                                                    tokenizer.n_words)
        for text in texts:
            ids = tokenizer.encode(text, add_bos=False, add_eos=False)
            assert auto(text)["input_ids"] == tokenizer.encode(text, add_bos=add_bos, add_eos=False), (name, text[:40])
            assert auto.encode(text, add_special_tokens=False) == ids, (name, text[:40])
            if unknown not in ids:  # sentencepiece spells an unknown piece " ⁇ ", transformers its name
                assert auto.decode(ids) == tokenizer.decode(ids), (name, text[:40])
    # Generation and evaluation read the export through lingua's hf tokenizer: the same ids again.
    exported = build_tokenizer(TokenizerArgs(name="hf", path=str(tmp_path / "hf_True")))
    assert all(exported.encode(text, True, True) == tokenizer.encode(text, True, True) for text in texts)


@pytest.mark.timeout(30)
def test_a_hugging_face_form_that_encodes_differently_is_one_sentence(student_tokenizers, monkeypatch):
    from apps.main.export_hf import hf_tokenizer_of
    from lingua.errors import DataError

    tokenizer = build_tokenizer(TokenizerArgs(name="tiktoken", path=str(student_tokenizers["tiktoken"])))
    bytes_form = ByteTokenizer().hf_backend()  # bytes alone: not the trained merges
    monkeypatch.setattr(tokenizer, "hf_backend", lambda: bytes_form)
    with pytest.raises(DataError, match=r"the Hugging Face form of this TikTokenTokenizer encodes 'def distill"):
        hf_tokenizer_of(tokenizer, add_bos=True)


@pytest.mark.timeout(30)
def test_a_sentencepiece_model_without_a_hugging_face_form_is_named(tmp_path):
    from lingua.tokenizer import hf_form_problem
    from tests.trained_tokenizers import sentencepiece_model

    char_model = sentencepiece_model(tmp_path / "char", model_type="char", byte_fallback=False)
    problem = hf_form_problem(TokenizerArgs("sp", str(char_model)))
    assert "is a 'char' model (only bpe and unigram models convert)" in problem
    assert hf_form_problem(TokenizerArgs("sp", str(sentencepiece_model(tmp_path / "bpe")))) is None
    unigram = sentencepiece_model(tmp_path / "unigram", model_type="unigram")  # its corpus has no "<"
    problem = hf_form_problem(TokenizerArgs("sp", str(unigram)))
    assert "has no piece for '<', so its Hugging Face form would read '<unk>' written in a document as" in problem
    assert hf_form_problem(TokenizerArgs("bytes")) is None
