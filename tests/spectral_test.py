"""HOPS spectral scores (fedrobust.aggregators.spectral) against NumPy."""

import jax
import numpy as np
import pytest

from fedrobust.aggregators import spectral


def np_hops(mats, mask, k, lam):
  sv = np.linalg.svd(mats.astype(np.float64), compute_uv=False)
  p = sv / sv.sum(1, keepdims=True)
  h = -(p * np.log(p)).sum(1)
  omr = 1 - p[:, :k].sum(1)
  real = np.flatnonzero(mask)
  mu_r, mu_h, sd_h = omr[real].mean(), h[real].mean(), h[real].std()
  s = lam * np.abs(omr - mu_r) + (1 - lam) * np.abs((h - mu_h) / sd_h)
  return np.where(mask, s, 0.0), sv


@pytest.mark.parametrize('method', spectral.SV_METHODS)
def test_hops_matches_numpy(method):
  rng = np.random.default_rng(0)
  mats = rng.normal(size=(6, 4, 40)).astype(np.float32)
  mats[1] = np.outer(rng.normal(size=4), rng.normal(size=40)) + 0.05 * mats[1]
  mask = np.array([True, True, True, True, True, False])
  want, sv_want = np_hops(mats, mask, k=1, lam=0.3)
  sv = jax.jit(spectral.singular_values, static_argnums=1)(mats, method)
  np.testing.assert_allclose(sv, sv_want, rtol=1e-4, atol=1e-5)
  got = spectral.hops_scores(sv, mask, k=1, lam=0.3)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # the near-rank-1 client is the outlier
  assert int(np.argmax(got)) == 1


def test_tall_matrices_and_masked_slot_is_inert():
  rng = np.random.default_rng(1)
  mats = rng.normal(size=(5, 30, 3)).astype(np.float32)
  sv = spectral.singular_values(mats)
  np.testing.assert_allclose(
      sv, np.linalg.svd(mats, compute_uv=False), rtol=1e-4, atol=1e-5)
  mask = np.array([True, True, True, False, True])
  base = spectral.hops_scores(sv, mask, k=1, lam=0.5)
  changed = np.array(sv)
  changed[3] = [1e6, 0.0, 0.0]
  np.testing.assert_array_equal(
      spectral.hops_scores(changed, mask, k=1, lam=0.5), base)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match='lambda'):
    spectral.hops_scores(np.ones((2, 3), np.float32), np.ones(2, bool),
                         lam=2.0)
  with pytest.raises(ValueError, match='method'):
    spectral.singular_values(np.ones((2, 3, 3), np.float32), 'qr')


@pytest.mark.parametrize('method', spectral.SV_METHODS)
@pytest.mark.parametrize('shape', [(5, 4, 40), (5, 40, 4), (3, 6, 6)])
def test_first_left_singular_matches_numpy_up_to_sign(method, shape):
  rng = np.random.default_rng(4)
  mats = rng.normal(size=shape).astype(np.float32)
  # a clear gap between s_1 and s_2, so u_1 is well defined
  u, s, vt = np.linalg.svd(mats, full_matrices=False)
  s[:, 0] *= 3.0
  mats = np.einsum('cik,ck,ckj->cij', u, s, vt).astype(np.float32)
  got = np.asarray(jax.jit(spectral.first_left_singular, static_argnums=1)(
      mats, method))
  want = np.linalg.svd(mats.astype(np.float64))[0][:, :, 0]
  assert got.shape == want.shape
  np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(np.abs(np.sum(got * want, axis=1)), 1.0,
                             rtol=1e-5)


def test_first_left_singular_gram_of_a_zero_matrix_is_zero():
  mats = np.zeros((2, 10, 3), np.float32)
  mats[1, 0, 0] = 2.0
  got = np.asarray(spectral.first_left_singular(mats, 'gram'))
  assert np.all(np.isfinite(got))
  np.testing.assert_array_equal(got[0], 0.0)
  np.testing.assert_allclose(np.abs(got[1]), np.eye(10)[0], atol=1e-6)
  with pytest.raises(ValueError, match='method'):
    spectral.first_left_singular(mats, 'qr')
