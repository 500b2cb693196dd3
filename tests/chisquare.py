"""Pearson's chi-square goodness-of-fit test (no SciPy needed)."""

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value that `counts` were drawn from `probs`.

    Outcomes of probability 0 must never be sampled; outcomes expected fewer than
    `min_expected` times are pooled into one bin, as the test's approximation requires.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "an impossible outcome was sampled"
    expected = probs * counts.sum()
    rare = (expected < min_expected) & (probs > 0)
    common = expected >= min_expected
    observed_bins = [counts[common]]
    expected_bins = [expected[common]]
    if rare.any():
        observed_bins.append(counts[rare].sum()[None])
        expected_bins.append(expected[rare].sum()[None])
    observed, expected = torch.cat(observed_bins), torch.cat(expected_bins)
    assert observed.numel() >= 2, "too few outcomes for a chi-square test"
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(observed.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))
