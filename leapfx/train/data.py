"""Training data: the Python standard library as a corpus, text folders, and two tokenizers.

Corpus. ``stdlib_corpus()`` reads the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, or a copy of one passed as ``root``), leaving out test
directories (``test/``, ``tests/``, ``idlelib/idle_test``, ``lib2to3/tests``, ...),
``site-packages``, caches and generated data (``EXCLUDED_FILES``). It is split by file, never
inside a file, so held-out code is unseen: a file is held out when the first 8 bytes of
``sha256(relative posix path)`` read as a fraction fall below ``held_out_fraction``. The split
depends only on the path, not on the machine, the file order or the other files present.

Tokenizers. Both are ``PreTrainedTokenizerFast`` objects over a ``tokenizers`` byte-level
pipeline, so every text round-trips exactly and ``AutoTokenizer.from_pretrained(dir)`` reloads
them from ``tokenizer.json``:

- ``byte_tokenizer()``: ids 0-255 are the bytes themselves, then ``<bos>``, ``<eos>``, ``<pad>``;
- ``train_bpe_tokenizer(texts, vocab_size)``: byte-level BPE trained with ``tokenizers``.

Both prepend ``<bos>`` when encoding (like Llama's tokenizers). Training streams are
``<bos> doc <eos>`` concatenated; ``held_out_prompts`` gives the first N tokens (``<bos>``
included) of held-out functions for the benchmarks.

Example::

    >>> corpus = stdlib_corpus()
    >>> tok = train_bpe_tokenizer([d.text for d in corpus.train], vocab_size=2048)
    >>> train_ids = encode_documents(tok, corpus.train)          # 1-D int32 tensor
    >>> prompts = list(held_out_prompts(tok, corpus, num_tokens=32, count=50))
"""

from __future__ import annotations

import ast
import hashlib
import logging
import sysconfig
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Directory names whose .py files are not part of the corpus (tests, installed packages, caches).
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
# Generated files that are data, not code: pydoc_data/topics.py is 0.75 MB of English help text
# in one string and would dominate whichever split it fell into.
EXCLUDED_FILES = frozenset({"pydoc_data/topics.py"})
BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)


@dataclass(frozen=True)
class Document:
    """One text: ``name`` is its path relative to the corpus root (posix)."""

    name: str
    text: str


@dataclass(frozen=True)
class CorpusSplit:
    """A corpus split by file into training and held-out documents, each sorted by name."""

    train: list[Document]
    held_out: list[Document]
    root: str


def held_out_score(relative_path: str) -> float:
    """A fraction in [0, 1) from ``sha256(relative_path)``: the file's fixed place in the split."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_held_out(relative_path: str, held_out_fraction: float) -> bool:
    """True when the file at ``relative_path`` belongs to the held-out split."""
    return held_out_score(relative_path) < held_out_fraction


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | Path | None = None) -> list[str]:
    """Relative posix paths of the corpus' ``.py`` files under ``root``, sorted.

    ``root`` may be a copy of a standard library folder (e.g. another machine's, to train on the
    same corpus under another Python): the paths, and so the split, depend on the files only.
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(
            f"root: {str(root)!r} is not a folder; pass a (copy of a) Python standard library "
            "folder, or None for this interpreter's"
        )
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.as_posix() in EXCLUDED_FILES:
            continue
        if not path.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def _read(path: Path) -> str:
    # A few stdlib files are not UTF-8 (they declare another coding); keep them, lossy.
    return path.read_bytes().decode("utf-8", errors="replace")


def split_documents(docs: Sequence[Document], held_out_fraction: float) -> CorpusSplit:
    """Split ``docs`` by name (see ``is_held_out``)."""
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(
            f"held_out_fraction: got {held_out_fraction!r}; allowed range is 0 <= f < 1"
        )
    train = sorted((d for d in docs if not is_held_out(d.name, held_out_fraction)), key=_name)
    held = sorted((d for d in docs if is_held_out(d.name, held_out_fraction)), key=_name)
    return CorpusSplit(train=train, held_out=held, root="")


def _name(doc: Document) -> str:
    return doc.name


def stdlib_corpus(held_out_fraction: float = 0.05, root: str | Path | None = None) -> CorpusSplit:
    """The standard-library corpus split by file (5% of files held out by default).

    >>> corpus = stdlib_corpus()
    >>> {d.name for d in corpus.train}.isdisjoint(d.name for d in corpus.held_out)
    True
    """
    root = Path(root) if root is not None else stdlib_root()
    docs = [Document(rel, _read(root / rel)) for rel in stdlib_files(root)]
    split = split_documents(docs, held_out_fraction)
    return CorpusSplit(train=split.train, held_out=split.held_out, root=str(root))


