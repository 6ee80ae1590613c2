"""GPT-2 byte-level BPE against a reference written here from GPT-2's published algorithm.

The reference (OpenAI's ``encoder.py``: ``bytes_to_unicode``, ``get_pairs``, ``bpe`` with
``min`` over ranked pairs and ``word.index``) is re-typed below independently of megazero. The
vocab/merges pair is learned in the test by a tiny BPE trainer on multilingual text, so merges
cover ASCII, accents, CJK and emoji.
"""

from __future__ import annotations

import collections
import json
import pickle
import random

import pytest
import regex

from megazero.tokenizer import GPT2BPETokenizer, TokenizerError, build_tokenizer

PAT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

TRAIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. It's what we'd've done, isn't it? "
    "I'm sure they'll say you're right. Numbers 1234 5678 90 and 3.14159!\n\n"
    "Café, naïve, résumé, façade, Ångström, über, jalapeño, crème brûlée. "
    "日本語のテキストです。中文文本。한국어 텍스트. "
    "Emoji 😀😀 👍🏽 🎉 and flags 🇫🇷. def f(x):\n    return x  # comment\n\t\ttabs   spaces"
) * 3


def ref_bytes_to_unicode():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def ref_get_pairs(word):
    return set(zip(word, word[1:]))


class RefEncoder:
    """GPT-2's published encoder, typed from its description (no megazero code)."""

    def __init__(self, encoder, bpe_merges):
        self.encoder = encoder
        self.decoder = {v: k for k, v in encoder.items()}
        self.byte_encoder = ref_bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.bpe_ranks = dict(zip(bpe_merges, range(len(bpe_merges))))

    def bpe(self, token):
        word = tuple(token)
        pairs = ref_get_pairs(word)
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                    new_word.extend(word[i:j])
                    i = j
                except ValueError:
                    new_word.extend(word[i:])
                    break
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = ref_get_pairs(word)
        return " ".join(word)

    def encode(self, text):
        ids = []
        for token in regex.findall(PAT, text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token).split(" "))
        return ids

    def decode(self, ids):
        text = "".join(self.decoder[i] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


def learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    """A tiny BPE trainer: most frequent adjacent pair first (ties: smallest pair)."""
    b2u = ref_bytes_to_unicode()
    words = collections.Counter(
        tuple(b2u[b] for b in t.encode("utf-8")) for t in regex.findall(PAT, text))
    merges = []
    for _ in range(num_merges):
        pairs = collections.Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i < len(w) - 1 and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return merges


def make_bpe_files(folder, num_merges: int = 300, text: str = TRAIN_TEXT):
    """Write a GPT-2 style vocab.json / merges.txt pair; returns (vocab_path, merges_path)."""
    merges = learn_merges(text, num_merges)
    vocab = {}
    for ch in ref_bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_path.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                           encoding="utf-8")
    return str(vocab_path), str(merges_path)


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    return make_bpe_files(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def tok_and_ref(bpe_files):
    vocab_path, merges_path = bpe_files
    with open(vocab_path, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merges_path, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:-1]]
    return GPT2BPETokenizer(vocab_path, merges_path), RefEncoder(vocab, merges)


