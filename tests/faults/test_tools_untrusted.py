"""Issue 14, finding 4: the tools read only what the user names.

A checkpoint's stored args are untrusted: ``to-hf`` used to copy whatever local file they named
as ``vocab_file``/``merge_file`` into the export folder (which people then upload). Here a
real checkpoint is written by megazero's own writer with args that point at a secret file
outside it (directly, through a relative path, or through a symbolic link inside the
checkpoint folder); the export must hold none of the secret, and say that it left the
tokenizer out. A tokenizer named on the command line, or kept inside the checkpoint folder,
is exported.
"""

import json
import os

import pytest
import torch

from megazero.config import DataConfig, MegazeroConfig, ModelConfig, ParallelConfig
from megazero.tokenizer.gpt2_bpe import EOD_TOKEN, bytes_to_unicode
from megazero.tools import hf
from megazero.tools.checkpoint import main as tool
from megazero.tools.offline import write_checkpoint

SECRET = "TOP-SECRET-4b1d: the production database password is hunter2"
VOCAB = 257  # the 256 byte symbols and <|endoftext|> (id 256)
N_HEAD = 4


def _full_tensors(h=16, n_layer=1, n_pos=8):
    """Full megazero tensors of a tiny GPT-2 (through the HF mapping, so the names are
    exactly those the model has)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    sd = {"wte.weight": r(VOCAB, h), "wpe.weight": r(n_pos, h), "ln_f.weight": 1 + r(h),
          "ln_f.bias": r(h)}
    for i in range(n_layer):
        p = f"h.{i}."
        sd.update({p + "ln_1.weight": 1 + r(h), p + "ln_1.bias": r(h),
                   p + "attn.c_attn.weight": r(h, 3 * h), p + "attn.c_attn.bias": r(3 * h),
                   p + "attn.c_proj.weight": r(h, h), p + "attn.c_proj.bias": r(h),
                   p + "ln_2.weight": 1 + r(h), p + "ln_2.bias": r(h),
                   p + "mlp.c_fc.weight": r(h, 4 * h), p + "mlp.c_fc.bias": r(4 * h),
                   p + "mlp.c_proj.weight": r(4 * h, h), p + "mlp.c_proj.bias": r(h)})
    return hf.hf_to_megazero(sd, N_HEAD)


FULL = _full_tensors()


def write_ckpt(root, tp=1, **data) -> str:
    """A real checkpoint (megazero's offline writer, tp ranks, iteration 5) whose stored args
    carry ``data``: what a hostile checkpoint's author controls."""
    config = MegazeroConfig(
        model=ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=N_HEAD,
                          seq_length=8, vocab_size=VOCAB, make_vocab_size_divisible_by=8),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, world_size=tp),
        data=DataConfig(**data))
    write_checkpoint(str(root), 5, config, full_tensor=lambda name, kind: FULL[name])
    return str(root)