def load_text_documents(path: str | Path, suffixes: Sequence[str] | None = None) -> list[Document]:
    """Documents from a single text file or from every file under a folder (recursively).

    ``suffixes`` (e.g. ``(".py", ".txt")``) filters a folder's files; None keeps every file
    that decodes as UTF-8. Hidden files and folders are skipped.

    >>> docs = load_text_documents("my_corpus/", suffixes=[".txt"])
    """
    path = Path(path)
    if path.is_file():
        return [Document(path.name, _read(path))]
    if not path.is_dir():
        raise ValueError(f"path: {str(path)!r} is neither a file nor a folder")
    docs = []
    for file in sorted(path.rglob("*")):
        rel = file.relative_to(path)
        if not file.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        if suffixes is not None and file.suffix not in suffixes:
            continue
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            log.debug("skipping %s: not UTF-8", file)
            continue
        docs.append(Document(rel.as_posix(), text))
    if not docs:
        raise ValueError(f"path: no text files found under {str(path)!r}")
    return docs


# ---------------------------------------------------------------------------------------------
# Tokenizers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ``ByteLevel`` alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _wrap(tok):  # tokenizers.Tokenizer -> PreTrainedTokenizerFast
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=10**9
    )


def byte_tokenizer():
    """A byte-level tokenizer: id ``b`` is byte ``b``; ``<bos>, <eos>, <pad>`` are 256-258.

    >>> tok = byte_tokenizer()
    >>> tok("hi")["input_ids"]
    [256, 104, 105]
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return _wrap(tok)


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 2048, *, min_frequency: int = 2):
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (specials included) fit on ``texts``.

    >>> tok = train_bpe_tokenizer(["def f(x):\\n    return x\\n"] * 10, vocab_size=300)
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size: got {vocab_size}; allowed range is >= {256 + len(SPECIAL_TOKENS)}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return _wrap(tok)


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """Bytes of text each token id stands for (0 for special tokens): ``[V]`` int64."""
    table = {ch: b for b, ch in _bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    lengths = torch.zeros(len(tokenizer), dtype=torch.int64)
    for token, idx in tokenizer.get_vocab().items():
        if idx not in special:
            lengths[idx] = sum(1 for ch in token if ch in table)
    return lengths


def encode_documents(tokenizer, docs: Sequence[Document]) -> torch.Tensor:
    """``<bos> doc <eos>`` for each document, concatenated: a 1-D int32 tensor."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer([d.text for d in docs])["input_ids"]:
        ids.extend(enc)  # starts with <bos>
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Prompts


@dataclass(frozen=True)
class Prompt:
    """A held-out prompt: the first tokens of a function; ``name`` is ``file:qualname:line``."""

    name: str
    text: str  # the prompt's text (decoded from input_ids)
    input_ids: list[int]  # <bos> + the first num_tokens - 1 tokens of the function's source
    source: str  # the whole function (dedented), the reference continuation


def _functions(doc: Document) -> list[tuple[str, int, str]]:
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
        return []
    lines = doc.text.splitlines(keepends=True)
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                source = textwrap.dedent("".join(lines[child.lineno - 1 : child.end_lineno]))
                found.append((name, child.lineno, source))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def held_out_prompts(
    tokenizer, corpus: CorpusSplit, *, num_tokens: int = 64, count: int = 100
) -> Iterator[Prompt]:
    """Yield up to ``count`` prompts of exactly ``num_tokens`` tokens (``<bos>`` included), each
    the start of a held-out function (``def ...``) whose source is longer than the prompt.

    Functions are taken round-robin over the held-out files (sorted by name; within a file in
    source order) so the prompts spread over many modules. Deterministic.

    >>> for p in held_out_prompts(tok, stdlib_corpus(), num_tokens=32, count=20): ...
    """
    if num_tokens < 2:
        raise ValueError(f"num_tokens: got {num_tokens}; allowed range is num_tokens >= 2")
    if count < 0:
        raise ValueError(f"count: got {count}; allowed range is count >= 0")
    per_file = [[(d.name, *f) for f in _functions(d)] for d in corpus.held_out]
    produced = 0
    depth = 0
    while produced < count and any(depth < len(fs) for fs in per_file):
        for fs in per_file:
            if depth >= len(fs) or produced >= count:
                continue
            file, qualname, line, source = fs[depth]
            ids = tokenizer(source)["input_ids"]
            if len(ids) <= num_tokens:
                continue
            ids = ids[:num_tokens]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            yield Prompt(f"{file}:{qualname}:{line}", text, ids, source)
            produced += 1
        depth += 1