CASES = {
    "ascii": "Hello world! The quick brown fox jumps over the lazy dog.",
    "accents": "Café naïve résumé façade Ångström über jalapeño crème brûlée",
    "cjk": "日本語のテキストです。中文文本。한국어 텍스트",
    "emoji": "Emoji 😀😀 👍🏽 🎉 🇫🇷 family 👨‍👩‍👧‍👦",
    "whitespace": "a  b   c\t\td\n\n\ne    \n  f \r\n g\u00a0h\u2003i   ",
    "contractions": "It's what we'd've done, isn't it? I'm sure they'll say you're right. 'S 'T",
    "numbers": "1234 5678.90 3.14159 ½ ⅓ ١٢٣",
    "code": "def f(x):\n    return x ** 2  # comment\n\tpass\n",
    "empty": "",
    "eod_text": "a<|endoftext|>b",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_and_round_trips(tok_and_ref, name):
    tok, ref = tok_and_ref
    text = CASES[name]
    ids = tok.tokenize(text)
    assert ids == ref.encode(text)
    assert tok.detokenize(ids) == text == ref.decode(ids)


def _random_text(rng: random.Random, n: int) -> str:
    chars = []
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            cp = rng.randrange(0x20, 0x7F)
        elif r < 0.4:
            cp = rng.choice([0x20, 0x09, 0x0A, 0x0D, 0x0B, 0x0C, 0x85, 0xA0, 0x3000, 0x2028])
        elif r < 0.6:
            cp = rng.randrange(0x80, 0x3000)
        else:
            cp = rng.randrange(0x3000, 0x110000)
        if 0xD800 <= cp <= 0xDFFF:
            cp = 0x41
        chars.append(chr(cp))
    return "".join(chars)


def test_random_unicode_matches_reference(tok_and_ref):
    tok, ref = tok_and_ref
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng, rng.randrange(0, 60))
        ids = tok.tokenize(text)
        assert ids == ref.encode(text), repr(text)
        assert tok.detokenize(ids) == text


def test_lone_surrogates_round_trip(tok_and_ref):
    tok, _ = tok_and_ref
    text = "a\ud800b \udfff"
    assert tok.detokenize(tok.tokenize(text)) == text


def test_attributes_and_padding(bpe_files):
    vocab_path, merges_path = bpe_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_path, merge_file=merges_path,
                          make_vocab_size_divisible_by=128, tensor_model_parallel_size=2)
    with open(vocab_path, encoding="utf-8") as f:
        vocab = json.load(f)
    assert tok.vocab_size == len(vocab)
    assert tok.eod == vocab["<|endoftext|>"]
    assert tok.padded_vocab_size % 256 == 0
    assert tok.vocab_size <= tok.padded_vocab_size < tok.vocab_size + 256
    assert tok.detokenize([tok.eod]) == "<|endoftext|>"
    assert tok._encode_word.cache_info().maxsize is not None  # bounded cache
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(CASES["cjk"]) == tok.tokenize(CASES["cjk"])
    assert clone.padded_vocab_size == tok.padded_vocab_size


def test_errors_name_the_problem(tmp_path, bpe_files):
    vocab_path, merges_path = bpe_files
    with pytest.raises(TokenizerError, match="--vocab-file: no such file"):
        GPT2BPETokenizer(str(tmp_path / "nope.json"), merges_path)
    with pytest.raises(TokenizerError, match="--merge-file: no such file"):
        GPT2BPETokenizer(vocab_path, str(tmp_path / "nope.txt"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="bad.json is not valid JSON"):
        GPT2BPETokenizer(str(bad), merges_path)
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(TokenizerError, match="JSON object"):
        GPT2BPETokenizer(str(bad), merges_path)
    bad.write_text(json.dumps({"a": 0, "<|endoftext|>": 1}), encoding="utf-8")
    with pytest.raises(TokenizerError, match="lacks 255 of the 256 byte symbols"):
        GPT2BPETokenizer(str(bad), merges_path)
    vocab = json.loads(open(vocab_path, encoding="utf-8").read())
    del vocab["<|endoftext|>"]
    bad.write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(TokenizerError, match="no '<\\|endoftext\\|>' token"):
        GPT2BPETokenizer(str(bad), merges_path)
    merges = tmp_path / "merges.txt"
    first_merge = open(merges_path, encoding="utf-8").read().split("\n")[1]
    merges.write_text(f"#version: 0.2\n{first_merge}\nonlyone\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="merges.txt line 3: expected two"):
        GPT2BPETokenizer(vocab_path, str(merges))
    merges.write_text("#version: 0.2\nq z\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="line 2: merged symbol 'qz' is not in the vocab"):
        GPT2BPETokenizer(vocab_path, str(merges))
    with pytest.raises(TokenizerError, match="needs --vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_path)
    with pytest.raises(TokenizerError, match="--tokenizer-type must be one of"):
        build_tokenizer("BertWordPieceLowerCase")
    tok = GPT2BPETokenizer(vocab_path, merges_path)
    with pytest.raises(ValueError, match="token id 999999 is not in the vocabulary"):
        tok.detokenize([999999])