def write_bpe(folder):
    """A valid GPT-2 BPE pair: every byte symbol, <|endoftext|>, no merges."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab[EOD_TOKEN] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return folder / "vocab.json", folder / "merges.txt"


def export_holds(folder, needle: str) -> list[str]:
    """Files under ``folder`` whose bytes contain ``needle``."""
    hits = []
    for d, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                if needle.encode() in fh.read():
                    hits.append(os.path.join(d, f))
    return hits


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text(SECRET + "\n")
    return path


def _to_hf(ckpt, out, *flags, capsys):
    rc = tool(["to-hf", str(ckpt), str(out), "--format", "bin", *flags])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


@pytest.mark.parametrize("how", ["absolute", "relative", "symlink-inside"])
def test_to_hf_never_copies_a_file_the_args_name_outside(how, tmp_path, secret, capsys,
                                                          monkeypatch):
    root = tmp_path / "ckpt"
    if how == "absolute":
        paths = {"vocab_file": str(secret), "merge_file": str(secret)}
    elif how == "relative":  # from the checkpoint folder, which is also the cwd
        root.mkdir()
        monkeypatch.chdir(root)
        paths = {"vocab_file": "../secret.txt", "merge_file": "../secret.txt"}
    else:  # links inside the folder, pointing out of it
        root.mkdir()
        (root / "vocab.json").symlink_to(secret)
        (root / "merges.txt").symlink_to(secret)
        paths = {"vocab_file": str(root / "vocab.json"), "merge_file": str(root / "merges.txt")}
    write_ckpt(root, tokenizer_type="GPT2BPETokenizer", **paths)
    rc, said = _to_hf(root, tmp_path / "export", capsys=capsys)
    assert rc == 0, said
    assert export_holds(tmp_path / "export", "TOP-SECRET") == []
    assert sorted(os.listdir(tmp_path / "export")) == ["config.json", "pytorch_model.bin"]
    assert "the tokenizer (GPT2BPETokenizer) is not exported" in said, said
    assert "pass --vocab-file and --merge-file" in said
    assert "eos_token_id" not in json.loads((tmp_path / "export" / "config.json").read_text())


def test_to_hf_never_reads_a_sentencepiece_model_outside(tmp_path, secret, capsys):
    root = write_ckpt(tmp_path / "ckpt", tokenizer_type="SentencePieceTokenizer",
                      tokenizer_model=str(secret))
    rc, said = _to_hf(root, tmp_path / "export", capsys=capsys)
    assert rc == 0 and export_holds(tmp_path / "export", "TOP-SECRET") == []
    assert "the tokenizer (SentencePieceTokenizer) is not exported" in said, said
    assert f"tokenizer_model={str(secret)!r}" in said and "pass --tokenizer-model" in said


def test_valid_tokenizer_outside_is_left_out_until_named(tmp_path, capsys):
    """Even a well-formed tokenizer outside the folder is not read (no eos id from it); the
    flags bring it in."""
    vocab, merges = write_bpe(tmp_path / "elsewhere")
    root = write_ckpt(tmp_path / "ckpt", tokenizer_type="GPT2BPETokenizer",
                      vocab_file=str(vocab), merge_file=str(merges))
    rc, said = _to_hf(root, tmp_path / "no-flags", capsys=capsys)
    assert rc == 0 and "is not exported" in said
    assert not (tmp_path / "no-flags" / "vocab.json").exists()
    assert "eos_token_id" not in json.loads((tmp_path / "no-flags" / "config.json").read_text())

    rc, said = _to_hf(root, tmp_path / "flags", "--vocab-file", str(vocab), "--merge-file",
                      str(merges), capsys=capsys)
    assert rc == 0 and "not exported" not in said, said
    out = tmp_path / "flags"
    assert (out / "vocab.json").read_bytes() == vocab.read_bytes()
    assert (out / "merges.txt").read_bytes() == merges.read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256


def test_flags_override_hostile_args(tmp_path, secret, capsys):
    vocab, merges = write_bpe(tmp_path / "mine")
    root = write_ckpt(tmp_path / "ckpt", tp=2, tokenizer_type="GPT2BPETokenizer",
                      vocab_file=str(secret), merge_file=str(secret))
    rc, said = _to_hf(root, tmp_path / "export", "--vocab-file", str(vocab), "--merge-file",
                      str(merges), capsys=capsys)
    assert rc == 0, said
    assert export_holds(tmp_path / "export", "TOP-SECRET") == []
    assert (tmp_path / "export" / "vocab.json").read_bytes() == vocab.read_bytes()


@pytest.mark.parametrize("stored", ["inside", "elsewhere"])
def test_tokenizer_inside_the_checkpoint_folder_is_exported(stored, tmp_path, secret, capsys):
    """The args' path when it lies inside the folder; else the folder's own vocab.json and
    merges.txt (a checkpoint moved with its tokenizer)."""
    root = tmp_path / "ckpt"
    vocab, merges = write_bpe(root)
    paths = ({"vocab_file": str(vocab), "merge_file": "merges.txt"} if stored == "inside"
             else {"vocab_file": str(secret), "merge_file": str(secret)})
    write_ckpt(root, tokenizer_type="GPT2BPETokenizer", **paths)
    rc, said = _to_hf(root, tmp_path / "export", capsys=capsys)
    assert rc == 0 and "not exported" not in said, said
    assert (tmp_path / "export" / "vocab.json").read_bytes() == vocab.read_bytes()
    assert (tmp_path / "export" / "merges.txt").read_bytes() == merges.read_bytes()
    assert export_holds(tmp_path / "export", "TOP-SECRET") == []
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["eos_token_id"] == 256


def test_from_hf_keeps_the_tokenizer_inside_and_convert_carries_it(tmp_path, capsys):
    """from-hf copies vocab.json/merges.txt into the checkpoint folder, so to-hf exports them
    after the HF folder is gone, and convert takes them along."""
    hf_dir = tmp_path / "hf"
    write_bpe(hf_dir)
    torch.save(hf.megazero_to_hf(FULL, N_HEAD), hf_dir / "pytorch_model.bin")
    cfg = hf.hf_config({"hidden_size": 16, "vocab_size": VOCAB, "max_position_embeddings": 8,
                        "num_layers": 1, "num_attention_heads": N_HEAD, "ffn_hidden_size": 64,
                        "hidden_dropout": 0.0, "attention_dropout": 0.0,
                        "layernorm_epsilon": 1e-5, "init_method_std": 0.02})
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    vocab_bytes = (hf_dir / "vocab.json").read_bytes()
    assert tool(["from-hf", str(hf_dir), str(tmp_path / "mz"),
                 "--make-vocab-size-divisible-by", "8"]) == 0
    for f in ("vocab.json", "merges.txt", "pytorch_model.bin", "config.json"):
        (hf_dir / f).unlink()
    assert tool(["convert", str(tmp_path / "mz"), str(tmp_path / "tp2"), "--tp", "2"]) == 0
    for src in ("mz", "tp2"):
        rc, said = _to_hf(tmp_path / src, tmp_path / f"out-{src}", capsys=capsys)
        assert rc == 0 and "not exported" not in said, said
        assert (tmp_path / f"out-{src}" / "vocab.json").read_bytes() == vocab_bytes


def test_to_hf_tokenizer_flags_are_checked(tmp_path, secret, capsys):
    root = write_ckpt(tmp_path / "ckpt")
    with pytest.raises(SystemExit) as exc:
        tool(["to-hf", root, str(tmp_path / "out"), "--vocab-file", str(secret)])
    assert exc.value.code == 2 and "--vocab-file and --merge-file go together" in \
        capsys.readouterr().err
    # a file the user names that is no tokenizer: an error naming it, nothing exported
    rc, said = _to_hf(root, tmp_path / "out", "--tokenizer-model", str(secret), capsys=capsys)
    assert rc == 1 and f"--tokenizer-model {secret}" in said, said
    assert not (tmp_path / "out").exists()


def test_file_inside_resolves_links_and_relative_paths(tmp_path, secret):
    from megazero.tools.checkpoint import file_inside  # new in the fix

    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "ok.json").write_text("{}")
    (root / "link").symlink_to(secret)
    (root / "dirlink").symlink_to(tmp_path)
    assert file_inside(str(root), "sub/ok.json") == os.path.realpath(root / "sub" / "ok.json")
    assert file_inside(str(root), str(root / "sub" / "ok.json")) is not None
    for bad in (str(secret), "../secret.txt", "link", "dirlink/secret.txt", "sub", "",
                None, "/etc/hostname", "sub/../../secret.txt", "a\0b"):
        assert file_inside(str(root), bad) is None, bad
